// The forward's own kernels (hyper-connections, router, clamped SwiGLU, combine, RMSNorm) against
// their plain double references and against hand-computed values.
#include <gtest/gtest.h>

#include <cmath>
#include <random>
#include <vector>

#include "kernels/cpu/hc.h"
#include "kernels/cpu/norm_rows.h"
#include "kernels/cpu/router.h"
#include "kernels/cpu/swiglu.h"

namespace fm {
namespace {

std::vector<float> Rand(size_t n, uint32_t seed, float lo = -1.0f, float hi = 1.0f) {
  std::mt19937 rng(seed);
  std::uniform_real_distribution<float> d(lo, hi);
  std::vector<float> v(n);
  for (auto& x : v) x = d(rng);
  return v;
}

void ExpectClose(const std::vector<float>& a, const std::vector<float>& b, float rel) {
  ASSERT_EQ(a.size(), b.size());
  for (size_t i = 0; i < a.size(); ++i)
    EXPECT_NEAR(a[i], b[i], rel * std::max(1.0f, std::fabs(b[i]))) << "index " << i;
}

// mix = fn . flatten(x), what the forward computes with Matmul.
std::vector<float> Mix(const std::vector<float>& fn, const std::vector<float>& x, int64_t rows) {
  const int64_t len = static_cast<int64_t>(x.size());
  std::vector<float> m(rows);
  for (int64_t r = 0; r < rows; ++r) {
    double acc = 0.0;
    for (int64_t c = 0; c < len; ++c) acc += static_cast<double>(fn[r * len + c]) * x[c];
    m[r] = static_cast<float>(acc);
  }
  return m;
}

constexpr int64_t kN = 4, kH = 64;

TEST(HcKernels, PreMatchesReferenceAndIsDoublyStochastic) {
  const auto x = Rand(kN * kH, 1, -3.0f, 3.0f);
  const auto fn = Rand((2 + kN) * kN * kN * kH, 2, -0.05f, 0.05f);
  const auto base = Rand((2 + kN) * kN, 3);
  const std::vector<float> scale = {0.7f, 1.3f, 2.0f};
  const float rinv = RmsInv(x.data(), kN * kH, 1e-6f);
  const auto mix = Mix(fn, x, (2 + kN) * kN);
  std::vector<float> pre(kN), post(kN), comb(kN * kN), y(kH);
  HcPreWeights_n(mix.data(), rinv, base.data(), scale.data(), kN, 20, 1e-6f, pre.data(),
                 post.data(), comb.data());
  HcCollapse_nH(x.data(), pre.data(), kN, kH, y.data());
  std::vector<float> y_ref(kH), post_ref(kN), comb_ref(kN * kN);
  HcPreRef(x.data(), fn.data(), base.data(), scale.data(), kN, kH, 20, 1e-6, 1e-6, y_ref.data(),
           post_ref.data(), comb_ref.data());
  ExpectClose(y, y_ref, 1e-5f);
  ExpectClose(post, post_ref, 1e-6f);
  ExpectClose(comb, comb_ref, 1e-5f);
  for (int64_t i = 0; i < kN; ++i) {
    EXPECT_GT(pre[i], 0.0f);
    EXPECT_LT(pre[i], 1.0f + 1e-5f);
    EXPECT_GT(post[i], 0.0f);
    EXPECT_LT(post[i], 2.0f);
    double row = 0.0, col = 0.0;
    for (int64_t k = 0; k < kN; ++k) row += comb[i * kN + k], col += comb[k * kN + i];
    EXPECT_NEAR(row, 1.0, 1e-3);
    EXPECT_NEAR(col, 1.0, 1e-5);  // the last Sinkhorn step normalises columns
  }
}

TEST(HcKernels, PreWithZeroMixIsUniform) {
  // m = 0, base = 0: pre = 0.5 + eh, post = 1, comb = 1/n everywhere (up to eh terms).
  std::vector<float> mix((2 + kN) * kN, 0.0f), base((2 + kN) * kN, 0.0f), scale = {1, 1, 1};
  std::vector<float> pre(kN), post(kN), comb(kN * kN);
  HcPreWeights_n(mix.data(), 1.0f, base.data(), scale.data(), kN, 20, 1e-6f, pre.data(),
                 post.data(), comb.data());
  for (int64_t i = 0; i < kN; ++i) {
    EXPECT_FLOAT_EQ(pre[i], 0.5f + 1e-6f);
    EXPECT_FLOAT_EQ(post[i], 1.0f);
  }
  for (float c : comb) EXPECT_NEAR(c, 0.25f, 1e-5f);
}

TEST(HcKernels, PostMatchesReferenceAndUsesColumns) {
  const auto x = Rand(kN * kH, 4), out = Rand(kH, 5), post = Rand(kN, 6, 0.0f, 2.0f);
  const auto comb = Rand(kN * kN, 7, 0.0f, 0.5f);
  std::vector<float> got(kN * kH), ref(kN * kH);
  HcPost_nH(x.data(), out.data(), post.data(), comb.data(), kN, kH, got.data());
  HcPostRef(x.data(), out.data(), post.data(), comb.data(), kN, kH, ref.data());
  ExpectClose(got, ref, 1e-6f);
  // Stream 1, channel 3 by hand: post_1 * out + sum_j C[j][1] * X[j].
  double want = post[1] * out[3];
  for (int64_t j = 0; j < kN; ++j) want += comb[j * kN + 1] * x[j * kH + 3];
  EXPECT_NEAR(got[1 * kH + 3], want, 1e-6);
}

TEST(HcKernels, HeadMatchesReference) {
  const auto x = Rand(kN * kH, 8, -2.0f, 2.0f), fn = Rand(kN * kN * kH, 9, -0.05f, 0.05f);
  const auto base = Rand(kN, 10);
  const float scale = 0.8f;
  const auto mix = Mix(fn, x, kN);
  std::vector<float> pre(kN), y(kH), ref(kH);
  HcHeadWeights_n(mix.data(), RmsInv(x.data(), kN * kH, 1e-6f), base.data(), scale, kN, 1e-6f,
                  pre.data());
  HcCollapse_nH(x.data(), pre.data(), kN, kH, y.data());
  HcHeadRef(x.data(), fn.data(), base.data(), scale, kN, kH, 1e-6, 1e-6, ref.data());
  ExpectClose(y, ref, 1e-5f);
}

TEST(RouterKernels, SqrtSoftplusValues) {
  const std::vector<float> l = {0.0f, 30.0f, -5.0f, 2.0f};
  std::vector<float> s(4);
  RouterSqrtSoftplus_E(l.data(), 4, s.data());
  EXPECT_NEAR(s[0], std::sqrt(std::log(2.0)), 1e-6);
  EXPECT_NEAR(s[1], std::sqrt(30.0), 1e-5);
  EXPECT_NEAR(s[2], std::sqrt(std::log1p(std::exp(-5.0))), 1e-6);
  EXPECT_NEAR(s[3], std::sqrt(std::log1p(std::exp(2.0))), 1e-6);
}

TEST(RouterKernels, TopkBiasChoosesWithBiasWeightsWithoutAndTiesGoLow) {
  // Bias lifts expert 0 above expert 3; the weights still use the unbiased scores.
  const std::vector<float> s = {0.1f, 0.5f, 0.5f, 0.9f, 0.2f};
  const std::vector<float> bias = {1.0f, 0.0f, 0.0f, 0.0f, 0.0f};
  int32_t ids[3];
  float w[3];
  RouterTopkBias_E(s.data(), bias.data(), 5, 3, 1.5f, ids, w);
  EXPECT_EQ(ids[0], 0);
  EXPECT_EQ(ids[1], 3);
  EXPECT_EQ(ids[2], 1);  // 1 and 2 tie: the lower index wins
  EXPECT_NEAR(w[0], 0.1 / 1.5 * 1.5, 1e-6);
  EXPECT_NEAR(w[1], 0.9 / 1.5 * 1.5, 1e-6);
  EXPECT_NEAR(w[2], 0.5 / 1.5 * 1.5, 1e-6);
  const std::vector<float> flat(8, 0.3f), zero(8, 0.0f);
  int32_t ids2[4];
  float w2[4];
  RouterTopkBias_E(flat.data(), zero.data(), 8, 4, 1.0f, ids2, w2);
  for (int j = 0; j < 4; ++j) {
    EXPECT_EQ(ids2[j], j);
    EXPECT_FLOAT_EQ(w2[j], 0.25f);
  }
}

TEST(RouterKernels, TopkMatchesReference) {
  for (uint32_t seed = 0; seed < 20; ++seed) {
    const auto s = Rand(256, 100 + seed, 0.0f, 2.0f), bias = Rand(256, 200 + seed, -0.1f, 0.1f);
    int32_t ids[6], ids_ref[6];
    float w[6], w_ref[6];
    RouterTopkBias_E(s.data(), bias.data(), 256, 6, 1.5f, ids, w);
    RouterTopkBiasRef(s.data(), bias.data(), 256, 6, 1.5, ids_ref, w_ref);
    float total = 0.0f;
    for (int j = 0; j < 6; ++j) {
      EXPECT_EQ(ids[j], ids_ref[j]);
      EXPECT_NEAR(w[j], w_ref[j], 1e-6);
      total += w[j];
    }
    EXPECT_NEAR(total, 1.5f, 1e-5);
  }
}

TEST(RouterKernels, HashTakesTheTableRow) {
  const std::vector<float> s = {0.2f, 0.4f, 0.6f, 0.8f};
  const int64_t eids[2] = {3, 0};
  int32_t ids[2];
  float w[2];
  RouterHash_k(s.data(), eids, 2, 2.0f, ids, w);
  EXPECT_EQ(ids[0], 3);
  EXPECT_EQ(ids[1], 0);
  EXPECT_NEAR(w[0], 0.8 / 1.0 * 2.0, 1e-6);
  EXPECT_NEAR(w[1], 0.2 / 1.0 * 2.0, 1e-6);
}

TEST(SwigluKernels, ClampValues) {
  const std::vector<float> g = {20.0f, -3.0f, 1.0f, 5.0f}, u = {20.0f, 2.0f, -15.0f, -4.0f};
  std::vector<float> out(4);
  SwigluClamp_n(g.data(), u.data(), 4, 10.0f, out.data());
  EXPECT_NEAR(out[0], 10.0 / (1.0 + std::exp(-10.0)) * 10.0, 1e-4);   // both clamped
  EXPECT_NEAR(out[1], -3.0 / (1.0 + std::exp(3.0)) * 2.0, 1e-6);      // gate only min()'d
  EXPECT_NEAR(out[2], 1.0 / (1.0 + std::exp(-1.0)) * -10.0, 1e-5);   // up clipped below
  EXPECT_NEAR(out[3], 5.0 / (1.0 + std::exp(-5.0)) * -4.0, 1e-5);
  const auto gr = Rand(1000, 11, -15.0f, 15.0f), ur = Rand(1000, 12, -15.0f, 15.0f);
  std::vector<float> got(1000), ref(1000);
  SwigluClamp_n(gr.data(), ur.data(), 1000, 10.0f, got.data());
  SwigluClampRef(gr.data(), ur.data(), 1000, 10.0, ref.data());
  ExpectClose(got, ref, 1e-6f);
}

TEST(SwigluKernels, CombineInKOrder) {
  const auto c = Rand(3 * kH, 13), w = Rand(3, 14, 0.0f, 1.0f);
  std::vector<float> got(kH), ref(kH);
  MoeCombine_kH(c.data(), w.data(), 3, kH, got.data());
  MoeCombineRef(c.data(), w.data(), 3, kH, ref.data());
  ExpectClose(got, ref, 1e-6f);
  // Bit-level: the kernel is exactly ((0 + w0 c0) + w1 c1) + w2 c2 in float.
  for (int64_t h = 0; h < kH; ++h) {
    float acc = 0.0f;
    for (int j = 0; j < 3; ++j) acc += w[j] * c[j * kH + h];
    EXPECT_EQ(got[h], acc);
  }
}

TEST(NormKernels, RmsNormWeightedMatchesReference) {
  const auto x = Rand(kH, 15, -4.0f, 4.0f), g = Rand(kH, 16, 0.5f, 1.5f);
  std::vector<float> got(kH), ref(kH);
  RmsNormWeighted_H(x.data(), g.data(), kH, 1e-6f, got.data());
  RmsNormWeightedRef(x.data(), g.data(), kH, 1e-6, ref.data());
  ExpectClose(got, ref, 1e-6f);
  const std::vector<float> ones(4, 1.0f), three = {3.0f, 3.0f, 3.0f, 3.0f};
  std::vector<float> y(4);
  RmsNormWeighted_H(three.data(), ones.data(), 4, 0.0f, y.data());
  for (float v : y) EXPECT_FLOAT_EQ(v, 1.0f);
}

}  // namespace
}  // namespace fm
