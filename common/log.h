// One logger for the whole project: levels, a component tag, one line per message to stderr.
#pragma once
#include <sstream>
#include <string>

namespace fm {

enum class LogLevel { kDebug = 0, kInfo = 1, kWarn = 2, kError = 3 };

void SetLogLevel(LogLevel level);
LogLevel GetLogLevel();
// Parses "debug|info|warn|error"; returns false on anything else.
bool ParseLogLevel(const std::string& s, LogLevel* out);
void LogLine(LogLevel level, const char* component, const std::string& msg);

class LogMessage {
 public:
  LogMessage(LogLevel level, const char* component) : level_(level), component_(component) {}
  ~LogMessage() { LogLine(level_, component_, os_.str()); }
  std::ostringstream& stream() { return os_; }

 private:
  LogLevel level_;
  const char* component_;
  std::ostringstream os_;
};

}  // namespace fm

// FM_LOG(kInfo, "worker") << "loaded " << n << " tensors";
#define FM_LOG(level, component)                                  \
  if (::fm::LogLevel::level < ::fm::GetLogLevel()) {              \
  } else                                                          \
    ::fm::LogMessage(::fm::LogLevel::level, component).stream()
