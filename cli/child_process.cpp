#include "cli/child_process.h"

#include <signal.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cstdio>
#include <thread>

#include "common/log.h"

namespace fm::cli {

Result<pid_t> SpawnSelf(const std::vector<std::string>& args, bool quiet_stdout) {
  std::vector<char*> argv;
  for (const auto& a : args) argv.push_back(const_cast<char*>(a.c_str()));
  argv.push_back(nullptr);
  pid_t pid = fork();
  if (pid < 0) return Internal("fork failed");
  if (pid == 0) {
    sigset_t none;
    sigemptyset(&none);
    pthread_sigmask(SIG_SETMASK, &none, nullptr);
    if (quiet_stdout) dup2(STDERR_FILENO, STDOUT_FILENO);
    execv("/proc/self/exe", argv.data());
    std::perror("flashmesh: exec");
    _exit(127);
  }
  return pid;
}

bool Exited(Child& c, int* status) {
  if (c.pid <= 0) return true;
  int st = 0;
  const pid_t r = waitpid(c.pid, &st, WNOHANG);
  if (r != c.pid && r >= 0) return false;
  if (status) *status = st;
  c.pid = -1;
  return true;
}

void StopAll(std::vector<Child>& children, std::chrono::milliseconds grace) {
  for (auto& c : children)
    if (c.pid > 0) kill(c.pid, SIGTERM);
  const auto deadline = std::chrono::steady_clock::now() + grace;
  for (auto& c : children) {
    while (!Exited(c, nullptr)) {
      if (std::chrono::steady_clock::now() > deadline) {
        FM_LOG(kWarn, "cli") << c.name << " did not stop in time; killing it";
        kill(c.pid, SIGKILL);
        int status = 0;
        waitpid(c.pid, &status, 0);
        c.pid = -1;
        break;
      }
      std::this_thread::sleep_for(std::chrono::milliseconds(20));
    }
  }
}

}  // namespace fm::cli
