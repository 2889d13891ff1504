// A device that a fault left unusable (emulated: EmuLoseDevice, as after a kernel's illegal
// address, when every later CUDA call fails), run by tests/gpu/emulate.sh only: the worker's
// step fails, its shard is dropped (Health then says unloaded, and the coordinator takes the
// node out), and a new load fails naming the device error instead of "loading" it again.
#include <gtest/gtest.h>

#include <cuda_runtime.h>

#include <chrono>

#include "tests/model_test_util.h"
#include "worker/shard_runtime.h"
#include "worker/stage_executor.h"

namespace fm {
namespace {

using namespace std::chrono_literals;

ShardPlacement OnDevice() {
  ShardPlacement p;
  p.model_dir = modeltest::PresetDir("tiny");
  p.stage = 0;
  p.num_stages = 1;
  p.layer_begin = 0;
  p.layer_end = -1;
  p.embed = p.head = true;
  p.cuda_device = 0;
  return p;
}

TEST(EmuDeviceLost, AFailedStepOnALostDeviceDropsTheShardAndReloadsNameTheError) {
  ShardRuntime r(1);
  ASSERT_TRUE(r.Load(OnDevice()).ok());
  StageExecutor e(&r);
  SamplerConfig greedy;
  greedy.greedy = true;
  ASSERT_TRUE(r.StartSequence(1, 64, greedy).ok());
  std::vector<SampledId> out;
  ASSERT_TRUE(e.RunStep(1, 0, {StepSlice{1, {5, 6, 7}}}, StageExecutor::Clock::now() + 30s, &out).ok());

  // A step that fails for its own reasons leaves a working device's shard alone.
  const Status beyond = e.RunStep(2, 1, {StepSlice{1, std::vector<int32_t>(100, 5)}},
                                  StageExecutor::Clock::now() + 30s, &out);
  EXPECT_EQ(beyond.code(), Code::kOutOfRange) << beyond.ToString();
  EXPECT_TRUE(r.loaded());

  EmuLoseDevice(true);
  const Status failed = e.RunStep(3, 2, {StepSlice{1, {8}}}, StageExecutor::Clock::now() + 30s, &out);
  EXPECT_FALSE(failed.ok());
  EXPECT_FALSE(r.loaded()) << "a shard on a lost device still reported loaded";
  const Status reload = r.Load(OnDevice());
  EXPECT_FALSE(reload.ok());
  EXPECT_NE(reload.message().find("cudaErrorIllegalAddress"), std::string::npos) << reload.ToString();
  EmuLoseDevice(false);
  EXPECT_TRUE(r.Load(OnDevice()).ok()) << "(a restarted process gets a working device)";
}

}  // namespace
}  // namespace fm
