// Chunked prefill on a device shard (limits.max_step_tokens): ShardRuntime::Sample gathers the
// last row of each sampled slice only, wherever it sits in X, and a prompt chunk with more to
// come gets no token (its sampler's RNG does not move).
#include <gtest/gtest.h>

#include <chrono>
#include <span>
#include <string>
#include <vector>

#include "kernels/cuda/device.h"
#include "tests/gpu/cuda_shard_test.h"
#include "tests/model_test_util.h"
#include "worker/shard_runtime.h"
#include "worker/stage_executor.h"

namespace fm {
namespace {

using namespace std::chrono_literals;

struct Runtime {
  ShardRuntime r{1};
  StageExecutor e{&r};
  uint64_t step = 0;
  Runtime() {
    EXPECT_TRUE(r.Load(TinyOnDevice()).ok());
    SamplerConfig seeded;
    seeded.temperature = 0.9f, seeded.seed = 5;
    for (uint64_t seq : {1, 2}) EXPECT_TRUE(r.StartSequence(seq, 256, seeded).ok());
  }
  std::vector<SampledId> Run(std::vector<StepSlice> slices) {
    std::vector<SampledId> out;
    ++step;
    const Status s = e.RunStep(step, step - 1, std::move(slices), StageExecutor::Clock::now() + 60s, &out);
    EXPECT_TRUE(s.ok()) << s.ToString();
    return out;
  }
};

TEST(CudaShardChunks, AChunkGetsNoTokenAndTheSampledSliceBehindItIsItsOwnRow) {
  if (cuda::DeviceCount() == 0) GTEST_SKIP() << "no CUDA device";
  Runtime chunked, whole;
  // Sequence 1's prompt in two chunks beside sequence 2's whole prompt; and all at once.
  const auto c1 = chunked.Run({{1, {5, 6, 7}, /*sample=*/false}, {2, {9, 10, 11, 12}, true}});
  const auto w1 = whole.Run({{2, {9, 10, 11, 12}, true}});
  ASSERT_EQ(c1.size(), 1u) << "a chunk with more to come got a token";
  ASSERT_EQ(w1.size(), 1u);
  EXPECT_EQ(c1[0].seq_id, 2u);
  EXPECT_EQ(c1[0].id, w1[0].id);
  EXPECT_EQ(c1[0].logprob, w1[0].logprob) << "sequence 2's row is not the one sampled";
  const auto c2 = chunked.Run({{1, {8}, true}});
  const auto w2 = whole.Run({{1, {5, 6, 7, 8}, true}});
  ASSERT_EQ(c2.size(), 1u);
  ASSERT_EQ(w2.size(), 1u);
  EXPECT_EQ(c2[0].seq_id, 1u);
  EXPECT_EQ(c2[0].id, w2[0].id) << "the first chunk moved sequence 1's sampler";
}

// A fork on the device (StepSlice.fork_from, CudaShardModel::CopySequence): sequence 2 takes
// sequence 1's state after a 124-token prefix (ring, ratio-4 entries, indexer keys, both
// compressors' pending rows) and decodes bit for bit as sequence 1 does in a runtime without
// the fork, through the ratio-128 window that completes at 127; sequence 1 itself is untouched.
TEST(CudaShardChunks, AForkDecodesAsItsSourceWould) {
  if (cuda::DeviceCount() == 0) GTEST_SKIP() << "no CUDA device";
  Runtime forked, plain;
  const auto prompt = modeltest::RandomTokens(125, 17, 512);
  const std::vector<int32_t> prefix(prompt.begin(), prompt.end() - 1);
  EXPECT_TRUE(forked.Run({{1, prefix, false}}).empty());
  EXPECT_TRUE(plain.Run({{1, prefix, false}}).empty());
  auto f = forked.Run({{2, {prompt.back()}, true, /*fork_from=*/1}});
  auto p = plain.Run({{1, {prompt.back()}, true}});
  const auto first = p;
  for (int t = 0; t < 5 && f.size() == 1 && p.size() == 1; ++t) {
    EXPECT_EQ(f[0].seq_id, 2u);
    EXPECT_EQ(f[0].id, p[0].id) << "token " << t;
    EXPECT_EQ(f[0].logprob, p[0].logprob) << "token " << t;
    f = forked.Run({{2, {f[0].id}, true}});
    p = plain.Run({{1, {p[0].id}, true}});
  }
  ASSERT_EQ(f.size(), 1u);
  ASSERT_EQ(p.size(), 1u);
  // The source, after its fork: its own last token gives what it gave without one (the first
  // draw of a sampler seeded alike).
  const auto got = forked.Run({{1, {prompt.back()}, true}});
  ASSERT_EQ(first.size(), 1u);
  ASSERT_EQ(got.size(), 1u);
  EXPECT_EQ(got[0].id, first[0].id);
  EXPECT_EQ(got[0].logprob, first[0].logprob);
}

// Prompt logprobs on a device shard (ShardRuntime::ScorePrompts through the device's ScoreNext,
// scored where the logits are): a 40-token prompt in chunks of 16, 16 and 8 (the head's
// device steps hold 32 rows) scores each token after the first as the CPU shard does, within
// 1e-3, with the same ids.
TEST(CudaShardChunks, APromptsScoresOnTheDeviceAreTheCpuShards) {
  if (cuda::DeviceCount() == 0) GTEST_SKIP() << "no CUDA device";
  ShardPlacement cpu_placement = TinyOnDevice();
  cpu_placement.cuda_device = -1;
  ShardRuntime gpu{1}, cpu{1};
  StageExecutor ge{&gpu}, ce{&cpu};
  ASSERT_TRUE(gpu.Load(TinyOnDevice()).ok());
  ASSERT_TRUE(cpu.Load(cpu_placement).ok());
  SamplerConfig scored{.greedy = true};
  scored.prompt_logprobs = 3;
  ASSERT_TRUE(gpu.StartSequence(1, 64, scored).ok());
  ASSERT_TRUE(cpu.StartSequence(1, 64, scored).ok());
  const auto prompt = modeltest::RandomTokens(40, 23, 512);
  std::vector<SampledToken> g, c;
  const size_t cuts[] = {0, 16, 32, 40};
  for (uint64_t k = 0; k < 3; ++k) {
    StepSlice chunk{1, {prompt.begin() + cuts[k], prompt.begin() + cuts[k + 1]}};
    chunk.sample = k == 2;
    if (!chunk.sample) chunk.next_token = prompt[cuts[k + 1]];
    for (auto [e, out] : {std::pair{&ge, &g}, std::pair{&ce, &c}}) {
      std::vector<SampledId> sampled;
      std::vector<PromptScores> scores;
      const Status s = e->RunStep(k + 1, k, {chunk}, StageExecutor::Clock::now() + 60s, &sampled, &scores);
      ASSERT_TRUE(s.ok()) << s.ToString();
      ASSERT_EQ(scores.size(), 1u);
      EXPECT_EQ(scores[0].first, static_cast<int64_t>(cuts[k]) + 1);
      out->insert(out->end(), scores[0].tokens.begin(), scores[0].tokens.end());
    }
  }
  ASSERT_EQ(g.size(), 39u);
  ASSERT_EQ(c.size(), 39u);
  for (size_t i = 0; i < 39; ++i) {
    EXPECT_EQ(g[i].id, prompt[i + 1]);
    EXPECT_NEAR(g[i].logprob, c[i].logprob, 1e-3) << "position " << i + 1;
    ASSERT_EQ(g[i].top.size(), 3u);
    ASSERT_EQ(c[i].top.size(), 3u);
    EXPECT_NEAR(g[i].top[0].logprob, c[i].top[0].logprob, 1e-3) << "position " << i + 1;
    // The most likely token, unless the CPU's first two are too close to call.
    if (c[i].top[0].logprob - c[i].top[1].logprob > 1e-2) {
      EXPECT_EQ(g[i].top[0].id, c[i].top[0].id) << i + 1;
    }
  }
}

// ScoreNext where the logits are: each row's score of a known token is ScoreToken's over the
// device's own logits (ids, ranks and alternatives' ids exactly, logprobs within 1e-5), over two
// device steps (40 rows, kMaxStepRows 32); a target outside the vocabulary is that row's error.
TEST_F(CudaShardTest, DeviceScoresAreScoreTokenOnTheSameLogits) {
  if (cuda::DeviceCount() == 0) GTEST_SKIP() << "no CUDA device";
  ThreadPool pool(2);
  Pair p = Open(&pool);
  ASSERT_TRUE(p.gpu);
  const auto a = Tokens(40, 47);
  auto seq = p.gpu->NewSequence(64).value();
  const BatchItem item{seq.get(), a};
  std::vector<float> lg, state;
  ASSERT_TRUE(modeltest::RunItems(*p.gpu, {&item, 1}, &lg, &state).ok());
  const int64_t V = p.gpu->config().vocab_size;
  auto x = modeltest::ToShard(*p.gpu, state);
  ASSERT_TRUE(x.ok()) << x.status().ToString();
  std::vector<float> logits(40 * V);
  ASSERT_TRUE(p.gpu->Logits((*x)->data(), 40, logits.data()).ok());
  std::vector<int32_t> targets(a.begin() + 1, a.end());
  targets.push_back(static_cast<int32_t>(V));
  auto got = p.gpu->ScoreNext((*x)->data(), targets, 5);
  ASSERT_TRUE(got.ok()) << got.status().ToString();
  ASSERT_EQ(got->size(), 40u);
  for (size_t r = 0; r < 39; ++r) {
    auto want = ScoreToken(std::span(&logits[r * V], V), targets[r], 5);
    ASSERT_TRUE(want.ok()) << want.status().ToString();
    const SampledToken& g = (*got)[r];
    ASSERT_TRUE(g.error.ok()) << "row " << r << ": " << g.error.ToString();
    EXPECT_EQ(g.id, targets[r]);
    EXPECT_NEAR(g.logprob, want->logprob, 1e-5) << "row " << r;
    EXPECT_EQ(g.rank, want->rank) << "row " << r;
    ASSERT_EQ(g.top.size(), want->top.size()) << "row " << r;
    for (size_t j = 0; j < g.top.size(); ++j) {
      EXPECT_EQ(g.top[j].id, want->top[j].id) << "row " << r << " alternative " << j;
      EXPECT_NEAR(g.top[j].logprob, want->top[j].logprob, 1e-5) << "row " << r;
    }
  }
  EXPECT_EQ((*got)[39].id, -1);
  EXPECT_NE((*got)[39].error.message().find("is outside the"), std::string::npos)
      << (*got)[39].error.ToString();
}

// Whether a device prefill's bits depend on where it is cut (what a fork of a shared prompt's
// choices relies on to equal a separate request, docs/architecture.md "Shared prompts"): a
// prompt whole against the same prompt as its first P - 1 tokens and then the last, P within one
// device step (20) and across two (40, kMaxStepRows 32): every row's logits, bit for bit.
TEST_F(CudaShardTest, APrefillsBitsDoNotDependOnWhereItIsCut) {
  if (cuda::DeviceCount() == 0) GTEST_SKIP() << "no CUDA device";
  ThreadPool pool(2);
  Pair p = Open(&pool);
  ASSERT_TRUE(p.gpu);
  for (int P : {20, 40}) {
    const auto toks = Tokens(P, 31);
    const std::span<const int32_t> all(toks);
    auto whole = p.gpu->NewSequence(64).value(), cut = p.gpu->NewSequence(64).value();
    std::vector<float> w, c;
    const BatchItem wi{whole.get(), all}, ci{cut.get(), all.subspan(0, P - 1)}, li{cut.get(), all.subspan(P - 1)};
    ASSERT_TRUE(modeltest::RunItems(*p.gpu, {&wi, 1}, &w).ok());
    ASSERT_TRUE(modeltest::RunItems(*p.gpu, {&ci, 1}, &c).ok());
    ASSERT_TRUE(modeltest::RunItems(*p.gpu, {&li, 1}, &c).ok());
    ASSERT_EQ(w.size(), c.size());
    EXPECT_TRUE(w == c) << "P = " << P << ": the cut prefill's logits differ";
  }
}

}  // namespace
}  // namespace fm
