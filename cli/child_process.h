// Child `flashmesh` processes of `up` and `bench cluster`: fork + exec of this binary with the
// signal mask cleared, and a bounded stop (SIGTERM, then SIGKILL after a grace period).
#pragma once
#include <sys/types.h>

#include <chrono>
#include <string>
#include <vector>

#include "common/status.h"

namespace fm::cli {

struct Child {
  std::string name;   // for logs: "worker w0", "coordinator"
  pid_t pid = -1;     // -1 once reaped
};

// Runs /proc/self/exe with `args` (args[0] is the program name) in a new child process.
// `quiet_stdout`: the child's stdout goes to stderr (keeps the parent's stdout for its report).
Result<pid_t> SpawnSelf(const std::vector<std::string>& args, bool quiet_stdout = false);

// SIGTERM to every live child, waits up to `grace`, then SIGKILL; every child is reaped.
void StopAll(std::vector<Child>& children, std::chrono::milliseconds grace);

// True if `c` has exited (then reaped, pid set to -1); `status` gets waitpid's status.
bool Exited(Child& c, int* status);

}  // namespace fm::cli
