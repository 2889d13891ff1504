// SetupFromConfig: what the coordinator makes of its YAML and its command line before it starts.
#include <gtest/gtest.h>
#include <unistd.h>

#include <filesystem>

#include "config/cluster_config.h"
#include "coordinator/coordinator.h"
#include "model/mkmodel.h"
#include "tests/unit/test_checkpoint_util.h"

namespace fm {
namespace {

namespace fs = std::filesystem;

// The coordinator's --model goes to every worker in LoadShard, and a worker resolves a path from
// its own working directory: a relative one must leave the coordinator absolute.
TEST(CoordinatorSetup, ARelativeModelOverrideIsSentToTheWorkersAbsolute) {
  const fs::path root = testing_ck::TempDir("coordinator_setup");
  ASSERT_TRUE(WritePresetCheckpoint((root / "tiny").string(), "tiny", 7).ok());
  auto cfg = ParseClusterConfig(
      "model: /nonexistent/model\n"
      "coordinator: { listen: 127.0.0.1:7100 }\n"
      "nodes:\n"
      "  - { name: a, control: 127.0.0.1:7101, data: 127.0.0.1:7201, device: cpu, memory_gib: 4 }\n",
      "t.yaml", "/cfg/dir");
  ASSERT_TRUE(cfg.ok()) << cfg.status().ToString();
  const fs::path before = fs::current_path();
  fs::current_path(root);
  auto setup = SetupFromConfig(*cfg, "tiny");
  fs::current_path(before);
  ASSERT_TRUE(setup.ok()) << setup.status().ToString();
  EXPECT_EQ(setup->model_dir, (root / "tiny").string());
  EXPECT_EQ(setup->cluster.model_dir, (root / "tiny").string());
  // Frames are bounded by the scheduler's largest step: 16 decode rows + a 2048-row chunk.
  EXPECT_EQ(setup->cluster.max_step_rows, 16 + 2048);

  // Without the override the YAML's path (already absolute) is used, and its error names it.
  auto yaml = SetupFromConfig(*cfg, "");
  ASSERT_FALSE(yaml.ok());
  EXPECT_NE(yaml.status().message().find("t.yaml"), std::string::npos) << yaml.status().ToString();
  EXPECT_NE(yaml.status().message().find("/nonexistent/model/config.json"), std::string::npos)
      << yaml.status().ToString();
}

}  // namespace
}  // namespace fm
