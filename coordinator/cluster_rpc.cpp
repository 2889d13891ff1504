// The Cluster's worker RPCs for the Scheduler (WorkerSet): async gRPC calls with deadlines,
// each result classified by who it belongs to (RpcFault) from the worker's trailing metadata.
// Also StatsOfAll, for the status table and /metrics.
#include <grpcpp/grpcpp.h>

#include "coordinator/cluster.h"
#include "rpc/grpc_status.h"

namespace fm {
namespace {

template <typename Req, typename Resp>
struct PendingCall {
  grpc::ClientContext ctx;
  Req req;
  Resp resp;
};

std::chrono::system_clock::time_point ToSystem(WorkerSet::Deadline d) {
  return std::chrono::system_clock::now() +
         std::chrono::duration_cast<std::chrono::system_clock::duration>(d - std::chrono::steady_clock::now());
}

// An error without the worker's fault mark never reached the worker's code: the node (or the
// network to it) failed, whatever the code or text.
RpcResult Classify(const NodeHandle& node, const StallWatch& watch, const grpc::ClientContext& ctx,
                   const grpc::Status& s, WorkerSet::Deadline deadline) {
  if (s.ok()) return {};
  const auto& md = ctx.GetServerTrailingMetadata();
  auto it = md.find(kFaultKey);
  if (it == md.end()) {
    const std::string named = "node " + node.name() + " (" + node.control() + ") ";
    if (s.error_code() == grpc::StatusCode::DEADLINE_EXCEEDED) {
      if (const auto stalled = watch.StalledAround(deadline); stalled.count() > 0)
        return {Unavailable("this coordinator did not run for " + std::to_string(stalled.count()) +
                            " ms (paused, or starved of CPU) around the deadline of its call to " +
                            named + "which may have answered in time"),
                RpcFault::kCoordinatorStalled};
      return {Unavailable(named + "did not answer in time"), RpcFault::kTimedOut};
    }
    return {Unavailable(named + "is unavailable: " + s.error_message()), RpcFault::kUnreachable};
  }
  const std::string fault(it->second.data(), it->second.size());
  return {FromGrpc(s), fault == kFaultLostSequences ? RpcFault::kLostSequences
                       : fault == kFaultSuperseded  ? RpcFault::kSuperseded
                                                    : RpcFault::kWorker};
}

// Starts one async call: `start(ctx, req, resp, on_done)` issues it on the node's stub.
// Returns the call's canceller (WorkerSet: harmless once it is done).
template <typename Req, typename Resp, typename Start>
std::function<void()> Call(NodeHandle* node, const StallWatch* watch, const Req& req,
                           WorkerSet::Deadline deadline, WorkerSet::Done<Resp> done, Start start) {
  auto p = std::make_shared<PendingCall<Req, Resp>>();
  p->req = req;
  p->ctx.set_deadline(ToSystem(deadline));
  start(&p->ctx, &p->req, &p->resp, [p, node, watch, deadline, done = std::move(done)](grpc::Status s) {
    done(Classify(*node, *watch, p->ctx, s, deadline), std::move(p->resp));
  });
  return [p] { p->ctx.TryCancel(); };
}

}  // namespace

std::function<void()> Cluster::StartSequence(int worker, const flashmesh::v1::StartSequenceRequest& req,
                                             Deadline deadline,
                                             Done<flashmesh::v1::StartSequenceResponse> done) {
  NodeHandle* n = nodes_[worker].get();
  return Call(n, &stall_watch_, req, deadline, StepDownIfSuperseded(n, std::move(done)),
              [n](auto* ctx, auto* q, auto* r, auto cb) {
    n->stub()->async()->StartSequence(ctx, q, r, std::move(cb));
  });
}

std::function<void()> Cluster::FreeSequence(int worker, const flashmesh::v1::FreeSequenceRequest& req,
                                            Deadline deadline,
                                            Done<flashmesh::v1::FreeSequenceResponse> done) {
  NodeHandle* n = nodes_[worker].get();
  return Call(n, &stall_watch_, req, deadline, StepDownIfSuperseded(n, std::move(done)),
              [n](auto* ctx, auto* q, auto* r, auto cb) {
    n->stub()->async()->FreeSequence(ctx, q, r, std::move(cb));
  });
}

std::function<void()> Cluster::Reset(int worker, Deadline deadline, Done<flashmesh::v1::ResetResponse> done) {
  NodeHandle* n = nodes_[worker].get();
  return Call(n, &stall_watch_, flashmesh::v1::ResetRequest(), deadline,
              StepDownIfSuperseded(n, std::move(done)), [n](auto* ctx, auto* q, auto* r, auto cb) {
    n->stub()->async()->Reset(ctx, q, r, std::move(cb));
  });
}

std::function<void()> Cluster::StepBatch(int worker, const flashmesh::v1::StepBatchRequest& req,
                                         Deadline deadline, Done<flashmesh::v1::StepBatchResponse> done) {
  NodeHandle* n = nodes_[worker].get();
  return Call(n, &stall_watch_, req, deadline, StepDownIfSuperseded(n, std::move(done)),
              [n](auto* ctx, auto* q, auto* r, auto cb) {
    n->stub()->async()->StepBatch(ctx, q, r, std::move(cb));
  });
}

std::vector<std::optional<flashmesh::v1::StatsResponse>> Cluster::StatsOfAll(
    std::chrono::milliseconds timeout) {
  struct Gather {
    std::mutex mu;
    std::condition_variable cv;
    int pending = 0;
    std::vector<std::optional<flashmesh::v1::StatsResponse>> out;
  };
  auto g = std::make_shared<Gather>();
  g->out.resize(nodes_.size());
  const auto deadline = std::chrono::steady_clock::now() + timeout;
  for (size_t i = 0; i < nodes_.size(); ++i) {
    NodeHandle* n = nodes_[i].get();
    // A coordinator that stepped down asks no node (it reports none, and a host gone since
    // would cost every scrape the whole timeout).
    if (stepped_down_ || n->state() == flashmesh::v1::NODE_STATE_DOWN) continue;
    {
      std::lock_guard<std::mutex> l(g->mu);
      ++g->pending;
    }
    Call(n, &stall_watch_, flashmesh::v1::StatsRequest(), deadline,
         WorkerSet::Done<flashmesh::v1::StatsResponse>([g, i](RpcResult r, flashmesh::v1::StatsResponse resp) {
           std::lock_guard<std::mutex> l(g->mu);
           if (r.ok()) g->out[i] = std::move(resp);
           if (--g->pending == 0) g->cv.notify_all();
         }),
         [n](auto* ctx, auto* q, auto* r, auto cb) { n->stub()->async()->Stats(ctx, q, r, std::move(cb)); });
  }
  // gRPC ends every call by its deadline; the margin covers its callback thread.
  std::unique_lock<std::mutex> l(g->mu);
  g->cv.wait_until(l, deadline + std::chrono::seconds(1), [&] { return g->pending == 0; });
  return g->out;
}

}  // namespace fm
