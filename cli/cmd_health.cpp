// flashmesh health --server HOST:PORT [--node NAME]: exit 0 healthy, 1 degraded, 2 down, 3
// nothing asked (a usage error, unusable credentials).
#include <cstdio>
#include <optional>

#include "cli/cluster_status.h"
#include "cli/commands.h"
#include "cli/flags.h"

namespace fm::cli {

namespace {

const CommandSpec kSpec{
    "health",
    "cluster: exit 0 healthy (docs/operations.md \"Health\"), 1 degraded (the reason is\n"
    "printed: a node not up, a step overdue, a reset in progress, a stray sequence),\n"
    "2 down (coordinator unreachable), 3 nothing asked (a usage error, an unusable\n"
    "--token-file or --tls-ca, credentials the coordinator refused, or a --server that is\n"
    "not a coordinator's API port).",
    {{"server", "HOST:PORT", "the coordinator's API", true},
     {"node", "NAME", "exit 0 if that node is up, 1 if loading/waiting/draining, 2 if down"},
     {"token-file", "FILE", "bearer token file (security.token_file)"},
     {"tls-ca", "FILE", "CA of the coordinator's certificate (security.tls)"}}};

}  // namespace

int CmdHealth(int argc, char** argv) {
  int rc = 0;
  const std::optional<Flags> flags = StartCommand(kSpec, argc, argv, &rc);
  if (!flags) return rc == 0 ? 0 : kExitCannotAsk;   // --help, or a usage error
  const auto status = FetchClusterStatus("health", *flags, stdout, &rc);
  if (!status) return rc;
  const flashmesh::v1::ClusterStatusResponse& resp = *status;
  if (flags->Has("node")) {
    for (const auto& n : resp.nodes()) {
      if (n.name() != flags->Get("node")) continue;
      if (n.state() == flashmesh::v1::NODE_STATE_UP) {
        std::printf("healthy: node %s\n", n.name().c_str());
        return 0;
      }
      bool down = n.state() == flashmesh::v1::NODE_STATE_DOWN;
      std::printf("%s: node %s is %s%s%s\n", down ? "down" : "degraded", n.name().c_str(),
                  StateName(n.state()), n.error().empty() ? "" : ": ", n.error().c_str());
      return down ? kExitDown : 1;
    }
    std::fprintf(stderr, "health: the cluster has no node named '%s'\n", flags->Get("node").c_str());
    return kExitDown;
  }
  if (resp.healthy()) {
    std::printf("healthy: %d node(s) up\n", resp.nodes_size());
    return 0;
  }
  std::printf("degraded: %s\n", resp.reason().c_str());
  return 1;
}

}  // namespace fm::cli
