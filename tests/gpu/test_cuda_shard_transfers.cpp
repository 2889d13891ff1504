// Host<->device traffic of the device ShardModel (common/device_transfers.h, docs/gpu.md
// "Host<->device traffic"): loading a shard counts its uploads as load traffic and no step
// traffic; every decode step of one shard holding embed, layers and head (sampling on the
// device) counts exactly the bytes the step copies today, computed from the model config, and
// stays under 1 MB a token for the tiny and the bench preset. A copy added to the step, or a
// copy left uncounted, fails these tests. Part of test_cuda_shard (and of its emulation).
#include <gtest/gtest.h>

#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <memory>
#include <span>
#include <string>
#include <vector>

#include "common/device_transfers.h"
#include "kernels/cuda/device.h"
#include "kernels/cuda/fused_ops.h"
#include "kernels/cuda/sample_ops.h"
#include "model/checkpoint.h"
#include "model/cuda/shard_model.h"
#include "model/cuda/step_inputs.h"
#include "model/forward.h"
#include "model/kv_cache.h"
#include "model/mkmodel.h"
#include "model/sampler.h"
#include "tests/model_test_util.h"

namespace fm {
namespace {

TransferBytes Since(const TransferBytes& before, const TransferBytes& after) {
  return {after.host_to_device - before.host_to_device,
          after.device_to_host - before.device_to_host};
}

// What a decode step of B sequences (one token each, S rows on the device: B, or B's bucket
// with padding rows in graph mode) copies in model/cuda/shard_model.cpp today, X staying in the
// shard's device activations (docs/gpu.md "Where X lives"). Embed: the B token ids in.
// ForwardLayers: the StepInputs and the row table cuda::RowCache [layers, S] in (X moves device
// to device). SampleNext: the B SampleParams in, the B SampleResults out (greedy picks ask for
// no alternatives, so no SampleTop comes back).
TransferBytes ExpectedDecodeStep(int64_t layers, int64_t B, int64_t S) {
  TransferBytes t;
  t.host_to_device = B * sizeof(int32_t) + sizeof(StepInputs) +
                     layers * S * sizeof(cuda::RowCache) + B * sizeof(cuda::SampleParams);
  t.device_to_host = B * sizeof(cuda::SampleResult);
  return t;
}

class CudaShardTransfers : public ::testing::Test {
 protected:
  static const std::string& Dir() { return modeltest::PresetDir("tiny"); }

  // One step of every sequence in `seqs`: next[b] in, embedded on the device, through the
  // layers, then each sequence's last row's greedy pick on the device into next[b].
  static void Step(const ShardModel& m, const std::vector<std::unique_ptr<SequenceCache>>& seqs,
                   std::vector<std::vector<int32_t>>& tokens, std::vector<Sampler>& samplers,
                   std::vector<int32_t>* next) {
    std::vector<int32_t> flat;
    std::vector<BatchItem> items;
    for (size_t b = 0; b < seqs.size(); ++b) {
      items.push_back({seqs[b].get(), tokens[b]});
      flat.insert(flat.end(), tokens[b].begin(), tokens[b].end());
    }
    auto x = m.NewActivations();
    auto last = m.NewActivations();  // each sequence's last row
    ASSERT_TRUE(x.ok() && last.ok());
    ASSERT_TRUE((*x)->Resize(static_cast<int64_t>(flat.size())).ok());
    ASSERT_TRUE((*last)->Resize(static_cast<int64_t>(seqs.size())).ok());
    ASSERT_TRUE(m.Embed(flat, (*x)->data()).ok());
    const Status st = m.ForwardLayers(items, (*x)->data());
    ASSERT_TRUE(st.ok()) << st.ToString();
    int64_t end = 0;
    for (size_t b = 0; b < tokens.size(); ++b) {
      end += static_cast<int64_t>(tokens[b].size());
      ASSERT_TRUE((*last)->CopyRows(static_cast<int64_t>(b), **x, end - 1, 1).ok());
    }
    std::vector<Sampler*> s;
    for (Sampler& one : samplers) s.push_back(&one);
    auto picked = m.SampleNext((*last)->data(), static_cast<int64_t>(seqs.size()), s);
    ASSERT_TRUE(picked.ok()) << picked.status().ToString();
    next->clear();
    for (const SampledToken& t : *picked) next->push_back(t.id);
  }

