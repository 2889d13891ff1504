// ApiService: the public Inference service (api.proto). Validates requests (errors name the
// field), checks the optional bearer token, tokenizes, hands requests to the Scheduler and
// streams their tokens; ClusterStatus merges the coordinator's node states with each worker's
// Stats.
#pragma once
#include <map>
#include <memory>
#include <mutex>
#include <span>
#include <string>
#include <vector>

#include "coordinator/cluster.h"
#include "coordinator/metrics.h"
#include "coordinator/openai_request.h"
#include "coordinator/scheduler.h"
#include "coordinator/write_watchdog.h"
#include "flashmesh/v1/api.grpc.pb.h"
#include "model/config.h"
#include "model/tokenizer.h"

namespace fm {

// Request limits of the public APIs (gRPC and HTTP): what one client can make the coordinator
// hold or work on.
inline constexpr int kApiMaxRequestBytes = 4 << 20;   // a gRPC request message (HTTP: its body)
inline constexpr size_t kMaxPromptBytesPerToken = 32;  // input.text up to this x max_context
inline constexpr size_t kMaxStopBytes = 256;
inline constexpr int kMaxLogitBias = 1024;            // logit_bias entries
inline constexpr int kMaxStopTokenIds = 1024;
inline constexpr int kPromptLogprobsPerEvent = 1024;  // PromptLogprobs tokens per GenerateResponse

struct ApiOptions {
  int64_t max_tokens = 4096;             // per request
  int64_t max_context = 8192;
  int64_t max_streams_per_client = 64;   // concurrent generations of one client identity
  // A Generate stream write that waits longer (the client reads nothing) cancels the call.
  std::chrono::milliseconds write_stall_timeout{60000};
  std::vector<std::string> api_tokens;   // accepted bearer tokens; empty = no auth
  std::string model_name;
};

// A prompt of `bytes` in `field` against kMaxPromptBytesPerToken x max_context, checked before
// tokenizing (both APIs): InvalidArgument naming the field and the bound past it.
Status CheckPromptBytes(const std::string& field, size_t bytes, int64_t max_context);
// Prompt token ids in [0, vocab_size) (both APIs, and /tokenize): InvalidArgument naming
// field[i] and the id otherwise.
Status CheckPromptIds(const std::string& field, std::span<const int32_t> ids, int64_t vocab_size);

// The value of an Authorization header (HTTP) or metadata entry (gRPC; null when absent) against
// the accepted tokens (empty: no auth): Ok for "Bearer <one of tokens>", Unauthenticated
// otherwise ("missing <what>" when absent).
Status CheckBearerToken(const std::string* value, const std::vector<std::string>& tokens,
                        const std::string& what);

class ApiService final : public flashmesh::v1::Inference::Service {
 public:
  ApiService(const ModelConfig& model, const Tokenizer* tokenizer, Cluster* cluster,
             Scheduler* scheduler, Metrics* metrics, ApiOptions options);

  grpc::Status Generate(grpc::ServerContext* ctx, const flashmesh::v1::GenerateRequest* req,
                        grpc::ServerWriter<flashmesh::v1::GenerateResponse>* writer) override;
  grpc::Status Tokenize(grpc::ServerContext* ctx, const flashmesh::v1::TokenizeRequest* req,
                        flashmesh::v1::TokenizeResponse* resp) override;
  grpc::Status ClusterStatus(grpc::ServerContext* ctx, const flashmesh::v1::ClusterStatusRequest* req,
                             flashmesh::v1::ClusterStatusResponse* resp) override;

  // The request as the scheduler takes it, or INVALID_ARGUMENT naming the field.
  Result<GenerateParams> Validate(const flashmesh::v1::GenerateRequest& req) const;

  // One of a client's concurrent generations, released when destroyed.
  class StreamSlot {
   public:
    StreamSlot(const ApiService* api, std::string client) : api_(api), client_(std::move(client)) {}
    StreamSlot(const StreamSlot&) = delete;
    StreamSlot& operator=(const StreamSlot&) = delete;
    ~StreamSlot();

   private:
    const ApiService* api_;
    std::string client_;
  };
  // `count` slots for `client` (its bearer token, else its address), all or none:
  // RESOURCE_EXHAUSTED when its running generations and `count` are more than
  // max_streams_per_client. All at once, so that a request of n choices refused for its last
  // never holds the others meanwhile (a spurious 429 for the client's other requests).
  Result<std::vector<std::unique_ptr<StreamSlot>>> AcquireStreams(const std::string& client,
                                                                  int64_t count) const;
  // The client of a stream limit, one key for HTTP and gRPC: its checked `Authorization` value
  // when the API checks tokens (so one token has one limit on both APIs), else `anonymous` (the
  // gRPC peer's address, "http" for every HTTP client).
  std::string StreamClient(const std::string& authorization, std::string anonymous) const;
  // Whether bearer tokens are checked: only then does a token name a client (else any client
  // could send a new one with each request and never reach its limit).
  bool checks_tokens() const { return !options_.api_tokens.empty(); }
  // The model's vocab_size (config.json): a prompt's token ids are below it.
  int64_t vocab_size() const { return model_.vocab_size; }

 private:
  Status Authenticate(grpc::ServerContext* ctx) const;

  ModelConfig model_;
  const Tokenizer* tokenizer_;
  Cluster* cluster_;
  Scheduler* scheduler_;
  Metrics* metrics_;
  ApiOptions options_;
  WriteWatchdog write_watchdog_{options_.write_stall_timeout};
  // Bookkeeping of AcquireStreams (also used by the HTTP API through a const ApiService).
  mutable std::mutex streams_mu_;
  mutable std::map<std::string, int64_t> streams_;   // client -> generations running
};

// The coordinator's health (ClusterStatus.healthy, /health, grpc.health.v1): every node UP and
// the scheduler healthy (no step overdue, no reset in progress); otherwise why not.
Status ClusterHealth(const Cluster& cluster, const Scheduler& scheduler);

// Bearer tokens from a token file: one per line, blank lines and '#' comments skipped.
Result<std::vector<std::string>> ReadApiTokens(const std::string& path);

}  // namespace fm
