// A client of the coordinator's Inference API (status, health, generate --server, bench cluster):
// the channel, and the bearer token from --token-file attached to every call.
#pragma once
#include <grpcpp/grpcpp.h>

#include <memory>
#include <string>

#include "common/status.h"
#include "flashmesh/v1/api.grpc.pb.h"

namespace fm {

struct ApiClient {
  std::unique_ptr<flashmesh::v1::Inference::Stub> stub;
  std::string token;   // "" = no authorization metadata
  // A context with the token and a deadline `timeout_s` from now (<= 0: none).
  std::unique_ptr<grpc::ClientContext> Context(double timeout_s) const;
};

// server: HOST:PORT; token_file: "" or a file whose first non-comment line is the token;
// tls_ca: "" (plain) or the CA file that signed the coordinator's certificate (security.tls).
Result<ApiClient> ConnectApi(const std::string& server, const std::string& token_file,
                             const std::string& tls_ca = "");

}  // namespace fm
