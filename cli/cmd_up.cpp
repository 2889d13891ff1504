// flashmesh up --config FILE [--model DIR] [--threads N]: a whole local cluster for
// development: every node of the YAML whose control host is this machine as a
// `flashmesh worker` child, plus a `flashmesh coordinator` child. SIGINT/SIGTERM stops them
// all; so does the coordinator exiting (a worker that exits is reported by the coordinator as
// down).
#include <signal.h>

#include <chrono>
#include <memory>
#include <optional>
#include <cstdio>
#include <string>
#include <vector>

#include "cli/commands.h"
#include "cli/flags.h"
#include "common/log.h"
#include "coordinator/coordinator.h"
#include "launch/local_cluster.h"

namespace fm::cli {
namespace {

constexpr auto kStopGrace = std::chrono::seconds(5);

const CommandSpec kSpec{
    "up",
    "starts the coordinator and every worker of FILE whose control host is local\n"
    "(127.0.0.0/8, localhost, ::1, 0.0.0.0) as child processes; Ctrl-C stops them all.",
    {{"config", "FILE", "the cluster YAML", true},
     {"model", "DIR", "checkpoint directory instead of the YAML's `model`"},
     {"threads", "N", "kernel threads of each local worker (default: all cores each; workers\n"
                      "that step at once, as under many streams, may want cores / workers)"}}};

}  // namespace

int CmdUp(int argc, char** argv) {
  int rc = 0;
  const std::optional<Flags> flags = StartCommand(kSpec, argc, argv, &rc);
  if (!flags) return rc;
  // Before any thread starts (gRPC's credentials below start some), so that no thread takes
  // SIGINT/SIGTERM by their default action.
  BlockShutdownSignals();
  // Everything that can be wrong with the YAML or the plan is reported before anything starts.
  auto threads = flags->GetInt("threads", 0, 1, kMaxThreads);
  if (!threads.ok()) return UsageError(kSpec, threads.status().message());
  auto cfg = LoadClusterConfig(flags->Get("config"));
  if (!cfg.ok()) {
    std::fprintf(stderr, "up: %s\n", cfg.status().message().c_str());
    return 1;
  }
  auto setup = SetupFromConfig(*cfg, flags->Get("model"));
  if (!setup.ok()) {
    std::fprintf(stderr, "up: %s\n", setup.status().message().c_str());
    return 1;
  }
  LocalClusterArgs args;
  args.config_path = flags->Get("config");
  if (flags->Has("model")) args.worker_args = {"--model", flags->Get("model")};
  if (flags->Has("log-level"))
    args.worker_args.insert(args.worker_args.end(), {"--log-level", flags->Get("log-level")});
  args.coordinator_args = args.worker_args;
  if (flags->Has("threads"))
    args.worker_args.insert(args.worker_args.end(), {"--threads", std::to_string(*threads)});
  auto started = StartLocalCluster(*cfg, args);
  if (!started.ok()) {
    std::fprintf(stderr, "up: could not start every process: %s\n",
                 started.status().message().c_str());
    return 1;   // the children started so far are killed with their handles
  }
  std::vector<std::unique_ptr<ChildProcess>>& children = *started;
  // Wait for a signal or for any child to exit, whichever comes first.
  sigset_t set;
  sigemptyset(&set);
  sigaddset(&set, SIGINT);
  sigaddset(&set, SIGTERM);
  int exit_code = 0;
  while (true) {
    timespec tick{0, 200 * 1000 * 1000};
    int sig = sigtimedwait(&set, nullptr, &tick);
    if (sig > 0) {
      FM_LOG(kInfo, "up") << "signal " << sig << ": stopping " << children.size() << " processes";
      break;
    }
    bool died = false;
    for (auto& c : children) {
      if (c->exit_code() >= 0 || c->Running()) continue;   // reported once, when it exits
      // A worker ends with an error status of its own only when it could not start (a port in
      // use, a bad secret file): the cluster cannot come up. One that crashed or was killed is
      // the coordinator's to report (the node is down) and may be started again.
      const bool could_not_start = c->exit_code() > 0 && c->exit_code() < 128;
      FM_LOG(kError, "up") << c->name() << " exited (" << c->exit_text() << ")"
                           << (could_not_start && c->name() != "coordinator"
                                   ? ": it could not start, so the cluster cannot; stopping"
                                   : "");
      died = died || c->name() == "coordinator" || could_not_start;
    }
    if (died) {
      exit_code = 1;
      break;
    }
  }
  StopAll(children, kStopGrace);
  return exit_code;
}

}  // namespace fm::cli
