// Control-RPC credentials and fencing (control_auth.h). HMAC-SHA256, SHA-256 and the nonces
// come from libcrypto.
#include "rpc/control_auth.h"

#include <google/protobuf/io/coded_stream.h>
#include <google/protobuf/io/zero_copy_stream_impl_lite.h>
#include <google/protobuf/message.h>
#include <grpcpp/support/client_interceptor.h>
#include <openssl/crypto.h>
#include <openssl/evp.h>
#include <openssl/hmac.h>
#include <openssl/rand.h>
#include <openssl/sha.h>

#include <charconv>
#include <vector>

#include "rpc/grpc_status.h"

namespace fm {
namespace {

using Clock = std::chrono::steady_clock;

std::string Hex(const uint8_t* p, size_t n) {
  static const char* d = "0123456789abcdef";
  std::string s(2 * n, '0');
  for (size_t i = 0; i < n; ++i) {
    s[2 * i] = d[p[i] >> 4];
    s[2 * i + 1] = d[p[i] & 15];
  }
  return s;
}

std::string HmacSha256(const std::string& key, const std::string& msg) {
  uint8_t mac[32];
  unsigned int len = 0;
  HMAC(EVP_sha256(), key.data(), static_cast<int>(key.size()),
       reinterpret_cast<const uint8_t*>(msg.data()), msg.size(), mac, &len);
  return std::string(reinterpret_cast<const char*>(mac), sizeof mac);
}

int64_t UnixMillis() {
  return std::chrono::duration_cast<std::chrono::milliseconds>(
             std::chrono::system_clock::now().time_since_epoch())
      .count();
}

// "/flashmesh.v1.Worker/LoadShard" -> "LoadShard": the name both sides sign.
std::string ShortMethod(const char* full) {
  const std::string m = full ? full : "";
  const size_t slash = m.rfind('/');
  return slash == std::string::npos ? m : m.substr(slash + 1);
}

// Adds the term and, with a key, the credential over the request to every call it sees.
class SigningInterceptor final : public grpc::experimental::Interceptor {
 public:
  SigningInterceptor(std::string method, const std::string* key, const std::string* node,
                     uint64_t term)
      : method_(std::move(method)), key_(key), node_(node), term_(term) {}

  void Intercept(grpc::experimental::InterceptorBatchMethods* m) override {
    using grpc::experimental::InterceptionHookPoints;
    // A unary call sends its metadata and its message in one batch: both are here.
    if (m->QueryInterceptionHookPoint(InterceptionHookPoints::PRE_SEND_INITIAL_METADATA)) {
      auto* md = m->GetSendInitialMetadata();
      md->emplace(kTermMetadata, std::to_string(term_));
      if (!key_->empty() &&
          m->QueryInterceptionHookPoint(InterceptionHookPoints::PRE_SEND_MESSAGE)) {
        const auto* req = static_cast<const google::protobuf::Message*>(m->GetSendMessage());
        uint8_t raw[16];
        RAND_bytes(raw, sizeof raw);
        const std::string nonce = Hex(raw, sizeof raw);
        const int64_t now = UnixMillis();
        const std::string body = req ? CanonicalBytes(*req) : std::string();
        md->emplace(kAuthMetadata, std::to_string(now) + "." + nonce + "." +
                                       ControlCallMac(*key_, *node_, method_, term_, now, nonce, body));
      }
    }
    m->Proceed();
  }

 private:
  std::string method_;
  const std::string* key_;    // owned by the factory, which outlives the channel's calls
  const std::string* node_;   // likewise
  uint64_t term_;
};

class SigningFactory final : public grpc::experimental::ClientInterceptorFactoryInterface {
 public:
  SigningFactory(std::string key, std::string node, uint64_t term)
      : key_(std::move(key)), node_(std::move(node)), term_(term) {}
  grpc::experimental::Interceptor* CreateClientInterceptor(
      grpc::experimental::ClientRpcInfo* info) override {
    return new SigningInterceptor(ShortMethod(info->method()), &key_, &node_, term_);
  }

