// The NCCL backend of the Communicator (net/communicator.h) for GPU workers: every exchange
// goes through device memory with grouped ncclSend/ncclRecv on the communicator's own stream.
// Device buffers (CommBuffer/RecvTarget .device: a device shard's activations) are handed to
// NCCL as they are; host buffers are staged through device scratch that only grows. No NCCL or CUDA
// types here, so plain C++ (the worker) includes it; built as fm_net_nccl when CUDA and NCCL
// are found (FM_HAVE_NCCL), docs/gpu.md.
//
// Bootstrap: the group's rank-0 worker makes an ncclUniqueId (NcclNewUniqueId,
// the NewNcclId RPC) and the coordinator hands the same 128 bytes to every member in its
// LoadShard. The communicator itself is created lazily by the group's first exchange, which
// every member reaches in the same step, so loading the members need not be simultaneous.
//
// Protocol of one exchange (kind, step, tag): first every rank sends every peer the 64-byte
// frame header of its buffer (net/frame.h: kind, dtype, step, tag, shape, payload length and
// CRC32C), then the payloads whose lengths the headers announced. Every received header is
// decoded and checked (DecodeFrameHeader, then kind/step/tag, and a RecvInto's capacity) before
// any payload moves. The payload CRC is 0 and not checked: NCCL delivers the bytes or fails
// the group, and a device payload cannot be read by the host without the copy this avoids.
//
// Failure: every wait polls the stream, NCCL's asynchronous error, AbortStep and the
// deadline. A dead member, a deadline or an abort calls ncclCommAbort and leaves the
// communicator broken (NCCL cannot take a restarted rank back into a communicator): every
// later call is Unavailable, and broken() tells the worker to report itself unloaded, so the
// coordinator loads the whole group again with a fresh id.
#pragma once
#include <memory>
#include <string>
#include <vector>

#include "common/status.h"
#include "net/communicator.h"

namespace fm::net {

inline constexpr size_t kNcclUniqueIdBytes = 128;   // sizeof(ncclUniqueId)

// Whether this build has the NCCL backend.
bool NcclBuilt();

// A fresh ncclUniqueId (its bootstrap root listens in this process until the group formed).
Result<std::string> NcclNewUniqueId();

class NcclCommunicator : public Communicator {
 public:
  // True once an exchange failed for good (see above).
  virtual bool broken() const = 0;
  // The largest payload a received header may claim (kDefaultMaxFramePayload until set): the
  // worker sets the plan's largest frame, as for its TCP transport; a header above it is an
  // error naming both sizes, and the group breaks.
  virtual void SetMaxPayload(uint64_t bytes) = 0;
};

// members in rank order (names are used in errors only); `cuda_device` is this process's GPU;
// `unique_id` the group's kNcclUniqueIdBytes bytes; `label` what errors call the group. Returns
// at once; the first exchange creates the NCCL communicator within that exchange's deadline.
// Used for an EP group and for a stage hop (two ranks: the sending stage 0, the receiving 1).
Result<std::unique_ptr<NcclCommunicator>> MakeNcclCommunicator(
    std::vector<CommMember> members, int rank, int cuda_device, const std::string& unique_id,
    const std::string& label = "NCCL EP group");

}  // namespace fm::net
