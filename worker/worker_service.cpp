#include "worker/worker_service.h"

#include <grpcpp/grpcpp.h>

#include <algorithm>
#include <chrono>

#include "common/log.h"
#include "model/checkpoint_fingerprint.h"
#include "rpc/grpc_status.h"

namespace fm {

WorkerService::WorkerService(std::string node, std::string model_dir_override, int threads,
                             net::Transport* data_plane, WorkerSecurity security)
    : node_(std::move(node)),
      security_(std::move(security)),
      guard_(security_.cluster_secret, node_),
      model_dir_override_(std::move(model_dir_override)),
      data_plane_(data_plane),
      runtime_(threads),
      executor_(&runtime_),
      receiver_(data_plane, &executor_) {}

WorkerService::~WorkerService() = default;

void WorkerService::Stop() {
  stopping_ = true;
  executor_.Stop();
  FM_LOG(kInfo, "worker") << node_ << ": stopped taking steps";
}

namespace {
// "host:port" / "[v6]:port" -> host.
std::string HostOf(const std::string& address) {
  std::string host = address.substr(0, address.rfind(':'));
  if (host.size() >= 2 && host.front() == '[' && host.back() == ']') host = host.substr(1, host.size() - 2);
  return host;
}
// A token's top alternatives (SampledToken.top) into its reply message.
void AddAlternatives(const std::vector<TokenLogprob>& top, flashmesh::v1::SampledToken* out) {
  for (const TokenLogprob& alt : top) {
    auto* a = out->add_top();
    a->set_id(alt.id);
    a->set_logprob(alt.logprob);
  }
}

}  // namespace

Status WorkerService::CheckPeers(const flashmesh::v1::ShardSpec& s) const {
  if (security_.node_data.empty()) return Status::Ok();
  auto check = [&](const std::string& field, const std::string& name, const std::string* data) {
    auto it = security_.node_data.find(name);
    if (it == security_.node_data.end())
      return InvalidArgument("shard." + field + ": '" + name + "' is not a node of the cluster YAML");
    if (data && *data != it->second)
      return InvalidArgument("shard." + field + ": '" + name + "' at " + *data +
                             ", but the cluster YAML puts its data plane at " + it->second);
    return Status::Ok();
  };
  if (!s.next_node().empty()) FM_RETURN_IF_ERROR(check("next_node", s.next_node(), &s.next_data()));
  if (!s.prev_node().empty()) FM_RETURN_IF_ERROR(check("prev_node", s.prev_node(), nullptr));
  for (int i = 0; i < s.ep_nodes_size(); ++i)
    FM_RETURN_IF_ERROR(check("ep_nodes[" + std::to_string(i) + "]", s.ep_nodes(i),
                             i < s.ep_data_size() ? &s.ep_data(i) : nullptr));
  return Status::Ok();
}

Status WorkerService::AllowPeers(const flashmesh::v1::ShardSpec& s) {
  std::vector<net::AllowedPeer> peers;
  auto add = [&](const std::string& name) {
    if (name.empty() || name == node_) return;
    auto it = security_.node_data.find(name);
    peers.push_back({name, it == security_.node_data.end() ? "" : HostOf(it->second)});
  };
  add(s.prev_node());
  add(s.next_node());
  for (const std::string& n : s.ep_nodes()) add(n);
  return data_plane_->SetAllowedPeers(peers);
}

void WorkerService::SetFrameLimits(const flashmesh::v1::ShardSpec& s) {
  // The largest frame of the plan: a step's rows times the widest row that crosses the data
  // plane (the manifold, hc x H, or an EP combine of top-k expert outputs, k x H; a TP
  // gather's last piece: H / t shared output rows and up to k x H routed outputs), in f32.
  // The rows as the loaded shard resolved them (a spec's 0s are the model's context).
  const ModelConfig& c = runtime_.config();
  const uint64_t rows = static_cast<uint64_t>(runtime_.placement().max_step_rows);
  const int64_t widest = std::max(c.hc_mult, c.num_experts_per_tok + (s.tensor_parallel() > 1 ? 1 : 0));
  const uint64_t row_bytes = static_cast<uint64_t>(c.hidden_size * widest) * 4;
  const uint64_t cap = uint64_t{1} << 60;   // far beyond any memory
  const uint64_t max_frame = row_bytes == 0 || rows > cap / row_bytes ? cap : std::max<uint64_t>(rows * row_bytes, 1);
  data_plane_->SetLimits(max_frame, runtime_.placement().max_waiting_bytes(max_frame));
  std::lock_guard<std::mutex> g(nccl_mu_);
  for (net::NcclCommunicator* c : nccl_comms_) c->SetMaxPayload(max_frame);
}

grpc::Status WorkerService::LoadShard(grpc::ServerContext* ctx, const flashmesh::v1::LoadShardRequest* req,
                                      flashmesh::v1::LoadShardResponse* resp) {
  uint64_t term = 0;
  if (grpc::Status a = guard_.Admit(ctx, "LoadShard", *req, true, &term); !a.ok()) return a;
  std::lock_guard<std::mutex> lock(load_mu_);
  if (stopping_) return WorkerError(ctx, Unavailable("node " + node_ + " is stopping"));
  // A load that waited here for an earlier one may have been given up by its caller (which
  // then retries): running it anyway would drop the sequences started since and stall steps.
  if (ctx->IsCancelled() || ctx->deadline() <= std::chrono::system_clock::now())
    return WorkerError(ctx, DeadlineExceeded("node " + node_ +
                                             ": LoadShard given up by its caller while an earlier load ran"));
  const auto& s = req->shard();
  if (Status peers = CheckPeers(s); !peers.ok()) return ToGrpc(peers.Wrap("node " + node_));
  if (s.max_context() < 0 || s.max_step_rows() < 0 || s.num_stages() < 1)
    return WorkerError(ctx, InvalidArgument(
                                "shard.max_context " + std::to_string(s.max_context()) +
                                ", shard.max_step_rows " + std::to_string(s.max_step_rows()) +
                                ", shard.num_stages " + std::to_string(s.num_stages()) +
                                ": want >= 0, >= 0 (0: the model's context, max_context) and >= 1"));
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
  if (s.has_cuda_device()) {
    if (s.cuda_device() < 0 || s.cuda_device() > 999)
      return WorkerError(ctx, InvalidArgument("shard.cuda_device: " + std::to_string(s.cuda_device()) +
                                              ", want a GPU index in [0, 999]"));
    p.cuda_device = s.cuda_device();
  }
  p.ep_rank = s.ep_rank();
  p.ep_expert_begin.assign(s.ep_expert_begin().begin(), s.ep_expert_begin().end());
  p.tensor_parallel = std::max(s.tensor_parallel(), 1);
  p.max_step_rows = s.max_step_rows();
  if (p.tensor_parallel > 1 && s.ep_nodes_size() != p.tensor_parallel)
    return WorkerError(ctx, InvalidArgument("shard.tensor_parallel " + std::to_string(p.tensor_parallel) +
                                            " but shard.ep_nodes names " + std::to_string(s.ep_nodes_size()) +
                                            " members (node " + node_ + ")"));
  // Every field is checked before a group forms: an NCCL group waits for its peers.
  if (p.stage < 0 || p.stage >= p.num_stages)
    return WorkerError(ctx, InvalidArgument("shard.stage " + std::to_string(p.stage) + " outside [0, " +
                                  std::to_string(p.num_stages) + ")"));
  // The first stage embeds the tokens and only the last holds the head: otherwise every step
  // would fail later ("no embedding") or end early (a middle stage sampling, never forwarding).
  if (p.embed != (p.stage == 0))
    return WorkerError(ctx, InvalidArgument("shard.embed: " + std::string(p.embed ? "true" : "false") +
                                            " on stage " + std::to_string(p.stage) +
                                            " (stage 0, and only it, embeds)"));
  if (p.head != (p.stage == p.num_stages - 1))
    return WorkerError(ctx, InvalidArgument("shard.head: " + std::string(p.head ? "true" : "false") +
                                            " on stage " + std::to_string(p.stage) + " of " +
                                            std::to_string(p.num_stages) +
                                            " (the last stage, and only it, holds the head)"));
  if (!p.head && (s.next_node().empty() || s.next_data().empty()))
    return WorkerError(ctx, InvalidArgument("shard.next_node / shard.next_data: empty on a stage without the head"));
  if (p.stage > 0 && s.prev_node().empty())
    return WorkerError(ctx, InvalidArgument("shard.prev_node: empty on stage " + std::to_string(p.stage)));
  auto dtype = ActivationFrameDType(s.activation_dtype());
  if (!dtype.ok()) return WorkerError(ctx, dtype.status().Wrap("shard"));
  const auto known = [](flashmesh::v1::Transport t) {
    return t == flashmesh::v1::TRANSPORT_TCP || t == flashmesh::v1::TRANSPORT_NCCL;
  };
  if (s.ep_nodes_size() > 1) {
    if (s.ep_data_size() != s.ep_nodes_size() || s.ep_expert_begin_size() != s.ep_nodes_size() + 1 ||
        p.ep_rank < 0 || p.ep_rank >= s.ep_nodes_size() || s.ep_nodes(p.ep_rank) != node_)
      return WorkerError(ctx, InvalidArgument("shard.ep_*: inconsistent expert-parallel group for node " + node_));
    if (!known(s.ep_transport()))
      return WorkerError(ctx, InvalidArgument("shard.ep_transport: unknown value " +
                                              std::to_string(s.ep_transport())));
  }
  if (!known(s.stage_transport()))
    return WorkerError(ctx, InvalidArgument("shard.stage_transport: unknown value " +
                                            std::to_string(s.stage_transport())));
  // Every node must load the same checkpoint, or the stages compute with other weights of the
  // same shapes and the tokens are silently wrong: checked before a weight is read.
  Result<std::vector<FileFingerprint>> files = FingerprintCheckpoint(p.model_dir);
  if (!files.ok()) return WorkerError(ctx, files.status().Wrap("node " + node_));
  std::vector<FileFingerprint> expected;
  // source and path only go into the message: capped, however long the coordinator sent them.
  for (const auto& e : req->expect_files())
    expected.push_back({e.name(), e.size(), e.crc32c(), e.source().substr(0, 256), e.path().substr(0, 1024),
                        e.holder().substr(0, 256)});
  if (Status same = MatchFingerprints(*files, p.model_dir, expected); !same.ok()) {
    FM_LOG(kError, "worker") << node_ << ": refused to load: " << same.message();
    return WorkerError(ctx, same.Wrap("node " + node_));
  }
  std::unique_ptr<net::Communicator> ep_group;
  net::NcclCommunicator* nccl = nullptr;   // ep_group when it is an NCCL group
  if (s.ep_nodes_size() > 1) {
    std::vector<net::CommMember> members;
    for (int i = 0; i < s.ep_nodes_size(); ++i) members.push_back({s.ep_nodes(i), s.ep_data(i)});
    if (s.ep_transport() == flashmesh::v1::TRANSPORT_NCCL) {
      auto group = net::MakeNcclCommunicator(std::move(members), p.ep_rank, s.cuda_device(),
                                             s.nccl_unique_id());
      if (!group.ok()) return WorkerError(ctx, group.status().Wrap("node " + node_ + ": shard.ep_transport nccl"));
      nccl = group->get();
      ep_group = std::move(group).value();
    } else {
      auto group = net::MakeTcpCommunicator(data_plane_, std::move(members), p.ep_rank);
      if (!group.ok()) return WorkerError(ctx, group.status().Wrap("node " + node_));
      ep_group = std::move(group).value();
    }
  } else {
    p.ep_expert_begin.clear();
  }
  // Stage hops over NCCL: a two-rank communicator per hop, the sending stage rank 0.
  std::unique_ptr<net::NcclCommunicator> next_link, prev_link;
  if (s.stage_transport() == flashmesh::v1::TRANSPORT_NCCL) {
    auto link = [&](std::vector<net::CommMember> m, int rank, const std::string& id,
                    const char* which) -> Result<std::unique_ptr<net::NcclCommunicator>> {
      auto l = net::MakeNcclCommunicator(std::move(m), rank, s.cuda_device(), id,
                                         "NCCL stage link");
      if (!l.ok())
        return l.status().Wrap("node " + node_ + ": shard.stage_transport nccl (" + which + ")");
      return l;
    };
    if (!p.head) {
      auto l = link({{node_, ""}, {s.next_node(), s.next_data()}}, 0, s.next_nccl_id(),
                    "to the next stage");
      if (!l.ok()) return WorkerError(ctx, l.status());
      next_link = std::move(l).value();
    }
    if (p.stage > 0) {
      auto l = link({{s.prev_node(), ""}, {node_, ""}}, 1, s.prev_nccl_id(),
                    "from the previous stage");
      if (!l.ok()) return WorkerError(ctx, l.status());
      prev_link = std::move(l).value();
    }
  }
  // The new peers before anything is replaced: a failure here leaves the old shard as it was.
  if (Status peers = AllowPeers(s); !peers.ok())
    return WorkerError(ctx, peers.Wrap("node " + node_ + ": data-plane peers"));
  {
    std::lock_guard<std::mutex> g(nccl_mu_);
    nccl_comms_.clear();   // the old communicators go away below
  }
  executor_.Reset();
  executor_.SetNext(nullptr);   // before the hops they use are replaced
  executor_.SetPrev(nullptr);
  // No step of the old shard computes while the model is replaced (an old coordinator's step
  // can still arrive until this load fences it).
  Status st = executor_.Exclusive([&] {
    Status loaded = runtime_.Load(p, ep_group.get());
    if (!loaded.ok()) runtime_.Unload();
    return loaded;
  });
  if (!st.ok()) {
    // The old shard's wiring is gone: unloaded, never half-wired (Health says loaded: false
    // and the coordinator loads it again).
    epoch_ = 0;
    {
      std::lock_guard<std::mutex> g(shard_mu_);
      shard_.Clear();
    }
    FM_LOG(kError, "worker") << node_ << ": " << st.ToString();
    return WorkerError(ctx, st.Wrap("node " + node_ + " loading its shard"));
  }
  ep_group_ = std::move(ep_group);   // the runtime now uses the new group (or none)
  next_link_ = std::move(next_link);
  prev_link_ = std::move(prev_link);
  {
    std::lock_guard<std::mutex> g(nccl_mu_);
    if (nccl) nccl_comms_.push_back(nccl);
    if (next_link_) nccl_comms_.push_back(next_link_.get());
    if (prev_link_) nccl_comms_.push_back(prev_link_.get());
  }
  if (p.head) {
    executor_.SetNext(nullptr);
  } else if (next_link_) {
    executor_.SetNext(NewCommActivationSink(next_link_.get(), 1, *dtype));
  } else {
    executor_.SetNext(NewTransportActivationSink(data_plane_, s.next_node(), s.next_data(), *dtype));
  }
  if (prev_link_) executor_.SetPrev(NewCommActivationSource(prev_link_.get(), 0, *dtype));
  receiver_.SetPeer(p.stage > 0 && !prev_link_ ? s.prev_node() : "");
  SetFrameLimits(s);
  guard_.Follow(term);
  epoch_ = s.epoch();
  {
    std::lock_guard<std::mutex> g(shard_mu_);
    shard_ = s;
  }
  resp->set_weight_bytes(runtime_.weight_bytes());
  resp->set_vocab_size(static_cast<int32_t>(runtime_.config().vocab_size));
  resp->set_num_hidden_layers(static_cast<int32_t>(runtime_.config().num_hidden_layers));
  resp->set_draining(draining_);
  resp->set_model_dir(p.model_dir);
  for (const FileFingerprint& f : *files) {
    flashmesh::v1::FileFingerprint* out = resp->add_files();
    out->set_name(f.name);
    out->set_size(f.size);
    out->set_crc32c(f.crc32c);
  }
  return grpc::Status::OK;
}

grpc::Status WorkerService::Health(grpc::ServerContext* ctx, const flashmesh::v1::HealthRequest* req,
                                   flashmesh::v1::HealthResponse* resp) {
  if (grpc::Status a = guard_.Admit(ctx, "Health", *req, false); !a.ok()) return a;
  resp->set_node(node_);
  bool group_ok = true;
  {
    std::lock_guard<std::mutex> g(nccl_mu_);
    for (const net::NcclCommunicator* c : nccl_comms_) group_ok = group_ok && !c->broken();
  }
  resp->set_loaded(runtime_.loaded() && group_ok);
  resp->set_epoch(epoch_);
  resp->set_draining(draining_);
  for (uint64_t id : runtime_.sequence_ids()) resp->add_seq_ids(id);
  std::lock_guard<std::mutex> g(shard_mu_);
  if (runtime_.loaded()) *resp->mutable_shard() = shard_;
  resp->set_term(guard_.term());
  return grpc::Status::OK;
}

grpc::Status WorkerService::Stats(grpc::ServerContext* ctx, const flashmesh::v1::StatsRequest* req,
                                  flashmesh::v1::StatsResponse* resp) {
  if (grpc::Status a = guard_.Admit(ctx, "Stats", *req, false); !a.ok()) return a;
  resp->set_node(node_);
  bool loaded = runtime_.loaded();
  resp->set_loaded(loaded);
  resp->set_weight_bytes(runtime_.weight_bytes());
  resp->set_kv_bytes(runtime_.kv_bytes());
  resp->set_active_sequences(runtime_.active_sequences());
  resp->set_tokens_per_second(executor_.tokens_per_second());
  resp->set_rows_processed(executor_.rows_processed());
  const net::TransportStats ts = data_plane_->stats();
  resp->set_data_bytes_sent(ts.bytes_sent);
  resp->set_data_bytes_received(ts.bytes_received);
  resp->set_data_frames_rejected(ts.connections_dropped + receiver_.frames_rejected());
  const EpStats ep = runtime_.ep_stats();
  for (uint64_t n : ep.tokens_per_expert) resp->add_expert_tokens(n);
  resp->set_ep_bytes_sent(ep.dispatch_bytes + ep.combine_bytes);
  const DeviceStepTraffic device = runtime_.device_traffic();
  resp->set_host_to_device_bytes(device.host_to_device);
  resp->set_device_to_host_bytes(device.device_to_host);
  resp->set_device_tokens(device.tokens);
  if (loaded) {
    const ShardPlacement p = runtime_.placement();
    resp->set_layer_begin(static_cast<int32_t>(p.layer_begin));
    resp->set_layer_end(static_cast<int32_t>(p.layer_end));
  }
  return grpc::Status::OK;
}

grpc::Status WorkerService::Drain(grpc::ServerContext* ctx, const flashmesh::v1::DrainRequest* req,
                                  flashmesh::v1::DrainResponse* resp) {
  if (grpc::Status a = guard_.Admit(ctx, "Drain", *req, true); !a.ok()) return a;
  // A drain lasts until a resume or the end of this process, across every LoadShard (a new
  // coordinator, an NCCL group reloaded, a worker drained while loading): it is the operator's
  // word that this machine is going away, and a reload must not send it new sequences.
  draining_ = !req->resume();
  FM_LOG(kInfo, "worker") << node_ << (req->resume() ? ": takes new sequences again" : ": draining");
  resp->set_active_sequences(runtime_.active_sequences());
  return grpc::Status::OK;
}

grpc::Status WorkerService::StartSequence(grpc::ServerContext* ctx,
                                          const flashmesh::v1::StartSequenceRequest* req,
                                          flashmesh::v1::StartSequenceResponse* resp) {
  if (grpc::Status a = guard_.Admit(ctx, "StartSequence", *req, true); !a.ok()) return a;
  if (draining_ || stopping_)
    return WorkerError(ctx, Unavailable("node " + node_ + (stopping_ ? " is stopping" : " is draining")));
  SamplerConfig sp;
  const auto& s = req->sampling();
  sp.greedy = s.greedy();
  sp.temperature = s.temperature();
  sp.top_p = s.top_p();
  sp.top_k = s.top_k();
  sp.seed = s.seed();
  sp.top_logprobs = s.top_logprobs();
  sp.repetition_penalty = s.repetition_penalty() == 0.0f ? 1.0f : s.repetition_penalty();
  sp.frequency_penalty = s.frequency_penalty();
  sp.presence_penalty = s.presence_penalty();
  sp.min_p = s.min_p();
  sp.logit_bias.assign(s.logit_bias().begin(), s.logit_bias().end());
  sp.min_tokens = s.min_tokens();
  sp.min_tokens_ids.assign(s.min_tokens_ids().begin(), s.min_tokens_ids().end());
  sp.prompt_logprobs = s.has_prompt_logprobs() ? s.prompt_logprobs() : -1;
  Status st = runtime_.StartSequence(req->seq_id(), req->max_context(), sp);
  if (!st.ok()) return WorkerError(ctx, st.Wrap("node " + node_));
  resp->set_kv_bytes(runtime_.kv_bytes());
  return grpc::Status::OK;
}

grpc::Status WorkerService::FreeSequence(grpc::ServerContext* ctx,
                                         const flashmesh::v1::FreeSequenceRequest* req,
                                         flashmesh::v1::FreeSequenceResponse* resp) {
  if (grpc::Status a = guard_.Admit(ctx, "FreeSequence", *req, true); !a.ok()) return a;
  executor_.Free(std::vector<uint64_t>(req->seq_ids().begin(), req->seq_ids().end()));
  resp->set_kv_bytes(runtime_.kv_bytes());
  return grpc::Status::OK;
}

grpc::Status WorkerService::StepBatch(grpc::ServerContext* ctx,
                                      const flashmesh::v1::StepBatchRequest* req,
                                      flashmesh::v1::StepBatchResponse* resp) {
  if (grpc::Status a = guard_.Admit(ctx, "StepBatch", *req, true); !a.ok()) return a;
  if (!runtime_.loaded()) return WorkerError(ctx, Unavailable("node " + node_ + ": no shard loaded"));
  if (stopping_) return WorkerError(ctx, Unavailable("node " + node_ + " is stopping"));
  // Refused before it joins the step order: a step that cannot run must not make the next
  // real step wait for it.
  if (req->items_size() == 0 && !runtime_.placement().expert_parallel())
    return WorkerError(ctx, InvalidArgument("node " + node_ + ": step " + std::to_string(req->step_id()) +
                                            " has no items (only an EP member runs empty steps)"));
  for (const auto& item : req->items())
    if (!runtime_.HasSequence(item.seq_id()))
      return WorkerError(ctx, NotFound("node " + node_ + " does not hold sequence " +
                                       std::to_string(item.seq_id()) + " of step " +
                                       std::to_string(req->step_id()) +
                                       " (the worker was reset or restarted)"),
                         kFaultLostSequences);
  std::vector<StepSlice> slices(req->items_size());
  for (int i = 0; i < req->items_size(); ++i) {
    slices[i].seq_id = req->items(i).seq_id();
    slices[i].tokens.assign(req->items(i).tokens().begin(), req->items(i).tokens().end());
    slices[i].sample = !req->items(i).prefill_continues();
    slices[i].fork_from = req->items(i).fork_from();
    if (req->items(i).has_next_token()) slices[i].next_token = req->items(i).next_token();
  }
  // A tenth before the caller's deadline: a step waiting for a peer that froze answers so
  // itself, and the coordinator blames the peer (which does not answer) rather than this node.
  // At most 10 minutes (also keeps the x 9 below from overflowing on a far deadline).
  auto left = std::chrono::duration_cast<std::chrono::nanoseconds>(std::chrono::minutes(10));
  if (ctx->deadline() != std::chrono::system_clock::time_point::max())
    left = std::min(left, std::chrono::duration_cast<std::chrono::nanoseconds>(
                              ctx->deadline() - std::chrono::system_clock::now()));
  const auto deadline = StageExecutor::Clock::now() + left * 9 / 10;
  std::vector<SampledId> sampled;
  std::vector<PromptScores> prompt;
  Status st = executor_.RunStep(req->step_id(), req->prev_step_id(), std::move(slices), deadline,
                                &sampled, &prompt);
  // A sequence gone by the time its step ran (a Reset between the check above and the run) is
  // lost like one missing before it: the coordinator ends its request UNAVAILABLE.
  if (!st.ok())
    return WorkerError(ctx, st.Wrap("node " + node_),
                       st.code() == Code::kNotFound ? kFaultLostSequences : kFaultWorker);
  for (const auto& t : sampled) {
    auto* out = resp->add_tokens();
    out->set_seq_id(t.seq_id);
    out->set_id(t.id);
    out->set_logprob(t.logprob);
    if (!t.error.ok()) out->set_error(t.error.message());
    AddAlternatives(t.top, out);
  }
  for (const auto& p : prompt) {
    auto* out = resp->add_prompt_scores();
    out->set_seq_id(p.seq_id);
    out->set_first(p.first);
    if (!p.error.ok()) out->set_error(p.error.message());
    for (const SampledToken& t : p.tokens) {
      auto* o = out->add_tokens();
      o->set_id(t.id);
      o->set_logprob(t.logprob);
      o->set_rank(t.rank);
      AddAlternatives(t.top, o);
    }
  }
  return grpc::Status::OK;
}

grpc::Status WorkerService::Reset(grpc::ServerContext* ctx, const flashmesh::v1::ResetRequest* req,
                                  flashmesh::v1::ResetResponse*) {
  if (grpc::Status a = guard_.Admit(ctx, "Reset", *req, true); !a.ok()) return a;
  std::lock_guard<std::mutex> lock(load_mu_);   // the runtime's EP group stays put meanwhile
  executor_.Reset();
  return grpc::Status::OK;
}

grpc::Status WorkerService::NewNcclId(grpc::ServerContext* ctx, const flashmesh::v1::NewNcclIdRequest* req,
                                      flashmesh::v1::NewNcclIdResponse* resp) {
  if (grpc::Status a = guard_.Admit(ctx, "NewNcclId", *req, true); !a.ok()) return a;
  Result<std::string> id = net::NcclNewUniqueId();
  if (!id.ok()) return WorkerError(ctx, id.status().Wrap("node " + node_));
  resp->set_unique_id(*id);
  return grpc::Status::OK;
}

}  // namespace fm
