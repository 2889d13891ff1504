#include <gtest/gtest.h>

#include <cmath>
#include <vector>

#include "model/sampler.h"

namespace fm {
namespace {

Sampler Make(SamplerConfig cfg) {
  auto s = Sampler::Create(cfg);
  EXPECT_TRUE(s.ok()) << s.status().ToString();
  return *s;
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
  EXPECT_EQ(Sampler::Create({.top_p = 1.0f}).status().code(), Code::kOk);
  EXPECT_EQ(Sampler::Create({.top_k = -1}).status().code(), Code::kInvalidArgument);
}

TEST(Sampler, BadLogits) {
  Sampler s = Make({});
  EXPECT_FALSE(s.Sample(std::vector<float>{1.0f, NAN}).ok());
  EXPECT_FALSE(s.Sample(std::vector<float>{-INFINITY, -INFINITY}).ok());
  EXPECT_FALSE(s.Sample(std::vector<float>{}).ok());
}

// Probabilities 0.1, 0.2, 0.3, 0.4: sorted order is ids 3, 2, 1, 0 with cumulative
// 0.4, 0.7, 0.9, 1.0, so the pick for a draw u is exactly predictable.
std::vector<float> Probs() { return {std::log(0.1f), std::log(0.2f), std::log(0.3f), std::log(0.4f)}; }

int32_t ExpectedPick(double u) { return u < 0.4 ? 3 : u < 0.7 ? 2 : u < 0.9 ? 1 : 0; }

TEST(Sampler, ExactPicksForSeeds) {
  for (uint64_t seed : {0ull, 1ull, 7ull, 12345ull}) {
    Sampler s = Make({.seed = seed});
    Rng rng(seed);
    for (int i = 0; i < 20; ++i) {
      double u = rng.Uniform();
      if (std::fabs(u - 0.4) < 1e-6 || std::fabs(u - 0.7) < 1e-6 || std::fabs(u - 0.9) < 1e-6)
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

TEST(Sampler, TemperatureSharpensAndFlattens) {
  // At T = 0.5 the probabilities become p^2 / sum p^2 = 1, 4, 9, 16 over 30.
  Sampler s = Make({.temperature = 0.5f, .seed = 11});
  Rng rng(11);
  for (int i = 0; i < 50; ++i) {
    double u = rng.Uniform() * 30.0;
    int32_t want = u < 16 ? 3 : u < 25 ? 2 : u < 29 ? 1 : 0;
    auto r = s.Sample(Probs());
    EXPECT_EQ(r->id, want);
    const double q[] = {1, 4, 9, 16};
    EXPECT_NEAR(r->logprob, std::log(q[r->id] / 30.0), 1e-5);
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

}  // namespace
}  // namespace fm
