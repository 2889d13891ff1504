// The device ShardModel on the tensor-core core for FP8/FP4 weights (kernels/cuda/ops.h
// SetWeightPath(kTensorCore), gemv_tc.cuh) on the tiny preset: a prefill of two sequences, then
// decode past the window and the ratio-4 entries, graph replay == eager launches bit for bit,
// and every step's logits within 1e-3 of the CPU shard's. (test_cuda_shard.cpp runs the same
// checks on the default FMA core.)
#include <gtest/gtest.h>

#include <cstring>
#include <memory>
#include <span>
#include <vector>

#include "common/thread_pool.h"
#include "kernels/cuda/device.h"
#include "model/checkpoint.h"
#include "model/cuda/shard_model.h"
#include "model/forward.h"
#include "model/kv_cache.h"
#include "tests/gpu/cuda_test_util.h"
#include "tests/model_test_util.h"

namespace fm {
namespace {

TEST(CudaShardTensorCore, PrefillDecodeMatchCpuAndGraphEqualsEager) {
  if (cuda::DeviceCount() == 0) GTEST_SKIP() << "no CUDA device";
  cudatest::WeightPathScope scope(cuda::WeightPath::kTensorCore);
  auto ck = Checkpoint::Open(modeltest::PresetDir("tiny"), {});
  ASSERT_TRUE(ck.ok()) << ck.status().ToString();
  ThreadPool pool(2);
  auto cpu = ShardModel::Create(**ck, &pool);
  auto graph = CreateCudaShardModel(**ck, 0, CudaStepMode::kGraph);
  auto eager = CreateCudaShardModel(**ck, 0, CudaStepMode::kEager);
  ASSERT_TRUE(cpu.ok() && graph.ok() && eager.ok());
  const ShardModel* models[3] = {cpu->get(), graph->get(), eager->get()};
  const int64_t V = (*cpu)->config().vocab_size;
  const auto a = modeltest::RandomTokens(30, 51, 512), b = modeltest::RandomTokens(7, 52, 512);
  std::vector<float> logits[3];
  for (int m = 0; m < 3; ++m) {
    auto sa = models[m]->NewSequence(256).value(), sb = models[m]->NewSequence(256).value();
    // Prefill: a's first 12 tokens and b's first 3 in one step; then a decodes 18 tokens and
    // b its other 4, interleaved.
    const BatchItem both[2] = {{sa.get(), std::span(a).first(12)}, {sb.get(), std::span(b).first(3)}};
    ASSERT_TRUE(modeltest::RunItems(*models[m], both, &logits[m]).ok()) << m;
    for (int t = 12; t < 30; ++t) {
      const BatchItem ia{sa.get(), std::span(a).subspan(t, 1)};
      ASSERT_TRUE(modeltest::RunItems(*models[m], {&ia, 1}, &logits[m]).ok()) << m << " t " << t;
      if (t < 16) {
        const BatchItem ib{sb.get(), std::span(b).subspan(t - 9, 1)};
        ASSERT_TRUE(modeltest::RunItems(*models[m], {&ib, 1}, &logits[m]).ok()) << m << " t " << t;
      }
    }
  }
  ASSERT_EQ(logits[1].size(), logits[0].size());
  ASSERT_EQ(logits[2].size(), logits[0].size());
  EXPECT_EQ(std::memcmp(logits[1].data(), logits[2].data(), logits[1].size() * sizeof(float)), 0)
      << "graph replay != eager launches";
  EXPECT_LT(modeltest::RowRelErr(logits[1], logits[0], V), 1e-3);
}

}  // namespace
}  // namespace fm
