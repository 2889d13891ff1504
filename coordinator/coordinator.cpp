#include "coordinator/coordinator.h"

#include <grpcpp/ext/proto_server_reflection_plugin.h>
#include <grpcpp/grpcpp.h>
#include <grpcpp/health_check_service_interface.h>

#include <algorithm>
#include <cmath>
#include <filesystem>

#include "common/log.h"
#include "rpc/grpc_status.h"

namespace fm {

Result<CoordinatorSetup> SetupFromConfig(const ClusterConfig& cfg, const std::string& model_override) {
  CoordinatorSetup s;
  s.listen = cfg.coordinator.listen.ToString();
  if (cfg.coordinator.http) s.http = cfg.coordinator.http->ToString();
  // Absolute, as the YAML's paths are: every worker without a --model of its own loads this
  // path, from its own working directory.
  s.model_dir = model_override.empty() ? cfg.model : std::filesystem::absolute(model_override).string();
  Result<ModelConfig> model = LoadModelConfig(s.model_dir + "/config.json");
  if (!model.ok())
    return model.status().Wrap(model_override.empty() ? cfg.model_where + ": model" : "--model");
  s.model = std::move(model).value();
  FM_ASSIGN_OR_RETURN(s.plan, PlanShards(s.model, cfg));
  s.cluster.nccl = cfg.transport == TransportKind::kNccl;
  for (const auto& w : s.plan.workers) {
    const NodeConfig& n = cfg.nodes.at(w.node_index);
    s.addresses.emplace_back(n.control.ToString(), n.data.ToString());
    s.cluster.cuda_devices.push_back(n.cuda_device);
  }
  s.cluster.model_dir = s.model_dir;
  s.cluster.down_after = std::chrono::milliseconds(cfg.heartbeat.timeout_ms);   // as configured
  s.cluster.heartbeat_interval = cfg.heartbeat.period();
  s.cluster.max_context = cfg.limits.max_context;
  // The scheduler's largest step: every live sequence's decode row and prompt chunks of at most
  // max_step_tokens rows (Scheduler::Launch); never more than every sequence's whole context.
  s.cluster.max_step_rows = std::min(cfg.limits.max_batch + cfg.limits.max_step_tokens,
                                     cfg.limits.max_batch * cfg.limits.max_context);
  FM_ASSIGN_OR_RETURN(s.cluster.cluster_secret, ReadClusterSecret(cfg));
  const TlsFiles tls{cfg.security.tls.cert, cfg.security.tls.key, cfg.security.tls.ca};
  FM_ASSIGN_OR_RETURN(s.cluster.worker_credentials, ChannelCredentialsFor(tls));
  FM_ASSIGN_OR_RETURN(s.api_credentials, ServerCredentialsFor(tls, false));
  if (!tls.cert.empty()) s.http_tls = HttpTls{tls.cert, tls.key};
  if (cfg.security.insecure && s.cluster.cluster_secret.empty()) {
    FM_LOG(kWarn, "coordinator") << "security.insecure: the worker control RPCs and the data plane "
                                    "are unauthenticated; anyone on this network controls the cluster";
  }
  s.cluster.activation_dtype = cfg.activation_dtype;
  s.cluster.kv_cache_bytes = static_cast<uint64_t>(std::llround(cfg.limits.kv_cache_gib * 1073741824.0));
  s.limits.max_batch = cfg.limits.max_batch;
  s.limits.max_queue = cfg.limits.max_queue;
  s.limits.max_context = cfg.limits.max_context;
  s.limits.max_step_tokens = cfg.limits.max_step_tokens;
  s.api.max_tokens = cfg.limits.max_tokens;
  s.api.max_context = cfg.limits.max_context;
  s.api.max_streams_per_client = cfg.limits.max_streams_per_client;
  s.api.write_stall_timeout = std::chrono::milliseconds(std::llround(cfg.limits.write_stall_timeout_s * 1000));
  s.http_limits.write_stall_timeout = s.api.write_stall_timeout;
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
  c->scheduler_->SetStepObserver([m = &c->metrics_](const std::string& node, double seconds) {
    m->StepLatency(node, seconds);
  });
  c->api_ = std::make_unique<ApiService>(s.model, c->tokenizer_.get(), c->cluster_.get(),
                                         c->scheduler_.get(), &c->metrics_, s.api);
  // Process-wide switches of gRPC, read when the server is built.
  grpc::EnableDefaultHealthCheckService(true);
  grpc::reflection::InitProtoReflectionServerBuilderPlugin();
  FM_ASSIGN_OR_RETURN(c->server_, StartGrpcServer(s.listen, c->api_.get(), &c->port_, kApiMaxRequestBytes,
                                                      s.api_credentials));
  if (!s.http.empty()) {
    c->http_api_ = std::make_unique<HttpApi>(c->tokenizer_.get(), c->cluster_.get(), c->scheduler_.get(),
                                             c->api_.get(), &c->metrics_, s.api);
    FM_ASSIGN_OR_RETURN(c->http_server_,
                        HttpServer::Start(s.http, s.http_limits, [api = c->http_api_.get()](
                                                                     const HttpRequest& req, HttpResponder* out) {
                          api->Handle(req, out);
                        }, s.http_tls));
    FM_LOG(kInfo, "coordinator") << (s.http_tls ? "HTTPS" : "HTTP") << " API on port "
                                 << c->http_server_->port();
  }
  c->health_thread_ = std::thread([p = c.get()] { p->WatchHealth(); });
  c->cluster_->Start();
  FM_LOG(kInfo, "coordinator") << "serving " << s.model_dir << " on port " << c->port_ << ": "
                               << s.plan.pipeline_stages << " stage(s), " << s.plan.workers.size()
                               << " worker(s)";
  return c;
}

void Coordinator::WatchHealth() {
  grpc::HealthCheckServiceInterface* health = server_->GetHealthCheckService();
  std::unique_lock<std::mutex> lock(health_mu_);
  bool first = true, serving = false;
  while (!stopping_) {
    const bool ready = ClusterHealth(*cluster_, *scheduler_).ok();
    if (first || ready != serving) {
      health->SetServingStatus(ready);   // "" (the server as a whole)
      health->SetServingStatus(flashmesh::v1::Inference::service_full_name(), ready);
      serving = ready;
      first = false;
    }
    health_cv_.wait_for(lock, std::chrono::milliseconds(100));
  }
}

void Coordinator::Shutdown() {
  {
    std::lock_guard<std::mutex> lock(health_mu_);
    stopping_ = true;
  }
  health_cv_.notify_all();
  if (health_thread_.joinable()) health_thread_.join();
  if (http_server_) http_server_->Shutdown();
  if (server_) server_->Shutdown(std::chrono::system_clock::now() + std::chrono::seconds(2));
}

Coordinator::~Coordinator() {
  Shutdown();
  scheduler_.reset();
  cluster_.reset();
}

}  // namespace fm
