// Communicator: the collective layer of an expert-parallel group (docs/architecture.md) on top of a
// Transport: ranks 0..size-1 named by their peer names, all-to-all-v, send/recv and a barrier.
// Every frame is tagged (kind, step id, tag) and checked on receipt, so a peer that falls out
// of step is an error naming it rather than silently mixed data. Every call has a deadline; a
// dead or silent rank becomes Unavailable / DeadlineExceeded naming it, never a hang.
//
// Backends: TCP (MakeTcpCommunicator below, over net::Transport; works across hosts) and NCCL
// (net/nccl_communicator.h: GPU memory, grouped ncclSend/ncclRecv; cluster YAML transport nccl).
#pragma once
#include <cstdint>
#include <cstring>
#include <functional>
#include <map>
#include <memory>
#include <mutex>
#include <string>
#include <vector>

#include "common/status.h"
#include "net/frame.h"
#include "net/transport.h"

namespace fm::net {

// One outgoing message: a typed, shaped view of the caller's bytes (not copied).
struct CommBuffer {
  FrameDType dtype = FrameDType::kF32;
  std::vector<uint32_t> shape = {0};  // rank 1..4; a zero dim = nothing (still sent)
  const void* data = nullptr;
  size_t nbytes = 0;
  bool device = false;  // data is CUDA device memory (only where device_buffers() is true)
};

// Where RecvInto writes a payload: `capacity` bytes at `data`, CUDA device memory when `device`.
struct RecvTarget {
  void* data = nullptr;
  size_t capacity = 0;
  bool device = false;
};

struct CommMember {
  std::string name;     // the member's transport peer name
  std::string address;  // its data-plane listen address
};

class Communicator {
 public:
  virtual ~Communicator() = default;
  virtual int rank() const = 0;
  virtual int size() const = 0;
  virtual const std::string& name(int rank) const = 0;

  // send[r] goes to rank r (send[rank()] is ignored: the caller keeps its own part); returns
  // the frame every other rank sent here, recv[rank()] empty. Every rank must call it with
  // the same (kind, step, tag). Deadline `timeout` for the whole exchange.
  virtual Result<std::vector<Frame>> AllToAllV(FrameKind kind, uint64_t step, uint32_t tag,
                                               const std::vector<CommBuffer>& send,
                                               Millis timeout) = 0;
  virtual Status Send(int peer, FrameKind kind, uint64_t step, uint32_t tag,
                      const CommBuffer& buf, Millis timeout) = 0;
  virtual Result<Frame> Recv(int peer, FrameKind kind, uint64_t step, uint32_t tag,
                             Millis timeout) = 0;
  // Recv whose payload lands in `into` instead of a Frame's own bytes (no copy on NCCL when it
  // is device memory); returns the header. A payload above into.capacity is InvalidArgument
  // naming both sizes (on NCCL it also breaks the group: the peer's bytes are already coming).
  // This default takes host memory only (Recv, then one copy); NCCL overrides it.
  virtual Result<FrameHeader> RecvInto(int peer, FrameKind kind, uint64_t step, uint32_t tag,
                                       const RecvTarget& into, Millis timeout) {
    if (into.device)
      return InvalidArgument("receive from rank " + std::to_string(peer) +
                             ": a device buffer, but this communicator receives into host memory");
    FM_ASSIGN_OR_RETURN(Frame f, Recv(peer, kind, step, tag, timeout));
    FM_RETURN_IF_ERROR(CheckFits(peer, f.payload.size(), into.capacity));
    if (!f.payload.empty()) std::memcpy(into.data, f.payload.data(), f.payload.size());
    return f.header;
  }
  // AllToAllV whose payload from rank r lands in into[r] (into[rank()] is not used) instead of a
  // Frame's own bytes: on NCCL a device target takes it straight from ncclRecv. Returns the
  // headers, [rank()] empty. A payload above into[r].capacity is InvalidArgument naming the rank
  // and both sizes (on NCCL the group breaks too). This default takes host targets only
  // (AllToAllV, then one copy each); NCCL overrides it.
  virtual Result<std::vector<FrameHeader>> AllToAllVInto(FrameKind kind, uint64_t step,
                                                         uint32_t tag,
                                                         const std::vector<CommBuffer>& send,
                                                         const std::vector<RecvTarget>& into,
                                                         Millis timeout) {
    FM_RETURN_IF_ERROR(CheckBufferCount(into.size()));
    for (int r = 0; r < size(); ++r)
      if (r != rank() && into[r].device)
        return InvalidArgument("all-to-all: a device buffer for rank " + std::to_string(r) +
                               ", but this communicator receives into host memory");
    FM_ASSIGN_OR_RETURN(std::vector<Frame> got, AllToAllV(kind, step, tag, send, timeout));
    std::vector<FrameHeader> headers(size());
    for (int r = 0; r < size(); ++r) {
      if (r == rank()) continue;
      FM_RETURN_IF_ERROR(CheckFits(r, got[r].payload.size(), into[r].capacity));
      if (!got[r].payload.empty())
        std::memcpy(into[r].data, got[r].payload.data(), got[r].payload.size());
      headers[r] = got[r].header;
    }
    return headers;
  }
  // Whether Send, RecvInto and AllToAllVInto take device memory (CommBuffer/RecvTarget .device) directly:
  // NCCL yes; TCP no (a device buffer there is InvalidArgument).
  virtual bool device_buffers() const { return false; }
  // Returns once every rank reached Barrier(step): an all-to-all of empty buffers.
  Status Barrier(uint64_t step, Millis timeout) {
    return AllToAllV(FrameKind::kControl, step, kBarrierTag, std::vector<CommBuffer>(size()), timeout)
        .status();
  }

