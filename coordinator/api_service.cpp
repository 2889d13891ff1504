#include "coordinator/api_service.h"

#include <openssl/crypto.h>
#include <openssl/sha.h>

#include <algorithm>
#include <array>
#include <cmath>

#include <grpcpp/grpcpp.h>

#include <fstream>
#include <optional>
#include <random>

#include "common/log.h"
#include "common/utf8.h"
#include "model/sampler.h"
#include "rpc/grpc_status.h"

namespace fm {
namespace {

constexpr auto kPollInterval = std::chrono::milliseconds(50);
constexpr auto kStatsTimeout = std::chrono::milliseconds(800);
// A call cancelled this close to its deadline timed out (Generate).
constexpr auto kDeadlineMargin = std::chrono::milliseconds(500);

std::string Trim(const std::string& s) {
  size_t b = s.find_first_not_of(" \t\r\n");
  if (b == std::string::npos) return "";
  size_t e = s.find_last_not_of(" \t\r\n");
  return s.substr(b, e - b + 1);
}

// "FIELD: not UTF-8 (byte N)" for text that arrives as bytes (api.proto).
Status CheckUtf8(const std::string& field, const std::string& text) {
  const size_t bad = FirstInvalidUtf8(text);
  if (bad == std::string_view::npos) return Status::Ok();
  return InvalidArgument(field + ": not valid UTF-8 (byte " + std::to_string(bad) + " of " +
                         std::to_string(text.size()) + ")");
}

}  // namespace

Result<std::vector<std::string>> ReadApiTokens(const std::string& path) {
  std::ifstream f(path);
  if (!f) return NotFound(path + ": cannot read security.token_file");
  std::vector<std::string> tokens;
  std::string line;
  while (std::getline(f, line)) {
    line = Trim(line);
    if (!line.empty() && line[0] != '#') tokens.push_back(line);
  }
  if (tokens.empty()) return InvalidArgument(path + ": security.token_file holds no token");
  return tokens;
}

Status ClusterHealth(const Cluster& cluster, const Scheduler& scheduler) {
  FM_RETURN_IF_ERROR(cluster.Ready());
  return scheduler.Health();
}

ApiService::ApiService(const ModelConfig& model, const Tokenizer* tokenizer, Cluster* cluster,
                       Scheduler* scheduler, Metrics* metrics, ApiOptions options)
    : model_(model), tokenizer_(tokenizer), cluster_(cluster), scheduler_(scheduler),
      metrics_(metrics), options_(std::move(options)) {}

ApiService::StreamSlot::~StreamSlot() {
  std::lock_guard<std::mutex> lock(api_->streams_mu_);
  if (--api_->streams_[client_] == 0) api_->streams_.erase(client_);
}

Result<std::vector<std::unique_ptr<ApiService::StreamSlot>>> ApiService::AcquireStreams(
    const std::string& client, int64_t count) const {
  std::lock_guard<std::mutex> lock(streams_mu_);
  int64_t& n = streams_[client];
  if (n + count > options_.max_streams_per_client) {
    const int64_t running = n;
    if (n == 0) streams_.erase(client);
    return ResourceExhausted("this client already has " + std::to_string(running) +
                             " generations running; " + std::to_string(count) +
                             " more would pass limits.max_streams_per_client (" +
                             std::to_string(options_.max_streams_per_client) + ")");
  }
  n += count;
  std::vector<std::unique_ptr<StreamSlot>> slots;
  for (int64_t i = 0; i < count; ++i) slots.push_back(std::make_unique<StreamSlot>(this, client));
  return slots;
}

Status CheckBearerToken(const std::string* value, const std::vector<std::string>& tokens,
                        const std::string& what) {
  if (tokens.empty()) return Status::Ok();
  if (!value) return Unauthenticated("missing " + what);
  const std::string prefix = "Bearer ";
  if (value->rfind(prefix, 0) != 0) return Unauthenticated("invalid bearer token");
  // Compared as SHA-256 digests in constant time, against every token: a byte-by-byte compare
  // that stops at the first difference tells a timing client how much of a token it has right.
  auto digest = [](const std::string& s) {
    std::array<unsigned char, SHA256_DIGEST_LENGTH> d;
    SHA256(reinterpret_cast<const unsigned char*>(s.data()), s.size(), d.data());
    return d;
  };
  const auto presented = digest(value->substr(prefix.size()));
  bool match = false;
  for (const std::string& t : tokens)
    match |= CRYPTO_memcmp(digest(t).data(), presented.data(), presented.size()) == 0;
  return match ? Status::Ok() : Unauthenticated("invalid bearer token");
}

Status CheckPromptBytes(const std::string& field, size_t bytes, int64_t max_context) {
  const size_t max_bytes = kMaxPromptBytesPerToken * static_cast<size_t>(max_context);
  if (bytes <= max_bytes) return Status::Ok();
  return InvalidArgument(field + ": " + std::to_string(bytes) + " bytes, more than " +
                         std::to_string(max_bytes) + " (" + std::to_string(kMaxPromptBytesPerToken) +
                         " x max_context)");
}

Status CheckPromptIds(const std::string& field, std::span<const int32_t> ids, int64_t vocab_size) {
  for (size_t i = 0; i < ids.size(); ++i)
    if (ids[i] < 0 || ids[i] >= vocab_size)
      return InvalidArgument(field + "[" + std::to_string(i) + "]: " + std::to_string(ids[i]) + " outside [0, " +
                             std::to_string(vocab_size) + ") (vocab_size)");
  return Status::Ok();
}

std::string ApiService::StreamClient(const std::string& authorization, std::string anonymous) const {
  return checks_tokens() ? "token " + authorization : "anonymous " + anonymous;
}

Status ApiService::Authenticate(grpc::ServerContext* ctx) const {
  static const std::string kMetadata = "'authorization: Bearer <token>' metadata";
  auto it = ctx->client_metadata().find("authorization");
  if (it == ctx->client_metadata().end())
    return CheckBearerToken(nullptr, options_.api_tokens, kMetadata);
  const std::string value(it->second.data(), it->second.size());
  return CheckBearerToken(&value, options_.api_tokens, kMetadata);
}

Result<GenerateParams> ApiService::Validate(const flashmesh::v1::GenerateRequest& req) const {
  GenerateParams p;
  switch (req.input_case()) {
    case flashmesh::v1::GenerateRequest::kText: {
      if (req.text().empty()) return InvalidArgument("input.text: empty");
      FM_RETURN_IF_ERROR(CheckUtf8("input.text", req.text()));
      FM_RETURN_IF_ERROR(CheckPromptBytes("input.text", req.text().size(), options_.max_context));
      if (!tokenizer_) return InvalidArgument("input.text: this model has no tokenizer.json; send input.tokens");
      std::string text;
      if (req.raw()) {
        FM_ASSIGN_OR_RETURN(std::string bos, tokenizer_->TokenBytes(tokenizer_->bos_id()));
        text = bos + req.text();
      } else {
        FM_ASSIGN_OR_RETURN(text, tokenizer_->ApplyChatTemplate({{"user", req.text()}}));
      }
      FM_ASSIGN_OR_RETURN(p.prompt, tokenizer_->Encode(text));
      break;
    }
    case flashmesh::v1::GenerateRequest::kTokens: {
      if (req.tokens().ids().empty()) return InvalidArgument("input.tokens.ids: empty");
      p.prompt.assign(req.tokens().ids().begin(), req.tokens().ids().end());
      FM_RETURN_IF_ERROR(CheckPromptIds("input.tokens.ids", p.prompt, model_.vocab_size));
      break;
    }
    default:
      return InvalidArgument("input: empty (set input.text or input.tokens)");
  }
  if (p.prompt.empty()) return InvalidArgument("input: tokenizes to no tokens");
  if (static_cast<int64_t>(p.prompt.size()) >= options_.max_context)
    return InvalidArgument("input: " + std::to_string(p.prompt.size()) +
                           " prompt tokens leave no room within max_context " +
                           std::to_string(options_.max_context));
  if (req.max_tokens() <= 0 || req.max_tokens() > options_.max_tokens)
    return InvalidArgument("max_tokens: " + std::to_string(req.max_tokens()) + " outside [1, " +
                           std::to_string(options_.max_tokens) + "]");
  p.max_tokens = req.max_tokens();
  const auto& s = req.sampling();
  // With greedy the other sampling fields are ignored (api.proto), so not checked either.
  if (!s.greedy()) {
    if (!std::isfinite(s.temperature()))
      return InvalidArgument("sampling.temperature: " + std::to_string(s.temperature()) + " is not a finite number");
    if (s.temperature() < 0)
      return InvalidArgument("sampling.temperature: " + std::to_string(s.temperature()) + " is negative");
    if (s.has_top_p() && !(s.top_p() > 0 && s.top_p() <= 1))
      return InvalidArgument("sampling.top_p: " + std::to_string(s.top_p()) + " outside (0, 1]");
    if (s.top_k() < 0) return InvalidArgument("sampling.top_k: " + std::to_string(s.top_k()) + " is negative");
  }
  // The penalties change the logits, so greedy takes them too; min-p is moot there.
  if (s.has_repetition_penalty() && !(s.repetition_penalty() > 0 && std::isfinite(s.repetition_penalty())))
    return InvalidArgument("sampling.repetition_penalty: " + std::to_string(s.repetition_penalty()) +
                           " (must be a finite number > 0; 1 = off)");
  if (!(s.frequency_penalty() >= -2 && s.frequency_penalty() <= 2))
    return InvalidArgument("sampling.frequency_penalty: " + std::to_string(s.frequency_penalty()) + " outside [-2, 2]");
  if (!(s.presence_penalty() >= -2 && s.presence_penalty() <= 2))
    return InvalidArgument("sampling.presence_penalty: " + std::to_string(s.presence_penalty()) + " outside [-2, 2]");
  if (!s.greedy() && !(s.min_p() >= 0 && s.min_p() <= 1))
    return InvalidArgument("sampling.min_p: " + std::to_string(s.min_p()) + " outside [0, 1]");
  if (s.logit_bias_size() > kMaxLogitBias)
    return InvalidArgument("sampling.logit_bias: " + std::to_string(s.logit_bias_size()) + " entries (at most " +
                           std::to_string(kMaxLogitBias) + ")");
  for (const auto& [id, bias] : s.logit_bias()) {
    if (id < 0 || id >= model_.vocab_size)
      return InvalidArgument("sampling.logit_bias: token " + std::to_string(id) + " outside [0, " +
                             std::to_string(model_.vocab_size) + ") (vocab_size)");
    if (!(bias >= -100 && bias <= 100))
      return InvalidArgument("sampling.logit_bias: token " + std::to_string(id) + ": bias " + std::to_string(bias) +
                             " outside [-100, 100]");
  }
  if (req.stop_token_ids_size() > kMaxStopTokenIds)
    return InvalidArgument("stop_token_ids: " + std::to_string(req.stop_token_ids_size()) + " ids (at most " +
                           std::to_string(kMaxStopTokenIds) + ")");
  for (int i = 0; i < req.stop_token_ids_size(); ++i)
    if (req.stop_token_ids(i) < 0 || req.stop_token_ids(i) >= model_.vocab_size)
      return InvalidArgument("stop_token_ids[" + std::to_string(i) + "]: " + std::to_string(req.stop_token_ids(i)) +
                             " outside [0, " + std::to_string(model_.vocab_size) + ") (vocab_size)");
  if (req.min_tokens() < 0 || req.min_tokens() > req.max_tokens())
    return InvalidArgument("min_tokens: " + std::to_string(req.min_tokens()) + " outside [0, max_tokens " +
                           std::to_string(req.max_tokens()) + "]");
  if (s.top_logprobs() < 0 || s.top_logprobs() > kMaxTopLogprobs)
    return InvalidArgument("sampling.top_logprobs: " + std::to_string(s.top_logprobs()) + " outside [0, " +
                           std::to_string(kMaxTopLogprobs) + "]");
  if (req.has_prompt_logprobs() && (req.prompt_logprobs() < 0 || req.prompt_logprobs() > kMaxTopLogprobs))
    return InvalidArgument("prompt_logprobs: " + std::to_string(req.prompt_logprobs()) + " outside [0, " +
                           std::to_string(kMaxTopLogprobs) + "]");
  if (req.stop_size() > kMaxStopStrings)
    return InvalidArgument("stop: " + std::to_string(req.stop_size()) + " strings (at most " +
                           std::to_string(kMaxStopStrings) + ")");
  for (size_t i = 0; i < static_cast<size_t>(req.stop_size()); ++i) {
    if (req.stop(i).empty()) return InvalidArgument("stop[" + std::to_string(i) + "]: empty");
    FM_RETURN_IF_ERROR(CheckUtf8("stop[" + std::to_string(i) + "]", req.stop(i)));
    if (req.stop(i).size() > kMaxStopBytes)
      return InvalidArgument("stop[" + std::to_string(i) + "]: " + std::to_string(req.stop(i).size()) +
                             " bytes (at most " + std::to_string(kMaxStopBytes) + ")");
  }
  const bool greedy = s.greedy() || s.temperature() == 0;
  p.sampling.set_greedy(greedy);
  p.sampling.set_temperature(greedy ? 0.f : s.temperature());
  p.sampling.set_top_p(!greedy && s.has_top_p() ? s.top_p() : 1.f);
  p.sampling.set_top_k(greedy ? 0 : s.top_k());
  p.sampling.set_top_logprobs(s.top_logprobs());
  if (req.has_prompt_logprobs()) p.sampling.set_prompt_logprobs(req.prompt_logprobs());
  p.sampling.set_repetition_penalty(s.has_repetition_penalty() ? s.repetition_penalty() : 1.f);
  p.sampling.set_frequency_penalty(s.frequency_penalty());
  p.sampling.set_presence_penalty(s.presence_penalty());
  p.sampling.set_min_p(greedy ? 0.f : s.min_p());
  if (s.has_seed()) {
    p.sampling.set_seed(s.seed());
  } else {
    std::random_device rd;
    p.sampling.set_seed((static_cast<uint64_t>(rd()) << 32) | rd());
  }
  p.stop.assign(req.stop().begin(), req.stop().end());
  p.ignore_eos = req.ignore_eos();
  p.stop_token_ids.assign(req.stop_token_ids().begin(), req.stop_token_ids().end());
  p.min_tokens = req.min_tokens();
  *p.sampling.mutable_logit_bias() = s.logit_bias();
  // The last stage holds back every token that would stop the request before min_tokens.
  if (p.min_tokens > 0) {
    p.sampling.set_min_tokens(static_cast<int32_t>(p.min_tokens));
    if (tokenizer_ && !p.ignore_eos) p.sampling.add_min_tokens_ids(tokenizer_->eos_id());
    for (int32_t id : p.stop_token_ids) p.sampling.add_min_tokens_ids(id);
  }
  return p;
}

// The time left before the client's deadline, if it set one within a year. Computed on the
// gpr_timespec: ServerContext::deadline() converts to nanoseconds, which overflows for a
// deadline past 2262 (a client's timeout=1e10 s), and a year is no deadline in practice.
static std::optional<std::chrono::steady_clock::duration> DeadlineLeft(const grpc::ServerContext* ctx) {
  const gpr_timespec deadline = gpr_convert_clock_type(ctx->raw_deadline(), GPR_CLOCK_MONOTONIC);
  if (gpr_time_cmp(deadline, gpr_inf_future(GPR_CLOCK_MONOTONIC)) == 0) return std::nullopt;
  const gpr_timespec left = gpr_time_sub(deadline, gpr_now(GPR_CLOCK_MONOTONIC));
  if (left.tv_sec >= int64_t{365} * 24 * 3600) return std::nullopt;
  return std::chrono::duration_cast<std::chrono::steady_clock::duration>(
      std::chrono::seconds(left.tv_sec) + std::chrono::nanoseconds(left.tv_nsec));
}

grpc::Status ApiService::Generate(grpc::ServerContext* ctx, const flashmesh::v1::GenerateRequest* req,
                                  grpc::ServerWriter<flashmesh::v1::GenerateResponse>* writer) {
  RequestMeter meter(metrics_, "grpc");
  auto fail = [&](const Status& s) {
    meter.Failed(s);
    return ToGrpc(s);
  };
  if (Status a = Authenticate(ctx); !a.ok()) return fail(a);
  auto params = Validate(*req);
  if (!params.ok()) return fail(params.status());
  const auto left = DeadlineLeft(ctx);
  std::optional<std::chrono::steady_clock::time_point> deadline;
  if (left) deadline = params->deadline = std::chrono::steady_clock::now() + *left;
  // The client: its (checked) token, else its address without the port.
  auto auth = ctx->client_metadata().find("authorization");
  const std::string token =
      auth == ctx->client_metadata().end() ? "" : std::string(auth->second.data(), auth->second.size());
  auto slot = AcquireStreams(StreamClient(token, ctx->peer().substr(0, ctx->peer().rfind(':'))), 1);
  if (!slot.ok()) return fail(slot.status());
  const int64_t prompt_tokens = static_cast<int64_t>(params->prompt.size());
  auto stream = scheduler_->Submit(std::move(params).value());
  if (!stream.ok()) return fail(stream.status());
  meter.Submitted(prompt_tokens);
  // The call ended under the request. At its deadline it timed out (a 504, as a queued one that
  // timed out counts), whatever gRPC calls it: only a client that hung up before then cancelled.
  // The client's own timer ends the call a little before this side's deadline (which starts
  // when the call arrives), hence the margin.
  auto gone = [&](const char* why) {
    (*stream)->Cancel();
    if (deadline && std::chrono::steady_clock::now() + kDeadlineMargin >= *deadline)
      return fail(DeadlineExceeded("the request ran past its deadline"));
    meter.Cancelled();
    return grpc::Status(grpc::StatusCode::CANCELLED, why);
  };
  RequestStream::Event ev;
  while (true) {
    if (ctx->IsCancelled()) return gone("cancelled by the client");
    if (!(*stream)->Pop(&ev, kPollInterval)) continue;
    flashmesh::v1::GenerateResponse out;
    if (ev.kind == RequestStream::Event::kError) return fail(ev.error);
    auto write = [&](const flashmesh::v1::GenerateResponse& r) {
      WriteWatchdog::Write watched(&write_watchdog_, ctx);
      return writer->Write(r);
    };
    if (ev.kind == RequestStream::Event::kPrompt) {
      // In pieces of kPromptLogprobsPerEvent tokens: a long prompt's scores with 20 alternatives
      // each are megabytes, past a gRPC client's default 4 MiB message limit.
      const auto& all = ev.prompt.tokens();
      out.mutable_prompt_logprobs();   // set even when empty (a prompt of one token)
      for (int i = 0; i < all.size(); i += kPromptLogprobsPerEvent) {
        auto* piece = out.mutable_prompt_logprobs();
        piece->Clear();
        for (int k = i; k < std::min(all.size(), i + kPromptLogprobsPerEvent); ++k) *piece->add_tokens() = all[k];
        if (!write(out)) return gone("the client went away");
      }
      if (all.empty() && !write(out)) return gone("the client went away");  // an empty event: nothing to score
      continue;
    }
    if (ev.kind == RequestStream::Event::kToken) {
      meter.Token();
      *out.mutable_token() = ev.token;
      if (!write(out)) return gone("the client went away");
      continue;
    }
    meter.Finished(ev.finish);
    *out.mutable_finish() = ev.finish;
    WriteWatchdog::Write watched(&write_watchdog_, ctx);
    writer->Write(out);
    return grpc::Status::OK;
  }
}

grpc::Status ApiService::Tokenize(grpc::ServerContext* ctx, const flashmesh::v1::TokenizeRequest* req,
                                  flashmesh::v1::TokenizeResponse* resp) {
  if (Status a = Authenticate(ctx); !a.ok()) return ToGrpc(a);
  if (!tokenizer_) return ToGrpc(InvalidArgument("text: this model has no tokenizer.json"));
  if (Status u = CheckUtf8("text", req->text()); !u.ok()) return ToGrpc(u);
  // Generate's bound: a 4 MiB text took seconds and a 2 GB reply of ids and pieces.
  if (Status b = CheckPromptBytes("text", req->text().size(), options_.max_context); !b.ok())
    return ToGrpc(b);
  auto ids = tokenizer_->Encode(req->text());
  if (!ids.ok()) return ToGrpc(ids.status().Wrap("text"));
  for (int32_t id : *ids) {
    resp->add_ids(id);
    auto piece = tokenizer_->TokenBytes(id);
    resp->add_pieces(piece.ok() ? *piece : "");
  }
  return grpc::Status::OK;
}

grpc::Status ApiService::ClusterStatus(grpc::ServerContext* ctx, const flashmesh::v1::ClusterStatusRequest*,
                                       flashmesh::v1::ClusterStatusResponse* resp) {
  if (Status a = Authenticate(ctx); !a.ok()) return ToGrpc(a);
  // The stats first (up to kStatsTimeout with a frozen node): the health and the node states
  // below are then read together, so the verdict agrees with the rows it heads.
  const auto stats = cluster_->StatsOfAll(kStatsTimeout);
  const Status health = ClusterHealth(*cluster_, *scheduler_);
  resp->set_healthy(health.ok());
  resp->set_reason(health.message());
  resp->set_active_requests(scheduler_->active());
  resp->set_queued_requests(scheduler_->queued());
  resp->set_model(options_.model_name);
  resp->set_pipeline_stages(cluster_->num_stages());
  resp->set_expert_parallel(cluster_->expert_parallel());
  resp->set_tensor_parallel(cluster_->tensor_parallel());
  for (size_t i = 0; i < cluster_->nodes().size(); ++i) {
    const NodeHandle* node = cluster_->nodes()[i].get();
    auto* n = resp->add_nodes();
    const WorkerPlan& w = node->plan();
    n->set_name(node->name());
    n->set_state(node->state());
    n->set_stage(w.stage);
    n->set_layer_begin(static_cast<int32_t>(w.layer_begin));
    n->set_layer_end(static_cast<int32_t>(w.layer_end));
    n->set_expert_begin(static_cast<int32_t>(w.expert_begin));
    n->set_expert_end(static_cast<int32_t>(w.expert_end));
    n->set_embed(w.embed);
    n->set_head(w.head);
    n->set_heartbeat_age_s(node->heartbeat_age_s());
    n->set_control(node->control());
    n->set_data(node->data());
    n->set_error(node->error());
    if (stats[i]) {
      const flashmesh::v1::StatsResponse& sresp = *stats[i];
      n->set_weight_bytes(sresp.weight_bytes());
      n->set_kv_bytes(sresp.kv_bytes());
      n->set_active_sequences(sresp.active_sequences());
      n->set_tokens_per_second(sresp.tokens_per_second());
      n->set_data_bytes_sent(sresp.data_bytes_sent());
      n->set_data_bytes_received(sresp.data_bytes_received());
      n->set_data_frames_rejected(sresp.data_frames_rejected());
      n->set_ep_bytes_sent(sresp.ep_bytes_sent());
      n->set_host_to_device_bytes(sresp.host_to_device_bytes());
      n->set_device_to_host_bytes(sresp.device_to_host_bytes());
      n->set_device_tokens(sresp.device_tokens());
      std::vector<std::pair<uint64_t, int>> load;   // (tokens, expert); most first, low id on ties
      for (int e = 0; e < sresp.expert_tokens_size(); ++e)
        if (sresp.expert_tokens(e) > 0) load.emplace_back(sresp.expert_tokens(e), e);
      std::sort(load.begin(), load.end(), [](const auto& a, const auto& b) {
        return a.first != b.first ? a.first > b.first : a.second < b.second;
      });
      for (size_t k = 0; k < load.size() && k < 5; ++k) {
        auto* el = n->add_top_experts();
        el->set_expert(load[k].second);
        el->set_tokens(load[k].first);
      }
    }
  }
  return grpc::Status::OK;
}

}  // namespace fm
