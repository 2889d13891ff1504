// A group of n TCP transports on loopback named m0..m{n-1}, each with its Communicator, for the
// unit tests of the group collectives (test_ep.cpp, test_tp.cpp).
#pragma once
#include <functional>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include <gtest/gtest.h>

#include "net/communicator.h"
#include "net/tcp_transport.h"

namespace fm {

struct CommGroup {
  const std::string secret = "group";   // every member's data-plane secret (a rejoining one's too)
  std::vector<std::unique_ptr<net::Transport>> transports;
  std::vector<std::unique_ptr<net::Communicator>> comms;

  // The communicators connect to each other while they are made: one thread per member.
  explicit CommGroup(int n) {
    std::vector<net::CommMember> members;
    for (int i = 0; i < n; ++i) {
      auto t = net::MakeTcpTransport({.self_name = "m" + std::to_string(i), .secret = secret});
      EXPECT_TRUE(t.ok());
      EXPECT_TRUE((*t)->Listen("127.0.0.1:0").ok());
      members.push_back({"m" + std::to_string(i), (*t)->listen_address()});
      transports.push_back(std::move(t).value());
    }
    comms.resize(n);
    std::vector<std::thread> threads;
    for (int i = 0; i < n; ++i)
      threads.emplace_back([&, i] {
        auto c = net::MakeTcpCommunicator(transports[i].get(), members, i);
        EXPECT_TRUE(c.ok()) << c.status().ToString();
        if (c.ok()) comms[i] = std::move(c).value();
      });
    for (auto& t : threads) t.join();
  }
  // Runs fn(rank) on every rank at once.
  void All(const std::function<void(int)>& fn) {
    std::vector<std::thread> threads;
    for (size_t i = 0; i < comms.size(); ++i) threads.emplace_back(fn, static_cast<int>(i));
    for (auto& t : threads) t.join();
  }
};

}  // namespace fm
