// Coordinator: the whole coordinator process minus argument parsing: the Cluster (heartbeats,
// shard loading), the Scheduler, the tokenizer, the public gRPC API server (with the standard
// grpc.health.v1 service, SERVING exactly while the cluster can generate, and server
// reflection) and the optional HTTP server (OpenAI-compatible API, /health, /metrics). Used by
// `flashmesh coordinator` (from the cluster YAML) and `flashmesh serve` (one in-process worker).
#pragma once
#include <condition_variable>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include "common/status.h"
#include "config/cluster_config.h"
#include "coordinator/api_service.h"
#include "coordinator/cluster.h"
#include "coordinator/http_api.h"
#include "coordinator/http_server.h"
#include "coordinator/metrics.h"
#include "coordinator/planner.h"
#include "coordinator/scheduler.h"

#include <grpcpp/grpcpp.h>

namespace fm {

struct CoordinatorSetup {
  std::string listen;                 // host:port of the API; port 0 picks one
  std::string http;                   // host:port of the HTTP API; "" = none; port 0 picks one
  HttpLimits http_limits;
  std::string model_dir;
  ModelConfig model;
  Plan plan;
  std::vector<std::pair<std::string, std::string>> addresses;   // (control, data) per worker
  ClusterOptions cluster;
  SchedulerLimits limits;
  ApiOptions api;
  // security.tls: the public gRPC API and the HTTP API over TLS; plain when unset.
  std::shared_ptr<grpc::ServerCredentials> api_credentials = grpc::InsecureServerCredentials();
  std::optional<HttpTls> http_tls;
};

// The setup a cluster YAML describes (planner included); model_override replaces `model:`.
Result<CoordinatorSetup> SetupFromConfig(const ClusterConfig& cfg, const std::string& model_override);

class Coordinator {
 public:
  static Result<std::unique_ptr<Coordinator>> Start(CoordinatorSetup setup);
  ~Coordinator();
  int port() const { return port_; }
  int http_port() const { return http_server_ ? http_server_->port() : 0; }
  Cluster* cluster() { return cluster_.get(); }
  void Shutdown();

 private:
  Coordinator() = default;
  // Keeps grpc.health.v1 in step with Cluster::Ready until Shutdown.
  void WatchHealth();
  CoordinatorSetup setup_;
  std::unique_ptr<Tokenizer> tokenizer_;
  std::unique_ptr<Cluster> cluster_;
  std::unique_ptr<Scheduler> scheduler_;
  Metrics metrics_;
  std::unique_ptr<ApiService> api_;
  std::unique_ptr<grpc::Server> server_;
  std::unique_ptr<HttpApi> http_api_;
  std::unique_ptr<HttpServer> http_server_;
  int port_ = 0;
  std::mutex health_mu_;
  std::condition_variable health_cv_;
  bool stopping_ = false;
  std::thread health_thread_;
};

}  // namespace fm
