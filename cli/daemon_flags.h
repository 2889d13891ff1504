// Flag parsing and process lifetime shared by the daemon subcommands (worker, coordinator,
// serve, up, status, health): "--name value" / "--flag" options, and waiting for SIGINT/SIGTERM.
#pragma once
#include <map>
#include <set>
#include <string>
#include <vector>

#include "common/status.h"

namespace fm::cli {

class Flags {
 public:
  // Parses argv[1..); `valued` take one argument, `boolean` none. Unknown or repeated
  // options and stray arguments are errors naming them.
  static Result<Flags> Parse(int argc, char** argv, const std::set<std::string>& valued,
                             const std::set<std::string>& boolean);
  bool Has(const std::string& name) const { return values_.count(name) > 0; }
  std::string Get(const std::string& name, const std::string& fallback = "") const;
  // An integer option; InvalidArgument naming it when it is not one.
  Result<long long> GetInt(const std::string& name, long long fallback) const;

 private:
  std::map<std::string, std::string> values_;
};

// Blocks SIGINT and SIGTERM in the calling thread (call first in main, before any thread
// starts, so every thread inherits the mask); WaitForShutdownSignal then returns the signal.
void BlockShutdownSignals();
int WaitForShutdownSignal();

// --log-level LEVEL (debug|info|warn|error), when given.
Status ApplyLogLevel(const Flags& flags);

}  // namespace fm::cli
