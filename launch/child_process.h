// Child processes of the `flashmesh` binary, for everything that starts some: `up` and
// `bench cluster` (launch/local_cluster.h) and the integration tests' fixture. One place
// forks, execs with a cleared signal mask, redirects the output, reaps, and stops (SIGTERM,
// then SIGKILL after a grace period).
#pragma once
#include <sys/types.h>

#include <chrono>
#include <memory>
#include <string>
#include <vector>

#include "common/status.h"

namespace fm {

struct ChildOutput {
  std::string log_path;           // "": the parent's stdout and stderr; else both appended here
  bool stdout_to_stderr = false;  // without log_path: keeps the parent's stdout for its report
};

class ChildProcess {
 public:
  // Runs `binary` with `args` (argv[1..]; argv[0] is the binary) in a new process. `name` is
  // for logs ("worker w0", "coordinator"). The child gets SIGTERM when the thread that started
  // it ends (PR_SET_PDEATHSIG), so start children from a thread that outlives them (main).
  // Errors: fork failed.
  static Result<std::unique_ptr<ChildProcess>> Start(std::string name, const std::string& binary,
                                                     const std::vector<std::string>& args,
                                                     const ChildOutput& output = {});
  // A child still running is killed (SIGKILL) and reaped: none outlives its handle.
  ~ChildProcess();
  ChildProcess(const ChildProcess&) = delete;
  ChildProcess& operator=(const ChildProcess&) = delete;

  const std::string& name() const { return name_; }
  const std::string& log_path() const { return log_path_; }
  pid_t pid() const { return pid_; }
  void Signal(int sig);
  // False once the child has exited (it is then reaped and exit_code() is set).
  bool Running();
  // The exit status, or 128 + the signal that ended it; -1 while it runs.
  int exit_code() const { return exit_code_; }
  // exit_code() for people: "status 1", "signal 9".
  std::string exit_text() const {
    return exit_code_ >= 128 ? "signal " + std::to_string(exit_code_ - 128)
                             : "status " + std::to_string(exit_code_);
  }
  // Waits up to `timeout` for the exit: exit_code(), or -1 on timeout.
  int Wait(std::chrono::milliseconds timeout);

 private:
  ChildProcess(std::string name, pid_t pid, std::string log_path)
      : name_(std::move(name)), pid_(pid), log_path_(std::move(log_path)) {}
  std::string name_;
  pid_t pid_;
  std::string log_path_;
  int exit_code_ = -1;
};

// SIGTERM to every running child, waits up to `grace` for them all, then SIGKILLs the rest.
void StopAll(std::vector<std::unique_ptr<ChildProcess>>& children, std::chrono::milliseconds grace);

// This process's own binary (/proc/self/exe): what `up` and `bench cluster` start.
std::string SelfBinary();

// A TCP port on 127.0.0.1 that nobody listens on right now, never the same twice per
// process (two fresh servers of one run cannot be handed the same port) nor to two processes
// at once (an abstract Unix socket per port, held until exit: one descriptor per port handed
// out), and below
// the kernel's ephemeral range when there is room: no outgoing connection takes it before the
// server it is for binds it.
Result<int> FreeLoopbackPort();

}  // namespace fm
