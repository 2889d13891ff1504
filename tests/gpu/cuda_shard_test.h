// The CudaShardTest fixture of the device shard tests (test_cuda_shard*.cpp): the tiny preset
// opened as a CPU and a cuda:0 ShardModel over the same selection, and decode helpers; and
// TinyOnDevice, the placement of the whole tiny preset on cuda:0 for a ShardRuntime.
#pragma once
#include <gtest/gtest.h>

#include <cmath>
#include <cstdint>
#include <memory>
#include <span>
#include <string>
#include <vector>

#include "common/thread_pool.h"
#include "model/checkpoint.h"
#include "model/cuda/shard_model.h"
#include "model/forward.h"
#include "model/kv_cache.h"
#include "tests/model_test_util.h"
#include "worker/shard_runtime.h"

namespace fm {

class CudaShardTest : public ::testing::Test {
 protected:
  static const std::string& Dir() { return modeltest::PresetDir("tiny"); }

  struct Pair {  // the same selection on the CPU and on cuda:0
    std::unique_ptr<Checkpoint> ckpt;
    std::unique_ptr<ShardModel> cpu, gpu;
  };
  static Pair Open(ThreadPool* pool, const ShardSelection& sel = {}) {
    Pair p;
    auto ck = Checkpoint::Open(Dir(), sel);
    EXPECT_TRUE(ck.ok()) << ck.status().ToString();
    if (!ck.ok()) return p;
    p.ckpt = std::move(ck).value();
    auto cpu = ShardModel::Create(*p.ckpt, pool);
    EXPECT_TRUE(cpu.ok()) << cpu.status().ToString();
    auto gpu = CreateCudaShardModel(*p.ckpt, 0);
    EXPECT_TRUE(gpu.ok()) << gpu.status().ToString();
    if (cpu.ok() && gpu.ok()) {
      p.cpu = std::move(cpu).value();
      p.gpu = std::move(gpu).value();
    }
    return p;
  }

  static std::vector<int32_t> Tokens(int n, uint32_t seed) {
    return modeltest::RandomTokens(n, seed, 512);
  }

  // Tokens [from, to) of toks decoded one at a time on both; every step's logits appended.
  static void DecodeBoth(const Pair& p, SequenceCache* cs, SequenceCache* gs,
                         const std::vector<int32_t>& toks, int from, int to,
                         std::vector<float>* cpu, std::vector<float>* gpu) {
    for (int t = from; t < to; ++t) {
      const BatchItem ci{cs, std::span(toks).subspan(t, 1)}, gi{gs, std::span(toks).subspan(t, 1)};
      ASSERT_TRUE(modeltest::RunItems(*p.cpu, {&ci, 1}, cpu).ok());
      const Status st = modeltest::RunItems(*p.gpu, {&gi, 1}, gpu);
      ASSERT_TRUE(st.ok()) << "token " << t << ": " << st.ToString();
    }
  }

  // n tokens decoded one at a time on both; every step's logits compared.
  void DecodeMatchesCpu(int n) {
    ThreadPool pool(2);
    Pair p = Open(&pool);
    ASSERT_TRUE(p.gpu);
    const auto toks = Tokens(n, 21);
    auto cc = p.cpu->NewSequence(1024).value(), gc = p.gpu->NewSequence(1024).value();
    std::vector<float> cpu, gpu;
    ASSERT_NO_FATAL_FAILURE(DecodeBoth(p, cc.get(), gc.get(), toks, 0, n, &cpu, &gpu));
    EXPECT_EQ(gc->next_pos(), n);
    EXPECT_GT(gc->bytes(), 0u);
    for (float v : gpu) ASSERT_TRUE(std::isfinite(v));
    EXPECT_LT(modeltest::RowRelErr(gpu, cpu, p.gpu->config().vocab_size), 1e-3);
  }
};

// A ShardRuntime's placement of the whole tiny preset (one stage) on cuda:0.
inline ShardPlacement TinyOnDevice() {
  ShardPlacement p;
  p.model_dir = modeltest::PresetDir("tiny");
  p.cuda_device = 0;
  return p;
}

}  // namespace fm
