// Device faults, emulated (tests/gpu/emulate.sh only). A device that a fault left unusable
// (EmuLoseDevice, as after a kernel's illegal address, when every later CUDA call fails): the
// worker's step fails, its shard is dropped (Health then says unloaded, and the coordinator
// takes the node out), and a new load fails naming the device error. A graph capture that
// fails (EmuFailCaptures): the step runs eagerly, with the same bits, and a later one captures
// (after three failures the bucket stays eager).
#include <gtest/gtest.h>

#include <cuda_runtime.h>

#include <chrono>
#include <cstring>
#include <functional>
#include <span>

#include "kernels/cuda/device.h"
#include "model/checkpoint.h"
#include "model/kv_cache.h"
#include "model/cuda/shard_model.h"
#include "tests/gpu/cuda_shard_test.h"
#include "tests/model_test_util.h"
#include "worker/shard_runtime.h"
#include "worker/stage_executor.h"

namespace fm {
namespace {

using namespace std::chrono_literals;

TEST(EmuDeviceLost, AFailedStepOnALostDeviceDropsTheShardAndReloadsNameTheError) {
  ShardRuntime r(1);
  ASSERT_TRUE(r.Load(TinyOnDevice()).ok());
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
  const Status reload = r.Load(TinyOnDevice());
  EXPECT_FALSE(reload.ok());
  EXPECT_NE(reload.message().find("cudaErrorIllegalAddress"), std::string::npos) << reload.ToString();
  EmuLoseDevice(false);
  EXPECT_TRUE(r.Load(TinyOnDevice()).ok()) << "(a restarted process gets a working device)";
}

// Two buckets: the 1-row one fails twice and then captures; the 2-row one fails three times
// and then runs eagerly for good. Every step gives the eager model's bits.
TEST(EmuGraphCapture, AFailedCaptureRunsTheStepEagerlyWithTheSameBitsUntilOneCaptures) {
  auto ck = Checkpoint::Open(modeltest::PresetDir("tiny"), {});
  ASSERT_TRUE(ck.ok()) << ck.status().ToString();
  auto graph = CreateCudaShardModel(**ck, 0, CudaStepMode::kGraph);
  auto eager = CreateCudaShardModel(**ck, 0, CudaStepMode::kEager);
  ASSERT_TRUE(graph.ok() && eager.ok());
  std::vector<std::unique_ptr<SequenceCache>> gs, es;
  const std::vector<int32_t> toks = modeltest::RandomTokens(16, 3, 512);
  std::vector<float> g, e;
  for (int q = 0; q < 2; ++q) {   // two sequences, a 4-token prefill each (eager in both)
    gs.push_back((*graph)->NewSequence(64).value());
    es.push_back((*eager)->NewSequence(64).value());
    const auto prompt = std::span(toks).first(4);
    const BatchItem gp{gs[q].get(), prompt}, ep{es[q].get(), prompt};
    ASSERT_TRUE(modeltest::RunItems(**graph, {&gp, 1}, &g).ok());
    ASSERT_TRUE(modeltest::RunItems(**eager, {&ep, 1}, &e).ok());
  }
  auto launches = [](const std::function<Status()>& f, int64_t* n) {
    const int64_t before = cuda::KernelLaunches();
    const Status st = f();
    *n = cuda::KernelLaunches() - before;
    return st;
  };
  for (int t = 4; t < 12; ++t) {
    const auto tok = std::span(toks).subspan(t, 1);
    for (const int rows : {1, 2}) {
      EmuFailCaptures(rows == 1 ? t < 6 : true);
      std::vector<BatchItem> gi, ei;
      for (int q = 0; q < rows; ++q) {
        gi.push_back({gs[q].get(), tok});
        ei.push_back({es[q].get(), tok});
      }
      int64_t by_graph = 0, by_eager = 0;
      ASSERT_TRUE(launches([&] { return modeltest::RunItems(**graph, gi, &g); }, &by_graph).ok())
          << "token " << t << ", " << rows << " rows";
      ASSERT_TRUE(launches([&] { return modeltest::RunItems(**eager, ei, &e); }, &by_eager).ok());
      // Replays launch only the embedding and the head; failed captures count their kernels
      // and then launch them all again; after three failures the 2-row bucket stops trying.
      if (rows == 1 && t > 6) EXPECT_LT(2 * by_graph, by_eager) << "token " << t << ": no replay";
      if (rows == 2 && t < 7) EXPECT_GT(by_graph, by_eager) << "token " << t << ": no capture tried";
      if (rows == 2 && t >= 7) EXPECT_EQ(by_graph, by_eager) << "token " << t << ": still capturing";
    }
  }
  EmuFailCaptures(false);
  ASSERT_EQ(g.size(), e.size());
  EXPECT_EQ(std::memcmp(g.data(), e.data(), g.size() * sizeof(float)), 0) << "graph != eager";
}

}  // namespace
}  // namespace fm