  // B sequences prefilled with 3 tokens each, then decode steps of one token each: every
  // decode step counts exactly ExpectedDecodeStep's bytes (S rows on the device) as step
  // traffic and no load traffic.
  void DecodeStepsCountWhatTheyCopy(CudaStepMode mode, int64_t B, int64_t S) {
    auto ckpt = Checkpoint::Open(Dir(), {});
    ASSERT_TRUE(ckpt.ok()) << ckpt.status().ToString();
    auto shard = CreateCudaShardModel(**ckpt, 0, mode);
    ASSERT_TRUE(shard.ok()) << shard.status().ToString();
    const ShardModel& m = **shard;
    std::vector<std::unique_ptr<SequenceCache>> seqs;
    std::vector<std::vector<int32_t>> tokens;
    std::vector<Sampler> samplers;
    for (int64_t b = 0; b < B; ++b) {
      seqs.push_back(m.NewSequence(64).value());
      tokens.push_back({static_cast<int32_t>(5 + b), 17, static_cast<int32_t>(300 - b)});
      samplers.push_back(*Sampler::Create(SamplerConfig{.greedy = true}));
    }
    std::vector<int32_t> next;
    ASSERT_NO_FATAL_FAILURE(Step(m, seqs, tokens, samplers, &next));  // the prefill
    const TransferBytes want = ExpectedDecodeStep(m.layer_end() - m.layer_begin(), B, S);
    for (int step = 0; step < 4; ++step) {
      for (int64_t b = 0; b < B; ++b) tokens[b] = {next[b]};
      const DeviceTransfers before = TransfersOf(0);
      ASSERT_NO_FATAL_FAILURE(Step(m, seqs, tokens, samplers, &next));
      const DeviceTransfers after = TransfersOf(0);
      const TransferBytes got = Since(before.step, after.step);
      EXPECT_EQ(got.host_to_device, want.host_to_device) << "decode step " << step;
      EXPECT_EQ(got.device_to_host, want.device_to_host) << "decode step " << step;
      EXPECT_EQ(Since(before.load, after.load).host_to_device, 0u) << "decode step " << step;
      EXPECT_LT(static_cast<double>(got.host_to_device + got.device_to_host) / B, 1e6);
    }
  }

};

TEST_F(CudaShardTransfers, LoadingCountsItsUploadsAsLoadTrafficOnly) {
  if (cuda::DeviceCount() == 0) GTEST_SKIP() << "no CUDA device";
  auto ckpt = Checkpoint::Open(Dir(), {});
  ASSERT_TRUE(ckpt.ok()) << ckpt.status().ToString();
  const DeviceTransfers before = TransfersOf(0);
  auto shard = CreateCudaShardModel(**ckpt, 0);
  ASSERT_TRUE(shard.ok()) << shard.status().ToString();
  const DeviceTransfers after = TransfersOf(0);
  // The head's weight alone is [vocab, H] in its checkpoint format (bf16 in tiny): uploaded.
  const uint64_t head = static_cast<uint64_t>((*shard)->config().vocab_size *
                                              (*shard)->config().hidden_size) * 2;
  EXPECT_GT(Since(before.load, after.load).host_to_device, head);
  EXPECT_EQ(Since(before.load, after.load).device_to_host, 0u);
  EXPECT_EQ(Since(before.step, after.step).host_to_device, 0u);
  EXPECT_EQ(Since(before.step, after.step).device_to_host, 0u);
}

TEST_F(CudaShardTransfers, GraphDecodeStepOfOneSequenceCountsExactlyItsCopies) {
  if (cuda::DeviceCount() == 0) GTEST_SKIP() << "no CUDA device";
  DecodeStepsCountWhatTheyCopy(CudaStepMode::kGraph, 1, 1);
}

TEST_F(CudaShardTransfers, EagerDecodeStepOfOneSequenceCountsExactlyItsCopies) {
  if (cuda::DeviceCount() == 0) GTEST_SKIP() << "no CUDA device";
  DecodeStepsCountWhatTheyCopy(CudaStepMode::kEager, 1, 1);
}

// Three sequences run in the bucket of 4: the padding row's X and row table entries count too.
TEST_F(CudaShardTransfers, GraphDecodeStepOfThreeSequencesCountsItsPaddingRow) {
  if (cuda::DeviceCount() == 0) GTEST_SKIP() << "no CUDA device";
  DecodeStepsCountWhatTheyCopy(CudaStepMode::kGraph, 3, 4);
}

// The figure docs/gpu.md gives for the bench preset (one worker holding everything, batch 1):
// under the 1 MB a token.
TEST(CudaShardTransferFigures, BenchPresetDecodeStepIsUnderOneMegabyteAToken) {
  auto cfg = PresetConfig("bench");
  ASSERT_TRUE(cfg.ok()) << cfg.status().ToString();
  const TransferBytes t = ExpectedDecodeStep(cfg->num_hidden_layers, 1, 1);
  std::printf("bench preset, batch-1 decode step: %llu bytes to the device, %llu back\n",
              static_cast<unsigned long long>(t.host_to_device),
              static_cast<unsigned long long>(t.device_to_host));
  EXPECT_LT(t.host_to_device + t.device_to_host, 1000000u);
}

}  // namespace
}  // namespace fm
