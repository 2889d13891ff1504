// CPU stand-in for the part of NCCL that net/nccl_communicator.cpp uses, so tests/gpu/emulate.sh
// can run the real NCCL communicator with its ranks as threads of one process.
//
// What it models: the unique id names a group, which forms once all `nranks` ranks called
// ncclCommInitRankConfig (non-blocking: until then ncclCommGetAsyncError says ncclInProgress).
// Point-to-point bytes (ncclUint8 only): at ncclGroupEnd every send of the group is copied into
// a FIFO per (sender, receiver) and every receive is queued on its communicator; a receive
// completes when ncclCommGetAsyncError polls it and the matching send (the next one in that
// FIFO) is there. Until all of a communicator's receives completed it says ncclInProgress, so a
// peer that never sends leaves the receiver waiting for its deadline. A send of another byte
// count than its receive is ncclInvalidUsage (real NCCL fails or corrupts the group); a receive
// from a member that aborted and sent nothing more is ncclRemoteError. ncclCommAbort makes every
// later call on that communicator fail.
// What it does not: rendezvous (a send completes at once, real NCCL waits for the receive),
// streams (the copies happen during the poll, every stream query says done), one rank per GPU
// (every rank here is on the one emulated device), collectives, blocking communicators.
#pragma once
#include <cuda_runtime.h>

#include <cstdint>
#include <cstring>
#include <deque>
#include <map>
#include <memory>
#include <mutex>
#include <random>
#include <string>
#include <vector>

typedef enum {
  ncclSuccess = 0,
  ncclUnhandledCudaError = 1,
  ncclSystemError = 2,
  ncclInternalError = 3,
  ncclInvalidArgument = 4,
  ncclInvalidUsage = 5,
  ncclRemoteError = 6,
  ncclInProgress = 7,
} ncclResult_t;

typedef enum { ncclInt8 = 0, ncclUint8 = 1 } ncclDataType_t;

typedef struct {
  char internal[128];
} ncclUniqueId;

typedef struct {
  int blocking;
} ncclConfig_t;
#define NCCL_CONFIG_INITIALIZER {1}

struct EmuNcclGroup;
struct ncclComm {
  EmuNcclGroup* group;
  int rank;
  bool aborted = false;
  ncclResult_t error = ncclSuccess;   // the asynchronous error, sticky
  struct PendingRecv {
    void* dst;
    size_t bytes;
  };
  std::vector<std::deque<PendingRecv>> pending;   // per sending rank, in posting order
};
typedef ncclComm* ncclComm_t;

// Every rank of one unique id. Groups (and their communicators) live until the process ends:
// a test makes a few, and a handle stays safe to call (and fail) after ncclCommAbort.
struct EmuNcclGroup {
  int nranks;
  std::vector<std::unique_ptr<ncclComm>> members;   // [rank], null until that rank joined
  int joined = 0;
  std::vector<std::deque<std::vector<uint8_t>>> fifo;   // [from * nranks + to]
  bool formed() const { return joined == nranks; }
};

struct EmuNcclState {
  std::mutex mu;   // guards everything here: the emulation is small and not about speed
  std::map<std::string, std::unique_ptr<EmuNcclGroup>> groups;   // by unique id bytes
};
inline EmuNcclState& EmuNccl() {
  static EmuNcclState state;
  return state;
}

// The sends and receives between this thread's ncclGroupStart and ncclGroupEnd.
struct EmuNcclOp {
  bool send;
  void* buf;
  size_t bytes;
  int peer;
  ncclComm_t comm;
};
inline thread_local int emu_nccl_group_depth = 0;
inline thread_local std::vector<EmuNcclOp> emu_nccl_ops;

inline const char* ncclGetErrorString(ncclResult_t r) {
  switch (r) {
    case ncclSuccess: return "no error";
    case ncclUnhandledCudaError: return "unhandled cuda error";
    case ncclSystemError: return "unhandled system error";
    case ncclInternalError: return "internal error";
    case ncclInvalidArgument: return "invalid argument";
    case ncclInvalidUsage: return "invalid usage";
    case ncclRemoteError: return "remote process exited or there was a network error";
    case ncclInProgress: return "NCCL operation in progress";
  }
  return "unknown result code";
}

inline ncclResult_t ncclGetUniqueId(ncclUniqueId* id) {
  static std::mt19937_64 rng{std::random_device{}()};
  std::lock_guard<std::mutex> lock(EmuNccl().mu);
  for (size_t i = 0; i < sizeof(id->internal); i += 8) {
    const uint64_t word = rng();
    std::memcpy(id->internal + i, &word, 8);
  }
  return ncclSuccess;
}

