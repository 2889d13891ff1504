// Glue between flashmesh Status and gRPC, shared by the worker and the coordinator.
#pragma once
#include <grpcpp/grpcpp.h>

#include <memory>
#include <string>

#include "common/status.h"

namespace fm {

// Status <-> grpc::Status with the matching code.
grpc::Status ToGrpc(const Status& s);
Status FromGrpc(const grpc::Status& s, const std::string& context);

// Starts a gRPC server for `service` on `listen` (host:port; port 0 picks one). *bound_port
// gets the port actually bound. Larger request messages are refused (RESOURCE_EXHAUSTED)
// before they are parsed.
Result<std::unique_ptr<grpc::Server>> StartGrpcServer(const std::string& listen,
                                                      grpc::Service* service, int* bound_port,
                                                      int max_request_bytes);

}  // namespace fm
