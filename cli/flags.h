// The one command-line parser of every subcommand: "--name value", "--name=value" and "--flag"
// options plus an operand where a command takes one, the --help text generated from the same
// table, and the preamble every subcommand shares (help, errors, --log-level). Also the
// process lifetime of the daemons: waiting for SIGINT/SIGTERM.
#pragma once
#include <cstdint>
#include <limits>
#include <map>
#include <optional>
#include <string>
#include <vector>

#include "common/status.h"

namespace fm::cli {

struct FlagSpec {
  const char* name;        // without "--"
  const char* value;       // placeholder of its value ("DIR", "N"); nullptr: a switch
  const char* help;        // for --help; '\n' continues on the next line
  bool required = false;
};

struct CommandSpec {
  const char* name;    // "plan", "bench decode": prefixes its errors, names it in the usage line
  const char* about;   // what it does, under the usage line ('\n'-separated lines)
  std::vector<FlagSpec> flags;   // --log-level and --help are every command's as well
  const char* operand = nullptr;  // placeholder of its one positional argument ("DIR"), if any
};

class Flags {
 public:
  bool Has(const std::string& name) const { return values_.count(name) > 0; }
  std::string Get(const std::string& name, const std::string& fallback = "") const;
  // An integer option in [min, max]; InvalidArgument naming the flag and the value otherwise.
  Result<int64_t> GetInt(const std::string& name, int64_t fallback, int64_t min = 0,
                         int64_t max = std::numeric_limits<int64_t>::max()) const;
  // A seed: any unsigned 64-bit integer (0 when absent); InvalidArgument naming the flag.
  Result<uint64_t> GetSeed(const std::string& name) const;
  // A finite number (strtof: the float nearest the text); InvalidArgument naming the flag
  // otherwise.
  Result<float> GetFloat(const std::string& name, float fallback) const;
  const std::string& operand() const { return operand_; }   // "" when not given

 private:
  friend Result<Flags> ParseFlags(const CommandSpec& spec, int argc, char** argv);
  std::map<std::string, std::string> values_;
  std::string operand_;
};

// A comma-separated list of token ids ("3,17,42"), the value of `flag`; InvalidArgument naming
// the flag, the item's index and its text otherwise.
Result<std::vector<int32_t>> ParseTokenIds(const std::string& flag, const std::string& list);

// Parses argv[1..) (argv[0] is the subcommand) against `spec`. Errors name what is wrong:
// "unknown option --x", "--x needs a value", "--x given twice" (a valued one; a switch may
// repeat), "unexpected argument 'y'",
// "--x is required", "DIR is required".
Result<Flags> ParseFlags(const CommandSpec& spec, int argc, char** argv);
// "usage: flashmesh NAME REQUIRED... [options] [OPERAND]", the about text, then every option.
std::string HelpText(const CommandSpec& spec);

// The preamble of every subcommand: parses the command line; with --help (or -h) prints the
// help on stdout (exit 0); on an error prints "NAME: error" and the help on stderr (exit 2);
// applies --log-level. Returns the flags, or nullopt with *exit_code to return.
std::optional<Flags> StartCommand(const CommandSpec& spec, int argc, char** argv, int* exit_code);
// A usage error found after parsing (a bad combination or value): "NAME: message" and the
// help on stderr; returns 2, the exit code of usage errors.
int UsageError(const CommandSpec& spec, const std::string& message);

// The most kernel threads a command takes (--threads): a larger count is a typo, and creating
// it would end the process when the system refuses threads.
constexpr int64_t kMaxThreads = 1024;

// Blocks SIGINT and SIGTERM in the calling thread (call first in main, before any thread
// starts, so every thread inherits the mask); WaitForShutdownSignal then returns the signal.
void BlockShutdownSignals();
int WaitForShutdownSignal();

}  // namespace fm::cli
