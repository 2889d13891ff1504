// flashmesh plan --config FILE [--model DIR] [--json]
#include <cstdio>
#include <filesystem>
#include <string>

#include "cli/commands.h"
#include "coordinator/cluster_config.h"
#include "coordinator/planner.h"
#include "model/config.h"

namespace fm::cli {

int CmdPlan(int argc, char** argv) {
  const char* usage =
      "usage: flashmesh plan --config FILE [--model DIR] [--json]\n"
      "  validates a cluster YAML and prints the placement plan (node, stage, layers, experts,\n"
      "  weight / KV / free GiB) from the model's config.json alone; no weights are read.\n"
      "  --model DIR  checkpoint directory instead of the YAML's `model`\n"
      "  --json       the plan as JSON\n";
  std::string config, model;
  bool json = false;
  for (int i = 1; i < argc; ++i) {
    const std::string a = argv[i];
    if (a == "--help" || a == "-h") {
      std::fputs(usage, stdout);
      return 0;
    } else if (a == "--config" && i + 1 < argc) {
      config = argv[++i];
    } else if (a == "--model" && i + 1 < argc) {
      model = argv[++i];
    } else if (a == "--json") {
      json = true;
    } else {
      std::fprintf(stderr, "plan: unexpected argument '%s'\n%s", a.c_str(), usage);
      return 2;
    }
  }
  if (config.empty()) {
    std::fputs(usage, stderr);
    return 2;
  }
  auto cluster = LoadClusterConfig(config);
  if (!cluster.ok()) {
    std::fprintf(stderr, "plan: %s\n", cluster.status().ToString().c_str());
    return 1;
  }
  const std::string dir = model.empty() ? cluster->model : model;
  const std::string config_json = (std::filesystem::path(dir) / "config.json").string();
  auto mc = LoadModelConfig(config_json);
  if (!mc.ok()) {
    std::fprintf(stderr, "plan: %s\n", mc.status().ToString().c_str());
    return 1;
  }
  auto plan = PlanShards(*mc, *cluster);
  if (!plan.ok()) {
    std::fprintf(stderr, "plan: %s: %s\n", config.c_str(), plan.status().ToString().c_str());
    return 1;
  }
  if (json) {
    std::printf("%s\n", PlanToJson(*plan).c_str());
  } else {
    std::printf("model: %s\n", dir.c_str());
    std::fputs(FormatPlanTable(*plan).c_str(), stdout);
  }
  return 0;
}

}  // namespace fm::cli
