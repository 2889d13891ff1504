// The coordinator's ClusterStatus, as `status` and `health` fetch it (--server, --token-file,
// --tls-ca), so that both treat an unreachable coordinator alike (docs/operations.md).
#pragma once
#include <cstdio>
#include <optional>

#include "cli/flags.h"
#include "flashmesh/v1/api.pb.h"

namespace fm::cli {

// health's and status's exit codes besides 0 (healthy) and 1 (degraded): the coordinator did
// not answer, or nothing was asked (a usage error, an unusable --token-file / --tls-ca, the
// coordinator refused the credentials, or --server is not a coordinator's API port): a probe
// tells a typo or a bad token from an outage.
inline constexpr int kExitDown = 2;
inline constexpr int kExitCannotAsk = 3;

// The status, or nullopt with *exit_code set: kExitDown when the coordinator did not answer
// (within 5 s; "down: coordinator HOST:PORT: why" to `down`: health's answer goes to stdout,
// status keeps stdout for its table or JSON), kExitCannotAsk when the flags name no usable
// connection or the coordinator refused the credentials ("<cmd>: why" on stderr).
std::optional<flashmesh::v1::ClusterStatusResponse> FetchClusterStatus(const char* cmd,
                                                                      const Flags& flags,
                                                                      std::FILE* down,
                                                                      int* exit_code);

// "waiting", "loading", "up", "down", "draining" (status's STATE column, health --node).
const char* StateName(flashmesh::v1::NodeState s);

}  // namespace fm::cli
