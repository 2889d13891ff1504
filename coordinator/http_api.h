// HttpApi: the routes of the coordinator's HTTP server (docs/api.md, "HTTP API"):
//   POST /v1/chat/completions, POST /v1/completions   OpenAI-compatible, streaming as SSE
//   GET  /v1/models                                   the served model and its max context
//   GET  /health                                      200 when the cluster can generate, else 503
//   GET  /metrics                                     Prometheus text format (metrics.h)
// Requests go through the same validation, scheduler and bearer tokens as the gRPC API; a
// client that goes away cancels its request (the scheduler frees the sequence on every worker).
#pragma once
#include <atomic>
#include <cstdint>
#include <ctime>
#include <string>

#include "coordinator/api_service.h"
#include "coordinator/http_server.h"
#include "coordinator/metrics.h"
#include "coordinator/openai_request.h"

namespace fm {

class HttpApi {
 public:
  HttpApi(const Tokenizer* tokenizer, Cluster* cluster, Scheduler* scheduler,
          const ApiService* grpc_api, Metrics* metrics, ApiOptions options);
  void Handle(const HttpRequest& req, HttpResponder* out);

 private:
  struct Job;      // one generation request in flight
  struct Choice;   // one of its n choices
  void Generate(const HttpRequest& req, HttpResponder* out, bool chat);
  void Stream(Job* job, HttpResponder* out);
  void Collect(Job* job, HttpResponder* out);
  // The next event of any of the request's choices (true; *which is the choice), or false when
  // the client went away first: the request is then cancelled and counted so. A response past
  // HttpLimits.response_timeout, or one the stopping server ends, is cancelled too and gets an
  // error naming why (504 / 503): a status before the first token, an error event after it.
  bool NextEvent(Job* job, HttpResponder* out, size_t* which, RequestStream::Event* ev);
  // A generated token of choice c: its text appended to the choice's, its logprobs entry and
  // text offset kept when asked for.
  void AddToken(Job* job, Choice* c, const flashmesh::v1::TokenEvent& token) const;
  void Models(HttpResponder* out) const;
  void Health(HttpResponder* out) const;
  Status Authenticate(const HttpRequest& req) const;
  // The prompt ids and scheduler parameters of a decoded request (errors name its fields).
  // The prompt's token ids: the chat template's rendering or the completion's text (BOS first
  // with add_special_tokens), encoded; or its ids. *opens_reasoning: the rendered chat prompt
  // ends inside a reasoning block (thinking mode's "<think>"), so the answer splits into
  // reasoning_content and content (docs/api.md "Thinking").
  // prompt: which of a completion's prompts (errors name it as PromptField does).
  Result<std::vector<int32_t>> PromptIds(const OpenAiRequest& r, size_t prompt, bool* opens_reasoning) const;
  Result<GenerateParams> ToParams(const OpenAiRequest& r, size_t prompt, bool* opens_reasoning) const;
  // vLLM's /tokenize and /detokenize (docs/api.md).
  void Tokenize(const HttpRequest& req, HttpResponder* out) const;
  void Detokenize(const HttpRequest& req, HttpResponder* out) const;
  std::string TokenString(int32_t id, const std::string& piece) const;

  const Tokenizer* tokenizer_;
  Cluster* cluster_;
  Scheduler* scheduler_;
  const ApiService* grpc_api_;
  Metrics* metrics_;
  ApiOptions options_;
  std::time_t started_ = std::time(nullptr);
  // Response ids: a random per-process part (ids do not repeat across coordinator restarts, in
  // logs and traces) and a counter (unique within the process).
  const uint64_t id_prefix_ = RandomIdPrefix();
  std::atomic<uint64_t> next_id_{1};

  static uint64_t RandomIdPrefix();
};

}  // namespace fm
