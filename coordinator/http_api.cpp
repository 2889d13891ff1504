#include "coordinator/http_api.h"

#include <algorithm>
#include <cstdio>
#include <limits>
#include <random>

#include <nlohmann/json.hpp>

#include "common/utf8.h"

namespace fm {
namespace {

using Json = nlohmann::json;
constexpr auto kPollInterval = std::chrono::milliseconds(50);

std::string Dump(const Json& j) { return j.dump(-1, ' ', false, Json::error_handler_t::replace); }

const char* FinishName(flashmesh::v1::FinishReason r) {
  return r == flashmesh::v1::FINISH_REASON_LENGTH ? "length" : "stop";
}

Json Usage(const flashmesh::v1::Usage& u) {
  return {{"prompt_tokens", u.prompt_tokens()},
          {"completion_tokens", u.completion_tokens()},
          {"total_tokens", u.prompt_tokens() + u.completion_tokens()}};
}

// code: OpenAI's error code when not the one ErrorFromStatus gives.
void ReplyError(HttpResponder* out, const Status& s, const char* code = nullptr) {
  OpenAiError e = ErrorFromStatus(s);
  if (code) e.code = code;
  HttpResponder::Headers extra;
  if (e.http_status == 429 || e.http_status == 503) extra.emplace_back("Retry-After", "1");
  if (e.http_status == 401) extra.emplace_back("WWW-Authenticate", "Bearer");
  out->Reply(e.http_status, "application/json", e.ToJson(), extra);
}

// The length of `text` that can be sent while `hold` trailing bytes might still become part of
// a stop string, backed off to a UTF-8 character boundary.
size_t Releasable(const std::string& text, size_t hold, size_t sent) {
  size_t n = text.size() > hold ? text.size() - hold : 0;
  while (n > sent && n < text.size() && (static_cast<unsigned char>(text[n]) & 0xC0) == 0x80) --n;
  return std::max(n, sent);
}

// Chat's {token, logprob, bytes} of one token (chosen or alternative).
Json LogprobEntry(const std::string& token, float logprob) {
  Json bytes = Json::array();
  for (unsigned char c : token) bytes.push_back(c);
  return {{"token", token}, {"logprob", logprob}, {"bytes", bytes}};
}

// A token as completions' logprobs name it (in `tokens` and as a `top_logprobs` key): its text
// when that is whole UTF-8, else OpenAI's "bytes:\xNN..." spelling, and vLLM's "token_id:N"
// without a tokenizer. So two tokens never share a key.
std::string CompletionToken(int32_t id, const std::string& token) {
  if (token.empty()) return "token_id:" + std::to_string(id);
  if (FirstInvalidUtf8(token) == std::string_view::npos) return token;
  std::string out = "bytes:";
  char hex[8];
  for (unsigned char c : token) {
    std::snprintf(hex, sizeof hex, "\\x%02x", c);
    out += hex;
  }
  return out;
}

// Completions' logprobs of the tokens `entries` ({token, logprob, top}: AddToken's), each
// starting at its offset in the generated text (a token may add no text: a special token, or
// part of a character).
Json CompletionLogprobs(const Json& entries, const Json& offsets) {
  Json tokens = Json::array(), lps = Json::array(), tops = Json::array();
  for (const auto& e : entries) {
    tokens.push_back(e["token"]);
    lps.push_back(e["logprob"]);
    tops.push_back(e["top"]);
  }
  return {{"tokens", tokens}, {"token_logprobs", lps}, {"top_logprobs", tops}, {"text_offset", offsets}};
}

}  // namespace

// One generation request: what it asked for, its stream, and what it produced so far.
struct HttpApi::Job {
  OpenAiRequest req;
  std::shared_ptr<RequestStream> stream;
  RequestMeter meter;
  std::string id;
  std::time_t created = 0;
  std::string text;     // decoded so far
  size_t sent = 0;      // bytes of text already streamed
  size_t hold = 0;      // longest stop string - 1
  Json logprobs = Json::array();   // entries of the tokens not yet streamed (all when not streaming)
  Json offsets = Json::array();    // where each of those tokens starts in text
  explicit Job(Metrics* m) : meter(m, "http") {}
  // The fields every response object and stream chunk starts with.
  Json Envelope(const std::string& object, const std::string& model) const {
    return {{"id", id}, {"object", object}, {"created", created}, {"model", model}};
  }
};

HttpApi::HttpApi(const Tokenizer* tokenizer, Cluster* cluster, Scheduler* scheduler,
                 const ApiService* grpc_api, Metrics* metrics, ApiOptions options)
    : tokenizer_(tokenizer), cluster_(cluster), scheduler_(scheduler), grpc_api_(grpc_api),
      metrics_(metrics), options_(std::move(options)) {}

void HttpApi::Handle(const HttpRequest& req, HttpResponder* out) {
  struct Route { const char* path; const char* method; };
  static const Route kRoutes[] = {{"/v1/chat/completions", "POST"}, {"/v1/completions", "POST"},
                                  {"/v1/models", "GET"}, {"/health", "GET"}, {"/metrics", "GET"}};
  const Route* route = nullptr;
  for (const auto& r : kRoutes)
    if (req.path == r.path) route = &r;
  if (!route) return ReplyError(out, NotFound("path: " + req.path + " is not an endpoint of this server"));
  if (req.method != route->method) {
    OpenAiError e = ErrorFromStatus(InvalidArgument("method: " + req.method + " (" + req.path + " takes " + route->method + ")"));
    out->Reply(405, "application/json", e.ToJson(), {{"Allow", route->method}});
    return;
  }
  // Probes and scrapers carry no API token (as vLLM's /health and /metrics).
  if (req.path == std::string("/health")) return Health(out);
  if (req.path == std::string("/metrics")) {
    out->Reply(200, "text/plain; version=0.0.4; charset=utf-8", metrics_->Render(cluster_, scheduler_));
    return;
  }
  if (Status a = Authenticate(req); !a.ok()) {
    metrics_->Failed("http", a);
    return ReplyError(out, a);
  }
  if (req.path == std::string("/v1/models")) return Models(out);
  Generate(req, out, req.path == std::string("/v1/chat/completions"));
}

Status HttpApi::Authenticate(const HttpRequest& req) const {
  const std::string value = req.Header("authorization");
  return CheckBearerToken(value.empty() ? nullptr : &value, options_.api_tokens,
                          "'Authorization: Bearer <token>' header");
}

void HttpApi::Health(HttpResponder* out) const {
  Status ready = ClusterHealth(*cluster_, *scheduler_);
  if (ready.ok()) {
    out->Reply(200, "application/json", Dump({{"status", "ok"}}));
  } else {
    out->Reply(503, "application/json", Dump({{"status", "unavailable"}, {"reason", ready.message()}}));
  }
}

void HttpApi::Models(HttpResponder* out) const {
  Json model = {{"id", options_.model_name}, {"object", "model"}, {"created", started_},
                {"owned_by", "flashmesh"}, {"max_model_len", options_.max_context}};
  out->Reply(200, "application/json", Dump({{"object", "list"}, {"data", Json::array({model})}}));
}

Result<GenerateParams> HttpApi::ToParams(const OpenAiRequest& r) const {
  flashmesh::v1::GenerateRequest g;
  const std::string input = r.chat ? "messages" : "prompt";
  if (r.chat || r.prompt_ids.empty()) {
    if (!tokenizer_) return InvalidArgument(input + ": this model has no tokenizer.json; send prompt as token ids");
    std::string text;
    if (r.chat) {
      FM_ASSIGN_OR_RETURN(text, tokenizer_->ApplyChatTemplate(r.messages));
    } else {   // a completion continues BOS + the prompt, as vLLM does
      FM_ASSIGN_OR_RETURN(std::string bos, tokenizer_->TokenBytes(tokenizer_->bos_id()));
      text = bos + r.prompt;
    }
    // As gRPC's input.text: no tokenizing of megabytes that cannot fit the context anyway.
    FM_RETURN_IF_ERROR(CheckPromptBytes(input, text.size(), options_.max_context));
    auto ids = tokenizer_->Encode(text);
    if (!ids.ok()) return ids.status().Wrap(input);
    g.mutable_tokens()->mutable_ids()->Add(ids->begin(), ids->end());
  } else {
    g.mutable_tokens()->mutable_ids()->Add(r.prompt_ids.begin(), r.prompt_ids.end());
  }
  const int64_t prompt = g.tokens().ids_size();
  int64_t max_tokens = r.max_tokens;
  if (max_tokens == 0) max_tokens = std::max<int64_t>(1, std::min(options_.max_tokens, options_.max_context - prompt));
  if (max_tokens > options_.max_tokens)
    return InvalidArgument(r.max_tokens_field + ": " + std::to_string(max_tokens) + " outside [1, " +
                           std::to_string(options_.max_tokens) + "] (limits.max_tokens)");
  g.set_max_tokens(static_cast<int32_t>(max_tokens));
  auto* s = g.mutable_sampling();
  s->set_greedy(r.temperature == 0);
  s->set_temperature(static_cast<float>(r.temperature));
  // A top_p below float's range (1e-60) is still > 0: the smallest float keeps its meaning
  // (the top candidate only) where the cast would make it 0, an error about another field.
  s->set_top_p(std::max(static_cast<float>(r.top_p), std::numeric_limits<float>::min()));
  s->set_top_k(static_cast<int32_t>(r.top_k));
  if (r.logprobs) s->set_top_logprobs(static_cast<int32_t>(r.top_logprobs));
  s->set_min_p(static_cast<float>(r.min_p));
  s->set_frequency_penalty(static_cast<float>(r.frequency_penalty));
  s->set_presence_penalty(static_cast<float>(r.presence_penalty));
  s->set_repetition_penalty(std::max(static_cast<float>(r.repetition_penalty), std::numeric_limits<float>::min()));
  if (r.seed) {
    s->set_seed(*r.seed);
    s->set_has_seed(true);
  }
  for (const auto& stop : r.stop) g.add_stop(stop);
  g.set_ignore_eos(r.ignore_eos);
  for (const auto& [id, bias] : r.logit_bias) (*s->mutable_logit_bias())[id] = bias;
  g.mutable_stop_token_ids()->Add(r.stop_token_ids.begin(), r.stop_token_ids.end());
  g.set_min_tokens(static_cast<int32_t>(std::min<int64_t>(r.min_tokens, std::numeric_limits<int32_t>::max())));
  auto params = grpc_api_->Validate(g);
  if (params.ok()) return params;
  // The gRPC validator names gRPC's fields: say the request's instead.
  std::string msg = params.status().message();
  if (msg.rfind("input.tokens.ids", 0) == 0) msg = "prompt" + msg.substr(16);
  else if (msg.rfind("input", 0) == 0) msg = input + msg.substr(5);
  else if (msg.rfind("sampling.", 0) == 0) msg = msg.substr(9);   // HTTP's fields are top-level
  return Status(params.status().code(), msg);
}

std::string HttpApi::TokenString(int32_t id, const std::string& piece) const {
  if (!tokenizer_) return piece;
  auto bytes = tokenizer_->TokenBytes(id);
  return bytes.ok() ? *bytes : piece;
}

void HttpApi::Generate(const HttpRequest& http, HttpResponder* out, bool chat) {
  Job job(metrics_);
  auto fail = [&](const Status& s) {
    job.meter.Failed(s);
    ReplyError(out, s);
  };
  auto decoded = DecodeOpenAiRequest(http.body, chat);
  if (!decoded.ok()) return fail(decoded.status());
  job.req = std::move(decoded).value();
  auto params = ToParams(job.req);
  if (!params.ok()) return fail(params.status());
  // HTTP requests carry no address here: a client is its (checked) token; without tokens,
  // every HTTP client is one.
  auto slot = grpc_api_->AcquireStream(grpc_api_->StreamClient(http.Header("authorization"), "http"));
  if (!slot.ok()) {
    job.meter.Failed(slot.status());
    return ReplyError(out, slot.status(), "rate_limit_exceeded");
  }
  for (const auto& s : job.req.stop) job.hold = std::max(job.hold, s.size() - 1);
  const int64_t prompt_tokens = static_cast<int64_t>(params->prompt.size());
  auto stream = scheduler_->Submit(std::move(params).value());
  if (!stream.ok()) return fail(stream.status());
  job.meter.Submitted(prompt_tokens);
  job.stream = *stream;
  char id[48];
  std::snprintf(id, sizeof id, "%s%016llx%016llx", chat ? "chatcmpl-" : "cmpl-",
                static_cast<unsigned long long>(id_prefix_),
                static_cast<unsigned long long>(next_id_++));
  job.id = id;
  job.created = std::time(nullptr);
  if (job.req.stream) Stream(&job, out);
  else Collect(&job, out);
}

uint64_t HttpApi::RandomIdPrefix() {
  std::random_device rd;
  return (static_cast<uint64_t>(rd()) << 32) ^ rd();
}

void HttpApi::AddToken(Job* job, const flashmesh::v1::TokenEvent& token) const {
  job->meter.Token();
  if (job->req.logprobs && job->req.chat) {
    Json e = LogprobEntry(TokenString(token.id(), token.text()), token.logprob());
    Json alts = Json::array();
    for (const auto& alt : token.top_logprobs())
      alts.push_back(LogprobEntry(TokenString(alt.id(), alt.token()), alt.logprob()));
    e["top_logprobs"] = std::move(alts);
    job->logprobs.push_back(std::move(e));
  } else if (job->req.logprobs) {
    // OpenAI's {token: logprob} of the alternatives and the chosen token ("up to logprobs + 1";
    // the chosen one's own value last, so it wins).
    const std::string chosen = CompletionToken(token.id(), TokenString(token.id(), token.text()));
    Json top = Json::object();
    for (const auto& alt : token.top_logprobs())
      top[CompletionToken(alt.id(), TokenString(alt.id(), alt.token()))] = alt.logprob();
    top[chosen] = token.logprob();
    job->logprobs.push_back({{"token", chosen}, {"logprob", token.logprob()}, {"top", std::move(top)}});
  }
  if (job->req.logprobs) job->offsets.push_back(job->text.size());
  job->text += token.text();
}

bool HttpApi::NextEvent(Job* job, HttpResponder* out, RequestStream::Event* ev) {
  while (!out->Abandoned())
    if (job->stream->Pop(ev, kPollInterval)) return true;
  job->stream->Cancel();  // the scheduler frees the sequence on every worker
  const Status why = out->AbandonedBecause();
  if (why.code() != Code::kCancelled) {  // the response timed out or the server stops: say so
    *ev = RequestStream::Event{RequestStream::Event::kError, {}, {}, why};
    return true;
  }
  job->meter.Cancelled();
  return false;
}

void HttpApi::Collect(Job* job, HttpResponder* out) {
  RequestStream::Event ev;
  while (true) {
    if (!NextEvent(job, out, &ev)) return;
    if (ev.kind == RequestStream::Event::kError) {
      job->meter.Failed(ev.error);
      return ReplyError(out, ev.error);
    }
    if (ev.kind == RequestStream::Event::kToken) {
      AddToken(job, ev.token);
      continue;
    }
    break;
  }
  job->meter.Finished(ev.finish);
  std::string text = job->text;
  if (!ev.finish.stop_string().empty()) text = text.substr(0, text.find(ev.finish.stop_string()));
  Json choice = {{"index", 0}, {"logprobs", nullptr}, {"finish_reason", FinishName(ev.finish.reason())}};
  Json body;
  if (job->req.chat) {
    choice["message"] = {{"role", "assistant"}, {"content", text}};
    if (job->req.logprobs) choice["logprobs"] = {{"content", job->logprobs}};
    body = job->Envelope("chat.completion", options_.model_name);
  } else {
    choice["text"] = text;
    if (job->req.logprobs) choice["logprobs"] = CompletionLogprobs(job->logprobs, job->offsets);
    body = job->Envelope("text_completion", options_.model_name);
  }
  body["choices"] = Json::array({choice});
  body["usage"] = Usage(ev.finish.usage());
  out->Reply(200, "application/json", Dump(body));
}

void HttpApi::Stream(Job* job, HttpResponder* out) {
  const bool chat = job->req.chat;
  const std::string object = chat ? "chat.completion.chunk" : "text_completion";
  // One SSE event: "data: <json>\n\n"; every chunk carries usage: null when usage is asked for.
  auto send = [&](Json choice, const Json* usage) {
    Json chunk = job->Envelope(object, options_.model_name);
    chunk["choices"] = choice.is_null() ? Json::array() : Json::array({choice});
    if (job->req.include_usage) chunk["usage"] = usage ? *usage : Json(nullptr);
    return out->Send("data: " + Dump(chunk) + "\n\n");
  };
  // A choice carrying the text released so far (and the logprobs of the tokens since the last).
  auto piece = [&](size_t upto, const char* finish) {
    std::string delta = job->text.substr(job->sent, upto - job->sent);
    Json choice = {{"index", 0}, {"logprobs", nullptr}, {"finish_reason", finish ? Json(finish) : Json(nullptr)}};
    if (chat) {
      choice["delta"] = finish && delta.empty() ? Json::object() : Json{{"content", delta}};
      if (!job->logprobs.empty()) choice["logprobs"] = {{"content", job->logprobs}};
    } else {
      choice["text"] = delta;
      if (!job->logprobs.empty()) choice["logprobs"] = CompletionLogprobs(job->logprobs, job->offsets);
    }
    job->sent = upto;
    job->logprobs = Json::array();
    job->offsets = Json::array();
    return choice;
  };
  auto client_gone = [&] {
    job->stream->Cancel();
    job->meter.Cancelled();
  };
  // The status line waits for the first event, as llama.cpp's server does: a request that fails
  // before its first token (its sequence refused by a worker's KV budget, a node down at its
  // start or during its prefill, the response's time limit spent in the queue) gets the HTTP
  // status of that error, which an OpenAI client retries, not a 200 with an error event in it.
  // The first token's bytes leave no later than they would have.
  RequestStream::Event ev;
  if (!NextEvent(job, out, &ev)) return;
  if (ev.kind == RequestStream::Event::kError) {
    job->meter.Failed(ev.error);
    return ReplyError(out, ev.error);
  }
  if (!out->StartStream(200, "text/event-stream")) return client_gone();
  if (chat) {
    Json first = {{"index", 0}, {"delta", {{"role", "assistant"}, {"content", ""}}}, {"logprobs", nullptr},
                  {"finish_reason", nullptr}};
    if (!send(first, nullptr)) return client_gone();
  }
  while (ev.kind != RequestStream::Event::kFinish) {
    if (ev.kind == RequestStream::Event::kError) {
      job->meter.Failed(ev.error);
      out->Send("data: " + ErrorFromStatus(ev.error).ToJson() + "\n\ndata: [DONE]\n\n");
      return;
    }
    AddToken(job, ev.token);
    // Never past the start of a stop string this token completed (the finish event follows).
    size_t upto = Releasable(job->text, job->hold, job->sent);
    for (const auto& stop : job->req.stop)
      upto = std::min(upto, std::max(job->sent, job->text.find(stop, job->sent > job->hold ? job->sent - job->hold : 0)));
    send(piece(upto, nullptr), nullptr);
    if (!NextEvent(job, out, &ev)) return;
  }
  job->meter.Finished(ev.finish);
  size_t end = job->text.size();
  if (!ev.finish.stop_string().empty()) end = std::max(job->sent, job->text.find(ev.finish.stop_string()));
  // The held-back rest (if any) and the finish reason in one last chunk, as OpenAI does.
  send(piece(end, FinishName(ev.finish.reason())), nullptr);
  if (job->req.include_usage) {
    Json usage = Usage(ev.finish.usage());
    send(Json(nullptr), &usage);
  }
  out->Send("data: [DONE]\n\n");
}

}  // namespace fm
