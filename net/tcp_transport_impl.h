// The TCP data plane's transport (net/tcp_transport.h), shared by its two files:
// tcp_transport.cpp (the Transport calls, from any thread) and tcp_transport_conns.cpp (a
// connection's life on the io thread: accept or dial, handshake, register, read loop).
// One io thread owns every socket (all socket operations run there, so no socket is touched
// by two threads); callers of Send/Recv/Connect hand work to it and wait with a deadline.
#pragma once
#include <algorithm>
#include <atomic>
#include <condition_variable>
#include <deque>
#include <map>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <thread>
#include <vector>

#include "net/handshake.h"
#include "net/tcp_conn.h"
#include "net/transport.h"

namespace fm::net {

class TcpTransport final : public Transport {
 public:
  explicit TcpTransport(TransportOptions o)
      : work_(asio::make_work_guard(io_)),
        opts_(std::move(o)),
        max_payload_(opts_.max_payload),
        max_queued_(opts_.max_queued_bytes),
        thread_([this] { io_.run(); }) {}

  ~TcpTransport() override;
  Status Listen(const std::string& address) override;
  std::string listen_address() const override;
  Status Connect(const std::string& peer, const std::string& address, Millis timeout) override;
  Status Send(const std::string& peer, const FrameHeader& header, const void* payload,
              size_t nbytes, Millis timeout) override;
  Result<Frame> Recv(const std::string& peer, Millis timeout) override;
  Status WaitForPeer(const std::string& peer, Millis timeout) override;
  bool IsConnected(const std::string& peer) const override;
  std::vector<std::string> ConnectedPeers() const override;
  void Disconnect(const std::string& peer) override;
  Status SetAllowedPeers(const std::vector<AllowedPeer>& peers) override;
  void SetLimits(uint64_t max_payload, uint64_t max_queued_bytes) override;
  TransportStats stats() const override;

 private:
  // What an unread frame holds: its payload plus the header and bookkeeping, so that a flood
  // of empty frames reaches the limit too (each ~100 bytes of memory).
  static uint64_t QueuedCost(uint64_t payload_bytes) { return payload_bytes + 128; }

  struct PeerState {
    std::deque<Frame> queue;
    uint64_t queued_bytes = 0;    // QueuedCost of the frames in queue
    std::shared_ptr<Conn> conn;   // the current connection; null when closed
    std::string close_reason;
  };

  asio::awaitable<void> AcceptLoop();

  // Acceptor side of handshake.h, then the read loop.
  asio::awaitable<void> Accepted(std::shared_ptr<Conn> c);

  asio::awaitable<Status> AcceptHandshake(std::shared_ptr<Conn> c);

  // Dialer side of handshake.h; on success the connection is registered and read.
  asio::awaitable<Status> Dial(std::shared_ptr<Conn> c, std::string peer, std::string address,
                               std::string host, std::string port, Millis timeout);

  asio::awaitable<Status> DialHandshake(std::shared_ptr<Conn> c, std::string peer,
                                        std::string address, std::string host, std::string port,
                                        Millis timeout);

  // With a secret: the connection's frame sealers, one per direction, `me` being this side.
  void StartSession(Conn& c, HandshakeRole me, const Nonce& dialer_nonce,
                    const Nonce& acceptor_nonce, const std::string& dialer,
                    const std::string& acceptor) const;

  // Whether `name` connecting from `from` is a peer of the plan (SetAllowedPeers). An address
  // its host did not have when last resolved resolves the host again: a pod that moved has a
  // new address, and a name may not have resolved yet when the plan came.
  asio::awaitable<Status> CheckAllowed(std::string name, asio::ip::address from);

  // Makes c the connection of its peer (replacing an older one).
  void Register(const std::shared_ptr<Conn>& c);

  // One frame: header, then the payload in kPayloadChunk steps (memory grows with the bytes
  // that really arrived, not with the length a header claims). Only the wait for the first
  // byte is unbounded; the rest of the frame runs on frame_timeout deadlines. Errors set
  // *bad_frame when the peer sent something invalid (not merely closed or stalled).
  asio::awaitable<Result<Frame>> ReadFrame(std::shared_ptr<Conn> c, bool* bad_frame);

  asio::awaitable<void> ReadLoop(std::shared_ptr<Conn> c);

  // Declared first so that it is destroyed last: the sockets held by peers_ and by pending
  // handlers must be destroyed while their io context still exists.
  asio::io_context io_;
  asio::executor_work_guard<asio::io_context::executor_type> work_;
  const TransportOptions opts_;
  std::atomic<uint64_t> max_payload_, max_queued_;   // SetLimits
  mutable std::mutex mu_;  // guards peers_, handshaking_, stats_, listen_address_, allowed_
  std::condition_variable cv_;
  std::map<std::string, PeerState> peers_;
  std::vector<std::shared_ptr<Conn>> handshaking_;
  // SetAllowedPeers: name -> the addresses it may connect from (empty: any); unset: anyone.
  // A peer's host in the plan and its addresses when last resolved ("" or a wildcard: any).
  struct AllowedHost {
    std::string host;
    bool any = false;
    std::vector<asio::ip::address> addresses;
    void Set(const tcp::resolver::results_type& eps) {
      addresses.clear();
      for (const auto& e : eps) {
        any = any || e.endpoint().address().is_unspecified();   // listens everywhere
        addresses.push_back(e.endpoint().address());
      }
    }
    bool Admits(const asio::ip::address& from) const {
      return any || std::find(addresses.begin(), addresses.end(), from) != addresses.end();
    }
  };
  std::optional<std::map<std::string, AllowedHost>> allowed_;
  std::optional<asio::ip::address> dial_from_;   // the listen address, unless a wildcard
  TransportStats stats_;
  std::string listen_address_;
  std::unique_ptr<tcp::acceptor> acceptor_;
  std::thread thread_;  // last: starts running io_ once everything above exists
};

}  // namespace fm::net
