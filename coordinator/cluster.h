// Cluster: the coordinator's view of its workers. One NodeHandle per worker of the plan (its
// gRPC stub, its shard spec, its state). A heartbeat thread per node calls Worker.Health every
// interval; a node silent for down_after is DOWN. A node that answers but has not loaded this
// coordinator's shard (first start, or restarted under the same name) gets LoadShard and is UP
// again once it succeeds, without restarting the coordinator. With transport nccl, a member of
// an EP group that needs loading makes the coordinator load its whole group: NCCL cannot take
// a restarted rank back, so every member gets the same fresh id from the group's rank 0.
// The Cluster is the Scheduler's WorkerSet: the worker RPCs, async over gRPC (cluster_rpc.cpp).
#pragma once
#include <atomic>
#include <condition_variable>
#include <chrono>
#include <cstdint>
#include <functional>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <thread>
#include <vector>

#include <grpcpp/grpcpp.h>

#include "common/status.h"
#include "coordinator/checkpoint_refs.h"
#include "coordinator/planner.h"
#include "coordinator/stall_watch.h"
#include "coordinator/worker_set.h"
#include "flashmesh/v1/api.pb.h"
#include "flashmesh/v1/worker.grpc.pb.h"

namespace fm {

struct ClusterOptions {
  std::string model_dir;
  std::chrono::milliseconds heartbeat_interval{500};
  std::chrono::milliseconds down_after{2500};   // heartbeat.timeout_ms: a silent worker is DOWN after it
  int64_t max_context = 8192;
  uint64_t kv_cache_bytes = 0;                   // per worker; 0 = unlimited
  std::string activation_dtype = "f32";          // data-plane frames between stages: f32 | bf16
  // transport nccl: EP groups exchange through NCCL on each worker's GPU (cuda_devices, one
  // per plan worker); a group is always loaded as a whole, with a fresh ncclUniqueId.
  bool nccl = false;
  std::vector<int> cuda_devices;
  int64_t max_step_rows = 0;   // rows one step may carry (max_batch + max_step_tokens): frame bound
  // Control-plane security (rpc/control_auth.h): every worker call is signed with the
  // cluster secret ("" = unsigned, loopback clusters) and carries the term; 0 = the start
  // time in ms (a later coordinator has a higher term).
  std::string cluster_secret;
  uint64_t term = 0;
  // security.tls: the control channels verify the workers against the CA and present the
  // coordinator's certificate; insecure when unset.
  std::shared_ptr<grpc::ChannelCredentials> worker_credentials = grpc::InsecureChannelCredentials();
};

class NodeHandle {
 public:
  NodeHandle(const WorkerPlan& plan, std::string control, std::string data,
             flashmesh::v1::ShardSpec spec, const ClusterOptions& options, uint64_t term);
  const std::string& name() const { return plan_.node; }
  const std::string& control() const { return control_; }
  const std::string& data() const { return data_; }
  const WorkerPlan& plan() const { return plan_; }
  const flashmesh::v1::ShardSpec& spec() const { return spec_; }
  flashmesh::v1::Worker::Stub* stub() { return stub_.get(); }

  flashmesh::v1::NodeState state() const;
  std::string error() const;
  double heartbeat_age_s() const;   // -1 = never answered

 private:
  friend class Cluster;
  WorkerPlan plan_;
  std::string control_, data_;
  flashmesh::v1::ShardSpec spec_;
  std::unique_ptr<flashmesh::v1::Worker::Stub> stub_;
  mutable std::mutex mu_;
  flashmesh::v1::NodeState state_ = flashmesh::v1::NODE_STATE_WAITING;
  std::string error_;
  bool ever_ok_ = false;
  std::chrono::steady_clock::time_point last_ok_;
  int index_ = 0;                                        // in Cluster::nodes()
  grpc::ClientContext* loading_ = nullptr;              // its LoadShard in flight (under mu_)
  // Under mu_: an NCCL group's loads run on threads of whichever member's heartbeat starts them.
  int load_failures_ = 0;                                // in a row
  std::chrono::steady_clock::time_point next_load_{};   // no LoadShard before (backoff)
  // Its last LoadShard of this coordinator succeeded and loaded the reference checkpoint: a
  // node is UP only then (a load refused after it ran leaves the worker loaded with our epoch).
  bool accepted_ = false;
};

class Cluster final : public WorkerSet {
 public:
  // nodes[i] pairs plan.workers[i] with its control/data addresses.
  Cluster(const Plan& plan, const std::vector<std::pair<std::string, std::string>>& addresses,
          const ClusterOptions& options);
  ~Cluster() override;

  void Start();   // heartbeat threads
  const ClusterOptions& options() const { return options_; }
  const std::vector<std::unique_ptr<NodeHandle>>& nodes() const { return nodes_; }
  NodeHandle* Find(const std::string& name) const;
  uint64_t term() const override { return term_; }
  // Whether a newer coordinator took the cluster over (a worker follows a higher term): this
  // one then stops loading and stepping workers and Ready() says why.
  bool stepped_down() const { return stepped_down_; }
  int vocab_size() const { return vocab_size_; }

