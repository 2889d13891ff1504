#include "rpc/grpc_status.h"

#include <grpcpp/grpcpp.h>

#include <fstream>
#include <sstream>

namespace fm {

grpc::Status ToGrpc(const Status& s) {
  using G = grpc::StatusCode;
  G code = G::UNKNOWN;
  switch (s.code()) {
    case Code::kOk: return grpc::Status::OK;
    case Code::kInvalidArgument: code = G::INVALID_ARGUMENT; break;
    case Code::kNotFound: code = G::NOT_FOUND; break;
    case Code::kOutOfRange: code = G::OUT_OF_RANGE; break;
    case Code::kResourceExhausted: code = G::RESOURCE_EXHAUSTED; break;
    case Code::kUnavailable: code = G::UNAVAILABLE; break;
    case Code::kUnauthenticated: code = G::UNAUTHENTICATED; break;
    case Code::kInternal: code = G::INTERNAL; break;
    case Code::kCancelled: code = G::CANCELLED; break;
    case Code::kDeadlineExceeded: code = G::DEADLINE_EXCEEDED; break;
    case Code::kFailedPrecondition: code = G::FAILED_PRECONDITION; break;
  }
  return grpc::Status(code, s.message());
}

Status FromGrpc(const grpc::Status& s, const std::string& context) {
  using G = grpc::StatusCode;
  Code code = Code::kInternal;
  switch (s.error_code()) {
    case G::OK: return Status::Ok();
    case G::INVALID_ARGUMENT: code = Code::kInvalidArgument; break;
    case G::NOT_FOUND: code = Code::kNotFound; break;
    case G::OUT_OF_RANGE: code = Code::kOutOfRange; break;
    case G::RESOURCE_EXHAUSTED: code = Code::kResourceExhausted; break;
    case G::UNAVAILABLE: code = Code::kUnavailable; break;
    case G::UNAUTHENTICATED: code = Code::kUnauthenticated; break;
    case G::CANCELLED: code = Code::kCancelled; break;
    case G::DEADLINE_EXCEEDED: code = Code::kDeadlineExceeded; break;
    case G::FAILED_PRECONDITION: code = Code::kFailedPrecondition; break;
    // The address given (a flag, a YAML) is another daemon's port: the caller's input is wrong.
    case G::UNIMPLEMENTED: code = Code::kInvalidArgument; break;
    default: break;
  }
  return Status(code, context + ": " + GrpcErrorText(s));
}

std::string GrpcErrorText(const grpc::Status& s) {
  using G = grpc::StatusCode;
  if (s.error_code() == G::UNIMPLEMENTED)
    return "UNIMPLEMENTED: the server there does not serve this call (another flashmesh daemon's "
           "port, or not flashmesh at all?)" + (s.error_message().empty() ? "" : ": " + s.error_message());
  if (!s.error_message().empty()) return s.error_message();
  switch (s.error_code()) {
    case G::UNKNOWN: return "UNKNOWN (no message)";
    case G::ABORTED: return "ABORTED (no message)";
    case G::DATA_LOSS: return "DATA_LOSS (no message)";
    case G::PERMISSION_DENIED: return "PERMISSION_DENIED (no message)";
    default: return "gRPC status " + std::to_string(static_cast<int>(s.error_code())) + " (no message)";
  }
}

Status FromGrpc(const grpc::Status& s) {
  const Status st = FromGrpc(s, "");
  return Status(st.code(), s.error_message());
}

grpc::Status WorkerError(grpc::ServerContext* ctx, const Status& s, const char* fault) {
  if (s.ok()) return grpc::Status::OK;
  ctx->AddTrailingMetadata(kFaultKey, fault);
  return ToGrpc(s);
}

namespace {
Result<std::string> ReadPem(const std::string& path, const std::string& what) {
  std::ifstream in(path);
  std::stringstream ss;
  ss << in.rdbuf();
  if (!in || ss.str().empty()) return NotFound("security.tls." + what + " " + path + ": cannot read");
  // gRPC takes any bytes and fails each connection later with "empty address list".
  if (ss.str().find("-----BEGIN ") == std::string::npos)
    return InvalidArgument("security.tls." + what + " " + path + ": not a PEM file (no -----BEGIN line)");
  return ss.str();
}

// A ChannelArguments takes each argument once: a second Set... of it is ignored.
grpc::ChannelArguments ReconnectingArgs(int max_receive_bytes) {
  grpc::ChannelArguments args;
  args.SetMaxReceiveMessageSize(max_receive_bytes);
  args.SetMaxSendMessageSize(-1);
  args.SetInt(GRPC_ARG_INITIAL_RECONNECT_BACKOFF_MS, 100);
  args.SetInt(GRPC_ARG_MAX_RECONNECT_BACKOFF_MS, 500);
  args.SetInt(GRPC_ARG_DNS_MIN_TIME_BETWEEN_RESOLUTIONS_MS, 100);
  return args;
}
}  // namespace

Result<std::shared_ptr<grpc::ServerCredentials>> ServerCredentialsFor(const TlsFiles& tls,
                                                                      bool require_client_cert) {
  if (!tls.enabled()) return grpc::InsecureServerCredentials();
  grpc::SslServerCredentialsOptions o(require_client_cert
                                          ? GRPC_SSL_REQUEST_AND_REQUIRE_CLIENT_CERTIFICATE_AND_VERIFY
                                          : GRPC_SSL_DONT_REQUEST_CLIENT_CERTIFICATE);
  FM_ASSIGN_OR_RETURN(o.pem_root_certs, ReadPem(tls.ca, "ca"));
  grpc::SslServerCredentialsOptions::PemKeyCertPair pair;
  FM_ASSIGN_OR_RETURN(pair.private_key, ReadPem(tls.key, "key"));
  FM_ASSIGN_OR_RETURN(pair.cert_chain, ReadPem(tls.cert, "cert"));
  o.pem_key_cert_pairs.push_back(pair);
  return grpc::SslServerCredentials(o);
}

grpc::ChannelArguments ReconnectingChannelArgs() { return ReconnectingArgs(-1); }

grpc::ChannelArguments WorkerChannelArgs() { return ReconnectingArgs(kWorkerMaxReplyBytes); }

Result<std::shared_ptr<grpc::ChannelCredentials>> ChannelCredentialsFor(const TlsFiles& tls) {
  if (tls.ca.empty()) return grpc::InsecureChannelCredentials();
  grpc::SslCredentialsOptions o;
  FM_ASSIGN_OR_RETURN(o.pem_root_certs, ReadPem(tls.ca, "ca"));
  if (!tls.cert.empty()) {
    FM_ASSIGN_OR_RETURN(o.pem_private_key, ReadPem(tls.key, "key"));
    FM_ASSIGN_OR_RETURN(o.pem_cert_chain, ReadPem(tls.cert, "cert"));
  }
  return grpc::SslCredentials(o);
}

Result<std::unique_ptr<grpc::Server>> StartGrpcServer(
    const std::string& listen, grpc::Service* service, int* bound_port, int max_request_bytes,
    std::shared_ptr<grpc::ServerCredentials> credentials) {
  grpc::ServerBuilder builder;
  builder.AddListeningPort(listen, credentials, bound_port);
  // gRPC binds with SO_REUSEPORT by default: a second daemon on a port in use would share it,
  // the kernel spreading connections between the two, instead of failing to start.
  builder.AddChannelArgument(GRPC_ARG_ALLOW_REUSEPORT, 0);
  // Descriptors are not left to clients that leak them: a connection that has not finished its
  // handshake within kHandshakeTimeout, or has had no call for kConnectionIdle, is closed (an
  // idle client reconnects on its next call, as gRPC clients do after a GOAWAY).
  builder.AddChannelArgument(GRPC_ARG_SERVER_HANDSHAKE_TIMEOUT_MS,
                             static_cast<int>(kHandshakeTimeout.count()));
  builder.AddChannelArgument(GRPC_ARG_MAX_CONNECTION_IDLE_MS, static_cast<int>(kConnectionIdle.count()));
  builder.SetMaxReceiveMessageSize(max_request_bytes);
  builder.SetMaxSendMessageSize(-1);
  builder.RegisterService(service);
  std::unique_ptr<grpc::Server> server = builder.BuildAndStart();
  if (!server || *bound_port == 0)
    return Unavailable("cannot listen on " + listen + " (address in use or invalid)");
  return server;
}

}  // namespace fm
