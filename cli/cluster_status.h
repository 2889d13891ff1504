// The coordinator's ClusterStatus, as `status` and `health` fetch it (--server, --token-file,
// --tls-ca), so that both treat an unreachable coordinator alike: exit 2 (docs/operations.md).
#pragma once
#include <cstdio>
#include <optional>

#include "cli/flags.h"
#include "flashmesh/v1/api.pb.h"

namespace fm::cli {

// The status, or nullopt when the coordinator did not answer (within 5 s) or the flags name no
// usable connection; then the reason is printed ("down: coordinator HOST:PORT: why" to `down`:
// health's answer goes to stdout, status keeps stdout for its table or JSON; or "<cmd>: why" on
// stderr) and the command exits 2.
std::optional<flashmesh::v1::ClusterStatusResponse> FetchClusterStatus(const char* cmd,
                                                                      const Flags& flags,
                                                                      std::FILE* down);

}  // namespace fm::cli
