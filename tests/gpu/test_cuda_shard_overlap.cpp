// The device ShardModel with launch overlap (kernels/cuda/ops.h SetLaunchOverlap: programmatic
// dependent launch, the weight kernels' L2 prefetch before their wait): a prefill of two
// sequences, decode past the window and the ratio-4 entries, and steps of both, on CUDA graphs
// and eager launches, each bit for bit the logits of the same steps with ordered launches; on the
// tiny preset and (on a GPU) the bench preset. On a GPU a kernel that touched a buffer before its
// wait would race with the kernel before it and could show here; the emulation runs launches in
// order, so there it checks the wiring.
#include <gtest/gtest.h>

#include <cstring>
#include <memory>
#include <span>
#include <string>
#include <vector>

#include "kernels/cuda/device.h"
#include "model/checkpoint.h"
#include "model/cuda/shard_model.h"
#include "model/forward.h"
#include "model/kv_cache.h"
#include "tests/gpu/cuda_test_util.h"
#include "tests/model_test_util.h"

namespace fm {
namespace {

// The logits of every step of a fixed schedule on a new device shard of `mode`.
std::vector<float> RunSchedule(const Checkpoint& ck, CudaStepMode mode) {
  std::vector<float> logits;
  auto model = CreateCudaShardModel(ck, 0, mode);
  EXPECT_TRUE(model.ok()) << model.status().ToString();
  if (!model.ok()) return logits;
  const ShardModel& m = **model;
  const auto a = modeltest::RandomTokens(24, 61, 512), b = modeltest::RandomTokens(9, 62, 512);
  auto sa = m.NewSequence(256).value(), sb = m.NewSequence(256).value();
  const BatchItem both[2] = {{sa.get(), std::span(a).first(12)}, {sb.get(), std::span(b).first(3)}};
  EXPECT_TRUE(modeltest::RunItems(m, both, &logits).ok());
  for (int t = 12; t < 24; ++t) {
    const BatchItem ia{sa.get(), std::span(a).subspan(t, 1)};
    if (t < 18) {  // a and b decode together: one step of two sequences
      const BatchItem pair[2] = {ia, {sb.get(), std::span(b).subspan(t - 9, 1)}};
      EXPECT_TRUE(modeltest::RunItems(m, pair, &logits).ok()) << "t " << t;
    } else {
      EXPECT_TRUE(modeltest::RunItems(m, {&ia, 1}, &logits).ok()) << "t " << t;
    }
  }
  return logits;
}

// The logits of RunSchedule on preset `name`, graphs and eager, without and with launch
// overlap: all four bit-identical.
void ExpectOverlapChangesNoBit(const std::string& name) {
  auto ck = Checkpoint::Open(modeltest::PresetDir(name), {});
  ASSERT_TRUE(ck.ok()) << ck.status().ToString();
  std::vector<float> ordered[2], overlapped[2];
  const CudaStepMode modes[2] = {CudaStepMode::kGraph, CudaStepMode::kEager};
  for (int i = 0; i < 2; ++i) {
    {
      cudatest::LaunchOverlapScope off(false);
      ordered[i] = RunSchedule(**ck, modes[i]);
    }
    cudatest::LaunchOverlapScope on(true);
    overlapped[i] = RunSchedule(**ck, modes[i]);
  }
  const int64_t V = (*ck)->config().vocab_size;
  ASSERT_EQ(ordered[0].size(), static_cast<size_t>(V) * (15 + 6 * 2 + 6));
  for (int i = 0; i < 2; ++i) {
    ASSERT_EQ(overlapped[i].size(), ordered[0].size()) << i;
    EXPECT_EQ(std::memcmp(ordered[i].data(), ordered[0].data(), ordered[0].size() * 4), 0)
        << "eager != graph, launches in order";
    EXPECT_EQ(std::memcmp(overlapped[i].data(), ordered[0].data(), ordered[0].size() * 4), 0)
        << (i == 0 ? "graph" : "eager") << " with launch overlap != ordered launches";
  }
}

TEST(CudaShardLaunchOverlap, SameBitsAsOrderedLaunchesOnGraphsAndEager) {
  if (cuda::DeviceCount() == 0) GTEST_SKIP() << "no CUDA device";
  ExpectOverlapChangesNoBit("tiny");
}

// The same on the bench preset (hidden 2048, 64 experts): grids of hundreds of blocks that run
// long enough for a kernel that read too early to lose the race. Not in the emulation, where
// launches are ordered anyway and its steps would take minutes.
TEST(CudaShardLaunchOverlap, BenchPresetSameBitsOnAGpu) {
  if (cuda::DeviceCount() == 0) GTEST_SKIP() << "no CUDA device";
  if (cuda::DeviceDescription(0) == "CPU emulation") GTEST_SKIP() << "launches are ordered there";
  ExpectOverlapChangesNoBit("bench");
}

}  // namespace
}  // namespace fm
