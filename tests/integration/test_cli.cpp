// Every subcommand parses its command line with the one parser (cli/flags.h): an unknown flag
// is the same usage error everywhere, naming the flag, and --help is generated.
#include <gtest/gtest.h>
#include <sys/wait.h>

#include <cstdio>
#include <string>

#include "tests/integration/cluster_fixture.h"

namespace fm::it {
namespace {

const char* const kCommands[] = {"mkmodel", "inspect", "serve", "coordinator", "worker", "up", "drain",
                                 "status", "health", "plan", "generate", "logits"};

TEST(Cli, AnUnknownFlagIsTheSameErrorInEveryCommand) {
  std::string out;
  for (const std::string command : kCommands) {
    // health and status: 3, since their 2 says the coordinator is down.
    const int usage = command == "health" || command == "status" ? 3 : 2;
    EXPECT_EQ(RunFlashmesh({command, "--no-such-flag"}, &out), usage) << command << ":\n" << out;
    EXPECT_NE(out.find(command + ": unknown option --no-such-flag\n"), std::string::npos)
        << command << ":\n" << out;
    EXPECT_NE(out.find("usage: flashmesh " + command), std::string::npos) << out;
  }
  for (const std::string mode : {"decode", "cluster"}) {
    EXPECT_EQ(RunFlashmesh({"bench", mode, "--no-such-flag=1"}, &out), 2) << out;
    EXPECT_NE(out.find("bench " + mode + ": unknown option --no-such-flag\n"), std::string::npos)
        << out;
  }
}

TEST(Cli, HelpComesFromTheTableOfEveryCommand) {
  std::string out;
  for (const std::string command : kCommands) {
    EXPECT_EQ(RunFlashmesh({command, "--help"}, &out), 0) << command << ":\n" << out;
    EXPECT_EQ(out.rfind("usage: flashmesh " + command, 0), 0u) << out;
    EXPECT_NE(out.find("\noptions:\n"), std::string::npos) << out;
    EXPECT_NE(out.find("  --log-level LEVEL"), std::string::npos) << out;
  }
  EXPECT_EQ(RunFlashmesh({"bench", "decode", "--help"}, &out), 0) << out;
  EXPECT_NE(out.find("  --streams B"), std::string::npos) << out;
}

// stdout of `flashmesh ARGS` (stderr dropped) and its exit code.
std::string StdoutOf(const std::string& args, int* code) {
  FILE* p = popen((FlashmeshBinary() + " " + args + " 2>/dev/null").c_str(), "r");
  std::string out;
  if (!p) return out;
  char buf[4096];
  for (size_t n; (n = std::fread(buf, 1, sizeof buf, p)) > 0;) out.append(buf, n);
  const int st = pclose(p);
  *code = WIFEXITED(st) ? WEXITSTATUS(st) : -1;
  return out;
}

// `flashmesh --help | less` shows the command list, as each command's --help does; without a
// command it is a usage error, on stderr.
TEST(Cli, TopLevelHelpGoesToStdoutAndNamesEveryCommand) {
  int code = -1;
  const std::string out = StdoutOf("--help", &code);
  EXPECT_EQ(code, 0);
  EXPECT_EQ(out.rfind("usage: flashmesh <command> [options]", 0), 0u) << out;
  for (const std::string command : kCommands)
    EXPECT_NE(out.find("\n  " + command + " "), std::string::npos) << command << ":\n" << out;
  EXPECT_NE(out.find("cluster (vs one process)"), std::string::npos) << out;
  EXPECT_NE(out.find("--server"), std::string::npos) << out;
  EXPECT_EQ(StdoutOf("", &code), "");
  EXPECT_EQ(code, 2);
}

// `-h` or `--help` as an option's value is that value, not a request for help.
TEST(Cli, HelpAsAnOptionsValueIsTheValue) {
  std::string out;
  EXPECT_EQ(RunFlashmesh({"generate", "--model", SmallModel(), "--prompt", "-h", "--max-tokens", "2",
                          "--threads", "1"}, &out), 0) << out;
  EXPECT_EQ(out.find("usage:"), std::string::npos) << out;
  EXPECT_NE(out.find("generated 2 tokens"), std::string::npos) << out;
}

// A flag of local generation given with --server is refused by name (a server's own settings
// decide it), not silently ignored; the check comes before any connection.
TEST(Cli, GenerateRefusesLocalFlagsWithServer) {
  for (const char* flag : {"--threads", "--max-step-tokens"}) {
    std::string out;
    EXPECT_EQ(RunFlashmesh({"generate", "--server", "127.0.0.1:1", "--prompt", "hi", flag, "4"}, &out), 2)
        << out;
    EXPECT_NE(out.find(std::string(flag) + ": only with --model"), std::string::npos) << out;
  }
}

// mkmodel does not write over a checkpoint (a mistyped OUT would leave a real one with another
// config and index) unless told to.
TEST(Cli, MkmodelRefusesACheckpointDirectoryWithoutForce) {
  TempDir dir;
  std::string out;
  ASSERT_EQ(RunFlashmesh({"mkmodel", "--preset", "tiny", dir.path()}, &out), 0) << out;
  EXPECT_EQ(RunFlashmesh({"mkmodel", "--preset", "tiny", "--seed", "2", dir.path()}, &out), 1) << out;
  EXPECT_NE(out.find(dir.path() + " already holds a checkpoint (config.json); --force writes over it"),
            std::string::npos) << out;
  EXPECT_EQ(RunFlashmesh({"mkmodel", "--preset", "tiny", "--seed", "2", "--force", dir.path()}, &out), 0)
      << out;
}

// status --json answers JSON when the coordinator is down too (a reader parses stdout).
TEST(Cli, StatusJsonOfADownCoordinatorSaysSo) {
  std::string out;
  const std::string nobody = "127.0.0.1:" + std::to_string(FreePort());
  EXPECT_EQ(RunFlashmesh({"status", "--server", nobody, "--json"}, &out), 2) << out;
  EXPECT_NE(out.find("{\"reachable\":false}"), std::string::npos) << out;
}

TEST(Cli, AMissingRequiredFlagIsNamed) {
  std::string out;
  EXPECT_EQ(RunFlashmesh({"coordinator"}, &out), 2) << out;
  EXPECT_NE(out.find("coordinator: --config is required"), std::string::npos) << out;
  EXPECT_EQ(RunFlashmesh({"inspect"}, &out), 2) << out;
  EXPECT_NE(out.find("inspect: DIR is required"), std::string::npos) << out;
}

// cpu | cuda:N, parsed alike by serve, bench decode and the cluster YAML (ParseDevice).
TEST(Cli, ABadDeviceIsNamed) {
  std::string out;
  EXPECT_EQ(RunFlashmesh({"serve", "--model", SmallModel(), "--device", "gpu0"}, &out), 2) << out;
  EXPECT_NE(out.find("--device: 'gpu0': want cpu or cuda:N"), std::string::npos) << out;
  EXPECT_EQ(RunFlashmesh({"bench", "decode", "--model", SmallModel(), "--device", "cuda:x"}, &out),
            2)
      << out;
  EXPECT_NE(out.find("--device: 'cuda:x': want cpu or cuda:N"), std::string::npos) << out;
}

// serve's limits have the YAML's bounds (config/cluster_config.h): max_context travels as int32.
TEST(Cli, ServeLimitsHaveTheYamlsBounds) {
  std::string out;
  EXPECT_EQ(RunFlashmesh({"serve", "--model", SmallModel(), "--max-context", "3000000000"}, &out), 2)
      << out;
  EXPECT_NE(out.find("--max-context"), std::string::npos) << out;
  EXPECT_NE(out.find("2147483647"), std::string::npos) << out;
  EXPECT_EQ(RunFlashmesh({"serve", "--model", SmallModel(), "--max-batch", "5000"}, &out), 2) << out;
  EXPECT_NE(out.find("--max-batch"), std::string::npos) << out;
  // max_tokens may not exceed max_context, as in the YAML (a request's max_tokens is int32).
  EXPECT_EQ(RunFlashmesh({"serve", "--model", SmallModel(), "--max-context", "100", "--max-tokens",
                          "200"}, &out), 2) << out;
  EXPECT_NE(out.find("--max-tokens: 200 exceeds --max-context 100"), std::string::npos) << out;
}

// Thread counts are bounded in every command: 2^32 used to wrap to 0 (all cores) in worker
// and serve, and 100000 ended the process when the system refused the threads.
TEST(Cli, ThreadCountsAreBounded) {
  std::string out;
  EXPECT_EQ(RunFlashmesh({"worker", "--config", "x.yaml", "--node", "w0", "--threads", "4294967296"},
                         &out), 2) << out;
  EXPECT_NE(out.find("--threads: '4294967296' is not an integer in [1, 1024]"), std::string::npos) << out;
  EXPECT_EQ(RunFlashmesh({"serve", "--model", SmallModel(), "--threads", "100000"}, &out), 2) << out;
  EXPECT_NE(out.find("--threads"), std::string::npos) << out;
  EXPECT_EQ(RunFlashmesh({"bench", "cluster", "--config", "x.yaml", "--streams", "100000"}, &out), 2)
      << out;
  EXPECT_NE(out.find("--streams"), std::string::npos) << out;
}

}  // namespace
}  // namespace fm::it