 private:
  const std::string key_;
  const std::string node_;
  const uint64_t term_;
};

// The single value of metadata `key`; "" when absent or repeated.
std::string Metadata(const grpc::ServerContext& ctx, const char* key) {
  const auto& md = ctx.client_metadata();
  if (md.count(key) != 1) return "";
  auto it = md.find(key);
  return std::string(it->second.data(), it->second.size());
}

}  // namespace

std::string CanonicalBytes(const google::protobuf::Message& m) {
  std::string out;
  {
    google::protobuf::io::StringOutputStream raw(&out);
    google::protobuf::io::CodedOutputStream coded(&raw);
    coded.SetSerializationDeterministic(true);
    m.SerializeToCodedStream(&coded);
  }
  return out;
}

std::string ControlKey(const std::string& cluster_secret) {
  return cluster_secret.empty() ? "" : HmacSha256(cluster_secret, "flashmesh control key");
}

std::string ControlCallMac(const std::string& key, const std::string& node, const std::string& method,
                           uint64_t term, int64_t unix_ms, const std::string& nonce,
                           const std::string& request_bytes) {
  uint8_t digest[SHA256_DIGEST_LENGTH];
  SHA256(reinterpret_cast<const uint8_t*>(request_bytes.data()), request_bytes.size(), digest);
  const std::string msg = "flashmesh-control-v2\n" + node + "\n" + method + "\n" + std::to_string(term) + "\n" +
                          std::to_string(unix_ms) + "\n" + nonce + "\n" +
                          std::string(reinterpret_cast<const char*>(digest), sizeof digest);
  const std::string mac = HmacSha256(key, msg);
  return Hex(reinterpret_cast<const uint8_t*>(mac.data()), mac.size());
}

std::shared_ptr<grpc::Channel> NewWorkerChannel(const std::string& target, const std::string& node,
                                                const grpc::ChannelArguments& args,
                                                const std::string& cluster_secret, uint64_t term,
                                                std::shared_ptr<grpc::ChannelCredentials> credentials) {
  std::vector<std::unique_ptr<grpc::experimental::ClientInterceptorFactoryInterface>> signers;
  signers.push_back(std::make_unique<SigningFactory>(ControlKey(cluster_secret), node, term));
  return grpc::experimental::CreateCustomChannelWithInterceptors(
      target, credentials, args, std::move(signers));
}

ControlGuard::ControlGuard(const std::string& cluster_secret, std::string node)
    : key_(ControlKey(cluster_secret)), node_(std::move(node)) {}

Result<uint64_t> ControlGuard::Authenticate(const grpc::ServerContext& ctx,
                                            const std::string& method,
                                            const google::protobuf::Message& req) {
  const std::string term_text = Metadata(ctx, kTermMetadata);
  uint64_t term = 0;
  if (term_text.empty() || term_text.size() > 20 ||
      term_text.find_first_not_of("0123456789") != std::string::npos)
    return Unauthenticated(method + ": missing or malformed '" + std::string(kTermMetadata) +
                           "' metadata (not a flashmesh coordinator?)");
  // 20 digits may still exceed 2^64 (a throw here was gRPC's UNKNOWN).
  if (std::from_chars(term_text.data(), term_text.data() + term_text.size(), term).ec != std::errc())
    return Unauthenticated(method + ": '" + std::string(kTermMetadata) + "' metadata out of range");
  if (key_.empty()) return term;
  const std::string cred = Metadata(ctx, kAuthMetadata);
  const size_t dot1 = cred.find('.'), dot2 = cred.find('.', dot1 + 1);
  if (cred.empty() || dot1 == std::string::npos || dot2 == std::string::npos || dot1 == 0 ||
      dot1 > 19 || cred.find_first_not_of("0123456789", 0) != dot1)
    return Unauthenticated(method + ": missing or malformed '" + std::string(kAuthMetadata) +
                           "' credential (this worker requires the cluster secret)");
  int64_t unix_ms = 0;
  if (std::from_chars(cred.data(), cred.data() + dot1, unix_ms).ec != std::errc())
    return Unauthenticated(method + ": '" + std::string(kAuthMetadata) + "' time out of range");
  const std::string nonce = cred.substr(dot1 + 1, dot2 - dot1 - 1);
  const std::string mac = cred.substr(dot2 + 1);
  const std::string want =
      ControlCallMac(key_, node_, method, term, unix_ms, nonce, CanonicalBytes(req));
  if (mac.size() != want.size() || CRYPTO_memcmp(mac.data(), want.data(), want.size()) != 0)
    return Unauthenticated(method + ": credential does not verify at node '" + node_ +
                           "' (wrong cluster secret, a call for another node, or the call was altered)");
  const int64_t skew = UnixMillis() - unix_ms;
  const int64_t max_skew = std::chrono::milliseconds(kMaxClockSkew).count();
  if (skew > max_skew || skew < -max_skew)
    return Unauthenticated(method + ": credential is " + std::to_string(skew) +
                           " ms off this worker's clock (limit " + std::to_string(max_skew) +
                           " ms): replayed, or the clocks differ");
  std::lock_guard<std::mutex> lock(mu_);
  const auto now = Clock::now();
  while (!expiring_.empty() && expiring_.front().first < now) {
    seen_.erase(expiring_.front().second);
    expiring_.pop_front();
  }
  if (!seen_.insert(nonce).second)
    return Unauthenticated(method + ": credential already used (a replayed call)");
  expiring_.emplace_back(now + 2 * kMaxClockSkew, nonce);
  return term;
}

void ControlGuard::Follow(uint64_t term) {
  uint64_t followed = term_.load();
  while (term > followed && !term_.compare_exchange_weak(followed, term)) {
  }
}

Status ControlGuard::Fence(uint64_t term, const std::string& method) const {
  const uint64_t followed = term_.load();
  if (term < followed)
    return FailedPrecondition(method + " refused: stale coordinator term " + std::to_string(term) +
                              "; this worker follows term " + std::to_string(followed) +
                              " (a newer coordinator took over)");
  return Status::Ok();
}

grpc::Status ControlGuard::Admit(grpc::ServerContext* ctx, const std::string& method,
                                 const google::protobuf::Message& req, bool changes_state,
                                 uint64_t* caller_term) {
  Result<uint64_t> term = Authenticate(*ctx, method, req);
  if (!term.ok()) return ToGrpc(term.status());
  if (caller_term) *caller_term = *term;
  if (changes_state) return WorkerError(ctx, Fence(*term, method), kFaultSuperseded);
  return grpc::Status::OK;
}

}  // namespace fm
