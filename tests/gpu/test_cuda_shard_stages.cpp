// Device shards as pipeline stages, against the CPU and against one device shard: a stage of
// layers [2, 5) on a given X within 1e-3 of the CPU stage; greedy decode with X resident on the
// device from the embedding to the head == the path through host memory bit for bit (and within
// 1e-3 of the CPU); two device stages handing X over device to device (as an NCCL link does) ==
// one device shard bit for bit.
#include <gtest/gtest.h>

#include <cstring>
#include <random>
#include <vector>

#include "common/thread_pool.h"
#include "kernels/cuda/device.h"
#include "model/sampler.h"
#include "tests/gpu/cuda_shard_test.h"
#include "tests/model_test_util.h"

namespace fm {
namespace {

using modeltest::RowRelErr;

TEST_F(CudaShardTest, PipelineStageMatchesCpuStage) {
  if (cuda::DeviceCount() == 0) GTEST_SKIP() << "no CUDA device";
  ThreadPool pool(2);
  ShardSelection sel;
  sel.layer_begin = 2;
  sel.layer_end = 5;
  sel.embed = false;
  sel.head = false;
  Pair p = Open(&pool, sel);
  ASSERT_TRUE(p.gpu);
  EXPECT_FALSE(p.gpu->has_embed());
  EXPECT_FALSE(p.gpu->has_head());
  const auto& cfg = p.cpu->config();
  const auto toks = Tokens(24, 41);
  std::mt19937 rng(5);
  std::normal_distribution<float> nd(0.0f, 1.0f);
  std::vector<float> xc(toks.size() * cfg.hc_mult * cfg.hidden_size);
  for (float& v : xc) v = nd(rng);
  auto xg = modeltest::ToShard(*p.gpu, xc);
  ASSERT_TRUE(xg.ok()) << xg.status().ToString();
  auto cc = p.cpu->NewSequence(128).value(), gc = p.gpu->NewSequence(128).value();
  const BatchItem ci{cc.get(), toks}, gi{gc.get(), toks};
  ASSERT_TRUE(p.cpu->ForwardLayers({&ci, 1}, xc.data()).ok());
  const Status st = p.gpu->ForwardLayers({&gi, 1}, (*xg)->data());
  ASSERT_TRUE(st.ok()) << st.ToString();
  EXPECT_LT(RowRelErr(modeltest::ToHostRows(**xg), xc, cfg.hc_mult * cfg.hidden_size), 1e-3);
}

// Greedy decode of `n` tokens after `prompt` on `first` (embedding, layers [0, cut)) then `last`
// (layers [cut, L), head; null: `first` holds everything), X resident in device buffers: ids in,
// (id, logprob) out, and between the stages a device-to-device row copy, as an NCCL link
// delivers it. host_hop: X goes to the host and back between embed, layers and head instead
// (the path before X was resident). Each step's logits (of the same buffer) go to *logits.
struct Picked {
  std::vector<int32_t> ids;
  std::vector<float> logprobs, logits;
};
Picked ResidentDecode(const ShardModel& first, const ShardModel* last, std::vector<int32_t> prompt,
                      int n, bool host_hop) {
  Picked out;
  const ShardModel& head = last ? *last : first;
  auto c0 = first.NewSequence(256).value();
  auto c1 = last ? last->NewSequence(256).value() : nullptr;
  auto x0 = first.NewActivations();
  auto x1 = head.NewActivations();
  EXPECT_TRUE(x0.ok() && x1.ok());
  if (!x0.ok() || !x1.ok()) return out;
  EXPECT_TRUE((*x0)->device() && (*x1)->device());
  Sampler greedy = *Sampler::Create(SamplerConfig{.greedy = true});
  auto hop = [&](Activations& x) {  // the old path's round trip through host memory
    if (!host_hop) return;
    std::vector<float> h = modeltest::ToHostRows(x);
    ASSERT_TRUE(x.CopyFromHost(0, x.rows(), h.data()).ok());
  };
  std::vector<int32_t> toks = std::move(prompt);
  for (int i = 0; i < n; ++i) {
    const int64_t T = static_cast<int64_t>(toks.size());
    EXPECT_TRUE((*x0)->Resize(T).ok() && (*x1)->Resize(T).ok());
    EXPECT_TRUE(first.Embed(toks, (*x0)->data()).ok());
    hop(**x0);
    const BatchItem i0{c0.get(), toks};
    Status st = first.ForwardLayers({&i0, 1}, (*x0)->data());
    EXPECT_TRUE(st.ok()) << st.ToString();
    Activations* x = x0->get();
    if (last) {  // the stage hop: device rows to the next stage's device buffer
      EXPECT_TRUE((*x1)->CopyRows(0, **x0, 0, T).ok());
      const BatchItem i1{c1.get(), toks};
      st = last->ForwardLayers({&i1, 1}, (*x1)->data());
      EXPECT_TRUE(st.ok()) << st.ToString();
      x = x1->get();
    }
    hop(*x);
    const float* final_row = x->row(T - 1);
    std::vector<float> lg(head.config().vocab_size);
    EXPECT_TRUE(head.Logits(final_row, 1, lg.data()).ok());
    out.logits.insert(out.logits.end(), lg.begin(), lg.end());
    Sampler* const s[] = {&greedy};
    auto picked = head.SampleNext(final_row, 1, s);
    EXPECT_TRUE(picked.ok()) << picked.status().ToString();
    if (!picked.ok()) return out;
    out.ids.push_back((*picked)[0].id);
    out.logprobs.push_back((*picked)[0].logprob);
    toks = {(*picked)[0].id};
  }
  return out;
}

// A device shard holding everything decodes with X on the device from the embedding to the
// head: the same tokens and logprobs, bit for bit, as with X brought to the host between embed,
// layers and head, and each step's logits within 1e-3 of the CPU shard fed the same tokens.
TEST_F(CudaShardTest, ResidentDecodeEqualsTheHostXPathAndMatchesCpu) {
  if (cuda::DeviceCount() == 0) GTEST_SKIP() << "no CUDA device";
  ThreadPool pool(2);
  Pair p = Open(&pool);
  ASSERT_TRUE(p.gpu);
  const std::vector<int32_t> prompt = Tokens(7, 71);
  const Picked resident = ResidentDecode(*p.gpu, nullptr, prompt, 12, false);
  const Picked hopped = ResidentDecode(*p.gpu, nullptr, prompt, 12, true);
  ASSERT_EQ(resident.ids.size(), 12u);
  EXPECT_EQ(resident.ids, hopped.ids);
  EXPECT_EQ(std::memcmp(resident.logprobs.data(), hopped.logprobs.data(),
                        resident.logprobs.size() * sizeof(float)), 0);
  EXPECT_EQ(std::memcmp(resident.logits.data(), hopped.logits.data(),
                        resident.logits.size() * sizeof(float)), 0);
  // The CPU shard over the tokens the device picked: each step's last-row logits.
  const int64_t V = p.cpu->config().vocab_size;
  auto cc = p.cpu->NewSequence(256).value();
  std::vector<int32_t> toks = prompt;
  std::vector<float> cpu;
  for (size_t i = 0; i < resident.ids.size(); ++i) {
    std::vector<float> lg;
    const BatchItem item{cc.get(), toks};
    ASSERT_TRUE(modeltest::RunItems(*p.cpu, {&item, 1}, &lg).ok());
    cpu.insert(cpu.end(), lg.end() - V, lg.end());
    toks = {resident.ids[i]};
  }
  EXPECT_LT(RowRelErr(resident.logits, cpu, V), 1e-3);
}

// Two device stages (pp2: embedding and layers [0, 3); layers [3, 6) and the head) passing a
// device X give one device shard's tokens, logprobs and logits bit for bit.
TEST_F(CudaShardTest, TwoDeviceStagesPassingADeviceXEqualOneDeviceShardBitForBit) {
  if (cuda::DeviceCount() == 0) GTEST_SKIP() << "no CUDA device";
  ThreadPool pool(2);
  Pair whole = Open(&pool);
  ShardSelection a, b;
  a.layer_end = 3;
  a.head = false;
  b.layer_begin = 3;
  b.embed = false;
  Pair first = Open(&pool, a), last = Open(&pool, b);
  ASSERT_TRUE(whole.gpu && first.gpu && last.gpu);
  const std::vector<int32_t> prompt = Tokens(9, 72);
  const Picked one = ResidentDecode(*whole.gpu, nullptr, prompt, 10, false);
  const Picked two = ResidentDecode(*first.gpu, last.gpu.get(), prompt, 10, false);
  ASSERT_EQ(one.ids.size(), 10u);
  EXPECT_EQ(two.ids, one.ids);
  EXPECT_EQ(std::memcmp(two.logprobs.data(), one.logprobs.data(),
                        one.logprobs.size() * sizeof(float)), 0);
  EXPECT_EQ(std::memcmp(two.logits.data(), one.logits.data(), one.logits.size() * sizeof(float)),
            0);
}

}  // namespace
}  // namespace fm
