// WorkerService: the gRPC control plane of one worker (worker.proto): LoadShard, Health, Stats
// (weight bytes, KV bytes, active sequences, tok/s, data-plane bytes), Drain, sequence
// lifecycle and StepBatch. Activations between stages travel on the data plane (`data_plane`,
// the worker's net::Transport listening on nodes[].data), never through gRPC.
#pragma once
#include <atomic>
#include <map>
#include <memory>
#include <mutex>
#include <string>
#include <vector>

#include "flashmesh/v1/worker.grpc.pb.h"
#include "net/nccl_communicator.h"
#include "net/transport.h"
#include "rpc/control_auth.h"
#include "worker/data_plane.h"
#include "worker/shard_runtime.h"
#include "worker/stage_executor.h"

namespace fm {

// What a worker checks its callers and peers against.
struct WorkerSecurity {
  // Every call must carry a credential from this secret (control_auth.h); "" = none needed.
  std::string cluster_secret;
  // The cluster YAML's nodes: name -> data address "host:port". When set, LoadShard's peers
  // must be nodes of it at exactly these addresses, and data-plane peers must connect from
  // their host. Empty (a single-process `serve`): no such checks.
  std::map<std::string, std::string> node_data;
};

// The largest control request a worker parses: a StepBatch of every sequence's whole prompt
// (max_batch x max_context token ids) stays far below it.
inline constexpr int kWorkerMaxRequestBytes = 64 << 20;

class WorkerService final : public flashmesh::v1::Worker::Service {
 public:
  // `model_dir_override`: load from this directory instead of the one LoadShard names.
  // `data_plane` (listening, outliving the service) carries the manifolds between stages.
  WorkerService(std::string node, std::string model_dir_override, int threads,
                net::Transport* data_plane, WorkerSecurity security = {});
  ~WorkerService() override;

  grpc::Status LoadShard(grpc::ServerContext*, const flashmesh::v1::LoadShardRequest*,
                         flashmesh::v1::LoadShardResponse*) override;
  grpc::Status Health(grpc::ServerContext*, const flashmesh::v1::HealthRequest*,
                      flashmesh::v1::HealthResponse*) override;
  grpc::Status Stats(grpc::ServerContext*, const flashmesh::v1::StatsRequest*,
                     flashmesh::v1::StatsResponse*) override;
  grpc::Status Drain(grpc::ServerContext*, const flashmesh::v1::DrainRequest*,
                     flashmesh::v1::DrainResponse*) override;
  grpc::Status StartSequence(grpc::ServerContext*, const flashmesh::v1::StartSequenceRequest*,
                             flashmesh::v1::StartSequenceResponse*) override;
  grpc::Status FreeSequence(grpc::ServerContext*, const flashmesh::v1::FreeSequenceRequest*,
                            flashmesh::v1::FreeSequenceResponse*) override;
  grpc::Status StepBatch(grpc::ServerContext*, const flashmesh::v1::StepBatchRequest*,
                         flashmesh::v1::StepBatchResponse*) override;
  grpc::Status Reset(grpc::ServerContext*, const flashmesh::v1::ResetRequest*,
                     flashmesh::v1::ResetResponse*) override;
  grpc::Status NewNcclId(grpc::ServerContext*, const flashmesh::v1::NewNcclIdRequest*,
                         flashmesh::v1::NewNcclIdResponse*) override;

  // Before the gRPC server's Shutdown: refuses new steps and sequences, ends the waiting and
  // running steps, so that no handler outlives the shutdown's grace period.
  void Stop();

 private:
  // LoadShard's peers checked against security_.node_data, then made the only ones the data
  // plane accepts (before the load); after it, frame limits from the plan's largest frame
  // (NCCL groups and hops too).
  Status CheckPeers(const flashmesh::v1::ShardSpec& s) const;
  Status AllowPeers(const flashmesh::v1::ShardSpec& s);
  void SetFrameLimits(const flashmesh::v1::ShardSpec& s);

  std::string node_;
  WorkerSecurity security_;
  ControlGuard guard_;
  std::string model_dir_override_;
  std::mutex load_mu_;   // one LoadShard at a time
  std::atomic<uint64_t> epoch_{0};
  mutable std::mutex shard_mu_;
  flashmesh::v1::ShardSpec shard_;   // what the last good LoadShard asked for; cleared on failure
  std::atomic<bool> draining_{false};   // Drain until Drain{resume}: kept across loads
  std::atomic<bool> stopping_{false};
  net::Transport* data_plane_;
  std::unique_ptr<net::Communicator> ep_group_;  // expert-parallel group of the loaded shard
  // transport nccl: the hops to the next and from the previous stage (the executor's sink and
  // source use them, so they outlive it).
  std::unique_ptr<net::NcclCommunicator> next_link_, prev_link_;
  // The NCCL communicators of the loaded shard (EP group, hops): Health reports a broken one as
  // not loaded, so the coordinator loads them all again; swapped under nccl_mu_.
  mutable std::mutex nccl_mu_;
  std::vector<net::NcclCommunicator*> nccl_comms_;
  ShardRuntime runtime_;
  StageExecutor executor_;
  ActivationReceiver receiver_;   // after executor_: stops before it
};

}  // namespace fm
