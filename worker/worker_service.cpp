#include "worker/worker_service.h"

#include <grpcpp/grpcpp.h>

#include <cstring>

#include "common/log.h"
#include "worker/grpc_status.h"

namespace fm {

WorkerService::WorkerService(std::string node, std::string model_dir_override, int threads)
    : node_(std::move(node)),
      model_dir_override_(std::move(model_dir_override)),
      runtime_(threads),
      executor_(&runtime_) {}

WorkerService::~WorkerService() = default;

grpc::Status WorkerService::LoadShard(grpc::ServerContext*, const flashmesh::v1::LoadShardRequest* req,
                                      flashmesh::v1::LoadShardResponse* resp) {
  std::lock_guard<std::mutex> lock(load_mu_);
  const auto& s = req->shard();
  ShardPlacement p;
  p.model_dir = model_dir_override_.empty() ? s.model_dir() : model_dir_override_;
  p.stage = s.stage();
  p.num_stages = s.num_stages();
  p.layer_begin = s.layer_begin();
  p.layer_end = s.layer_end();
  p.embed = s.embed();
  p.head = s.head();
  p.experts.assign(s.experts().begin(), s.experts().end());
  p.max_context = s.max_context();
  p.kv_cache_bytes = s.kv_cache_bytes();
  if (p.stage < 0 || p.stage >= p.num_stages)
    return ToGrpc(InvalidArgument("shard.stage " + std::to_string(p.stage) + " outside [0, " +
                                  std::to_string(p.num_stages) + ")"));
  if (!p.head && s.next_control().empty())
    return ToGrpc(InvalidArgument("shard.next_control is empty on a stage without the head"));
  executor_.Reset();
  Status st = runtime_.Load(p);
  if (!st.ok()) {
    FM_LOG(kError, "worker") << node_ << ": " << st.ToString();
    return ToGrpc(st.Wrap("node " + node_ + " loading its shard"));
  }
  executor_.SetNext(p.head ? nullptr : NewGrpcActivationSink(s.next_control()));
  epoch_ = s.epoch();
  draining_ = false;
  resp->set_weight_bytes(runtime_.weight_bytes());
  resp->set_vocab_size(static_cast<int32_t>(runtime_.config().vocab_size));
  resp->set_num_hidden_layers(static_cast<int32_t>(runtime_.config().num_hidden_layers));
  return grpc::Status::OK;
}

grpc::Status WorkerService::Health(grpc::ServerContext*, const flashmesh::v1::HealthRequest*,
                                   flashmesh::v1::HealthResponse* resp) {
  resp->set_node(node_);
  resp->set_loaded(runtime_.loaded());
  resp->set_epoch(epoch_);
  resp->set_draining(draining_);
  return grpc::Status::OK;
}

grpc::Status WorkerService::Stats(grpc::ServerContext*, const flashmesh::v1::StatsRequest*,
                                  flashmesh::v1::StatsResponse* resp) {
  resp->set_node(node_);
  bool loaded = runtime_.loaded();
  resp->set_loaded(loaded);
  resp->set_weight_bytes(runtime_.weight_bytes());
  resp->set_kv_bytes(runtime_.kv_bytes());
  resp->set_active_sequences(runtime_.active_sequences());
  resp->set_tokens_per_second(executor_.tokens_per_second());
  resp->set_rows_processed(executor_.rows_processed());
  if (loaded) {
    resp->set_layer_begin(static_cast<int32_t>(runtime_.placement().layer_begin));
    resp->set_layer_end(static_cast<int32_t>(runtime_.placement().layer_end));
  }
  return grpc::Status::OK;
}

grpc::Status WorkerService::Drain(grpc::ServerContext*, const flashmesh::v1::DrainRequest*,
                                  flashmesh::v1::DrainResponse* resp) {
  draining_ = true;
  FM_LOG(kInfo, "worker") << node_ << ": draining";
  resp->set_active_sequences(runtime_.active_sequences());
  return grpc::Status::OK;
}

grpc::Status WorkerService::StartSequence(grpc::ServerContext*,
                                          const flashmesh::v1::StartSequenceRequest* req,
                                          flashmesh::v1::StartSequenceResponse* resp) {
  if (draining_) return ToGrpc(Unavailable("node " + node_ + " is draining"));
  SamplerConfig sp;
  const auto& s = req->sampling();
  sp.greedy = s.greedy();
  sp.temperature = s.temperature();
  sp.top_p = s.top_p();
  sp.top_k = s.top_k();
  sp.seed = s.seed();
  Status st = runtime_.StartSequence(req->seq_id(), req->max_context(), sp);
  if (!st.ok()) return ToGrpc(st.Wrap("node " + node_));
  resp->set_kv_bytes(runtime_.kv_bytes());
  return grpc::Status::OK;
}

grpc::Status WorkerService::FreeSequence(grpc::ServerContext*,
                                         const flashmesh::v1::FreeSequenceRequest* req,
                                         flashmesh::v1::FreeSequenceResponse* resp) {
  executor_.Free(std::vector<uint64_t>(req->seq_ids().begin(), req->seq_ids().end()));
  resp->set_kv_bytes(runtime_.kv_bytes());
  return grpc::Status::OK;
}

grpc::Status WorkerService::StepBatch(grpc::ServerContext* ctx,
                                      const flashmesh::v1::StepBatchRequest* req,
                                      flashmesh::v1::StepBatchResponse* resp) {
  if (!runtime_.loaded()) return ToGrpc(Unavailable("node " + node_ + ": no shard loaded"));
  std::vector<StepSlice> slices(req->items_size());
  for (int i = 0; i < req->items_size(); ++i) {
    slices[i].seq_id = req->items(i).seq_id();
    slices[i].tokens.assign(req->items(i).tokens().begin(), req->items(i).tokens().end());
  }
  auto deadline = StageExecutor::Clock::now() + std::chrono::minutes(10);
  if (ctx->deadline() != std::chrono::system_clock::time_point::max())
    deadline = StageExecutor::Clock::now() + (ctx->deadline() - std::chrono::system_clock::now());
  std::vector<SampledId> sampled;
  Status st = executor_.RunStep(req->step_id(), std::move(slices), deadline, &sampled);
  if (!st.ok()) return ToGrpc(st.Wrap("node " + node_));
  for (const auto& t : sampled) {
    auto* out = resp->add_tokens();
    out->set_seq_id(t.seq_id);
    out->set_id(t.id);
    out->set_logprob(t.logprob);
  }
  return grpc::Status::OK;
}

grpc::Status WorkerService::Reset(grpc::ServerContext*, const flashmesh::v1::ResetRequest*,
                                  flashmesh::v1::ResetResponse*) {
  executor_.Reset();
  return grpc::Status::OK;
}

grpc::Status WorkerService::PushActivation(grpc::ServerContext*,
                                           const flashmesh::v1::ActivationFrame* frame,
                                           flashmesh::v1::PushActivationResponse*) {
  const std::string& payload = frame->payload();
  if (payload.size() % sizeof(float) != 0)
    return ToGrpc(InvalidArgument("activation payload of " + std::to_string(payload.size()) +
                                  " bytes is not a whole number of f32"));
  std::vector<float> x(payload.size() / sizeof(float));
  std::memcpy(x.data(), payload.data(), payload.size());
  Status st = executor_.Receive(frame->step_id(), frame->rows(), frame->row_floats(), std::move(x));
  return ToGrpc(st.Wrap("node " + node_));
}

}  // namespace fm
