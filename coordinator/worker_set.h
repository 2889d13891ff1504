// WorkerSet: what the Scheduler needs of the cluster, so that it runs against a fake cluster in
// its unit tests: the workers' shape, whether they can run steps and take new sequences, and
// the four worker RPCs, each asynchronous with a deadline. Cluster implements it over gRPC.
#pragma once
#include <chrono>
#include <cstdint>
#include <functional>
#include <string>
#include <vector>

#include "common/status.h"
#include "flashmesh/v1/worker.pb.h"

namespace fm {

// Who a failed worker RPC's error belongs to, from the RPC status itself (the worker marks the
// errors it returns with trailing metadata, rpc/grpc_status.h), never from its text.
enum class RpcFault {
  kNone,
  kUnreachable,     // the worker could not be reached (connection): the node itself failed
  kTimedOut,        // no answer by the call's deadline: the node failed, or paused a moment
  kCoordinatorStalled,  // timed out while this process was not running, or just after (SIGSTOP,
                        // a VM pause, CPU starvation: StallWatch); no node is to blame
  kWorker,          // the worker answered with this error
  kLostSequences,   // the worker answered that it does not hold a sequence of the call
  kSuperseded,      // the worker answered that it follows a newer coordinator (this one steps down)
};

// No answer by the deadline: the node may only be paused, so a control call that ends so fails
// its own request and the heartbeat decides whether the node is down.
inline bool NoAnswerInTime(RpcFault f) {
  return f == RpcFault::kTimedOut || f == RpcFault::kCoordinatorStalled;
}

struct RpcResult {
  Status status;
  RpcFault fault = RpcFault::kNone;
  bool ok() const { return status.ok(); }
};

struct WorkerInfo {
  std::string name;      // nodes[].name
  std::string control;   // host:port, for error messages
  int ep_rank = 0;       // member of its stage's EP group (0 without EP)
  bool head = false;     // last stage: its StepBatch answers carry the sampled tokens
};

class WorkerSet {
 public:
  using Deadline = std::chrono::steady_clock::time_point;
  template <typename T>
  using Done = std::function<void(RpcResult, T)>;

  virtual ~WorkerSet() = default;
  virtual int num_stages() const = 0;
  virtual int expert_parallel() const = 0;
  // This coordinator's term (its start time in ms; a coordinator that takes over has a higher
  // one). Step ids start at term x 2^20 + 1, so they rise across coordinators too: a frame an
  // earlier coordinator's step left in a worker's queues is older than every step of this one,
  // and skipped as such.
  virtual uint64_t term() const = 0;
  virtual const std::vector<WorkerInfo>& workers() const = 0;
  // Ok while every worker takes new sequences (UP); otherwise why not, naming the node.
  virtual Status Ready() const = 0;
  // Ok while every worker can run the live sequences' steps (UP or DRAINING).
  virtual Status Running() const = 0;
  // UP or DRAINING: it answers RPCs now (a LOADING worker's Reset would wait behind its load,
  // which resets it anyway).
  virtual bool serving(int worker) const = 0;
  // The worker failed an RPC at the transport level: DOWN until its heartbeat answers again.
  // Nothing once this coordinator stepped down: the workers are the newer one's to judge.
  virtual void MarkDown(int worker, const std::string& why) = 0;
  // `fn` runs (on any thread) after every change of a worker's state; set before Start.
  virtual void OnChange(std::function<void()> fn) = 0;
  // `fn` runs (on any thread) with each heartbeat of an UP or DRAINING worker: the sequences
  // it held when asked at `asked`; set before Start.
  virtual void OnHeld(std::function<void(int worker, std::vector<uint64_t> ids, Deadline asked)> fn) = 0;

  // Each calls `done` exactly once, on any thread (possibly before returning), and returns a
  // function that cancels the call (harmless once it is done).
  virtual std::function<void()> StartSequence(int worker, const flashmesh::v1::StartSequenceRequest& req,
                                              Deadline deadline,
                                              Done<flashmesh::v1::StartSequenceResponse> done) = 0;
  virtual std::function<void()> FreeSequence(int worker, const flashmesh::v1::FreeSequenceRequest& req,
                                             Deadline deadline,
                                             Done<flashmesh::v1::FreeSequenceResponse> done) = 0;
  virtual std::function<void()> Reset(int worker, Deadline deadline,
                                      Done<flashmesh::v1::ResetResponse> done) = 0;
  virtual std::function<void()> StepBatch(int worker, const flashmesh::v1::StepBatchRequest& req,
                                          Deadline deadline,
                                          Done<flashmesh::v1::StepBatchResponse> done) = 0;
};

}  // namespace fm
