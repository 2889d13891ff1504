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
    {"plan", "validate a cluster YAML and print the placement plan (no weights read)", CmdPlan},
    {"generate", "generate text or token ids from a prompt (single process)", CmdGenerate},
    {"logits", "run the model on token ids, write raw f32 logits, print argmaxes", CmdLogits},
    {"bench", "benchmarks: decode (tok/s against measured memory bandwidth)", CmdBench},
};

void Usage() {
  std::fprintf(stderr, "usage: flashmesh <command> [options]\n\ncommands:\n");
  for (const auto& c : kCommands) std::fprintf(stderr, "  %-12s %s\n", c.name, c.summary);
  std::fprintf(stderr, "\nflashmesh <command> --help for the options of a command\n");
}

}  // namespace
}  // namespace fm::cli

int main(int argc, char** argv) {
  using namespace fm::cli;
  fm::HoldFreedHeapMemory();
  if (argc < 2 || !std::strcmp(argv[1], "--help") || !std::strcmp(argv[1], "-h")) {
    Usage();
    return argc < 2 ? 2 : 0;
  }
  for (const auto& c : kCommands)
    if (!std::strcmp(argv[1], c.name)) return c.run(argc - 1, argv + 1);
  std::fprintf(stderr, "flashmesh: unknown command '%s'\n", argv[1]);
  Usage();
  return 2;
}
