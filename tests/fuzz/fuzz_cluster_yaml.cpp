// libFuzzer target: the cluster YAML (config/cluster_config.cpp) must turn any file into a
// cluster config or an error naming file:line and the field, never a crash or an exception
// (yaml-cpp's accessors throw); what it accepts has nodes with distinct names.
#include <cstdint>
#include <cstdlib>
#include <set>
#include <string>

#include "config/cluster_config.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  const std::string text(reinterpret_cast<const char*>(data), size);
  auto c = fm::ParseClusterConfig(text, "fuzz.yaml", "/fuzz");
  if (!c.ok()) {
    if (c.status().message().rfind("fuzz.yaml", 0) != 0) std::abort();   // names the file
    return 0;
  }
  std::set<std::string> names;
  for (const auto& n : c->nodes)
    if (!names.insert(n.name).second) std::abort();
  return 0;
}
