#include "cli/flags.h"

#include <signal.h>

#include <charconv>
#include <cmath>
#include <cstdio>
#include <cstdlib>

#include "common/log.h"

namespace fm::cli {
namespace {

// The options every command has besides its own.
const FlagSpec kLogLevel{"log-level", "LEVEL", "debug|info|warn|error (default info)"};
const FlagSpec kHelp{"help", nullptr, "this text"};

const FlagSpec* Find(const CommandSpec& spec, const std::string& name) {
  for (const FlagSpec& f : spec.flags)
    if (name == f.name) return &f;
  if (name == kLogLevel.name) return &kLogLevel;
  if (name == kHelp.name) return &kHelp;
  return nullptr;
}

std::string Left(const FlagSpec& f) {
  return std::string("--") + f.name + (f.value ? std::string(" ") + f.value : "");
}

bool IsHelp(const std::string& a) { return a == "--help" || a == "-h"; }

}  // namespace

std::string Flags::Get(const std::string& name, const std::string& fallback) const {
  auto it = values_.find(name);
  return it == values_.end() ? fallback : it->second;
}

Result<int64_t> Flags::GetInt(const std::string& name, int64_t fallback, int64_t min,
                              int64_t max) const {
  auto it = values_.find(name);
  if (it == values_.end()) return fallback;
  const std::string& v = it->second;
  int64_t n = 0;
  const auto [end, ec] = std::from_chars(v.data(), v.data() + v.size(), n);
  if (v.empty() || ec != std::errc() || end != v.data() + v.size() || n < min || n > max) {
    const std::string range = max == std::numeric_limits<int64_t>::max()
                                  ? ">= " + std::to_string(min)
                                  : "in [" + std::to_string(min) + ", " + std::to_string(max) + "]";
    return InvalidArgument("--" + name + ": '" + v + "' is not an integer " + range);
  }
  return n;
}

Result<uint64_t> Flags::GetSeed(const std::string& name) const {
  auto it = values_.find(name);
  if (it == values_.end()) return uint64_t{0};
  const std::string& v = it->second;
  uint64_t n = 0;
  const auto [end, ec] = std::from_chars(v.data(), v.data() + v.size(), n);
  if (v.empty() || ec != std::errc() || end != v.data() + v.size())
    return InvalidArgument("--" + name + ": '" + v + "' is not an integer in [0, 2^64)");
  return n;
}

Result<float> Flags::GetFloat(const std::string& name, float fallback) const {
  auto it = values_.find(name);
  if (it == values_.end()) return fallback;
  const std::string& v = it->second;
  char* end = nullptr;
  const float x = std::strtof(v.c_str(), &end);
  if (v.empty() || *end || !std::isfinite(x))
    return InvalidArgument("--" + name + ": '" + v + "' is not a number");
  return x;
}

Result<std::vector<int32_t>> ParseTokenIds(const std::string& flag, const std::string& list) {
  std::vector<int32_t> ids;
  size_t pos = 0;
  while (pos <= list.size()) {
    const size_t comma = list.find(',', pos);
    const std::string item =
        list.substr(pos, comma == std::string::npos ? std::string::npos : comma - pos);
    int32_t id = 0;
    const auto [end, ec] = std::from_chars(item.data(), item.data() + item.size(), id);
    if (item.empty() || ec != std::errc() || end != item.data() + item.size() || id < 0)
      return InvalidArgument("--" + flag + "[" + std::to_string(ids.size()) + "]: '" + item +
                             "' is not a token id (an integer in [0, 2147483647])");
    ids.push_back(id);
    if (comma == std::string::npos) break;
    pos = comma + 1;
  }
  return ids;
}

Result<Flags> ParseFlags(const CommandSpec& spec, int argc, char** argv) {
  Flags f;
  for (int i = 1; i < argc; ++i) {
    const std::string a = argv[i];
    if (a.rfind("--", 0) != 0 || a == "--") {
      if (spec.operand && f.operand_.empty() && !a.empty() && a[0] != '-') {
        f.operand_ = a;
        continue;
      }
      return InvalidArgument("unexpected argument '" + a + "'");
    }
    std::string name = a.substr(2), value;
    const size_t eq = name.find('=');
    if (eq != std::string::npos) name.resize(eq);
    const FlagSpec* flag = Find(spec, name);
    if (!flag) return InvalidArgument("unknown option --" + name);
    if (eq != std::string::npos) {
      if (!flag->value) return InvalidArgument("--" + name + " takes no value");
      value = a.substr(2 + eq + 1);
    } else if (flag->value) {
      if (i + 1 >= argc) return InvalidArgument("--" + name + " needs a value");
      value = argv[++i];
    }
    // A switch may repeat (it says the same thing twice); a second value contradicts the first.
    if (flag->value && f.values_.count(name)) return InvalidArgument("--" + name + " given twice");
    f.values_[name] = value;
  }
  if (f.Has("help")) return f;   // help needs nothing else
  for (const FlagSpec& flag : spec.flags)
    if (flag.required && !f.Has(flag.name))
      return InvalidArgument("--" + std::string(flag.name) + " is required");
  if (spec.operand && f.operand_.empty())
    return InvalidArgument(std::string(spec.operand) + " is required");
  return f;
}

std::string HelpText(const CommandSpec& spec) {
  std::string usage = std::string("usage: flashmesh ") + spec.name;
  for (const FlagSpec& f : spec.flags)
    if (f.required) usage += " " + Left(f);
  usage += " [options]";
  if (spec.operand) usage += std::string(" ") + spec.operand;
  std::string out = usage + "\n";
  for (const char* p = spec.about; *p;) {   // indent every line of the about text
    const char* nl = p;
    while (*nl && *nl != '\n') ++nl;
    out += "  " + std::string(p, nl) + "\n";
    p = *nl ? nl + 1 : nl;
  }
  out += "options:\n";
  std::vector<const FlagSpec*> all;
  for (const FlagSpec& f : spec.flags) all.push_back(&f);
  all.push_back(&kLogLevel);
  all.push_back(&kHelp);
  size_t width = 0;
  for (const FlagSpec* f : all) width = std::max(width, Left(*f).size());
  for (const FlagSpec* f : all) {
    std::string left = Left(*f);
    left.resize(width, ' ');
    std::string help = f->help;
    if (f->required) help += " (required)";
    // Continuation lines of the help line up under its first line.
    for (size_t at = help.find('\n'); at != std::string::npos; at = help.find('\n', at + 1))
      help.insert(at + 1, std::string(width + 4, ' '));
    out += "  " + left + "  " + help + "\n";
  }
  return out;
}

int UsageError(const CommandSpec& spec, const std::string& message) {
  std::fprintf(stderr, "%s: %s\n%s", spec.name, message.c_str(), HelpText(spec).c_str());
  return 2;
}

std::optional<Flags> StartCommand(const CommandSpec& spec, int argc, char** argv, int* exit_code) {
  for (int i = 1; i < argc; ++i) {
    const std::string a = argv[i];
    if (IsHelp(a)) {
      std::fputs(HelpText(spec).c_str(), stdout);
      *exit_code = 0;
      return std::nullopt;
    }
    // The value of an option is not a request for help (`--prompt -h` generates "-h").
    if (a.rfind("--", 0) == 0 && a.find('=') == std::string::npos) {
      const FlagSpec* f = Find(spec, a.substr(2));
      if (f && f->value) ++i;
    }
  }
  Result<Flags> flags = ParseFlags(spec, argc, argv);
  if (!flags.ok()) {
    *exit_code = UsageError(spec, flags.status().message());
    return std::nullopt;
  }
  if (flags->Has("log-level")) {
    LogLevel level;
    if (!ParseLogLevel(flags->Get("log-level"), &level)) {
      *exit_code = UsageError(spec, "--log-level: '" + flags->Get("log-level") +
                                        "' is not debug|info|warn|error");
      return std::nullopt;
    }
    SetLogLevel(level);
  }
  return std::move(flags).value();
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

}  // namespace fm::cli
