// Coordinator: the whole coordinator process minus argument parsing: the Cluster (heartbeats,
// shard loading), the Scheduler, the tokenizer and the public gRPC API server. Used by
// `flashmesh coordinator` (from the cluster YAML) and `flashmesh serve` (one in-process worker).
#pragma once
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "common/status.h"
#include "coordinator/api_service.h"
#include "coordinator/cluster.h"
#include "coordinator/cluster_config.h"
#include "coordinator/planner.h"
#include "coordinator/scheduler.h"

namespace grpc {
class Server;
}

namespace fm {

struct CoordinatorSetup {
  std::string listen;                 // host:port of the API; port 0 picks one
  std::string model_dir;
  ModelConfig model;
  Plan plan;
  std::vector<std::pair<std::string, std::string>> addresses;   // (control, data) per worker
  ClusterOptions cluster;
  SchedulerLimits limits;
  ApiOptions api;
};

// The setup a cluster YAML describes (planner included); model_override replaces `model:`.
Result<CoordinatorSetup> SetupFromConfig(const ClusterConfig& cfg, const std::string& model_override);

class Coordinator {
 public:
  static Result<std::unique_ptr<Coordinator>> Start(CoordinatorSetup setup);
  ~Coordinator();
  int port() const { return port_; }
  Cluster* cluster() { return cluster_.get(); }
  void Shutdown();

 private:
  Coordinator() = default;
  CoordinatorSetup setup_;
  std::unique_ptr<Tokenizer> tokenizer_;
  std::unique_ptr<Cluster> cluster_;
  std::unique_ptr<Scheduler> scheduler_;
  std::unique_ptr<ApiService> api_;
  std::unique_ptr<grpc::Server> server_;
  int port_ = 0;
};

}  // namespace fm