  // WorkerSet. Ready: every node UP, otherwise why not, naming the first node that is not.
  int num_stages() const override { return num_stages_; }
  int expert_parallel() const override { return expert_parallel_; }
  int tensor_parallel() const { return tensor_parallel_; }
  const std::vector<WorkerInfo>& workers() const override { return infos_; }
  Status Ready() const override;
  Status Running() const override;
  bool serving(int worker) const override;
  void MarkDown(int worker, const std::string& why) override;
  void OnChange(std::function<void()> fn) override { listener_ = std::move(fn); }
  void OnHeld(std::function<void(int, std::vector<uint64_t>, Deadline)> fn) override {
    held_listener_ = std::move(fn);
  }
  std::function<void()> StartSequence(int worker, const flashmesh::v1::StartSequenceRequest& req,
                                      Deadline deadline,
                                      Done<flashmesh::v1::StartSequenceResponse> done) override;
  std::function<void()> FreeSequence(int worker, const flashmesh::v1::FreeSequenceRequest& req,
                                     Deadline deadline,
                                     Done<flashmesh::v1::FreeSequenceResponse> done) override;
  std::function<void()> Reset(int worker, Deadline deadline,
                              Done<flashmesh::v1::ResetResponse> done) override;
  std::function<void()> StepBatch(int worker, const flashmesh::v1::StepBatchRequest& req,
                                  Deadline deadline,
                                  Done<flashmesh::v1::StepBatchResponse> done) override;

  // Every node's Stats, asked of all at once (the status table, /metrics), so that slow nodes
  // cost one timeout together rather than one each. Indexed like nodes(); empty for a node that
  // is DOWN or did not answer within `timeout`.
  std::vector<std::optional<flashmesh::v1::StatsResponse>> StatsOfAll(std::chrono::milliseconds timeout);

 private:
  // Ok, or Unavailable naming the newer term's takeover once this coordinator stepped down.
  Status SteppedDown() const;
  // An NCCL EP group: its members in rank order; generation counts the starts and ends of
  // whole-group loads (odd while one runs).
  struct NcclGroup {
    std::mutex mu;
    std::atomic<uint64_t> generation{0};   // read without mu by the heartbeats
    std::vector<NodeHandle*> members;
  };
  void Heartbeat(NodeHandle* node);
  void LoadNode(NodeHandle* node, const flashmesh::v1::ShardSpec& spec);
  // A failed load of `node`: DOWN with "`what` (N in a row, next in B ms): `why`", and no load
  // before a backoff B that doubles with each failure in a row (returned).
  std::chrono::milliseconds FailLoad(NodeHandle* node, const std::string& what, const std::string& why);
  // Loads every member of `group` with a fresh id, unless another heartbeat did since this
  // one read `seen` (the generation).
  void LoadNcclGroup(NcclGroup* group, uint64_t seen);
  // A fresh ncclUniqueId from `root` (`what` it is for goes into the error).
  Result<std::string> NewNcclId(NodeHandle* root, const std::string& what);
  NcclGroup* GroupOf(const NodeHandle* node) const;
  void SetState(NodeHandle* node, flashmesh::v1::NodeState state, const std::string& error);
  void StepDown(const std::string& why);
  // `done`, after stepping down when the worker answered that it follows a newer coordinator.
  template <typename T>
  Done<T> StepDownIfSuperseded(NodeHandle* node, Done<T> done) {
    return [this, node, done = std::move(done)](RpcResult r, T resp) {
      if (r.fault == RpcFault::kSuperseded)
        StepDown("node " + node->name() + " follows a newer coordinator: " + r.status.message());
      done(std::move(r), std::move(resp));
    };
  }

  ClusterOptions options_;
  CheckpointRefs checkpoint_;   // every node must load the same checkpoint
  StallWatch stall_watch_;   // a call that timed out while this process was paused blames it
  int num_stages_ = 1;
  int expert_parallel_ = 1;
  int stage_group_ = 1;   // workers of a stage (EP or TP group)
  int tensor_parallel_ = 1;
  uint64_t epoch_ = 0;
  uint64_t term_ = 0;
  std::atomic<bool> stepped_down_{false};
  mutable std::mutex step_down_mu_;
  std::string step_down_reason_;
  std::vector<std::unique_ptr<NodeHandle>> nodes_;
  std::vector<WorkerInfo> infos_;
  // transport nccl: per stage (EP groups only) or one of every worker (with stage hops)
  std::vector<std::unique_ptr<NcclGroup>> nccl_groups_;
  std::function<void()> listener_;
  std::function<void(int, std::vector<uint64_t>, Deadline)> held_listener_;
  std::atomic<int> vocab_size_{0};
  std::atomic<bool> stop_{false};
  std::mutex stop_mu_;
  std::condition_variable stop_cv_;
  std::vector<std::thread> threads_;
};

}  // namespace fm
