// flashmesh: one binary, subcommands (README.md).
#include <cstdio>
#include <cstring>

#include "cli/commands.h"
#include "common/heap_policy.h"

namespace fm::cli {
namespace {

const Command kCommands[] = {
    {"mkmodel", "write a random test checkpoint in the official layout", CmdMkmodel},
    {"inspect", "summarize a checkpoint directory", CmdInspect},
    {"serve", "single process: coordinator + one worker holding the whole model", CmdServe},
    {"coordinator", "run the coordinator of a cluster YAML", CmdCoordinator},
    {"worker", "run one worker (node) of a cluster YAML", CmdWorker},
    {"up", "start a whole local cluster (coordinator + local workers) from a YAML", CmdUp},
    {"status", "per-node state, layers, memory, KV, tok/s of a running cluster", CmdStatus},
    {"health", "exit 0 healthy, 1 degraded, 2 down, 3 nothing asked (cluster or --node NAME)", CmdHealth},
    {"drain", "take a worker out of service without failing a live request (--resume: back)", CmdDrain},
    {"plan", "validate a cluster YAML and print the placement plan (no weights read)", CmdPlan},
    {"generate", "generate from a prompt: in this process (--model) or on a server (--server)", CmdGenerate},
    {"logits", "run the model on token ids, write raw f32 logits, print argmaxes", CmdLogits},
    {"bench", "benchmarks: decode (tok/s against memory bandwidth), cluster (vs one process)", CmdBench},
};

// To stdout when asked for (--help, as every command's --help), to stderr after a usage error.
void Usage(FILE* out) {
  std::fprintf(out, "usage: flashmesh <command> [options]\n\ncommands:\n");
  for (const auto& c : kCommands) std::fprintf(out, "  %-12s %s\n", c.name, c.summary);
  std::fprintf(out, "\nflashmesh <command> --help for the options of a command\n");
}

}  // namespace
}  // namespace fm::cli

int main(int argc, char** argv) {
  using namespace fm::cli;
  fm::HoldFreedHeapMemory();
  if (argc < 2) {
    Usage(stderr);
    return 2;
  }
  if (!std::strcmp(argv[1], "--help") || !std::strcmp(argv[1], "-h")) {
    Usage(stdout);
    return 0;
  }
  for (const auto& c : kCommands)
    if (!std::strcmp(argv[1], c.name)) return c.run(argc - 1, argv + 1);
  std::fprintf(stderr, "flashmesh: unknown command '%s'\n", argv[1]);
  Usage(stderr);
  return 2;
}
