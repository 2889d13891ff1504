// flashmesh up --config FILE [--model DIR]: a whole local cluster for development: every
// node of the YAML whose control host is this machine as a `flashmesh worker` child, plus
// a `flashmesh coordinator` child. SIGINT/SIGTERM stops them all; so does the coordinator
// exiting (a worker that exits is reported by the coordinator as down).
#include <signal.h>
#include <sys/wait.h>

#include <chrono>
#include <cstdio>
#include <string>
#include <vector>

#include "cli/child_process.h"
#include "cli/commands.h"
#include "cli/daemon_flags.h"
#include "common/log.h"
#include "coordinator/coordinator.h"

namespace fm::cli {
namespace {

constexpr auto kStopGrace = std::chrono::seconds(5);

bool IsLocalHost(const std::string& host) {
  return host == "127.0.0.1" || host == "localhost" || host == "::1" || host == "0.0.0.0";
}

}  // namespace

int CmdUp(int argc, char** argv) {
  const char* usage =
      "usage: flashmesh up --config FILE [--model DIR] [--log-level LEVEL]\n"
      "  starts the coordinator and every worker of FILE whose control host is local\n"
      "  (127.0.0.1, localhost, ::1) as child processes; Ctrl-C stops them all.\n";
  auto flags = Flags::Parse(argc, argv, {"config", "model", "log-level"}, {"help"});
  if (!flags.ok()) {
    std::fprintf(stderr, "up: %s\n%s", flags.status().message().c_str(), usage);
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
    std::fprintf(stderr, "up: %s\n", s.message().c_str());
    return 2;
  }
  // Everything that can be wrong with the YAML or the plan is reported before anything starts.
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
  BlockShutdownSignals();
  std::vector<std::string> common;
  if (flags->Has("model")) common = {"--model", flags->Get("model")};
  if (flags->Has("log-level")) {
    common.push_back("--log-level");
    common.push_back(flags->Get("log-level"));
  }
  std::vector<Child> children;
  auto spawn = [&](const std::string& name, std::vector<std::string> args) {
    args.insert(args.end(), common.begin(), common.end());
    auto pid = SpawnSelf(args);
    if (!pid.ok()) return false;
    children.push_back({name, *pid});
    FM_LOG(kInfo, "up") << "started " << name << " (pid " << *pid << ")";
    return true;
  };
  bool ok = true;
  for (const auto& n : cfg->nodes) {
    if (!IsLocalHost(n.control.host)) {
      FM_LOG(kInfo, "up") << "node " << n.name << " is remote (" << n.control.ToString()
                          << "): start it there with `flashmesh worker`";
      continue;
    }
    ok = ok && spawn("worker " + n.name, {"flashmesh", "worker", "--config", flags->Get("config"),
                                          "--node", n.name});
  }
  ok = ok && spawn("coordinator", {"flashmesh", "coordinator", "--config", flags->Get("config")});
  if (!ok) {
    std::fprintf(stderr, "up: could not start every process\n");
    StopAll(children, kStopGrace);
    return 1;
  }
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
      int status = 0;
      if (c.pid > 0 && Exited(c, &status)) {
        FM_LOG(kError, "up") << c.name << " exited ("
                             << (WIFEXITED(status) ? "status " + std::to_string(WEXITSTATUS(status))
                                                   : "signal " + std::to_string(WTERMSIG(status)))
                             << ")";
        died = died || c.name == "coordinator";   // a dead worker is the coordinator's to report
      }
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
