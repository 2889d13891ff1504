#include "cli/daemon_flags.h"

#include <signal.h>

#include <cstdlib>

#include "common/log.h"

namespace fm::cli {

Result<Flags> Flags::Parse(int argc, char** argv, const std::set<std::string>& valued,
                           const std::set<std::string>& boolean) {
  Flags f;
  for (int i = 1; i < argc; ++i) {
    std::string a = argv[i];
    if (a.rfind("--", 0) != 0) return InvalidArgument("unexpected argument '" + a + "'");
    std::string name = a.substr(2), value;
    if (size_t eq = name.find('='); eq != std::string::npos) {
      value = name.substr(eq + 1);
      name = name.substr(0, eq);
      if (!valued.count(name)) return InvalidArgument("unknown option --" + name);
    } else if (valued.count(name)) {
      if (i + 1 >= argc) return InvalidArgument("--" + name + " needs a value");
      value = argv[++i];
    } else if (!boolean.count(name)) {
      return InvalidArgument("unknown option --" + name);
    }
    if (f.values_.count(name)) return InvalidArgument("--" + name + " given twice");
    f.values_[name] = value;
  }
  return f;
}

std::string Flags::Get(const std::string& name, const std::string& fallback) const {
  auto it = values_.find(name);
  return it == values_.end() ? fallback : it->second;
}

Result<long long> Flags::GetInt(const std::string& name, long long fallback) const {
  auto it = values_.find(name);
  if (it == values_.end()) return fallback;
  char* end = nullptr;
  long long v = std::strtoll(it->second.c_str(), &end, 10);
  if (it->second.empty() || *end != '\0')
    return InvalidArgument("--" + name + ": '" + it->second + "' is not an integer");
  return v;
}

void BlockShutdownSignals() {
  sigset_t set;
  sigemptyset(&set);
  sigaddset(&set, SIGINT);
  sigaddset(&set, SIGTERM);
  pthread_sigmask(SIG_BLOCK, &set, nullptr);
}

int WaitForShutdownSignal() {
  sigset_t set;
  sigemptyset(&set);
  sigaddset(&set, SIGINT);
  sigaddset(&set, SIGTERM);
  int sig = 0;
  sigwait(&set, &sig);
  return sig;
}

Status ApplyLogLevel(const Flags& flags) {
  if (!flags.Has("log-level")) return Status::Ok();
  LogLevel level;
  if (!ParseLogLevel(flags.Get("log-level"), &level))
    return InvalidArgument("--log-level: '" + flags.Get("log-level") + "' is not debug|info|warn|error");
  SetLogLevel(level);
  return Status::Ok();
}

}  // namespace fm::cli
