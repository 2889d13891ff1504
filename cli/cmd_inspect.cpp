// flashmesh inspect DIR
#include <cstdio>
#include <optional>
#include <string>

#include "cli/commands.h"
#include "cli/flags.h"
#include "model/inspect.h"

namespace fm::cli {

namespace {

const CommandSpec kSpec{
    "inspect",
    "validates a checkpoint directory against its config.json and prints parameters,\n"
    "bytes by dtype, layer kinds, bytes read per decoded token and KV-cache bytes",
    {},
    "DIR"};

}  // namespace

int CmdInspect(int argc, char** argv) {
  int rc = 0;
  const std::optional<Flags> flags = StartCommand(kSpec, argc, argv, &rc);
  if (!flags) return rc;
  auto r = InspectCheckpoint(flags->operand());
  if (!r.ok()) {
    std::fprintf(stderr, "inspect: %s\n", r.status().ToString().c_str());
    return 1;
  }
  std::fputs(FormatInspectReport(*r).c_str(), stdout);
  return 0;
}

}  // namespace fm::cli