  // A payload of `bytes` from `peer` against the capacity of a RecvTarget.
  static Status CheckFits(int peer, uint64_t bytes, size_t capacity) {
    if (bytes > capacity)
      return InvalidArgument("receive from rank " + std::to_string(peer) + ": a payload of " +
                             std::to_string(bytes) + " bytes for a buffer of " +
                             std::to_string(capacity));
    return Status::Ok();
  }
  // Makes every wait of step `step`, in progress or to come, return Cancelled within a few
  // milliseconds: a reset ends a step blocked on a member that will never answer instead of
  // leaving it to its deadline. 0 = none. Callable from any thread.
  virtual void AbortStep(uint64_t step) = 0;

 protected:
  static constexpr uint32_t kBarrierTag = 0xFFFFFFFFu;

  // The argument checks every backend makes before it touches the wire.
  Status CheckPeer(int peer) const {
    if (peer < 0 || peer >= size() || peer == rank())
      return InvalidArgument("EP peer rank " + std::to_string(peer) + " (group of " +
                             std::to_string(size()) + ", self " + std::to_string(rank()) + ")");
    return Status::Ok();
  }
  // The frame header of `buf` sent to `peer` as (kind, step, tag); a shape of rank 0 or
  // above kFrameMaxRank is InvalidArgument naming the peer.
  static Result<FrameHeader> HeaderFor(int peer, FrameKind kind, uint64_t step, uint32_t tag,
                                       const CommBuffer& buf) {
    if (buf.shape.empty() || buf.shape.size() > kFrameMaxRank)
      return InvalidArgument("EP send to rank " + std::to_string(peer) + ": rank " +
                             std::to_string(buf.shape.size()) + " shape");
    FrameHeader h;
    h.kind = kind;
    h.dtype = buf.dtype;
    h.step_id = step;
    h.tag = tag;
    h.set_shape(buf.shape);
    return h;
  }
  Status CheckBufferCount(size_t buffers) const {
    if (static_cast<int>(buffers) != size())
      return InvalidArgument("all-to-all: " + std::to_string(buffers) + " buffers for " +
                             std::to_string(size()) + " ranks");
    return Status::Ok();
  }
};

// The sends of a step that a reset may end early. A TCP write to a frozen peer (stopped,
// partitioned) waits until the step's deadline once the socket buffers are full, which would
// hold a Reset or a shutdown that long: aborting the step closes the connection of each of its
// sends in flight, which fails the write at once (the next send dials again).
class AbortableSends {
 public:
  // Runs `send` (one send of `step` to `peer`) as a send in flight; Unavailable ("step N aborted
  // by a reset") instead when the step is aborted before it, or while it ran and it failed.
  Status Send(uint64_t step, const std::string& peer, const std::function<Status()>& send);
  // Aborts `step` (0 clears the abort, for the steps after a reset) and closes `t`'s
  // connection of each of its sends in flight.
  void Abort(uint64_t step, Transport* t);
  // Unavailable naming the step when it is aborted (step != 0); Ok otherwise.
  Status Check(uint64_t step) const;

 private:
  mutable std::mutex mu_;
  uint64_t aborted_ = 0;
  std::multimap<std::string, uint64_t> in_flight_;   // peer -> step
};

// Members in rank order; `rank` is this process (members[rank].name must be the transport's
// self name). Returns at once: connections are made on first use (the lower rank of a pair
// dials, retrying within the call's deadline; the higher waits), and made again after one
// broke, so a restarted member rejoins without the others reloading. (A frame sent in the
// instant between the old process's death and the sender seeing its connection close is
// lost; that step then ends at its deadline.) Frames of an older step (left over from a step
// aborted by a failure) are skipped on receipt. A frame of a later step while waiting for
// step S means the peer gave S up (each rank runs steps in order and sends a step's frames
// before the next step's): S fails at once (Unavailable naming the peer), and the frame is
// kept for the step it belongs to.
Result<std::unique_ptr<Communicator>> MakeTcpCommunicator(Transport* transport,
                                                          std::vector<CommMember> members,
                                                          int rank);

}  // namespace fm::net
