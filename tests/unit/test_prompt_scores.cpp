// Prompt logprobs (GenerateRequest.prompt_logprobs, completions' echo): ScoreToken against a
// float64 log_softmax and the greedy sampler's bits, and a two-stage pipeline scoring a prompt
// sent in chunks (StepItem.next_token) against the whole model's logits of one prefill.
#include <gtest/gtest.h>

#include <bit>
#include <cmath>
#include <memory>
#include <thread>

#include "common/thread_pool.h"
#include "model/checkpoint.h"
#include "model/forward.h"
#include "model/kv_cache.h"
#include "model/mkmodel.h"
#include "model/sampler.h"
#include "net/tcp_transport.h"
#include "tests/unit/stage_test_util.h"
#include "tests/unit/test_checkpoint_util.h"
#include "worker/data_plane.h"
#include "worker/shard_runtime.h"
#include "worker/stage_executor.h"

namespace fm {
namespace {

using namespace std::chrono_literals;

TEST(ScoreToken, IsTheLogSoftmaxOfTheRawLogitsWithTheGreedySamplersBits) {
  const std::vector<float> logits = {0.5f, 2.0f, -1.25f, 2.0f, -INFINITY, 1.0f};
  double sum = 0;
  for (float l : logits) sum += std::exp(static_cast<double>(l));
  for (int32_t id : {0, 1, 2, 3, 5}) {
    auto s = ScoreToken(logits, id, 0);
    ASSERT_TRUE(s.ok()) << s.status().ToString();
    EXPECT_EQ(s->id, id);
    EXPECT_NEAR(s->logprob, logits[id] - std::log(sum), 1e-6) << id;
    EXPECT_TRUE(s->top.empty());
  }
  EXPECT_EQ(ScoreToken(logits, 4, 0)->logprob, -INFINITY);
  // vLLM's rank: the ids with a logit at least as large, itself included (ties: the last rank).
  const std::pair<int32_t, int64_t> ranks[] = {{1, 2}, {3, 2}, {5, 3}, {0, 4}, {2, 5}, {4, 6}};
  for (auto [id, rank] : ranks) EXPECT_EQ(ScoreToken(logits, id, 0)->rank, rank) << id;
  // Top: larger logit first, the lower id among equal ones; -inf never listed.
  auto s = ScoreToken(logits, 2, 20);
  ASSERT_TRUE(s.ok());
  ASSERT_EQ(s->top.size(), 5u);
  const int32_t order[] = {1, 3, 5, 0, 2};
  for (size_t k = 0; k < 5; ++k) {
    EXPECT_EQ(s->top[k].id, order[k]) << k;
    EXPECT_EQ(s->top[k].logprob, ScoreToken(logits, order[k], 0)->logprob) << k;
  }
  EXPECT_EQ(s->top.back().logprob, s->logprob);
  // The bits a greedy sampler reports for the same row (its pick and its alternatives).
  auto greedy = Sampler::Create({.greedy = true, .top_logprobs = 3});
  ASSERT_TRUE(greedy.ok());
  auto pick = greedy->Sample(logits);
  ASSERT_TRUE(pick.ok());
  ASSERT_EQ(pick->id, 1);
  EXPECT_EQ(std::bit_cast<uint32_t>(ScoreToken(logits, 1, 0)->logprob), std::bit_cast<uint32_t>(pick->logprob));
  ASSERT_EQ(pick->top.size(), 3u);
  for (size_t k = 0; k < 3; ++k) EXPECT_EQ(pick->top[k], s->top[k]) << k;
}

TEST(ScoreToken, RefusesBadLogitsAndIdsNamingThem) {
  auto message = [](std::vector<float> l, int32_t id) { return ScoreToken(l, id, 1).status().message(); };
  EXPECT_EQ(message({1.0f, NAN}, 0), "logits[1] is NaN");
  EXPECT_EQ(message({1.0f, INFINITY}, 0), "logits[1] is +inf");
  EXPECT_EQ(message({-INFINITY, -INFINITY}, 0), "logits: no finite value among 2");
  EXPECT_EQ(message({1.0f, 2.0f}, 2), "token 2 is outside the 2 logits");
  EXPECT_EQ(message({1.0f, 2.0f}, -1), "token -1 is outside the 2 logits");
  EXPECT_EQ(Sampler::Create({.prompt_logprobs = 21}).status().message(),
            "prompt_logprobs: 21 (must be in [0, 20], or -1: off)");
  EXPECT_TRUE(Sampler::Create({.prompt_logprobs = 0}).ok());
}

const std::string& Tiny() {
  static const std::string d = [] {
    const std::string p = testing_ck::TempDir("prompt_scores_tiny");
    EXPECT_TRUE(WritePresetCheckpoint(p, "tiny", 11).ok());
    return p;
  }();
  return d;
}

ShardPlacement Stage(int stage, int num_stages, int64_t begin, int64_t end) {
  return testing_stage::StagePlacement(Tiny(), stage, num_stages, begin, end);
}

std::unique_ptr<net::Transport> Transport(const std::string& name) { return testing_stage::LoopbackTransport(name); }

// Two stages joined on loopback, as a worker pair runs them.
struct TwoStages {
  std::unique_ptr<net::Transport> t0 = Transport("s0"), t1 = Transport("s1");
  ShardRuntime r0{1}, r1{1};
  StageExecutor e0{&r0}, e1{&r1};
  ActivationReceiver recv1{t1.get(), &e1};
  TwoStages() {
    EXPECT_TRUE(r0.Load(Stage(0, 2, 0, 2)).ok());
    EXPECT_TRUE(r1.Load(Stage(1, 2, 2, -1)).ok());
    e0.SetNext(NewTransportActivationSink(t0.get(), "s1", t1->listen_address(), net::FrameDType::kF32));
    recv1.SetPeer("s0");
  }
  // Step `id` on both stages; the last stage's results.
  Status Step(uint64_t id, const std::vector<StepSlice>& slices, std::vector<SampledId>* sampled,
              std::vector<PromptScores>* scores) {
    Status s0;
    const auto deadline = StageExecutor::Clock::now() + 20s;
    std::thread first([&] { s0 = e0.RunStep(id, id - 1, slices, deadline, nullptr); });
    Status s1 = e1.RunStep(id, id - 1, slices, deadline, sampled, scores);
    first.join();
    return s0.ok() ? s1 : s0;
  }
};

// The whole model's logits of every row of one prefill of `prompt` (the reference).
std::vector<float> PrefillLogits(const std::vector<int32_t>& prompt) {
  auto ck = Checkpoint::Open(Tiny());
  EXPECT_TRUE(ck.ok());
  ThreadPool pool(1);
  auto m = ShardModel::Create(**ck, &pool);
  EXPECT_TRUE(m.ok());
  const ModelConfig& c = (*m)->config();
  const int64_t row = c.hc_mult * c.hidden_size, T = static_cast<int64_t>(prompt.size());
  auto cache = (*m)->NewSequence(T).value();
  std::vector<float> x(T * row), logits(T * c.vocab_size);
  EXPECT_TRUE((*m)->Embed(prompt, x.data()).ok());
  BatchItem item{cache.get(), prompt};
  EXPECT_TRUE((*m)->ForwardLayers(std::span<const BatchItem>(&item, 1), x.data()).ok());
  EXPECT_TRUE((*m)->Logits(x.data(), T, logits.data()).ok());
  return logits;
}

// A prompt in chunks of 3, 2 and 2 tokens beside a sequence that does not score its prompt:
// each chunk scores the token after each of its rows (the next chunk's first through
// next_token), with the bits of ScoreToken on one whole prefill's logits; the last chunk's last
// row is sampled, not scored; the other sequence gets no scores.
TEST(PromptScores, AChunkedPromptScoresEachTokenAsOneWholePrefillWould) {
  const std::vector<int32_t> prompt = {5, 17, 3, 90, 41, 8, 23};
  const std::vector<float> ref = PrefillLogits(prompt);
  TwoStages p;
  SamplerConfig scored{.greedy = true};
  scored.prompt_logprobs = 2;
  for (ShardRuntime* r : {&p.r0, &p.r1}) {
    ASSERT_TRUE(r->StartSequence(1, 32, scored).ok());
    ASSERT_TRUE(r->StartSequence(2, 32, {.greedy = true}).ok());
  }
  const int64_t V = p.r1.config().vocab_size;
  std::vector<SampledToken> got;
  const size_t cuts[] = {0, 3, 5, 7};
  for (size_t c = 0; c < 3; ++c) {
    StepSlice chunk{1, {prompt.begin() + cuts[c], prompt.begin() + cuts[c + 1]}};
    chunk.sample = c == 2;
    if (!chunk.sample) chunk.next_token = prompt[cuts[c + 1]];
    std::vector<SampledId> sampled;
    std::vector<PromptScores> scores;
    ASSERT_TRUE(p.Step(c + 1, {StepSlice{2, {7, 7}}, chunk}, &sampled, &scores).ok());
    ASSERT_EQ(scores.size(), 1u) << "chunk " << c;
    EXPECT_EQ(scores[0].seq_id, 1u);
    EXPECT_EQ(scores[0].first, static_cast<int64_t>(cuts[c]) + 1);
    EXPECT_TRUE(scores[0].error.ok());
    got.insert(got.end(), scores[0].tokens.begin(), scores[0].tokens.end());
    EXPECT_EQ(sampled.size(), c == 2 ? 2u : 1u);
  }
  ASSERT_EQ(got.size(), prompt.size() - 1);
  for (size_t i = 0; i + 1 < prompt.size(); ++i) {
    auto want = ScoreToken({ref.data() + i * V, static_cast<size_t>(V)}, prompt[i + 1], 2);
    ASSERT_TRUE(want.ok());
    EXPECT_EQ(got[i].id, prompt[i + 1]);
    EXPECT_EQ(std::bit_cast<uint32_t>(got[i].logprob), std::bit_cast<uint32_t>(want->logprob)) << "position " << i + 1;
    EXPECT_EQ(got[i].top, want->top) << "position " << i + 1;
  }
}

// A chunk with more to come that would score its last row without next_token fails the step
// naming the sequence (the coordinator always sends it); one past the vocabulary likewise.
TEST(PromptScores, AContinuingChunkNeedsItsNextToken) {
  TwoStages p;
  SamplerConfig scored{.greedy = true};
  scored.prompt_logprobs = 0;
  for (ShardRuntime* r : {&p.r0, &p.r1}) ASSERT_TRUE(r->StartSequence(1, 32, scored).ok());
  StepSlice chunk{1, {5, 6}};
  chunk.sample = false;
  std::vector<SampledId> sampled;
  std::vector<PromptScores> scores;
  Status st = p.Step(1, {chunk}, &sampled, &scores);
  EXPECT_EQ(st.message(), "sequence 1: a prompt chunk with more to come is scored, but has no next_token");
  const int64_t V = p.r1.config().vocab_size;
  chunk.tokens = {7};
  chunk.next_token = static_cast<int32_t>(V);
  st = p.Step(2, {chunk}, &sampled, &scores);
  EXPECT_EQ(st.message(), "sequence 1: next_token " + std::to_string(V) + " is outside the vocabulary of " +
                              std::to_string(V));
}

}  // namespace
}  // namespace fm