// Non-blocking only (what the communicator asks for, so that forming the group has a deadline).
inline ncclResult_t ncclCommInitRankConfig(ncclComm_t* comm, int nranks, ncclUniqueId id, int rank,
                                           ncclConfig_t* config) {
  *comm = nullptr;
  if (!config || config->blocking) return ncclInvalidUsage;
  if (nranks < 1 || rank < 0 || rank >= nranks) return ncclInvalidArgument;
  std::lock_guard<std::mutex> lock(EmuNccl().mu);
  std::unique_ptr<EmuNcclGroup>& g = EmuNccl().groups[std::string(id.internal, sizeof id.internal)];
  if (!g) {
    g = std::make_unique<EmuNcclGroup>();
    g->nranks = nranks;
    g->members.resize(nranks);
    g->fifo.resize(static_cast<size_t>(nranks) * nranks);
  }
  if (g->nranks != nranks || g->members[rank]) return ncclInvalidUsage;
  g->members[rank] = std::make_unique<ncclComm>();
  ncclComm& c = *g->members[rank];
  c.group = g.get();
  c.rank = rank;
  c.pending.resize(nranks);
  ++g->joined;
  *comm = &c;
  return ncclInProgress;
}

// Completes what can complete of comm's receives (under the lock); the result is as
// ncclCommGetAsyncError's *async.
inline ncclResult_t EmuNcclProgress(ncclComm& c) {
  EmuNcclGroup& g = *c.group;
  if (!g.formed()) return ncclInProgress;
  bool waiting = false;
  for (int from = 0; from < g.nranks && c.error == ncclSuccess; ++from) {
    auto& in = g.fifo[static_cast<size_t>(from) * g.nranks + c.rank];
    auto& want = c.pending[from];
    while (!want.empty() && !in.empty()) {
      if (in.front().size() != want.front().bytes) {
        c.error = ncclInvalidUsage;
        break;
      }
      if (!in.front().empty()) std::memcpy(want.front().dst, in.front().data(), in.front().size());
      in.pop_front();
      want.pop_front();
    }
    if (want.empty()) continue;
    if (g.members[from]->aborted) c.error = ncclRemoteError;   // nothing more will come
    waiting = true;
  }
  return c.error != ncclSuccess ? c.error : waiting ? ncclInProgress : ncclSuccess;
}

inline ncclResult_t ncclCommGetAsyncError(ncclComm_t comm, ncclResult_t* async) {
  if (!comm || !async) return ncclInvalidArgument;
  std::lock_guard<std::mutex> lock(EmuNccl().mu);
  if (comm->aborted) return ncclInvalidUsage;
  *async = EmuNcclProgress(*comm);
  return ncclSuccess;
}

inline ncclResult_t ncclGroupStart() {
  ++emu_nccl_group_depth;
  return ncclSuccess;
}

// The outermost end posts the group's operations: sends copied into their FIFOs, receives
// queued on their communicators.
inline ncclResult_t ncclGroupEnd() {
  if (emu_nccl_group_depth > 0 && --emu_nccl_group_depth > 0) return ncclSuccess;
  std::lock_guard<std::mutex> lock(EmuNccl().mu);
  for (const EmuNcclOp& op : emu_nccl_ops) {
    if (op.comm->aborted) continue;
    EmuNcclGroup& g = *op.comm->group;
    if (op.send) {
      const uint8_t* p = static_cast<const uint8_t*>(op.buf);
      g.fifo[static_cast<size_t>(op.comm->rank) * g.nranks + op.peer].emplace_back(p, p + op.bytes);
    } else {
      op.comm->pending[op.peer].push_back({op.buf, op.bytes});
    }
  }
  emu_nccl_ops.clear();
  return ncclSuccess;
}

// One send or receive: inside a group it waits for ncclGroupEnd, outside it is a group alone.
inline ncclResult_t EmuNcclQueue(bool send, const void* buf, size_t count, ncclDataType_t type,
                                 int peer, ncclComm_t comm) {
  if (!comm || type != ncclUint8 || (count > 0 && !buf)) return ncclInvalidArgument;
  {
    std::lock_guard<std::mutex> lock(EmuNccl().mu);
    if (comm->aborted || !comm->group->formed()) return ncclInvalidUsage;
    if (peer < 0 || peer >= comm->group->nranks) return ncclInvalidArgument;
  }
  emu_nccl_ops.push_back({send, const_cast<void*>(buf), count, peer, comm});
  return emu_nccl_group_depth > 0 ? ncclSuccess : ncclGroupEnd();
}

inline ncclResult_t ncclSend(const void* buf, size_t count, ncclDataType_t type, int peer,
                             ncclComm_t comm, cudaStream_t) {
  return EmuNcclQueue(true, buf, count, type, peer, comm);
}

inline ncclResult_t ncclRecv(void* buf, size_t count, ncclDataType_t type, int peer,
                             ncclComm_t comm, cudaStream_t) {
  return EmuNcclQueue(false, buf, count, type, peer, comm);
}

// Its pending receives and the bytes sent to it go; peers waiting on it see ncclRemoteError.
inline ncclResult_t ncclCommAbort(ncclComm_t comm) {
  if (!comm) return ncclSuccess;
  std::lock_guard<std::mutex> lock(EmuNccl().mu);
  EmuNcclGroup& g = *comm->group;
  comm->aborted = true;
  for (auto& want : comm->pending) want.clear();
  for (int from = 0; from < g.nranks; ++from)
    g.fifo[static_cast<size_t>(from) * g.nranks + comm->rank].clear();
  return ncclSuccess;
}
