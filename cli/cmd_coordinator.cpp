// flashmesh coordinator --config FILE [--model DIR]
#include <cstdio>

#include "cli/commands.h"
#include "cli/daemon_flags.h"
#include "common/log.h"
#include "coordinator/coordinator.h"

namespace fm::cli {

int CmdCoordinator(int argc, char** argv) {
  const char* usage =
      "usage: flashmesh coordinator --config FILE [--model DIR] [--log-level LEVEL]\n"
      "  validates the cluster YAML and the plan, loads every worker's shard, serves the\n"
      "  Inference API on coordinator.listen. Stops on SIGINT/SIGTERM.\n";
  auto flags = Flags::Parse(argc, argv, {"config", "model", "log-level"}, {"help"});
  if (!flags.ok()) {
    std::fprintf(stderr, "coordinator: %s\n%s", flags.status().message().c_str(), usage);
    return 2;
  }
  if (flags->Has("help")) {
    std::fputs(usage, stdout);
    return 0;
  }
  if (!flags->Has("config")) {
    std::fputs(usage, stderr);
    return 2;
  }
  if (Status s = ApplyLogLevel(*flags); !s.ok()) {
    std::fprintf(stderr, "coordinator: %s\n", s.message().c_str());
    return 2;
  }
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
