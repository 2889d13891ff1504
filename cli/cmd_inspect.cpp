// flashmesh inspect DIR
#include <cstdio>
#include <string>

#include "cli/commands.h"
#include "model/inspect.h"

namespace fm::cli {

int CmdInspect(int argc, char** argv) {
  const char* usage =
      "usage: flashmesh inspect DIR\n"
      "  validates a checkpoint directory against its config.json and prints parameters,\n"
      "  bytes by dtype, layer kinds, bytes read per decoded token and KV-cache bytes\n";
  if (argc == 2 && (std::string(argv[1]) == "--help" || std::string(argv[1]) == "-h")) {
    std::fputs(usage, stdout);
    return 0;
  }
  if (argc != 2 || argv[1][0] == '-') {
    std::fputs(usage, stderr);
    return 2;
  }
  auto r = InspectCheckpoint(argv[1]);
  if (!r.ok()) {
    std::fprintf(stderr, "inspect: %s\n", r.status().ToString().c_str());
    return 1;
  }
  std::fputs(FormatInspectReport(*r).c_str(), stdout);
  return 0;
}

}  // namespace fm::cli
