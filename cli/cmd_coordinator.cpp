// flashmesh coordinator --config FILE [--model DIR]
#include <cstdio>
#include <optional>

#include "cli/commands.h"
#include "cli/flags.h"
#include "common/log.h"
#include "coordinator/coordinator.h"

namespace fm::cli {

namespace {

const CommandSpec kSpec{
    "coordinator",
    "validates the cluster YAML and the plan, loads every worker's shard, serves the\n"
    "Inference API on coordinator.listen. Stops on SIGINT/SIGTERM.",
    {{"config", "FILE", "the cluster YAML", true},
     {"model", "DIR", "checkpoint directory instead of the YAML's `model`, sent to every worker\n"
                      "that has no --model of its own"}}};

}  // namespace

int CmdCoordinator(int argc, char** argv) {
  int rc = 0;
  const std::optional<Flags> flags = StartCommand(kSpec, argc, argv, &rc);
  if (!flags) return rc;
  BlockShutdownSignals();
  auto cfg = LoadClusterConfig(flags->Get("config"));
  if (!cfg.ok()) {
    std::fprintf(stderr, "coordinator: %s\n", cfg.status().message().c_str());
    return 1;
  }
  auto setup = SetupFromConfig(*cfg, flags->Get("model"));
  if (!setup.ok()) {
    std::fprintf(stderr, "coordinator: %s\n", setup.status().message().c_str());
    return 1;
  }
  auto coord = Coordinator::Start(std::move(setup).value());
  if (!coord.ok()) {
    std::fprintf(stderr, "coordinator: %s\n", coord.status().message().c_str());
    return 1;
  }
  int sig = WaitForShutdownSignal();
  FM_LOG(kInfo, "coordinator") << "stopping (signal " << sig << ")";
  (*coord)->Shutdown();
  return 0;
}

}  // namespace fm::cli
