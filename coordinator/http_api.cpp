#include "coordinator/http_api.h"

#include <algorithm>
#include <cstdio>
#include <limits>
#include <random>

#include <nlohmann/json.hpp>

#include "coordinator/completion_logprobs.h"
#include "coordinator/reasoning.h"

namespace fm {
namespace {

constexpr auto kJobPollInterval = std::chrono::milliseconds(50);

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

// How errors name a completion's prompt k: "prompt", or "prompt[k]" in a batch of several
// (the decoder's names).
std::string PromptField(const OpenAiRequest& r, size_t k) {
  return r.prompts.size() > 1 ? "prompt[" + std::to_string(k) + "]" : "prompt";
}

}  // namespace

// One choice of a request (n > 1 makes several): its generation's stream, what it produced so
// far, and its own metrics (each choice is a generation: its own time to first token, finish
// reason and tokens).
struct HttpApi::Choice {
  explicit Choice(Metrics* m) : meter(m, "http") {}
  std::unique_ptr<ApiService::StreamSlot> slot;
  std::shared_ptr<RequestStream> stream;
  RequestMeter meter;
  std::string text;     // decoded so far
  size_t sent = 0;      // bytes of text already streamed
  Json logprobs = Json::array();   // entries of the tokens not yet streamed (all when not streaming)
  Json offsets = Json::array();    // where each of those tokens starts in text, in characters
  size_t chars = 0;     // code points in text: text_offset counts them, as OpenAI's and vLLM's do
  int64_t tokens = 0;
  size_t stops_from = 0; // the text before min_tokens' token: a stop string must end past it
  // Thinking mode: where "</think>" starts in text (npos: not yet), how far text was searched.
  size_t think_end = std::string::npos, think_searched = 0;
  CompletionEcho echo;  // completions' echo: the prompt's text (and logprobs) before the answer
  Json prompt_logprobs;  // vLLM's prompt_logprobs, when asked for
  bool finished = false;
  flashmesh::v1::Finish finish;
  // Where the matched stop string starts in the text (the scheduler found it there).
  size_t StopOffset() const {
    return static_cast<size_t>(std::clamp<int64_t>(finish.stop_offset(), 0, static_cast<int64_t>(text.size())));
  }
};

// One generation request: what it asked for and its choices.
struct HttpApi::Job {
  OpenAiRequest req;
  std::vector<std::unique_ptr<Choice>> choices;
  std::shared_ptr<StreamWaker> waker = std::make_shared<StreamWaker>();
  size_t next_poll = 0; // the choice NextEvent looks at first (round robin: none starves)
  std::string id;
  std::time_t created = 0;
  size_t hold = 0;      // longest stop string - 1
  bool reasoning = false; // the answer starts inside thinking mode's reasoning (ToParams)
  // The fields every response object and stream chunk starts with.
  Json Envelope(const std::string& object, const std::string& model) const {
    return {{"id", id}, {"object", object}, {"created", created}, {"model", model}};
  }
  // The client left or one choice failed: the others end too.
  void CancelAll() {
    for (auto& c : choices) c->stream->Cancel();
  }
  // Choice `failed` ended the response with `why`: the others still going end, counted as
  // cancelled (each choice counts once in the metrics).
  void FailAll(size_t failed, const Status& why) {
    CancelAll();
    for (size_t i = 0; i < choices.size(); ++i) {
      if (choices[i]->finished) continue;
      choices[i]->finished = true;
      if (i == failed) choices[i]->meter.Failed(why);
      else choices[i]->meter.Cancelled();
    }
  }
  // The usage of every choice together: each prompt once (as OpenAI counts it: choices k * n ..
  // k * n + n - 1 are prompt k's), the tokens of all.
  Json TotalUsage() const {
    flashmesh::v1::Usage u;
    for (size_t k = 0; k < choices.size(); ++k) {
      const auto& usage = choices[k]->finish.usage();
      if (k % static_cast<size_t>(req.n) == 0) u.set_prompt_tokens(u.prompt_tokens() + usage.prompt_tokens());
      if (!req.prompt_only) u.set_completion_tokens(u.completion_tokens() + usage.completion_tokens());
    }
    return Usage(u);
  }
};

HttpApi::HttpApi(const Tokenizer* tokenizer, Cluster* cluster, Scheduler* scheduler,
                 const ApiService* grpc_api, Metrics* metrics, ApiOptions options)
    : tokenizer_(tokenizer), cluster_(cluster), scheduler_(scheduler), grpc_api_(grpc_api),
      metrics_(metrics), options_(std::move(options)) {}

void HttpApi::Handle(const HttpRequest& req, HttpResponder* out) {
  struct Route { const char* path; const char* method; };
  static const Route kRoutes[] = {{"/v1/chat/completions", "POST"}, {"/v1/completions", "POST"},
                                  {"/v1/models", "GET"}, {"/tokenize", "POST"}, {"/detokenize", "POST"},
                                  {"/health", "GET"}, {"/metrics", "GET"}};
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
  if (req.path == std::string("/tokenize")) return Tokenize(req, out);
  if (req.path == std::string("/detokenize")) return Detokenize(req, out);
  Generate(req, out, req.path == std::string("/v1/chat/completions"));
}

void HttpApi::Tokenize(const HttpRequest& req, HttpResponder* out) const {
  auto r = DecodeTokenizeRequest(req.body);
  if (!r.ok()) return ReplyError(out, r.status());
  bool opens_reasoning = false;
  auto ids = PromptIds(r->input, 0, &opens_reasoning);
  if (!ids.ok()) return ReplyError(out, ids.status());
  Json strs = nullptr;
  if (r->return_token_strs) {
    strs = Json::array();   // as tokenizer.json spells them (vLLM's convert_ids_to_tokens)
    for (int32_t id : *ids) {
      auto token = tokenizer_ ? tokenizer_->IdToToken(id) : Result<std::string>(std::string());
      strs.push_back(token.ok() ? *token : "token_id:" + std::to_string(id));
    }
  }
  out->Reply(200, "application/json", Dump({{"count", ids->size()}, {"max_model_len", options_.max_context},
                                             {"tokens", *ids}, {"token_strs", std::move(strs)}}));
}

void HttpApi::Detokenize(const HttpRequest& req, HttpResponder* out) const {
  auto ids = DecodeDetokenizeRequest(req.body);
  if (!ids.ok()) return ReplyError(out, ids.status());
  if (!tokenizer_) return ReplyError(out, InvalidArgument("tokens: this model has no tokenizer.json"));
  for (size_t i = 0; i < ids->size(); ++i)
    if ((*ids)[i] >= tokenizer_->vocab_size())
      return ReplyError(out, InvalidArgument("tokens[" + std::to_string(i) + "]: " + std::to_string((*ids)[i]) +
                                             " outside the vocabulary [0, " +
                                             std::to_string(tokenizer_->vocab_size()) + ")"));
  auto text = tokenizer_->Decode(*ids);
  if (!text.ok()) return ReplyError(out, text.status().Wrap("tokens"));
  out->Reply(200, "application/json", Dump({{"prompt", *text}}));
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

Result<std::vector<int32_t>> HttpApi::PromptIds(const OpenAiRequest& r, size_t prompt,
                                                bool* opens_reasoning) const {
  *opens_reasoning = false;
  const std::string input = r.chat ? "messages" : PromptField(r, prompt);
  const OpenAiRequest::Prompt* p = r.chat ? nullptr : &r.prompts.at(prompt);
  if (p && !p->ids.empty()) {
    FM_RETURN_IF_ERROR(CheckPromptIds(input, p->ids, grpc_api_->vocab_size()));
    return p->ids;
  }
  if (!tokenizer_) return InvalidArgument(input + ": this model has no tokenizer.json; send prompt as token ids");
  std::string text;
  if (r.chat) {
    FM_ASSIGN_OR_RETURN(text, tokenizer_->ApplyChatTemplate(r.messages, r.thinking));
    // Not when the conversation ends with a system or assistant turn: the template then opens
    // no assistant reply, so the answer is not reasoning.
    *opens_reasoning = r.thinking && text.ends_with(kThinkStart);
  } else if (r.add_special_tokens) {   // a completion continues BOS + the prompt, as vLLM's
    FM_ASSIGN_OR_RETURN(text, tokenizer_->TokenBytes(tokenizer_->bos_id()));
  }
  if (p) text += p->text;
  // As gRPC's input.text: no tokenizing of megabytes that cannot fit the context anyway.
  FM_RETURN_IF_ERROR(CheckPromptBytes(input, text.size(), options_.max_context));
  auto ids = tokenizer_->Encode(text);
  if (!ids.ok()) return ids.status().Wrap(input);
  return std::move(ids).value();
}

Result<GenerateParams> HttpApi::ToParams(const OpenAiRequest& r, size_t prompt, bool* opens_reasoning) const {
  flashmesh::v1::GenerateRequest g;
  FM_ASSIGN_OR_RETURN(std::vector<int32_t> ids, PromptIds(r, prompt, opens_reasoning));
  g.mutable_tokens()->mutable_ids()->Add(ids.begin(), ids.end());
  const int64_t prompt_tokens = g.tokens().ids_size();
  int64_t max_tokens = r.max_tokens;
  if (max_tokens == 0)
    max_tokens = std::max<int64_t>(1, std::min(options_.max_tokens, options_.max_context - prompt_tokens));
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
  // Echo with logprobs scores the prompt too (with as many alternatives), as vLLM's
  // prompt_logprobs does (the larger count serves both).
  const int64_t scores = std::max<int64_t>(r.echo && r.logprobs ? r.top_logprobs : -1, r.prompt_logprobs.value_or(-1));
  if (scores >= 0) g.set_prompt_logprobs(static_cast<int32_t>(scores));
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
  const std::string input = r.chat ? "messages" : PromptField(r, prompt);
  if (msg.rfind("input.tokens.ids", 0) == 0) msg = input + msg.substr(16);
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
  Job job;
  auto fail = [&](const Status& s, const char* code = nullptr) {
    RequestMeter(metrics_, "http").Failed(s);
    job.CancelAll();
    ReplyError(out, s, code);
  };
  auto decoded = DecodeOpenAiRequest(http.body, chat);
  if (!decoded.ok()) return fail(decoded.status());
  job.req = std::move(decoded).value();
  // Each choice is a generation of the client's, queued with the others: more than it may run
  // at once, or than the queue holds, can never start (a 429 would be retried for ever).
  const size_t prompts = chat ? 1 : job.req.prompts.size();
  const int64_t total = job.req.n * static_cast<int64_t>(prompts);
  // The field to change: n, or the batch when it alone is too large.
  const std::string what = job.req.n == 1 && prompts > 1
                               ? "prompt: a batch of " + std::to_string(prompts) + " prompts"
                               : "n: " + std::to_string(job.req.n) + " choices" +
                                     (prompts > 1 ? " of " + std::to_string(prompts) + " prompts" : "");
  if (total > options_.max_streams_per_client)
    return fail(InvalidArgument(what + ", more than the " + std::to_string(options_.max_streams_per_client) +
                                " generations a client may run at once (limits.max_streams_per_client)"));
  if (total > scheduler_->max_queue())
    return fail(InvalidArgument(what + ", more than the " + std::to_string(scheduler_->max_queue()) +
                                " requests the queue holds (limits.max_queue)"));
  std::vector<GenerateParams> per_prompt;
  for (size_t p = 0; p < prompts; ++p) {
    auto params = ToParams(job.req, p, &job.reasoning);
    if (!params.ok()) return fail(params.status());
    per_prompt.push_back(std::move(params).value());
  }
  for (const auto& s : job.req.stop) job.hold = std::max(job.hold, s.size() - 1);
  // HTTP requests carry no address here: a client is its (checked) token; without tokens,
  // every HTTP client is one.
  const std::string client = grpc_api_->StreamClient(http.Header("authorization"), "http");
  auto slots = grpc_api_->AcquireStreams(client, total);
  if (!slots.ok()) return fail(slots.status(), "rate_limit_exceeded");
  std::random_device rd;
  std::vector<GenerateParams> choices;
  for (const GenerateParams& params : per_prompt)
    for (int64_t i = 0; i < job.req.n; ++i) {
      // Choice i of a prompt draws from seed + i (a given seed still gives the same n choices,
      // and a prompt of a batch the choices it gets alone), or from a seed of its own.
      choices.push_back(params);
      if (i > 0)
        choices.back().sampling.set_seed(job.req.seed ? *job.req.seed + static_cast<uint64_t>(i)
                                                      : (static_cast<uint64_t>(rd()) << 32) | rd());
    }
  auto streams = scheduler_->SubmitAll(std::move(choices));
  if (!streams.ok()) return fail(streams.status());
  for (size_t i = 0; i < streams->size(); ++i) {
    auto c = std::make_unique<Choice>(metrics_);
    c->slot = std::move((*slots)[i]);
    c->stream = (*streams)[i];
    c->stream->SetWaker(job.waker);
    c->meter.Submitted(static_cast<int64_t>(per_prompt[i / job.req.n].prompt.size()));
    if (job.req.echo) {
      const OpenAiRequest::Prompt& p = job.req.prompts[i / static_cast<size_t>(job.req.n)];
      c->echo = MakeCompletionEcho(tokenizer_, per_prompt[i / job.req.n].prompt, p.ids.empty() ? &p.text : nullptr);
    }
    job.choices.push_back(std::move(c));
  }
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

void HttpApi::AddToken(Job* job, Choice* c, const flashmesh::v1::TokenEvent& token) const {
  c->meter.Token();
  if (job->req.prompt_only) return;   // max_tokens 0 with echo: the token is not part of the answer
  if (job->req.logprobs && job->req.chat) {
    Json e = LogprobEntry(TokenString(token.id(), token.text()), token.logprob());
    Json alts = Json::array();
    for (const auto& alt : token.top_logprobs())
      alts.push_back(LogprobEntry(TokenString(alt.id(), alt.token()), alt.logprob()));
    e["top_logprobs"] = std::move(alts);
    c->logprobs.push_back(std::move(e));
  } else if (job->req.logprobs) {
    c->logprobs.push_back(CompletionEntry(token.id(), TokenString(token.id(), token.text()), token.logprob(),
                                          token.top_logprobs(), token.top_logprobs_size()));
  }
  // Completions' echo: the generated text's offsets come after the prompt's.
  if (job->req.logprobs) c->offsets.push_back(c->echo.chars + c->chars);
  // Stop strings count from min_tokens' token on (the scheduler's rule).
  if (++c->tokens == job->req.min_tokens) c->stops_from = c->text.size();
  c->text += token.text();   // whole characters (the stream holds a character's first bytes back)
  for (unsigned char b : token.text()) c->chars += (b & 0xC0) != 0x80;
  if (job->reasoning) FindThinkEnd(c->text, &c->think_end, &c->think_searched);
}

bool HttpApi::NextEvent(Job* job, HttpResponder* out, size_t* which, RequestStream::Event* ev) {
  const size_t n = job->choices.size();
  while (!out->Abandoned()) {
    const uint64_t seen = job->waker->count();
    for (size_t k = 0; k < n; ++k) {
      const size_t i = (job->next_poll + k) % n;
      if (job->choices[i]->finished || !job->choices[i]->stream->Pop(ev, std::chrono::milliseconds(0))) continue;
      job->next_poll = (i + 1) % n;
      *which = i;
      return true;
    }
    job->waker->Wait(seen, kJobPollInterval);
  }
  job->CancelAll();  // the scheduler frees the sequences on every worker
  const Status why = out->AbandonedBecause();
  if (why.code() != Code::kCancelled) {  // the response timed out or the server stops: say so
    *which = 0;
    while (*which + 1 < n && job->choices[*which]->finished) ++*which;   // one still going
    *ev = RequestStream::Event{RequestStream::Event::kError, {}, {}, why};
    return true;
  }
  for (auto& c : job->choices)
    if (!c->finished) c->meter.Cancelled();
  return false;
}

void HttpApi::Collect(Job* job, HttpResponder* out) {
  RequestStream::Event ev;
  size_t i = 0, left = job->choices.size();
  while (left > 0) {
    if (!NextEvent(job, out, &i, &ev)) return;
    Choice* c = job->choices[i].get();
    if (ev.kind == RequestStream::Event::kError) {
      job->FailAll(i, ev.error);
      return ReplyError(out, ev.error);
    }
    if (ev.kind == RequestStream::Event::kToken) {
      AddToken(job, c, ev.token);
      continue;
    }
    if (ev.kind == RequestStream::Event::kPrompt) {
      if (job->req.echo) AddPromptScores(&c->echo, TokenString(c->echo.first_id, ""), ev.prompt, job->req.top_logprobs);
      if (job->req.prompt_logprobs) c->prompt_logprobs = VllmPromptLogprobs(ev.prompt, *job->req.prompt_logprobs);
      continue;
    }
    c->finished = true;
    c->finish = ev.finish;
    c->meter.Finished(ev.finish);
    --left;
  }
  Json choices = Json::array();
  for (size_t k = 0; k < job->choices.size(); ++k) {
    const Choice& c = *job->choices[k];
    std::string text = c.text;
    if (!c.finish.stop_string().empty()) text = text.substr(0, c.StopOffset());
    Json choice = {{"index", k}};
    Json logprobs = nullptr;
    if (job->reasoning) {
      // The reasoning, then the answer after "</think>" (null when the reasoning never ended:
      // also when a stop string cut the tag, whose bytes then stay reasoning).
      const size_t end = ReasoningEnd(c.think_end, text.size());
      const ReasoningParts parts = SplitReasoning(text, end, 0, text.size());
      choice["message"] = {{"role", "assistant"}, {"reasoning_content", parts.reasoning},
                           {"content", end == std::string::npos ? Json(nullptr) : Json(parts.content)}};
      if (job->req.logprobs) logprobs = {{"content", c.logprobs}};
    } else if (job->req.chat) {
      choice["message"] = {{"role", "assistant"}, {"content", text}};
      if (job->req.logprobs) logprobs = {{"content", c.logprobs}};
    } else if (job->req.echo) {
      choice["text"] = c.echo.text + text;
      if (job->req.logprobs) {
        Json entries = c.echo.entries, offsets = c.echo.offsets;
        entries.insert(entries.end(), c.logprobs.begin(), c.logprobs.end());
        offsets.insert(offsets.end(), c.offsets.begin(), c.offsets.end());
        logprobs = CompletionLogprobs(entries, offsets);
      }
    } else {
      choice["text"] = text;
      if (job->req.logprobs) logprobs = CompletionLogprobs(c.logprobs, c.offsets);
    }
    choice["logprobs"] = std::move(logprobs);
    choice["finish_reason"] = FinishName(c.finish.reason());
    if (job->req.prompt_logprobs && !job->req.chat) choice["prompt_logprobs"] = c.prompt_logprobs;
    choices.push_back(std::move(choice));
  }
  Json body = job->Envelope(job->req.chat ? "chat.completion" : "text_completion", options_.model_name);
  body["choices"] = std::move(choices);
  body["usage"] = job->TotalUsage();
  // vLLM's place for a chat's: the response's (every choice has the one prompt).
  if (job->req.prompt_logprobs && job->req.chat) body["prompt_logprobs"] = job->choices[0]->prompt_logprobs;
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
  // A choice carrying choice i's text released so far (and the logprobs of its tokens since).
  auto piece = [&](size_t i, size_t upto, const char* finish) {
    Choice& c = *job->choices[i];
    // Thinking: the tag's bytes wait until the text released holds all of it or the answer
    // ends (a stop string that cuts it leaves them reasoning, as Collect does).
    if (job->reasoning && !finish && ReasoningEnd(c.think_end, upto) == std::string::npos)
      upto = std::max(c.sent, std::min(upto, c.think_end));
    std::string delta = c.text.substr(c.sent, upto - c.sent);
    Json choice = {{"index", i}};
    Json logprobs = nullptr;
    if (job->reasoning) {
      // Before "</think>" the text is reasoning_content, after it content; a delta crossing
      // the tag carries both. An empty one names the part the text is in.
      const size_t end = ReasoningEnd(c.think_end, upto);
      const ReasoningParts parts = SplitReasoning(c.text, end, c.sent, upto);
      Json d = Json::object();
      if (!parts.reasoning.empty()) d["reasoning_content"] = parts.reasoning;
      if (!parts.content.empty()) d["content"] = parts.content;
      if (d.empty() && !finish) d[end == std::string::npos ? "reasoning_content" : "content"] = "";
      choice["delta"] = std::move(d);
      if (!c.logprobs.empty()) logprobs = {{"content", c.logprobs}};
    } else if (chat) {
      choice["delta"] = finish && delta.empty() ? Json::object() : Json{{"content", delta}};
      if (!c.logprobs.empty()) logprobs = {{"content", c.logprobs}};
    } else {
      choice["text"] = delta;
      if (!c.logprobs.empty()) logprobs = CompletionLogprobs(c.logprobs, c.offsets);
    }
    choice["logprobs"] = std::move(logprobs);
    choice["finish_reason"] = finish ? Json(finish) : Json(nullptr);
    c.sent = upto;
    c.logprobs = Json::array();
    c.offsets = Json::array();
    return choice;
  };
  // Completions' echo: the prompt (and its tokens' logprobs) in a chunk of its own before the
  // choice's first generated text, as vLLM streams it.
  auto echo = [&](size_t i) {
    Choice& c = *job->choices[i];
    c.echo.sent = true;
    Json logprobs = job->req.logprobs ? CompletionLogprobs(c.echo.entries, c.echo.offsets) : Json(nullptr);
    return send({{"index", i}, {"text", c.echo.text}, {"logprobs", std::move(logprobs)}, {"finish_reason", nullptr}},
                nullptr);
  };
  auto client_gone = [&] {
    job->CancelAll();
    for (auto& c : job->choices)
      if (!c->finished) c->meter.Cancelled();
  };
  // The status line waits for the first event, as llama.cpp's server does: a request that fails
  // before its first token (its sequence refused by a worker's KV budget, a node down at its
  // start or during its prefill, the response's time limit spent in the queue) gets the HTTP
  // status of that error, which an OpenAI client retries, not a 200 with an error event in it.
  // The first token's bytes leave no later than they would have. With n choices that is the
  // first of any choice (one may wait in the queue for a batch slot while another runs); a
  // choice that fails later ends the stream with an error event.
  const size_t n = job->choices.size();
  size_t first_choice = 0;
  RequestStream::Event first_ev;
  if (!NextEvent(job, out, &first_choice, &first_ev)) return;
  if (first_ev.kind == RequestStream::Event::kError) {
    job->FailAll(first_choice, first_ev.error);
    return ReplyError(out, first_ev.error);
  }
  if (!out->StartStream(200, "text/event-stream")) return client_gone();
  for (size_t i = 0; chat && i < n; ++i) {
    Json first = {{"index", i}, {"delta", {{"role", "assistant"}, {"content", ""}}}, {"logprobs", nullptr},
                  {"finish_reason", nullptr}};
    if (!send(first, nullptr)) return client_gone();
  }
  size_t left = n;
  // Sends what choice i's event adds; false when the response ends here (an error).
  auto on_event = [&](size_t i, const RequestStream::Event& ev) {
    Choice& c = *job->choices[i];
    if (ev.kind == RequestStream::Event::kError) {
      job->FailAll(i, ev.error);
      out->Send("data: " + ErrorFromStatus(ev.error).ToJson() + "\n\ndata: [DONE]\n\n");
      return false;
    }
    if (ev.kind == RequestStream::Event::kPrompt) {   // echo with logprobs (prompt_logprobs is not streamed)
      AddPromptScores(&c.echo, TokenString(c.echo.first_id, ""), ev.prompt, job->req.top_logprobs);
      echo(i);
      return true;
    }
    if (job->req.echo && !c.echo.sent) echo(i);
    if (ev.kind == RequestStream::Event::kToken) {
      AddToken(job, &c, ev.token);
      // Never past the start of a stop string this token completed (the finish event follows);
      // one that ends before min_tokens' token does not stop the request, so it is not held.
      size_t upto = Releasable(c.text, job->hold, c.sent);
      // Reasoning: not the first bytes of a "</think>" that the next token may complete.
      if (job->reasoning && c.think_end == std::string::npos)
        upto = std::min(upto, std::max(c.sent, ReleasableReasoning(c.text)));
      for (const auto& stop : job->req.stop) {
        const size_t allowed = c.stops_from >= stop.size() ? c.stops_from - stop.size() + 1 : 0;
        const size_t from = std::max(allowed, c.sent > job->hold ? c.sent - job->hold : 0);
        upto = std::min(upto, std::max(c.sent, c.text.find(stop, from)));
      }
      send(piece(i, upto, nullptr), nullptr);
      return true;
    }
    c.finished = true;
    c.finish = ev.finish;
    c.meter.Finished(ev.finish);
    --left;
    size_t end = c.text.size();
    if (!ev.finish.stop_string().empty()) end = std::max(c.sent, c.StopOffset());
    // The held-back rest (if any) and the finish reason in one last chunk, as OpenAI does.
    send(piece(i, end, FinishName(ev.finish.reason())), nullptr);
    return true;
  };
  if (!on_event(first_choice, first_ev)) return;
  while (left > 0) {
    size_t i = 0;
    RequestStream::Event ev;
    if (!NextEvent(job, out, &i, &ev)) return;
    if (!on_event(i, ev)) return;
  }
  if (job->req.include_usage) {
    Json usage = job->TotalUsage();
    send(Json(nullptr), &usage);
  }
  out->Send("data: [DONE]\n\n");
}

}  // namespace fm
