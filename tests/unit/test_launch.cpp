// launch/: which nodes `up` starts here, and that a child never outlives its launcher.
#include <signal.h>
#include <sys/socket.h>
#include <sys/un.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <chrono>
#include <cstddef>
#include <cstdio>
#include <cstring>
#include <fstream>
#include <set>
#include <string>
#include <thread>

#include <gtest/gtest.h>

#include "launch/child_process.h"
#include "launch/local_cluster.h"

namespace fm {
namespace {

// The YAML accepts every 127/8 address as loopback without a secret; `up` must start those
// nodes too (it used to call 127.0.0.2 remote and never start it).
TEST(Launch, LocalHostsAreTheLoopbackAddressesAndAny) {
  for (const char* h : {"127.0.0.1", "127.0.0.2", "127.1.2.3", "localhost", "::1", "0.0.0.0"})
    EXPECT_TRUE(IsLocalHost(h)) << h;
  for (const char* h : {"10.0.0.1", "127.example.com", "128.0.0.1", "spark-a", ""})
    EXPECT_FALSE(IsLocalHost(h)) << h;
}

// True while `pid` exists and is not a zombie (an orphan is reaped by whoever adopts it,
// which in a container may never happen).
bool Alive(pid_t pid) {
  std::ifstream stat("/proc/" + std::to_string(pid) + "/stat");
  std::string line;
  if (!std::getline(stat, line)) return false;
  const size_t close = line.rfind(')');
  return close != std::string::npos && close + 2 < line.size() && line[close + 2] != 'Z';
}

// A launcher killed outright (SIGKILL: no destructor, no handler) takes its children along,
// so no daemon keeps the cluster's ports after a killed `up` or `bench cluster`.
TEST(Launch, AChildDiesWithItsLauncher) {
  int fds[2];
  ASSERT_EQ(pipe(fds), 0);
  const pid_t launcher = fork();
  ASSERT_GE(launcher, 0);
  if (launcher == 0) {
    close(fds[0]);
    auto child = ChildProcess::Start("sleeper", "/bin/sleep", {"30"});
    const pid_t pid = child.ok() ? (*child)->pid() : -1;
    if (write(fds[1], &pid, sizeof pid) != sizeof pid) _exit(1);
    pause();
    _exit(0);
  }
  close(fds[1]);
  pid_t child = -1;
  const ssize_t got = read(fds[0], &child, sizeof child);
  close(fds[0]);
  if (got != static_cast<ssize_t>(sizeof child) || child <= 0) {
    // The launcher waits in pause(): end it before failing, or it holds ctest's output open.
    kill(launcher, SIGKILL);
    waitpid(launcher, nullptr, 0);
    FAIL() << "the launcher did not report its child (read " << got << ", pid " << child << ")";
  }
  EXPECT_TRUE(Alive(child));
  kill(launcher, SIGKILL);
  waitpid(launcher, nullptr, 0);
  const auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(10);
  while (Alive(child) && std::chrono::steady_clock::now() < deadline)
    std::this_thread::sleep_for(std::chrono::milliseconds(20));
  EXPECT_FALSE(Alive(child)) << "pid " << child << " outlived its launcher";
  if (Alive(child)) kill(child, SIGKILL);
}

// Test processes side by side (ctest -j) must not be handed the same port, and no outgoing
// connection may take one before its server binds it.
TEST(Launch, AFreePortIsReservedAgainstOtherProcessesAndBelowTheEphemeralRange) {
  int low = 32768, high = 60999;
  if (FILE* f = std::fopen("/proc/sys/net/ipv4/ip_local_port_range", "r")) {
    ASSERT_EQ(std::fscanf(f, "%d %d", &low, &high), 2);
    std::fclose(f);
  }
  std::set<int> seen;
  for (int i = 0; i < 20; ++i) {
    auto port = FreeLoopbackPort();
    ASSERT_TRUE(port.ok()) << port.status().ToString();
    EXPECT_TRUE(seen.insert(*port).second) << *port;
    if (low - std::max(10000, low - 16384) >= 1024) {
      EXPECT_LT(*port, low);
      EXPECT_GE(*port, 10000);
    }
    // Another process's claim on it (the same abstract socket name) is refused while this
    // process lives.
    const int fd = socket(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0);
    ASSERT_GE(fd, 0);
    sockaddr_un addr{};
    addr.sun_family = AF_UNIX;
    const std::string name = "flashmesh-port-" + std::to_string(*port);
    std::memcpy(addr.sun_path + 1, name.data(), name.size());
    const auto len = static_cast<socklen_t>(offsetof(sockaddr_un, sun_path) + 1 + name.size());
    EXPECT_NE(bind(fd, reinterpret_cast<sockaddr*>(&addr), len), 0) << "port " << *port << " not reserved";
    EXPECT_EQ(errno, EADDRINUSE);
    close(fd);
  }
}

}  // namespace
}  // namespace fm
