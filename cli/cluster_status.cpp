#include "cli/cluster_status.h"

#include <cstdio>

#include "coordinator/api_client.h"
#include "rpc/grpc_status.h"

namespace fm::cli {

std::optional<flashmesh::v1::ClusterStatusResponse> FetchClusterStatus(const char* cmd,
                                                                      const Flags& flags,
                                                                      std::FILE* down,
                                                                      int* exit_code) {
  auto client = ConnectApi(flags.Get("server"), flags.Get("token-file"), flags.Get("tls-ca"));
  if (!client.ok()) {
    std::fprintf(stderr, "%s: %s\n", cmd, client.status().message().c_str());
    *exit_code = kExitCannotAsk;
    return std::nullopt;
  }
  flashmesh::v1::ClusterStatusRequest req;
  flashmesh::v1::ClusterStatusResponse resp;
  auto ctx = client->Context(5);
  const grpc::Status s = client->stub->ClusterStatus(ctx.get(), req, &resp);
  if (s.error_code() == grpc::StatusCode::UNAUTHENTICATED ||
      s.error_code() == grpc::StatusCode::PERMISSION_DENIED) {
    std::fprintf(stderr, "%s: coordinator %s refused the credentials: %s\n", cmd,
                 flags.Get("server").c_str(), s.error_message().c_str());
    *exit_code = kExitCannotAsk;
    return std::nullopt;
  }
  // A typo, not an outage: a worker's control port (UNIMPLEMENTED), or an HTTP/1 port such as
  // the coordinator's own --http (gRPC's transport says so in its message, whatever the code).
  if (s.error_code() == grpc::StatusCode::UNIMPLEMENTED ||
      s.error_message().find("http1.x server") != std::string::npos) {
    std::fprintf(stderr, "%s: %s is not a coordinator's API: %s\n", cmd, flags.Get("server").c_str(),
                 GrpcErrorText(s).c_str());
    *exit_code = kExitCannotAsk;
    return std::nullopt;
  }
  if (!s.ok()) {
    std::fprintf(down, "down: coordinator %s: %s\n", flags.Get("server").c_str(),
                 GrpcErrorText(s).c_str());
    *exit_code = kExitDown;
    return std::nullopt;
  }
  return resp;
}

const char* StateName(flashmesh::v1::NodeState s) {
  switch (s) {
    case flashmesh::v1::NODE_STATE_WAITING: return "waiting";
    case flashmesh::v1::NODE_STATE_LOADING: return "loading";
    case flashmesh::v1::NODE_STATE_UP: return "up";
    case flashmesh::v1::NODE_STATE_DOWN: return "down";
    case flashmesh::v1::NODE_STATE_DRAINING: return "draining";
    default: return "unknown";
  }
}

}  // namespace fm::cli
