// The data-plane Transport (docs/architecture.md "Data plane"): frames between named peers over one persistent,
// authenticated connection per peer pair. Backend: TCP (tcp_transport.h). The
// NCCL backend is a Communicator (nccl_communicator.h), not a Transport.
//
// Model: every process has a name (cluster YAML nodes[].name). A process listens on its data
// address; for each peer pair ONE side dials (by convention the lower worker index dials the
// higher), the other accepts; afterwards the connection is symmetric and both sides Send and
// Recv by peer name. Frames from one peer arrive in order (per-peer FIFO). A bad frame or a
// failed authentication closes only that connection (logged with the reason); the transport
// keeps serving its other peers. Nothing blocks without a deadline: a dead or silent peer
// becomes Unavailable / DeadlineExceeded naming the peer.
//
// A Communicator (all-to-all-v, send/recv, barrier for expert parallelism) is built on top: it
// maps ranks to peer names, tags frames with (step id, micro-batch, tag) and checks them on
// receipt; the per-peer FIFO plus non-blocking sends (the receiver drains every connection
// into its queue continuously) make "send to all, then receive from all" deadlock-free.
#pragma once
#include <algorithm>
#include <chrono>
#include <cstddef>
#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "common/status.h"
#include "net/frame.h"

namespace fm::net {

using Millis = std::chrono::milliseconds;

// The time left until `deadline`, at least 1 ms (a wait whose time ran out still looks once).
inline Millis Until(std::chrono::steady_clock::time_point deadline) {
  return std::max(std::chrono::duration_cast<Millis>(deadline - std::chrono::steady_clock::now()),
                  Millis(1));
}

struct TransportOptions {
  std::string self_name;  // this process's peer name (1..255 printable ASCII, no spaces)
  // Cluster secret (security.cluster_secret_file). Both sides prove knowledge of it with
  // HMAC-SHA256 over a fresh random nonce from each side before any frame is accepted.
  // Empty = no authentication: any peer with an empty secret is accepted (development only).
  // With a secret every frame also carries a tag under a per-connection session key
  // (frame_auth.h): a tampered, replayed or reordered frame closes the connection.
  std::string secret;
  bool encrypt = false;   // security.encrypt_data_plane: AES-256-GCM payloads (needs a secret)
  uint64_t max_payload = kDefaultMaxFramePayload;  // larger incoming frames close the connection
  // Unread frames of one peer may hold at most this many bytes; a peer that sends more than
  // its reader takes is dropped (the bound on what a flooding peer can make us hold).
  uint64_t max_queued_bytes = 4 * kDefaultMaxFramePayload;
  Millis handshake_timeout{5000};  // an accepted connection must authenticate within this
  // Once a frame's first byte arrived, the rest of its header must arrive within this, and its
  // payload must keep coming (each 1 MiB within this): a stalled or trickling peer is dropped.
  // Between frames a connection may stay idle for as long as it likes.
  Millis frame_timeout{10000};
};

// Which peers may connect (Transport::SetAllowedPeers): a peer's name and the host of its data
// address in the plan. An accepted connection presenting any other name, or (when the host
// resolves to addresses) coming from another address, is refused in the handshake.
struct AllowedPeer {
  std::string name;
  std::string host;   // "" or a wildcard (0.0.0.0, ::): any source address
};

struct TransportStats {
  uint64_t frames_sent = 0, frames_received = 0;
  uint64_t bytes_sent = 0, bytes_received = 0;  // headers + payloads
  uint64_t connections_rejected = 0;             // failed handshakes, and connections closed
                                                 // at once with 64 handshakes under way
  uint64_t connections_dropped = 0;              // closed because of a bad frame / flooding
};

class Transport {
 public:
  virtual ~Transport() = default;

  // Starts accepting peers on "host:port" (port 0 = ephemeral). At most once.
  virtual Status Listen(const std::string& address) = 0;
  // The bound "host:port" after Listen (the real port when 0 was asked); "" before.
  virtual std::string listen_address() const = 0;

  // Dials `address`, authenticates, and registers the connection under `peer`. The peer must
  // present exactly that name. Returns when both sides accepted the handshake, or an error:
  // Unavailable (refused, closed), Unauthenticated (wrong secret / name), DeadlineExceeded.
  // Connecting to a peer that is already connected replaces the old connection.
  virtual Status Connect(const std::string& peer, const std::string& address, Millis timeout) = 0;

  // Sends one frame: the header is completed (payload length + CRC) and validated, then header
  // and payload are written straight from `payload` (no copy); `payload` must stay valid until
  // Send returns. Returns when the bytes are handed to the kernel. Unavailable if the peer is
  // not connected or the connection broke; DeadlineExceeded (and the connection is closed) if
  // the write did not finish within `timeout`.
  virtual Status Send(const std::string& peer, const FrameHeader& header, const void* payload,
                      size_t nbytes, Millis timeout) = 0;

  // The next frame from `peer`, waiting at most `timeout`. Frames already received are
  // returned even after the connection closed; then Unavailable naming the peer and the close
  // reason. A peer that has not connected (yet) is waited for until the deadline.
  virtual Result<Frame> Recv(const std::string& peer, Millis timeout) = 0;

  // Waits until `peer` has an open, authenticated connection (the accepting side uses it at
  // start-up before its first Send); DeadlineExceeded naming the peer otherwise.
  virtual Status WaitForPeer(const std::string& peer, Millis timeout) = 0;

  // Whether `peer` currently has an open, authenticated connection.
  virtual bool IsConnected(const std::string& peer) const = 0;
  // Names of the peers with an open connection, sorted.
  virtual std::vector<std::string> ConnectedPeers() const = 0;
  // Closes the connection to `peer` (no-op if none); queued frames stay readable.
  virtual void Disconnect(const std::string& peer) = 0;

  // Restricts accepted connections to `peers` (replacing the previous list; connections of
  // peers no longer listed are closed). Until first called every validly authenticated name is
  // accepted. A host is resolved now if it can be, and again when its peer connects from an
  // address it did not have (a moved pod, a name that did not resolve yet).
  virtual Status SetAllowedPeers(const std::vector<AllowedPeer>& peers) = 0;
  // The frame size limit and the per-peer unread-bytes limit for frames from now on (a worker
  // sets them from its shard: the plan's largest frame).
  virtual void SetLimits(uint64_t max_payload, uint64_t max_queued_bytes) = 0;

  virtual TransportStats stats() const = 0;
};

}  // namespace fm::net
