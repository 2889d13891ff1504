#include "launch/child_process.h"

#include <arpa/inet.h>
#include <fcntl.h>
#include <netinet/in.h>
#include <signal.h>
#include <sys/prctl.h>
#include <sys/socket.h>
#include <sys/un.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstddef>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <mutex>
#include <random>
#include <set>
#include <thread>

#include "common/log.h"

namespace fm {

Result<std::unique_ptr<ChildProcess>> ChildProcess::Start(std::string name,
                                                          const std::string& binary,
                                                          const std::vector<std::string>& args,
                                                          const ChildOutput& output) {
  std::vector<char*> argv;
  argv.push_back(const_cast<char*>(binary.c_str()));
  for (const auto& a : args) argv.push_back(const_cast<char*>(a.c_str()));
  argv.push_back(nullptr);
  const pid_t parent = getpid();
  const pid_t pid = fork();
  if (pid < 0) return Internal("fork failed for " + name);
  if (pid == 0) {
    // The child dies with its parent: a launcher killed by a signal (SIGTERM's default action,
    // SIGKILL, a crash) leaves no daemon holding the cluster's ports. Checked after the prctl
    // in case the parent died before it.
    if (prctl(PR_SET_PDEATHSIG, SIGTERM) != 0 || getppid() != parent) _exit(127);
    sigset_t none;
    sigemptyset(&none);
    pthread_sigmask(SIG_SETMASK, &none, nullptr);
    if (!output.log_path.empty()) {
      const int fd = open(output.log_path.c_str(), O_WRONLY | O_CREAT | O_APPEND, 0644);
      if (fd < 0) {
        std::perror(output.log_path.c_str());
        _exit(127);
      }
      dup2(fd, STDOUT_FILENO);
      dup2(fd, STDERR_FILENO);
    } else if (output.stdout_to_stderr) {
      dup2(STDERR_FILENO, STDOUT_FILENO);
    }
    execv(binary.c_str(), argv.data());
    std::perror("flashmesh: exec");
    _exit(127);
  }
  return std::unique_ptr<ChildProcess>(new ChildProcess(std::move(name), pid, output.log_path));
}

ChildProcess::~ChildProcess() {
  if (Running()) {
    kill(pid_, SIGKILL);
    Wait(std::chrono::seconds(10));
  }
}

void ChildProcess::Signal(int sig) {
  if (Running()) kill(pid_, sig);
}

bool ChildProcess::Running() {
  if (exit_code_ >= 0) return false;
  int st = 0;
  const pid_t r = waitpid(pid_, &st, WNOHANG);
  if (r == 0) return true;
  // r < 0: not our child any more (reaped elsewhere); count it as ended by SIGKILL.
  exit_code_ = r < 0 ? 128 + SIGKILL : WIFEXITED(st) ? WEXITSTATUS(st) : 128 + WTERMSIG(st);
  return false;
}

int ChildProcess::Wait(std::chrono::milliseconds timeout) {
  const auto deadline = std::chrono::steady_clock::now() + timeout;
  while (Running()) {
    if (std::chrono::steady_clock::now() > deadline) return -1;
    std::this_thread::sleep_for(std::chrono::milliseconds(10));
  }
  return exit_code_;
}

void StopAll(std::vector<std::unique_ptr<ChildProcess>>& children, std::chrono::milliseconds grace) {
  for (auto& c : children) c->Signal(SIGTERM);
  const auto deadline = std::chrono::steady_clock::now() + grace;
  for (auto& c : children) {
    const auto left = std::chrono::duration_cast<std::chrono::milliseconds>(
        deadline - std::chrono::steady_clock::now());
    if (c->Wait(std::max(left, std::chrono::milliseconds(0))) >= 0) continue;
    FM_LOG(kWarn, "launch") << c->name() << " did not stop in time; killing it";
    c->Signal(SIGKILL);
    c->Wait(std::chrono::seconds(10));
  }
}

std::string SelfBinary() {
  std::error_code ec;
  const auto path = std::filesystem::read_symlink("/proc/self/exe", ec);
  return ec ? "/proc/self/exe" : path.string();
}

namespace {

// The lowest port the kernel hands to outgoing connections (ip_local_port_range): a port below
// it cannot be taken by some process's connect() between our pick and the child's bind.
int EphemeralLow() {
  int low = 32768, high = 60999;
  if (FILE* f = std::fopen("/proc/sys/net/ipv4/ip_local_port_range", "r")) {
    if (std::fscanf(f, "%d %d", &low, &high) != 2) low = 32768;
    std::fclose(f);
  }
  return low;
}

// Binds a TCP socket to 127.0.0.1:port (0: a port the kernel picks) and closes it again: the
// port that was bound, or -1 when none could be (errno says why).
int BindLoopback(int port) {
  const int fd = socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
  if (fd < 0) return -1;
  sockaddr_in addr{};
  addr.sin_family = AF_INET;
  addr.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  addr.sin_port = htons(static_cast<uint16_t>(port));
  socklen_t len = sizeof addr;
  const bool ok = bind(fd, reinterpret_cast<sockaddr*>(&addr), sizeof addr) == 0 &&
                  getsockname(fd, reinterpret_cast<sockaddr*>(&addr), &len) == 0;
  const int saved = errno;
  close(fd);
  errno = saved;
  return ok ? ntohs(addr.sin_port) : -1;
}

// Holds `port` for this process's lifetime against other processes that pick ports here (the
// test binaries ctest runs side by side): a bound abstract Unix socket named after it, which
// the kernel releases when this process exits and which leaves no file behind.
bool Reserve(int port) {
  const int fd = socket(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0);
  if (fd < 0) return true;   // no reservation to be had: the bind check alone
  sockaddr_un addr{};
  addr.sun_family = AF_UNIX;
  const std::string name = "flashmesh-port-" + std::to_string(port);
  std::memcpy(addr.sun_path + 1, name.data(), name.size());   // sun_path[0] == 0: abstract
  const auto len = static_cast<socklen_t>(offsetof(sockaddr_un, sun_path) + 1 + name.size());
  if (bind(fd, reinterpret_cast<sockaddr*>(&addr), len) != 0) {
    const bool taken = errno == EADDRINUSE;
    close(fd);
    return !taken;   // another error (a security policy, say): no reservation to be had
  }
  return true;   // fd stays open: the reservation lasts until this process exits
}

}  // namespace

Result<int> FreeLoopbackPort() {
  static std::mutex mu;
  static std::set<int> handed_out;
  static std::mt19937 rng{std::random_device{}()};
  std::lock_guard<std::mutex> lock(mu);
  // Below the ephemeral range, at random: [max(10000, low - 16384), low).
  const int low = EphemeralLow();
  const int first = std::max(10000, low - 16384);
  if (low - first >= 1024) {
    std::uniform_int_distribution<int> pick(first, low - 1);
    for (int tries = 0; tries < 1000; ++tries) {
      const int port = pick(rng);
      if (handed_out.count(port) || BindLoopback(port) != port || !Reserve(port)) continue;
      handed_out.insert(port);
      return port;
    }
  }
  // No room below the ephemeral range: a port the kernel picks.
  for (int tries = 0; tries < 1000; ++tries) {
    const int port = BindLoopback(0);
    if (port < 0)
      return Internal(std::string("FreeLoopbackPort: no free loopback port: ") + std::strerror(errno));
    if (handed_out.count(port) || !Reserve(port)) continue;
    handed_out.insert(port);
    return port;
  }
  return Internal("FreeLoopbackPort: every loopback port tried is taken or reserved by another process");
}

}  // namespace fm
