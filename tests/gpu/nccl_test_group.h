// n NCCL communicators of one fresh unique id in this process, for the tests that run a group's
// ranks as threads (the emulation's NCCL, or one GPU a rank on a machine with several).
#pragma once
#include <gtest/gtest.h>

#include <memory>
#include <string>
#include <vector>

#include "kernels/cuda/device.h"
#include "net/nccl_communicator.h"

namespace fm {

// Rank r on cuda:(r % devices), named <prefix>r; empty (with the test failed) when one cannot
// be made.
inline std::vector<std::unique_ptr<net::NcclCommunicator>> NcclGroupInProcess(
    int n, const std::string& prefix) {
  std::vector<net::CommMember> members;
  for (int r = 0; r < n; ++r) members.push_back({prefix + std::to_string(r), ""});
  auto id = net::NcclNewUniqueId();
  EXPECT_TRUE(id.ok()) << id.status().ToString();
  if (!id.ok()) return {};
  std::vector<std::unique_ptr<net::NcclCommunicator>> comms;
  for (int r = 0; r < n; ++r) {
    auto c = net::MakeNcclCommunicator(members, r, r % cuda::DeviceCount(), *id);
    EXPECT_TRUE(c.ok()) << c.status().ToString();
    if (!c.ok()) return {};
    comms.push_back(std::move(c).value());
  }
  return comms;
}

}  // namespace fm
