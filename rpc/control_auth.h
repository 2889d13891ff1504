// Authentication and fencing of the worker control RPCs (issue 17, docs/operations.md
// "Security"). Every call of the coordinator to a worker carries, in its metadata:
//   x-flashmesh-term: <term>                 the coordinator's term (always)
//   x-flashmesh-auth: <unix_ms>.<nonce>.<mac>   with a cluster secret only
// mac = hex HMAC-SHA256(K, "flashmesh-control-v2" | node | method | term | unix_ms | nonce |
//                          SHA-256(request bytes)), fields separated by '\n', and
// K = HMAC-SHA256(secret, "flashmesh control key") (not the data plane's use of the secret).
// The worker recomputes the MAC over its own name and method name and the request it parsed,
// refuses a timestamp off its clock by more than kMaxClockSkew and a nonce it has seen (a
// recorded call cannot be replayed, redirected to another worker or RPC or given another body).
//
// Fencing: the term is the coordinator's start time in ms, so a newer coordinator has a higher
// one. A worker follows the term of the last LoadShard that succeeded and refuses state changes
// of an older one (FailedPrecondition naming both terms); Health reports the term it follows,
// so a stale coordinator learns it was superseded and steps down (cluster.h).
#pragma once
#include <grpcpp/grpcpp.h>

#include <atomic>
#include <chrono>
#include <cstdint>
#include <deque>
#include <memory>
#include <mutex>
#include <string>
#include <unordered_set>
#include <utility>

#include "common/status.h"

namespace google::protobuf {
class Message;
}

namespace fm {

inline constexpr char kTermMetadata[] = "x-flashmesh-term";
inline constexpr char kAuthMetadata[] = "x-flashmesh-auth";
inline constexpr std::chrono::seconds kMaxClockSkew{60};

// A message's bytes in protobuf's deterministic serialization (map entries in key order): what
// the MAC signs, so that the sender's message and the receiver's parsed copy give the same
// bytes (a map field made them differ from one call to the next). Deterministic within one
// protobuf build and schema, which the cluster shares: coordinator and workers are one build.
std::string CanonicalBytes(const google::protobuf::Message& m);

// The control key derived from the cluster secret; "" for no secret.
std::string ControlKey(const std::string& cluster_secret);
// The hex MAC of one call to worker `node` (see above). The node is signed so that a call
// recorded on its way to one worker cannot be replayed to another (a Drain{} or Reset{} body is
// the same for all, and their nonce sets are their own).
std::string ControlCallMac(const std::string& key, const std::string& node, const std::string& method,
                           uint64_t term, int64_t unix_ms, const std::string& nonce,
                           const std::string& request_bytes);

// A channel to worker `node` at `target` whose every call carries this coordinator's term
// and, with a secret, its credential (a client interceptor signs each request as it is sent).
// `credentials`: TLS to the worker (security.tls) or insecure.
std::shared_ptr<grpc::Channel> NewWorkerChannel(
    const std::string& target, const std::string& node, const grpc::ChannelArguments& args,
    const std::string& cluster_secret, uint64_t term,
    std::shared_ptr<grpc::ChannelCredentials> credentials = grpc::InsecureChannelCredentials());

// The worker side: checks each call and keeps the term it follows.
class ControlGuard {
 public:
  // `node`: this worker's name, which every credential must be for.
  ControlGuard(const std::string& cluster_secret, std::string node);

  // For every RPC: the credential of the call to `method` ("LoadShard", ...) with request
  // `req`. Unauthenticated, naming what is missing or wrong. Returns the caller's term.
  Result<uint64_t> Authenticate(const grpc::ServerContext& ctx, const std::string& method,
                                const google::protobuf::Message& req);
  // For RPCs that change state: refuses a term older than the one followed (FailedPrecondition).
  Status Fence(uint64_t term, const std::string& method) const;
  // Both, as a grpc::Status for the handlers (OK when the call may go on); *term gets the
  // caller's term when not null. A fenced call is marked kFaultSuperseded (grpc_status.h), so
  // that the stale coordinator steps down rather than take this worker for a dead one.
  grpc::Status Admit(grpc::ServerContext* ctx, const std::string& method,
                     const google::protobuf::Message& req, bool changes_state,
                     uint64_t* term = nullptr);
  // A LoadShard of `term` succeeded: follow it from now on (never goes back).
  void Follow(uint64_t term);
  uint64_t term() const { return term_; }

 private:
  const std::string key_;   // "" = calls are not authenticated (no cluster secret)
  const std::string node_;
  std::atomic<uint64_t> term_{0};
  // Nonces of accepted calls, kept until their timestamps can no longer pass (2 x skew):
  // expiring_ holds them oldest first, so forgetting costs nothing per call.
  std::mutex mu_;           // guards seen_, expiring_
  std::unordered_set<std::string> seen_;
  std::deque<std::pair<std::chrono::steady_clock::time_point, std::string>> expiring_;
};

}  // namespace fm
