#include "coordinator/coordinator.h"

#include <grpcpp/grpcpp.h>

#include <algorithm>
#include <cmath>

#include "common/log.h"
#include "worker/grpc_status.h"

namespace fm {

Result<CoordinatorSetup> SetupFromConfig(const ClusterConfig& cfg, const std::string& model_override) {
  CoordinatorSetup s;
  s.listen = cfg.coordinator.listen.ToString();
  s.model_dir = model_override.empty() ? cfg.model : model_override;
  FM_ASSIGN_OR_RETURN(s.model, LoadModelConfig(s.model_dir + "/config.json"));
  FM_ASSIGN_OR_RETURN(s.plan, PlanShards(s.model, cfg));
  s.cluster.nccl = cfg.transport == TransportKind::kNccl;
  for (const auto& w : s.plan.workers) {
    const NodeConfig& n = cfg.nodes.at(w.node_index);
    s.addresses.emplace_back(n.control.ToString(), n.data.ToString());
    s.cluster.cuda_devices.push_back(n.cuda_device);
  }
  s.cluster.model_dir = s.model_dir;
  auto interval = std::chrono::milliseconds(cfg.heartbeat.interval_ms);
  s.cluster.down_after = std::min(std::chrono::milliseconds(cfg.heartbeat.timeout_ms),
                                  std::chrono::milliseconds(2000));
  s.cluster.heartbeat_interval = std::min(interval, s.cluster.down_after / 4);
  s.cluster.max_context = cfg.limits.max_context;
  s.cluster.activation_dtype = cfg.activation_dtype;
  s.cluster.kv_cache_bytes = static_cast<uint64_t>(std::llround(cfg.limits.kv_cache_gib * 1073741824.0));
  s.limits.max_batch = cfg.limits.max_batch;
  s.limits.max_queue = cfg.limits.max_queue;
  s.limits.max_context = cfg.limits.max_context;
  s.api.max_tokens = cfg.limits.max_tokens;
  s.api.max_context = cfg.limits.max_context;
  s.api.model_name = s.model_dir;
  if (!cfg.security.token_file.empty()) {
    FM_ASSIGN_OR_RETURN(s.api.api_tokens, ReadApiTokens(cfg.security.token_file));
  }
  return s;
}

Result<std::unique_ptr<Coordinator>> Coordinator::Start(CoordinatorSetup setup) {
  std::unique_ptr<Coordinator> c(new Coordinator());
  c->setup_ = std::move(setup);
  const CoordinatorSetup& s = c->setup_;
  if (s.plan.workers.size() != s.addresses.size())
    return Internal("the plan has " + std::to_string(s.plan.workers.size()) + " workers but " +
                    std::to_string(s.addresses.size()) + " addresses");
  auto tok = Tokenizer::Load(s.model_dir);
  if (tok.ok()) {
    c->tokenizer_ = std::make_unique<Tokenizer>(std::move(tok).value());
  } else {
    FM_LOG(kWarn, "coordinator") << "no tokenizer (token-id input only): " << tok.status().ToString();
  }
  c->cluster_ = std::make_unique<Cluster>(s.plan, s.addresses, s.cluster);
  c->scheduler_ = std::make_unique<Scheduler>(c->cluster_.get(), c->tokenizer_.get(), s.limits);
  c->api_ = std::make_unique<ApiService>(s.model, c->tokenizer_.get(), c->cluster_.get(),
                                         c->scheduler_.get(), s.api);
  FM_ASSIGN_OR_RETURN(c->server_, StartGrpcServer(s.listen, c->api_.get(), &c->port_));
  c->cluster_->Start();
  FM_LOG(kInfo, "coordinator") << "serving " << s.model_dir << " on port " << c->port_ << ": "
                               << s.plan.pipeline_stages << " stage(s), " << s.plan.workers.size()
                               << " worker(s)";
  return c;
}

void Coordinator::Shutdown() {
  if (server_) server_->Shutdown(std::chrono::system_clock::now() + std::chrono::seconds(2));
}

Coordinator::~Coordinator() {
  Shutdown();
  scheduler_.reset();
  cluster_.reset();
}

}  // namespace fm
