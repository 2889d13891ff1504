#include "coordinator/api_client.h"

#include <chrono>

#include "coordinator/api_service.h"
#include "rpc/grpc_status.h"

namespace fm {

std::unique_ptr<grpc::ClientContext> ApiClient::Context(double timeout_s) const {
  auto ctx = std::make_unique<grpc::ClientContext>();
  if (!token.empty()) ctx->AddMetadata("authorization", "Bearer " + token);
  if (timeout_s > 0)
    ctx->set_deadline(std::chrono::system_clock::now() +
                      std::chrono::milliseconds(static_cast<long long>(timeout_s * 1000)));
  return ctx;
}

Result<ApiClient> ConnectApi(const std::string& server, const std::string& token_file,
                             const std::string& tls_ca) {
  if (server.empty() || server.find(':') == std::string::npos)
    return InvalidArgument("--server: '" + server + "' is not HOST:PORT");
  ApiClient c;
  TlsFiles tls;
  tls.ca = tls_ca;
  FM_ASSIGN_OR_RETURN(auto credentials, ChannelCredentialsFor(tls));
  // A client that waits for a starting server (bench cluster, scripts) retries within 0.5 s.
  c.stub = flashmesh::v1::Inference::NewStub(
      grpc::CreateCustomChannel(server, credentials, ReconnectingChannelArgs()));
  if (!token_file.empty()) {
    FM_ASSIGN_OR_RETURN(auto tokens, ReadApiTokens(token_file));
    c.token = tokens.front();
  }
  return c;
}

}  // namespace fm
