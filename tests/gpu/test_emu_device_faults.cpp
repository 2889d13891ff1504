// Device faults, emulated (tests/gpu/emulate.sh only). A device that a fault left unusable
// (EmuLoseDevice, as after a kernel's illegal address, when every later CUDA call fails): the
// worker's step fails, its shard is dropped (Health then says unloaded, and the coordinator
// takes the node out), and a new load fails naming the device error. A graph capture that
// fails (EmuFailCaptures): the step runs eagerly, with the same bits, and a later one captures.
#include <gtest/gtest.h>

#include <cuda_runtime.h>

#include <chrono>
#include <cstring>
#include <span>

#include "kernels/cuda/device.h"
#include "model/checkpoint.h"
#include "model/kv_cache.h"
#include "model/cuda/shard_model.h"
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

TEST(EmuGraphCapture, AFailedCaptureRunsTheStepEagerlyWithTheSameBitsAndALaterStepCaptures) {
  auto ck = Checkpoint::Open(modeltest::PresetDir("tiny"), {});
  ASSERT_TRUE(ck.ok()) << ck.status().ToString();
  auto graph = CreateCudaShardModel(**ck, 0, CudaStepMode::kGraph);
  auto eager = CreateCudaShardModel(**ck, 0, CudaStepMode::kEager);
  ASSERT_TRUE(graph.ok() && eager.ok());
  auto gs = (*graph)->NewSequence(64).value();
  auto es = (*eager)->NewSequence(64).value();
  const std::vector<int32_t> toks = modeltest::RandomTokens(12, 3, 512);
  std::vector<float> g, e;
  const auto prompt = std::span(toks).first(4);   // a prefill (eager in both)
  const BatchItem gp{gs.get(), prompt}, ep{es.get(), prompt};
  ASSERT_TRUE(modeltest::RunItems(**graph, {&gp, 1}, &g).ok());
  ASSERT_TRUE(modeltest::RunItems(**eager, {&ep, 1}, &e).ok());
  for (int t = 4; t < 12; ++t) {
    EmuFailCaptures(t < 7);   // the 1-row bucket's capture fails three times, then succeeds
    const int64_t before = cuda::KernelLaunches();
    const auto tok = std::span(toks).subspan(t, 1);
    const BatchItem gi{gs.get(), tok}, ei{es.get(), tok};
    ASSERT_TRUE(modeltest::RunItems(**graph, {&gi, 1}, &g).ok()) << "token " << t;
    const int64_t launched = cuda::KernelLaunches() - before;
    ASSERT_TRUE(modeltest::RunItems(**eager, {&ei, 1}, &e).ok());
    const int64_t eager_launched = cuda::KernelLaunches() - before - launched;
    // Failed: the failed capture's kernels (a capture counts them) and then every kernel again,
    // launched as in the eager model; t = 7 captures; later steps replay it (only the embedding
    // and the head launch).
    if (t < 7) EXPECT_GE(launched, eager_launched) << "token " << t;
    if (t > 7) EXPECT_LT(2 * launched, eager_launched) << "token " << t << ": the graph was not replayed";
  }
  EmuFailCaptures(false);
  ASSERT_EQ(g.size(), e.size());
  EXPECT_EQ(std::memcmp(g.data(), e.data(), g.size() * sizeof(float)), 0) << "graph != eager";
}

}  // namespace
}  // namespace fm
