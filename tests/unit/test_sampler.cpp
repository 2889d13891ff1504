#include <gtest/gtest.h>
#include <unistd.h>

#include <algorithm>
#include <bit>

#include <cmath>
#include <filesystem>
#include <limits>
#include <vector>

#include "common/thread_pool.h"
#include "model/checkpoint.h"
#include "model/forward.h"
#include "model/generate.h"
#include "model/kv_cache.h"
#include "model/mkmodel.h"
#include "model/sampler.h"
#include "model/tokenizer.h"

namespace fm {
namespace {

Sampler Make(SamplerConfig cfg) {
  auto s = Sampler::Create(cfg);
  EXPECT_TRUE(s.ok()) << s.status().ToString();
  return *s;
}

// Sample draws exactly once per non-greedy pick, so SampleWith(l, DrawUniform()) on a twin
// sampler (what the device path does) gives the same tokens in the same order.
TEST(Sampler, SampleWithTheDrawEqualsSample) {
  const std::vector<float> logits = {0.1f, 2.0f, -1.0f, 1.5f, 1.5f, 0.3f, -INFINITY, 0.9f};
  SamplerConfig cfg;
  cfg.temperature = 1.4f, cfg.top_k = 5, cfg.top_p = 0.9f, cfg.seed = 77;
  Sampler a = Make(cfg), b = Make(cfg);
  for (int i = 0; i < 50; ++i) {
    auto x = a.Sample(logits);
    auto y = b.SampleWith(logits, b.DrawUniform());
    ASSERT_TRUE(x.ok() && y.ok());
    EXPECT_EQ(x->id, y->id) << "draw " << i;
    EXPECT_EQ(x->logprob, y->logprob) << "draw " << i;
  }
}

// docs/api.md's walk, by hand. Weights exp(l - 2) of {0, 2, 0, 1}: {0.135, 1, 0.135, 0.368},
// total 1.639; u = 0.75 asks for a running sum past 1.229. Untruncated, ids are walked in id
// order (0.135, 1.135, 1.271: id 2); with top-p they are sorted first (1, 1.368: id 3).
TEST(Sampler, UntruncatedWalksIdsInIdOrderTruncatedInLogitOrder) {
  const std::vector<float> logits = {0.f, 2.f, 0.f, 1.f};
  SamplerConfig cfg;
  cfg.temperature = 1.f;
  Sampler plain = Make(cfg);
  auto a = plain.SampleWith(logits, 0.75);
  ASSERT_TRUE(a.ok());
  EXPECT_EQ(a->id, 2);
  cfg.top_p = 0.999f;
  Sampler nucleus = Make(cfg);
  auto b = nucleus.SampleWith(logits, 0.75);
  ASSERT_TRUE(b.ok());
  EXPECT_EQ(b->id, 3);
}

TEST(Rng, KnownSequence) {
  // splitmix64(0) starts with 0xE220A8397B1DCDAF: the first word of the xoshiro state.
  // xoshiro256** output 0 is rotl(s1 * 5, 7) * 9, independent of s0: check it from s1.
  uint64_t x = 0;
  auto split = [&x] {
    uint64_t z = (x += 0x9E3779B97F4A7C15ull);
    z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
    z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
    return z ^ (z >> 31);
  };
  EXPECT_EQ(split(), 0xE220A8397B1DCDAFull);
  uint64_t s1 = split();
  uint64_t m = s1 * 5;
  Rng rng(0);
  EXPECT_EQ(rng.Next(), ((m << 7) | (m >> 57)) * 9);
  Rng a(42), b(42), c(43);
  for (int i = 0; i < 100; ++i) {
    double u = a.Uniform();
    EXPECT_EQ(u, b.Uniform());
    EXPECT_GE(u, 0.0);
    EXPECT_LT(u, 1.0);
  }
  EXPECT_NE(Rng(42).Next(), c.Next());
}

TEST(Sampler, GreedyArgmaxTiesToLowerIdAndLogprob) {
  Sampler s = Make({.greedy = true});
  std::vector<float> logits = {1.0f, 3.0f, 3.0f, 2.0f};
  auto r = s.Sample(logits);
  ASSERT_TRUE(r.ok());
  EXPECT_EQ(r->id, 1);
  double lse = std::log(std::exp(1.0) + 2 * std::exp(3.0) + std::exp(2.0));
  EXPECT_NEAR(r->logprob, 3.0 - lse, 1e-6);
  // temperature 0 is greedy too
  Sampler t0 = Make({.temperature = 0.0f});
  EXPECT_EQ(t0.Sample(logits)->id, 1);
  EXPECT_TRUE(t0.is_greedy());
}

TEST(Sampler, ValidationNamesTheField) {
  auto err = [](SamplerConfig c) { return Sampler::Create(c).status().message(); };
  EXPECT_NE(err({.temperature = -0.5f}).find("temperature"), std::string::npos);
  EXPECT_NE(err({.temperature = NAN}).find("temperature"), std::string::npos);
  EXPECT_NE(err({.top_p = 0.0f}).find("top_p"), std::string::npos);
  EXPECT_NE(err({.top_p = 1.5f}).find("top_p"), std::string::npos);
  EXPECT_NE(err({.top_k = -1}).find("top_k"), std::string::npos);
  EXPECT_NE(err({.top_logprobs = -1}).find("top_logprobs"), std::string::npos);
  EXPECT_NE(err({.repetition_penalty = 0.0f}).find("repetition_penalty"), std::string::npos);
  EXPECT_NE(err({.repetition_penalty = INFINITY}).find("repetition_penalty"), std::string::npos);
  EXPECT_NE(err({.frequency_penalty = 2.5f}).find("frequency_penalty"), std::string::npos);
  EXPECT_NE(err({.presence_penalty = -2.5f}).find("presence_penalty"), std::string::npos);
  EXPECT_NE(err({.presence_penalty = NAN}).find("presence_penalty"), std::string::npos);
  EXPECT_NE(err({.min_p = 1.5f}).find("min_p"), std::string::npos);
  EXPECT_NE(err({.min_p = -0.1f}).find("min_p"), std::string::npos);
  EXPECT_NE(err({.logit_bias = {{5, 100.5f}}}).find("logit_bias"), std::string::npos);
  EXPECT_NE(err({.logit_bias = {{-1, 1.0f}}}).find("logit_bias"), std::string::npos);
  EXPECT_NE(err({.min_tokens = -1}).find("min_tokens"), std::string::npos);
  EXPECT_NE(err({.top_logprobs = kMaxTopLogprobs + 1}).find("top_logprobs"), std::string::npos);
  EXPECT_EQ(Sampler::Create({.top_logprobs = kMaxTopLogprobs}).status().code(), Code::kOk);
  EXPECT_EQ(Sampler::Create({.top_p = 1.0f}).status().code(), Code::kOk);
  EXPECT_EQ(Sampler::Create({.top_k = -1}).status().code(), Code::kInvalidArgument);
}

TEST(Sampler, BadLogits) {
  Sampler s = Make({});
  EXPECT_FALSE(s.Sample(std::vector<float>{1.0f, NAN}).ok());
  EXPECT_FALSE(s.Sample(std::vector<float>{-INFINITY, -INFINITY}).ok());
  EXPECT_FALSE(s.Sample(std::vector<float>{}).ok());
}

// Probabilities 0.1, 0.2, 0.3, 0.4. Untruncated sampling walks ids in order (cumulative 0.1,
// 0.3, 0.6, 1.0); top-k / top-p walk the sorted order 3, 2, 1, 0. So each pick is predictable.
std::vector<float> Probs() { return {std::log(0.1f), std::log(0.2f), std::log(0.3f), std::log(0.4f)}; }

int32_t ExpectedPick(double u) { return u < 0.1 ? 0 : u < 0.3 ? 1 : u < 0.6 ? 2 : 3; }

TEST(Sampler, ExactPicksForSeeds) {
  for (uint64_t seed : {0ull, 1ull, 7ull, 12345ull}) {
    Sampler s = Make({.seed = seed});
    Rng rng(seed);
    for (int i = 0; i < 20; ++i) {
      double u = rng.Uniform();
      if (std::fabs(u - 0.1) < 1e-6 || std::fabs(u - 0.3) < 1e-6 || std::fabs(u - 0.6) < 1e-6)
        continue;  // too close to a boundary for float logits
      auto r = s.Sample(Probs());
      ASSERT_TRUE(r.ok());
      EXPECT_EQ(r->id, ExpectedPick(u)) << "seed " << seed << " draw " << i << " u " << u;
      const double p[] = {0.1, 0.2, 0.3, 0.4};
      EXPECT_NEAR(r->logprob, std::log(p[r->id]), 1e-6);
    }
  }
}

TEST(Sampler, TopKAndTopPTruncate) {
  // top_k 2 keeps ids 3 and 2 (0.4, 0.3 -> 4/7, 3/7).
  Sampler k2 = Make({.top_k = 2, .seed = 9});
  Rng rng(9);
  for (int i = 0; i < 50; ++i) {
    double u = rng.Uniform();
    auto r = k2.Sample(Probs());
    EXPECT_EQ(r->id, u < 4.0 / 7.0 ? 3 : 2);
    EXPECT_NEAR(r->logprob, std::log(r->id == 3 ? 4.0 / 7.0 : 3.0 / 7.0), 1e-6);
  }
  // top_p 0.65: 0.4 < 0.65 <= 0.7, so {3, 2} as well; top_p 0.3: {3} only, logprob 0.
  Sampler p65 = Make({.top_p = 0.65f, .seed = 9});
  Rng rng2(9);
  for (int i = 0; i < 50; ++i)
    EXPECT_EQ(p65.Sample(Probs())->id, rng2.Uniform() < 4.0 / 7.0 ? 3 : 2);
  Sampler p30 = Make({.top_p = 0.3f, .seed = 5});
  for (int i = 0; i < 20; ++i) {
    auto r = p30.Sample(Probs());
    EXPECT_EQ(r->id, 3);
    EXPECT_EQ(r->logprob, 0.0f);
  }
  Sampler k1 = Make({.temperature = 5.0f, .top_k = 1, .seed = 3});
  for (int i = 0; i < 20; ++i) EXPECT_EQ(k1.Sample(Probs())->id, 3);
}

// Alternatives of Probs() (0.1, 0.2, 0.3, 0.4): the most likely first, under the distribution
// the token was drawn from, and the chosen token's entry has the chosen logprob's bits.
TEST(Sampler, TopLogprobsAreTheMostLikelyUnderTheDrawnDistribution) {
  auto alts = [](const SampledToken& t) {
    std::vector<int32_t> ids;
    for (const auto& a : t.top) ids.push_back(a.id);
    return ids;
  };
  // The chosen token's entry, as bits (-0 and +0 differ).
  auto chosen_entry = [](const SampledToken& t) {
    for (const auto& a : t.top)
      if (a.id == t.id) return std::bit_cast<uint32_t>(a.logprob);
    return 0xFFFFFFFFu;
  };
  auto bits = [](float f) { return std::bit_cast<uint32_t>(f); };
  // Greedy: log_softmax of the raw logits.
  auto g = Make({.greedy = true, .top_logprobs = 3}).Sample(Probs());
  ASSERT_TRUE(g.ok());
  EXPECT_EQ(g->id, 3);
  EXPECT_EQ(alts(*g), (std::vector<int32_t>{3, 2, 1}));
  EXPECT_NEAR(g->top[1].logprob, std::log(0.3), 1e-6);
  EXPECT_NEAR(g->top[2].logprob, std::log(0.2), 1e-6);
  EXPECT_EQ(chosen_entry(*g), bits(g->logprob));
  // Untruncated: every token is a candidate, so 4 alternatives of 5 asked.
  Sampler plain = Make({.seed = 4, .top_logprobs = 5});
  for (int i = 0; i < 20; ++i) {
    auto r = plain.Sample(Probs());
    ASSERT_TRUE(r.ok());
    EXPECT_EQ(alts(*r), (std::vector<int32_t>{3, 2, 1, 0}));
    EXPECT_NEAR(r->top[3].logprob, std::log(0.1), 1e-6);
    EXPECT_EQ(chosen_entry(*r), bits(r->logprob)) << "draw " << i;
  }
  // top_k 2 renormalizes over {3, 2}: 4/7 and 3/7, and ids 1 and 0 have probability 0.
  Sampler k2 = Make({.top_k = 2, .seed = 9, .top_logprobs = 4});
  for (int i = 0; i < 20; ++i) {
    auto r = k2.Sample(Probs());
    ASSERT_TRUE(r.ok());
    EXPECT_EQ(alts(*r), (std::vector<int32_t>{3, 2}));
    EXPECT_NEAR(r->top[0].logprob, std::log(4.0 / 7.0), 1e-6);
    EXPECT_NEAR(r->top[1].logprob, std::log(3.0 / 7.0), 1e-6);
    EXPECT_EQ(chosen_entry(*r), bits(r->logprob));
  }
  // top_p 0.3 keeps {3} only; one alternative asked of a wider set gives the most likely.
  EXPECT_EQ(alts(*Make({.top_p = 0.3f, .top_logprobs = 2}).Sample(Probs())), (std::vector<int32_t>{3}));
  EXPECT_EQ(alts(*Make({.top_logprobs = 1}).Sample(Probs())), (std::vector<int32_t>{3}));
  // None asked, none given; equal logits: the lower id first; a -inf logit is never one.
  EXPECT_TRUE(Make({}).Sample(Probs())->top.empty());
  const std::vector<float> ties = {1.f, -INFINITY, 2.f, 1.f, 2.f};
  EXPECT_EQ(alts(*Make({.greedy = true, .top_logprobs = 5}).Sample(ties)), (std::vector<int32_t>{2, 4, 0, 3}));
  EXPECT_EQ(alts(*Make({.seed = 1, .top_logprobs = 5}).Sample(ties)), (std::vector<int32_t>{2, 4, 0, 3}));
  // One token takes all the mass: the chosen logprob is -log(1) = -0, and so is its entry. A
  // greedy alternative of a finite logit stays however unlikely (only -inf is left out).
  const std::vector<float> sure = {0.f, -1000.f, -INFINITY};
  auto one = Make({.greedy = true, .top_logprobs = 3}).Sample(sure);
  EXPECT_EQ(alts(*one), (std::vector<int32_t>{0, 1}));
  EXPECT_EQ(chosen_entry(*one), bits(one->logprob));
  EXPECT_EQ(bits(one->logprob), bits(-0.0f));
  EXPECT_EQ(one->top[1].logprob, -1000.0f);
}

// A fork's sampler (Sampler::AdoptPrompt) sees the prompt its source saw: the repetition
// penalty applies to it as if it had observed the prompt itself; a source that kept nothing, or
// a sampler that has generated, is refused.
TEST(Sampler, AForkAdoptsThePromptItsSourceSaw) {
  const std::vector<float> logits = {1.0f, 2.0f, -1.0f, 3.0f};
  const SamplerConfig rep{.greedy = true, .repetition_penalty = 2.0f};
  Sampler source = Make(rep), fork = Make(rep), plain = Make(rep);
  source.Observe(std::vector<int32_t>{3, 2, 3}, false);
  ASSERT_TRUE(fork.AdoptPrompt(source).ok());
  EXPECT_EQ(fork.Sample(logits)->id, 1) << "3 / 2 = 1.5 < 2: the prompt's 3 is penalized";
  EXPECT_EQ(plain.Sample(logits)->id, 3) << "without the prompt, 3 wins";
  Sampler none = Make({.greedy = true});
  none.Observe(std::vector<int32_t>{3}, false);
  Sampler wants = Make(rep);
  const Status kept_nothing = wants.AdoptPrompt(none);
  EXPECT_EQ(kept_nothing.code(), Code::kInvalidArgument);
  EXPECT_NE(kept_nothing.message().find("repetition_penalty"), std::string::npos) << kept_nothing.ToString();
  EXPECT_TRUE(Make({.greedy = true}).AdoptPrompt(source).ok()) << "a fork without penalties needs nothing";
  fork.Observe(std::vector<int32_t>{1}, true);   // its token fed back
  EXPECT_EQ(Make(rep).AdoptPrompt(fork).code(), Code::kInvalidArgument) << "fork has generated";
  EXPECT_EQ(fork.AdoptPrompt(source).code(), Code::kInvalidArgument) << "fork has generated";
}

// The penalties by hand (vLLM's rules), greedy so each pick is the argmax of the changed
// logits, and its logprob is log_softmax of them.
TEST(Sampler, PenaltiesChangeTheLogitsOfTheSequencesTokens) {
  const std::vector<float> logits = {1.0f, 2.0f, -1.0f, 3.0f};
  auto log_softmax = [](std::vector<double> l, int id) {
    double m = *std::max_element(l.begin(), l.end()), sum = 0.0;
    for (double v : l) sum += std::exp(v - m);
    return static_cast<float>(l[id] - m - std::log(sum));
  };
  // Repetition over prompt and generated tokens: 3 -> 3 / 2 = 1.5, -1 -> -2; so id 1 (2.0) wins.
  Sampler rep = Make({.greedy = true, .repetition_penalty = 2.0f});
  rep.Observe(std::vector<int32_t>{3, 2, 3}, false);
  auto r = rep.Sample(logits);
  ASSERT_TRUE(r.ok());
  EXPECT_EQ(r->id, 1);
  EXPECT_NEAR(r->logprob, log_softmax({1.0, 2.0, -2.0, 1.5}, 1), 1e-6);
  // Frequency and presence count generated tokens only: a prompt's 3 is not penalized ...
  Sampler freq = Make({.greedy = true, .frequency_penalty = 0.5f, .presence_penalty = 0.25f});
  freq.Observe(std::vector<int32_t>{3, 3, 3}, false);
  EXPECT_EQ(freq.Sample(logits)->id, 3);
  // ... a generated 3 once (3 - 0.5 - 0.25 = 2.25) still wins, twice (1.75) it loses to id 1.
  freq.Observe(std::vector<int32_t>{3}, true);
  auto once = freq.Sample(logits);
  EXPECT_EQ(once->id, 3);
  EXPECT_NEAR(once->logprob, log_softmax({1.0, 2.0, -1.0, 2.25}, 3), 1e-6);
  freq.Observe(std::vector<int32_t>{3}, true);
  auto twice = freq.Sample(logits);
  EXPECT_EQ(twice->id, 1);
  EXPECT_NEAR(twice->logprob, log_softmax({1.0, 2.0, -1.0, 1.75}, 1), 1e-6);
  // A negative presence penalty favours what was generated; ids outside the vocabulary (from the
  // network) change nothing.
  Sampler fav = Make({.greedy = true, .repetition_penalty = 1.5f, .presence_penalty = -2.0f});
  fav.Observe(std::vector<int32_t>{2, -7, 99}, true);
  EXPECT_EQ(fav.Sample(logits)->id, 3) << "-1 * 1.5 + 2 = 0.5 < 3";
  fav.Observe(std::vector<int32_t>{0}, true);   // 1 / 1.5 + 2 = 2.67 < 3
  EXPECT_EQ(fav.Sample(logits)->id, 3);
  Sampler fav2 = Make({.greedy = true, .presence_penalty = -2.0f});
  fav2.Observe(std::vector<int32_t>{0}, true);   // 1 + 2 = 3: ties id 3, and the lower id wins
  EXPECT_EQ(fav2.Sample(logits)->id, 0);
  // A tiny repetition penalty makes a large logit the largest float, not +inf (which would be
  // an error that fails the step of every sequence); -inf stays -inf.
  Sampler tiny = Make({.greedy = true, .top_logprobs = 2, .repetition_penalty = 1e-40f});
  tiny.Observe(std::vector<int32_t>{3, 1}, false);
  auto t = tiny.Sample(std::vector<float>{1.0f, 2.0f, -INFINITY, 3.0f});
  ASSERT_TRUE(t.ok()) << t.status().ToString();
  EXPECT_EQ(t->id, 1) << "2 / 1e-40 and 3 / 1e-40 both clamp to FLT_MAX: the lower id";
  EXPECT_EQ(t->top.size(), 2u);
  EXPECT_FALSE(Make({.greedy = true, .repetition_penalty = 2.0f}).Sample(std::vector<float>{1.0f, INFINITY}).ok())
      << "the model's own +inf is still an error";
  // Without a penalty nothing is kept and nothing changes; the host needs the logits only then.
  Sampler plain = Make({.greedy = true});
  plain.Observe(std::vector<int32_t>{3, 3}, true);
  EXPECT_EQ(plain.Sample(logits)->id, 3);
  EXPECT_FALSE(plain.AdjustsLogits());
  EXPECT_TRUE(freq.AdjustsLogits());
  EXPECT_FALSE(Make({.top_logprobs = 1}).AdjustsLogits());
  EXPECT_TRUE(Make({.min_p = 0.1f}).AdjustsLogits());
  EXPECT_FALSE(Make({.greedy = true, .min_p = 0.1f}).AdjustsLogits()) << "min-p cannot move an argmax";
}

// logit_bias is added first; min_tokens holds its ids back until that many tokens were
// generated (what the sequence was fed back counts, the prompt does not).
TEST(Sampler, LogitBiasAndMinTokens) {
  const std::vector<float> logits = {1.0f, 2.0f, -1.0f, 3.0f};
  auto b = Make({.greedy = true, .logit_bias = {{0, 2.5f}, {3, -100.0f}}}).Sample(logits);
  ASSERT_TRUE(b.ok());
  EXPECT_EQ(b->id, 0) << "1 + 2.5 beats 2, and 3 - 100";
  EXPECT_EQ(Make({.greedy = true, .logit_bias = {{2, 100.0f}}}).Sample(logits)->id, 2);
  // A bias past the vocabulary (the coordinator checks ids; a worker just skips them).
  EXPECT_EQ(Make({.greedy = true, .logit_bias = {{9, 100.0f}}}).Sample(logits)->id, 3);

  Sampler m = Make({.greedy = true, .top_logprobs = 2, .min_tokens = 2, .min_tokens_ids = {3, 1}});
  m.Observe(std::vector<int32_t>{0, 2, 1}, false);   // the prompt
  for (int i = 0; i < 2; ++i) {
    EXPECT_TRUE(m.AdjustsLogits());
    auto r = m.Sample(logits);
    EXPECT_EQ(r->id, 0) << "3 and 1 held back, token " << i;
    EXPECT_EQ(r->top.size(), 2u) << "-inf is never an alternative";
    m.Observe(std::vector<int32_t>{r->id}, true);
  }
  EXPECT_EQ(m.Sample(logits)->id, 3) << "two generated: free again";
  // Holding back every token would leave nothing to draw: then none is held back.
  auto all = Make({.greedy = true, .min_tokens = 1, .min_tokens_ids = {0, 1, 2, 3}}).Sample(logits);
  ASSERT_TRUE(all.ok()) << all.status().ToString();
  EXPECT_EQ(all->id, 3);
  // Without other adjustments the device may pick again once min_tokens is reached.
  Sampler d = Make({.greedy = true, .min_tokens = 1, .min_tokens_ids = {3}});
  EXPECT_TRUE(d.AdjustsLogits());
  d.Observe(std::vector<int32_t>{1}, true);
  EXPECT_FALSE(d.AdjustsLogits());
}

// What a device hands back after adjusting the logits itself: SampleAdjustedWith(Adjusted(l))
// is SampleWith(l), token, logprob and alternatives, for every draw.
TEST(Sampler, SamplingAdjustedLogitsIsSamplingTheRawOnes) {
  const std::vector<float> logits = {1.0f, 2.0f, -1.0f, 3.0f, 0.5f};
  Sampler s = Make({.temperature = 0.9f, .seed = 4, .top_logprobs = 3, .repetition_penalty = 1.5f,
                    .presence_penalty = 0.5f, .min_p = 0.1f, .logit_bias = {{2, 1.0f}}});
  s.Observe(std::vector<int32_t>{3, 1}, false);
  s.Observe(std::vector<int32_t>{3}, true);
  const std::vector<float> adjusted = s.Adjusted(logits);
  EXPECT_NE(adjusted, logits);
  for (double u : {0.05, 0.4, 0.97}) {
    auto a = s.SampleWith(logits, u), b = s.SampleAdjustedWith(adjusted, u);
    ASSERT_TRUE(a.ok() && b.ok());
    EXPECT_EQ(a->id, b->id) << u;
    EXPECT_EQ(a->logprob, b->logprob) << u;
    EXPECT_EQ(a->top, b->top) << u;
  }
}

// min-p of Probs() (0.1, 0.2, 0.3, 0.4): 0.6 keeps p >= 0.24, i.e. {3, 2}: 4/7 and 3/7, as top_k 2.
TEST(Sampler, MinPDropsTokensBelowAFractionOfTheMostLikely) {
  Sampler mp = Make({.seed = 9, .top_logprobs = 4, .min_p = 0.6f});
  Rng rng(9);
  for (int i = 0; i < 50; ++i) {
    const double u = rng.Uniform();
    auto r = mp.Sample(Probs());
    ASSERT_TRUE(r.ok());
    // Untruncated by top-k/top-p, candidates walk in id order: 2 (3/7) before 3.
    EXPECT_EQ(r->id, u < 3.0 / 7.0 ? 2 : 3) << "draw " << i;
    EXPECT_NEAR(r->logprob, std::log(r->id == 3 ? 4.0 / 7.0 : 3.0 / 7.0), 1e-6);
    ASSERT_EQ(r->top.size(), 2u);
    EXPECT_EQ(r->top[0].id, 3);
  }
  // Temperature first: at T = 0.5 the ratios square (0.5625 for id 2), so 0.6 keeps id 3 only.
  auto hot = Make({.temperature = 0.5f, .seed = 1, .min_p = 0.6f}).Sample(Probs());
  EXPECT_EQ(hot->id, 3);
  EXPECT_EQ(hot->logprob, 0.0f);
  // min_p 1 keeps the most likely (and its equals) only.
  EXPECT_EQ(Make({.seed = 2, .min_p = 1.0f}).Sample(Probs())->id, 3);
}

TEST(Sampler, TemperatureSharpensAndFlattens) {
  // At T = 0.5 the probabilities become p^2 / sum p^2 = 1, 4, 9, 16 over 30.
  Sampler s = Make({.temperature = 0.5f, .seed = 11});
  Rng rng(11);
  for (int i = 0; i < 50; ++i) {
    double u = rng.Uniform() * 30.0;
    int32_t want = u < 1 ? 0 : u < 5 ? 1 : u < 14 ? 2 : 3;
    auto r = s.Sample(Probs());
    EXPECT_EQ(r->id, want);
    const double q[] = {1, 4, 9, 16};
    EXPECT_NEAR(r->logprob, std::log(q[r->id] / 30.0), 1e-5);
  }
}

TEST(Sampler, TopPOnLargeVocabMatchesFullSort) {
  // 5000 logits: the growing sorted prefix must pick exactly what a full sort would keep.
  std::vector<float> logits(5000);
  Rng fill(5);
  for (float& l : logits) l = static_cast<float>(fill.Uniform() * 4.0);
  std::vector<int32_t> order(logits.size());
  for (size_t i = 0; i < order.size(); ++i) order[i] = static_cast<int32_t>(i);
  std::sort(order.begin(), order.end(), [&](int32_t a, int32_t b) {
    return logits[a] != logits[b] ? logits[a] > logits[b] : a < b;
  });
  const float top = *std::max_element(logits.begin(), logits.end());
  double total = 0.0;
  for (float l : logits) total += std::exp(static_cast<double>(l) - top);
  double cum = 0.0;
  size_t keep = 0;
  while (keep < order.size()) {
    cum += std::exp(static_cast<double>(logits[order[keep++]]) - top);
    if (cum >= 0.95 * total) break;
  }
  ASSERT_GT(keep, 1024u);  // beyond the first sorted prefix
  std::vector<bool> kept(logits.size(), false);
  for (size_t j = 0; j < keep; ++j) kept[order[j]] = true;
  Sampler s = Make({.top_p = 0.95f, .seed = 8});
  Rng rng(8);
  for (int i = 0; i < 200; ++i) {
    double u = rng.Uniform() * cum;
    double c = 0.0;
    int32_t want = order[keep - 1];
    for (size_t j = 0; j < keep; ++j) {
      c += std::exp(static_cast<double>(logits[order[j]]) - top);
      if (u < c) {
        want = order[j];
        break;
      }
    }
    auto r = s.Sample(logits);
    ASSERT_TRUE(r.ok());
    EXPECT_TRUE(kept[r->id]);
    EXPECT_EQ(r->id, want);
  }
}

TEST(Sampler, FrequenciesMatchDistribution) {
  Sampler s = Make({.seed = 2024});
  int counts[4] = {0, 0, 0, 0};
  const int n = 20000;
  for (int i = 0; i < n; ++i) ++counts[s.Sample(Probs())->id];
  const double p[] = {0.1, 0.2, 0.3, 0.4};
  for (int i = 0; i < 4; ++i) EXPECT_NEAR(counts[i] / static_cast<double>(n), p[i], 0.015) << i;
}

TEST(Sampler, EqualLogitsOrderedByIdAndNegInfNeverPicked) {
  Sampler s = Make({.seed = 77});
  Rng rng(77);
  std::vector<float> logits = {-INFINITY, 0.0f, 0.0f, -INFINITY};
  for (int i = 0; i < 50; ++i) EXPECT_EQ(s.Sample(logits)->id, rng.Uniform() < 0.5 ? 1 : 2);
}

// Generate on the tiny preset checkpoint (written once for the suite).
class GenerateTest : public ::testing::Test {
 protected:
  static void SetUpTestSuite() {
    dir_ = (std::filesystem::temp_directory_path() /
            ("fm_generate_tiny_" + std::to_string(getpid()))).string();  // ctest runs cases in parallel
    std::filesystem::remove_all(dir_);
    ASSERT_TRUE(WritePresetCheckpoint(dir_, "tiny", 3).ok());
    auto ck = Checkpoint::Open(dir_);
    ASSERT_TRUE(ck.ok()) << ck.status().ToString();
    ckpt_ = std::move(*ck).release();
    pool_ = new ThreadPool(2);
    auto m = ShardModel::Create(*ckpt_, pool_);
    ASSERT_TRUE(m.ok()) << m.status().ToString();
    model_ = std::move(*m).release();
  }
  static void TearDownTestSuite() {
    delete model_;
    delete pool_;
    delete ckpt_;
    std::filesystem::remove_all(dir_);
  }
  // Argmax of the last row after a fresh prefill of `tokens` (no decode path involved).
  static int32_t PrefillArgmax(const std::vector<int32_t>& tokens) {
    const ModelConfig& c = model_->config();
    const int64_t row = c.hc_mult * c.hidden_size;
    auto cache = model_->NewSequence(static_cast<int64_t>(tokens.size())).value();
    std::vector<float> x(tokens.size() * row), logits(c.vocab_size);
    EXPECT_TRUE(model_->Embed(tokens, x.data()).ok());
    BatchItem item{cache.get(), tokens};
    EXPECT_TRUE(model_->ForwardLayers(std::span<const BatchItem>(&item, 1), x.data()).ok());
    EXPECT_TRUE(model_->Logits(x.data() + (tokens.size() - 1) * row, 1, logits.data()).ok());
    return static_cast<int32_t>(std::max_element(logits.begin(), logits.end()) - logits.begin());
  }
  static std::string dir_;
  static Checkpoint* ckpt_;
  static ThreadPool* pool_;
  static ShardModel* model_;
};
std::string GenerateTest::dir_;
Checkpoint* GenerateTest::ckpt_ = nullptr;
ThreadPool* GenerateTest::pool_ = nullptr;
ShardModel* GenerateTest::model_ = nullptr;

// SampleNext (the head and the samplers in one call, what a device shard overrides) picks what
// Logits + Sampler::Sample pick, draw for draw, and refuses a sampler count that is not the rows.
TEST_F(GenerateTest, SampleNextEqualsLogitsThenSample) {
  const ModelConfig& c = model_->config();
  const int64_t row = c.hc_mult * c.hidden_size, V = c.vocab_size;
  const std::vector<int32_t> tokens = {3, 1, 4, 1, 5};
  auto cache = model_->NewSequence(8).value();
  std::vector<float> x(tokens.size() * row), logits(2 * V);
  ASSERT_TRUE(model_->Embed(tokens, x.data()).ok());
  BatchItem item{cache.get(), tokens};
  ASSERT_TRUE(model_->ForwardLayers(std::span<const BatchItem>(&item, 1), x.data()).ok());
  const float* last2 = x.data() + 3 * row;
  ASSERT_TRUE(model_->Logits(last2, 2, logits.data()).ok());
  SamplerConfig k, p;
  k.temperature = 0.9f, k.top_k = 5, k.seed = 8;
  p.temperature = 1.2f, p.top_p = 0.7f, p.seed = 9;
  Sampler a = Make(k), b = Make(p), ra = Make(k), rb = Make(p);
  for (int draw = 0; draw < 4; ++draw) {
    Sampler* const both[] = {&a, &b};
    auto got = model_->SampleNext(last2, 2, both);
    ASSERT_TRUE(got.ok()) << got.status().ToString();
    auto wa = ra.Sample(std::span(logits.data(), V)), wb = rb.Sample(std::span(&logits[V], V));
    ASSERT_TRUE(wa.ok() && wb.ok());
    EXPECT_EQ((*got)[0].id, wa->id);
    EXPECT_EQ((*got)[0].logprob, wa->logprob);
    EXPECT_EQ((*got)[1].id, wb->id);
    EXPECT_EQ((*got)[1].logprob, wb->logprob);
  }
  Sampler* const one[] = {&a};
  const auto bad = model_->SampleNext(last2, 2, one);
  ASSERT_FALSE(bad.ok());
  EXPECT_NE(bad.status().message().find("2 rows but 1 samplers"), std::string::npos)
      << bad.status().ToString();
}

// A row whose logits cannot be sampled (here its state is NaN, so are its logits) carries its
// error; the other row's pick is the one it would get alone, and the call succeeds.
TEST_F(GenerateTest, SampleNextGivesARowsErrorToThatRowAlone) {
  const ModelConfig& c = model_->config();
  const int64_t row = c.hc_mult * c.hidden_size, V = c.vocab_size;
  const std::vector<int32_t> tokens = {3, 1, 4};
  auto cache = model_->NewSequence(8).value();
  std::vector<float> x(tokens.size() * row), logits(V);
  ASSERT_TRUE(model_->Embed(tokens, x.data()).ok());
  BatchItem item{cache.get(), tokens};
  ASSERT_TRUE(model_->ForwardLayers(std::span<const BatchItem>(&item, 1), x.data()).ok());
  std::fill(x.begin(), x.begin() + row, std::numeric_limits<float>::quiet_NaN());   // row 0
  const float* last = x.data() + 2 * row;
  ASSERT_TRUE(model_->Logits(last, 1, logits.data()).ok());
  SamplerConfig k;
  k.temperature = 0.9f, k.top_k = 5, k.seed = 8;
  Sampler bad = Make(k), good = Make(k), want = Make(k);
  Sampler* const rows[] = {&bad, &good};
  std::vector<float> two(2 * row);
  std::copy(x.begin(), x.begin() + row, two.begin());
  std::copy(last, last + row, two.begin() + row);
  auto got = model_->SampleNext(two.data(), 2, rows);
  ASSERT_TRUE(got.ok()) << got.status().ToString();
  EXPECT_EQ((*got)[0].id, -1);
  EXPECT_EQ((*got)[0].error.code(), Code::kInvalidArgument);
  EXPECT_NE((*got)[0].error.message().find("is NaN"), std::string::npos) << (*got)[0].error.ToString();
  auto w = want.Sample(std::span(logits.data(), V));
  ASSERT_TRUE(w.ok());
  EXPECT_TRUE((*got)[1].error.ok()) << (*got)[1].error.ToString();
  EXPECT_EQ((*got)[1].id, w->id);
  EXPECT_EQ((*got)[1].logprob, w->logprob);
}

TEST_F(GenerateTest, GreedyDecodeMatchesPrefillArgmax) {
  const std::vector<int32_t> prompt = {0, 17, 42, 99};
  GenerateOptions opt;
  opt.sampling.greedy = true;
  opt.max_tokens = 6;
  int calls = 0;
  auto res = Generate(*model_, prompt, opt, [&](const SampledToken& t) {
    EXPECT_LE(t.logprob, 0.0f);
    ++calls;
    return true;
  });
  ASSERT_TRUE(res.ok()) << res.status().ToString();
  ASSERT_EQ(res->tokens.size(), 6u);
  EXPECT_EQ(calls, 6);
  EXPECT_EQ(res->finish, FinishReason::kLength);
  EXPECT_EQ(res->prompt_tokens, 4);
  std::vector<int32_t> seq = prompt;
  for (int32_t t : res->tokens) {
    EXPECT_EQ(t, PrefillArgmax(seq)) << "after " << seq.size() << " tokens";
    seq.push_back(t);
  }
}

TEST_F(GenerateTest, SeededSamplingIsReproducibleAndStopsAtEos) {
  const std::vector<int32_t> prompt = {0, 5, 6};
  GenerateOptions opt;
  opt.sampling = {.temperature = 1.5f, .top_k = 50, .top_p = 0.9f, .seed = 123};
  opt.max_tokens = 8;
  auto a = Generate(*model_, prompt, opt, nullptr);
  auto b = Generate(*model_, prompt, opt, nullptr);
  ASSERT_TRUE(a.ok() && b.ok());
  EXPECT_EQ(a->tokens, b->tokens);
  // Making the 3rd sampled token the EOS stops right after it.
  opt.eos_id = a->tokens[2];
  auto c = Generate(*model_, prompt, opt, nullptr);
  ASSERT_TRUE(c.ok());
  size_t first = std::find(a->tokens.begin(), a->tokens.end(), opt.eos_id) - a->tokens.begin();
  EXPECT_EQ(c->tokens, std::vector<int32_t>(a->tokens.begin(), a->tokens.begin() + first + 1));
  EXPECT_EQ(c->finish, FinishReason::kStop);
  // The callback cancels.
  auto d = Generate(*model_, prompt, opt, [](const SampledToken&) { return false; });
  ASSERT_TRUE(d.ok());
  EXPECT_EQ(d->tokens.size(), 1u);
  EXPECT_EQ(d->finish, FinishReason::kCancelled);
}

TEST_F(GenerateTest, BadRequestsNameTheField) {
  GenerateOptions opt;
  auto msg = [&](std::vector<int32_t> prompt) {
    return Generate(*model_, prompt, opt, nullptr).status().message();
  };
  EXPECT_NE(msg({}).find("prompt"), std::string::npos);
  EXPECT_NE(msg({0, static_cast<int32_t>(model_->config().vocab_size)}).find("prompt[1]"),
            std::string::npos);
  opt.max_tokens = 0;
  EXPECT_NE(msg({0}).find("max_tokens"), std::string::npos);
  opt.max_tokens = 4;
  opt.sampling.top_p = 2.0f;
  EXPECT_NE(msg({0}).find("top_p"), std::string::npos);
  opt.sampling.top_p = 1.0f;
  opt.max_context = 3;
  EXPECT_NE(msg({0}).find("max_context"), std::string::npos);
}

TEST_F(GenerateTest, TinyCheckpointTokenizerRoundTrip) {
  auto tok = Tokenizer::Load(dir_);
  ASSERT_TRUE(tok.ok()) << tok.status().ToString();
  EXPECT_EQ(tok->vocab_size(), model_->config().vocab_size);
  auto prompt = tok->Encode(*tok->ApplyChatTemplate({{"user", "Hello there"}}));
  ASSERT_TRUE(prompt.ok());
  GenerateOptions opt;
  opt.sampling.greedy = true;
  opt.max_tokens = 5;
  opt.eos_id = tok->eos_id();
  StreamDecoder sd(*tok);
  std::string streamed;
  auto res = Generate(*model_, *prompt, opt, [&](const SampledToken& t) {
    streamed += *sd.Push(t.id);
    return true;
  });
  ASSERT_TRUE(res.ok()) << res.status().ToString();
  streamed += sd.Flush();
  EXPECT_EQ(streamed, *tok->Decode(res->tokens, /*skip_special=*/true));
}

}  // namespace
}  // namespace fm
