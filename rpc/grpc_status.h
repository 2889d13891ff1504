// Glue between flashmesh Status and gRPC, shared by the worker and the coordinator.
#pragma once
#include <chrono>
#include <grpcpp/grpcpp.h>

#include <memory>
#include <string>

#include "common/status.h"

namespace fm {

// Status <-> grpc::Status with the matching code.
grpc::Status ToGrpc(const Status& s);
Status FromGrpc(const grpc::Status& s, const std::string& context);
Status FromGrpc(const grpc::Status& s);
// A failed call's message for a person: gRPC's own, or, when it says nothing (a server that
// does not serve the method answers UNIMPLEMENTED with no text), the code and what it means.
std::string GrpcErrorText(const grpc::Status& s);

// A worker marks every error it returns itself with this trailing metadata key, so that the
// coordinator tells "the worker answered with an error" from "the worker did not answer" by
// the status, never by its text. The value says what kind of error it is.
inline constexpr char kFaultKey[] = "fm-fault";
inline constexpr char kFaultWorker[] = "worker";
// The call names a sequence the worker does not hold (it was reset or restarted meanwhile).
inline constexpr char kFaultLostSequences[] = "lost-sequences";
// The worker follows a newer coordinator (a higher term): the caller is to step down.
inline constexpr char kFaultSuperseded[] = "superseded";
grpc::Status WorkerError(grpc::ServerContext* ctx, const Status& s, const char* fault = kFaultWorker);

// PEM files of security.tls: this process's certificate and key, and the CA that signed the
// cluster's certificates. All empty: no TLS.
struct TlsFiles {
  std::string cert, key, ca;
  bool enabled() const { return !cert.empty(); }
};
// Server credentials: TLS with cert/key (and, when `require_client_cert`, only clients whose
// certificate the CA signed: the worker control plane); insecure without TLS. Errors name
// the file that cannot be read.
Result<std::shared_ptr<grpc::ServerCredentials>> ServerCredentialsFor(const TlsFiles& tls,
                                                                      bool require_client_cert);
// Channel credentials: TLS verifying the server against the CA, presenting cert/key when
// set; insecure without TLS.
Result<std::shared_ptr<grpc::ChannelCredentials>> ChannelCredentialsFor(const TlsFiles& tls);

// Channel arguments for a client of a server that may be starting or restarting (the
// CLI's API client): unlimited message sizes, and a reconnect within 0.5 s of a refused connect.
// gRPC's own backoff starts at 1 s, and its pick_first then waits for a re-resolution of the
// address, rate-limited to seconds unless set short here.
grpc::ChannelArguments ReconnectingChannelArgs();

// The largest reply the coordinator takes from a worker. The largest real ones are kilobytes
// (a Health listing its live sequences, Stats' per-expert counts, one token per sequence of a
// step); the cap keeps a misbehaving worker from making the coordinator allocate gigabytes.
inline constexpr int kWorkerMaxReplyBytes = 16 << 20;

// ReconnectingChannelArgs for the coordinator's worker channels: a larger reply fails its call
// with RESOURCE_EXHAUSTED before it is parsed (the node is then marked down with that error).
grpc::ChannelArguments WorkerChannelArgs();

// A server's connection that has not finished its handshake by then is closed, and so is one
// without a call for kConnectionIdle (StartGrpcServer).
inline constexpr std::chrono::milliseconds kHandshakeTimeout{5000};
inline constexpr std::chrono::milliseconds kConnectionIdle{600000};

// Starts a gRPC server for `service` on `listen` (host:port; port 0 picks one). *bound_port
// gets the port actually bound. Larger request messages are refused (RESOURCE_EXHAUSTED)
// before they are parsed.
Result<std::unique_ptr<grpc::Server>> StartGrpcServer(
    const std::string& listen, grpc::Service* service, int* bound_port, int max_request_bytes,
    std::shared_ptr<grpc::ServerCredentials> credentials = grpc::InsecureServerCredentials());

}  // namespace fm
