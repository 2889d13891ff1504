// Attention kernels against plain double references and hand-computed values.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <functional>
#include <limits>
#include <random>
#include <vector>

#include "kernels/cpu/attention_core.h"
#include "kernels/cpu/compressor_pool.h"
#include "kernels/cpu/indexer.h"
#include "kernels/cpu/rmsnorm.h"
#include "kernels/cpu/rope.h"

namespace fm {
namespace {

std::vector<float> Randn(size_t n, uint32_t seed, float scale = 1.0f) {
  std::mt19937 rng(seed);
  std::normal_distribution<float> d(0.0f, scale);
  std::vector<float> v(n);
  for (auto& x : v) x = d(rng);
  return v;
}

// ---- references ----

void RmsNormRef(const float* x, const float* g, int64_t dim, double eps, double* y) {
  double ss = 0;
  for (int64_t i = 0; i < dim; ++i) ss += double(x[i]) * x[i];
  const double inv = 1.0 / std::sqrt(ss / dim + eps);
  for (int64_t i = 0; i < dim; ++i) y[i] = (g ? g[i] : 1.0) * x[i] * inv;
}

// Rotation of the last rd channels as complex numbers (a + ib) * e^{i*angle}.
void RopeRef(const float* x, int64_t dim, int64_t rd, int64_t pos, const float* f, bool inverse,
             double* y) {
  for (int64_t i = 0; i < dim; ++i) y[i] = x[i];
  for (int64_t i = 0; i < rd / 2; ++i) {
    const double angle = (inverse ? -1.0 : 1.0) * double(float(pos) * f[i]);
    const double a = x[dim - rd + 2 * i], b = x[dim - rd + 2 * i + 1];
    y[dim - rd + 2 * i] = a * std::cos(angle) - b * std::sin(angle);
    y[dim - rd + 2 * i + 1] = a * std::sin(angle) + b * std::cos(angle);
  }
}

void SinkAttentionRef(const float* q, const std::vector<const float*>& keys, int64_t d, float sink,
                      double scale, double* o) {
  std::vector<double> s(keys.size());
  double m = sink;
  for (size_t i = 0; i < keys.size(); ++i) {
    double dot = 0;
    for (int64_t c = 0; c < d; ++c) dot += double(q[c]) * keys[i][c];
    s[i] = dot * scale;
    m = std::max(m, s[i]);
  }
  double den = std::exp(sink - m);
  for (auto& v : s) den += (v = std::exp(v - m));
  for (int64_t c = 0; c < d; ++c) o[c] = 0;
  for (size_t i = 0; i < keys.size(); ++i)
    for (int64_t c = 0; c < d; ++c) o[c] += s[i] / den * keys[i][c];
}

double MaxAbsDiff(const float* a, const double* b, int64_t n) {
  double m = 0;
  for (int64_t i = 0; i < n; ++i) {
    const double d = std::fabs(a[i] - b[i]);
    if (!std::isnan(m) && !(d <= m)) m = d;   // a NaN, once there, stays (std::max skips it)
  }
  return m;
}

// ---- RMSNorm ----

TEST(AttentionKernels, RmsNormHandValues) {
  const float x[2] = {3.0f, 4.0f}, g[2] = {2.0f, -1.0f};
  float y[2];
  RmsNormRows_rd(x, nullptr, 1, 2, 0.0f, y);  // rms = sqrt(12.5)
  EXPECT_NEAR(y[0], 3.0 / std::sqrt(12.5), 1e-6);
  EXPECT_NEAR(y[1], 4.0 / std::sqrt(12.5), 1e-6);
  RmsNormRows_rd(x, g, 1, 2, 0.0f, y);
  EXPECT_NEAR(y[0], 6.0 / std::sqrt(12.5), 1e-6);
  EXPECT_NEAR(y[1], -4.0 / std::sqrt(12.5), 1e-6);
}

TEST(AttentionKernels, RmsNormMatchesReference) {
  const int64_t rows = 5, dim = 37;
  auto x = Randn(rows * dim, 1), g = Randn(dim, 2);
  std::vector<float> yw(rows * dim), yu(rows * dim);
  RmsNormRows_rd(x.data(), g.data(), rows, dim, 1e-6f, yw.data());
  RmsNormRows_rd(x.data(), nullptr, rows, dim, 1e-6f, yu.data());
  std::vector<double> ref(dim);
  for (int64_t r = 0; r < rows; ++r) {
    RmsNormRef(x.data() + r * dim, g.data(), dim, 1e-6, ref.data());
    EXPECT_LT(MaxAbsDiff(yw.data() + r * dim, ref.data(), dim), 1e-5);
    RmsNormRef(x.data() + r * dim, nullptr, dim, 1e-6, ref.data());
    EXPECT_LT(MaxAbsDiff(yu.data() + r * dim, ref.data(), dim), 1e-5);
  }
  std::vector<float> inplace = x;  // in place gives the same bits
  RmsNormRows_rd(inplace.data(), g.data(), rows, dim, 1e-6f, inplace.data());
  EXPECT_EQ(inplace, yw);
}

// ---- RoPE ----

TEST(AttentionKernels, RopeDefaultFrequenciesHandComputed) {
  auto f = RopeInvFreqDefault(10000.0, 64);
  ASSERT_EQ(f.size(), 32u);
  EXPECT_FLOAT_EQ(f[0], 1.0f);
  EXPECT_NEAR(f[1], 0.7498942093324559, 1e-7);    // 10000^(-2/64)
  EXPECT_NEAR(f[31], 1.333521432163324e-4, 1e-10);  // 10000^(-62/64)
}

TEST(AttentionKernels, RopeYarnFrequenciesHandComputed) {
  // DeepSeek-V4-Flash: rd 64, compress theta 160000, factor 16, beta 32/1, L0 65536.
  // corr(32) = 15.45 -> lo = 15; corr(1) = 24.71 -> hi = 25.
  auto f = RopeInvFreqYarn(160000.0, 64, 16.0, 32.0, 1.0, 65536);
  ASSERT_EQ(f.size(), 32u);
  auto rel = [](double a, double b) { return std::fabs(a - b) / std::fabs(b); };
  EXPECT_LT(rel(f[0], 1.0), 1e-7);                                  // ramp 0: unscaled
  EXPECT_LT(rel(f[1], 0.6876560219336321), 1e-6);
  EXPECT_LT(rel(f[15], 0.003635538583622384), 1e-6);                // last unscaled
  EXPECT_LT(rel(f[18], 0.0008496897268387907), 1e-6);               // ramp 0.3
  EXPECT_LT(rel(f[20], 0.00029697777826169085), 1e-6);              // ramp 0.5
  EXPECT_LT(rel(f[25], 8.595700274170402e-05 / 16), 1e-6);          // ramp 1: f/16
  EXPECT_LT(rel(f[31], 9.088846459055961e-06 / 16), 1e-6);
  // Equal correction dims get hi += 0.001 rather than a division by zero.
  auto g = RopeInvFreqYarn(10000.0, 4, 4.0, 1.0, 1.0, 6);
  for (float v : g) EXPECT_TRUE(std::isfinite(v));
}

TEST(AttentionKernels, RopeMatchesReferenceAndInverts) {
  const int64_t n = 3, dim = 40, rd = 16;
  auto x = Randn(n * dim, 3);
  auto f = RopeInvFreqYarn(160000.0, rd, 16.0, 32.0, 1.0, 65536);
  for (int64_t pos : {0, 1, 7, 300, 65000}) {
    std::vector<float> y = x;
    RopeRows_nd(y.data(), n, dim, rd, pos, f.data(), false);
    std::vector<double> ref(dim);
    for (int64_t r = 0; r < n; ++r) {
      RopeRef(x.data() + r * dim, dim, rd, pos, f.data(), false, ref.data());
      EXPECT_LT(MaxAbsDiff(y.data() + r * dim, ref.data(), dim), 2e-6) << pos;
      for (int64_t c = 0; c < dim - rd; ++c) EXPECT_EQ(y[r * dim + c], x[r * dim + c]);
    }
    RopeRows_nd(y.data(), n, dim, rd, pos, f.data(), true);
    for (int64_t i = 0; i < n * dim; ++i) EXPECT_NEAR(y[i], x[i], 2e-6);
  }
  // Position 0 is the identity, bit for bit.
  std::vector<float> y = x;
  RopeRows_nd(y.data(), n, dim, rd, 0, f.data(), false);
  EXPECT_EQ(y, x);
}

// ---- attention core ----

TEST(AttentionKernels, DotHandlesTails) {
  for (int64_t n : {1, 7, 8, 9, 33}) {
    auto a = Randn(n, 10 + n), b = Randn(n, 20 + n);
    double ref = 0;
    for (int64_t i = 0; i < n; ++i) ref += double(a[i]) * b[i];
    EXPECT_NEAR(DotF32_n(a.data(), b.data(), n), ref, 1e-5) << n;
  }
}

TEST(AttentionKernels, SinkAttentionMatchesReference) {
  const int64_t d = 29, n = 21, nh = 3;
  auto q = Randn(nh * d, 4), kbuf = Randn(n * d, 5);
  const float sinks[nh] = {-3.0f, 0.0f, 2.5f};
  std::vector<const float*> keys;
  for (int64_t i = 0; i < n; ++i) keys.push_back(kbuf.data() + i * d);
  std::vector<float> o(nh * d), scratch(nh * n);
  SinkAttentionHeads_hd(q.data(), nh, keys.data(), n, d, sinks, 0.2f, scratch.data(), o.data());
  for (int64_t h = 0; h < nh; ++h) {
    std::vector<double> ref(d);
    SinkAttentionRef(q.data() + h * d, keys, d, sinks[h], 0.2, ref.data());
    EXPECT_LT(MaxAbsDiff(o.data() + h * d, ref.data(), d), 1e-5);
    // A head alone gives the same bits as inside the block.
    std::vector<float> one(d), s1(n);
    SinkAttentionHeads_hd(q.data() + h * d, 1, keys.data(), n, d, sinks + h, 0.2f, s1.data(),
                          one.data());
    EXPECT_EQ(0, std::memcmp(one.data(), o.data() + h * d, d * sizeof(float)));
  }
}

TEST(AttentionKernels, SinkOnlyInDenominator) {
  // n identical keys with logit 0 and sink 0: o = k * n / (n + 1).
  const int64_t d = 4, n = 3;
  const float k[d] = {1, -2, 0.5f, 4};
  const float q[d] = {0, 0, 0, 0};
  const float* keys[n] = {k, k, k};
  float o[d], scratch[n];
  const float zero = 0.0f, very_negative = -1e30f;
  SinkAttentionHeads_hd(q, 1, keys, n, d, &zero, 1.0f, scratch, o);
  for (int64_t c = 0; c < d; ++c) EXPECT_NEAR(o[c], k[c] * 0.75f, 1e-6);
  // A very negative sink: plain softmax, weights sum to 1.
  SinkAttentionHeads_hd(q, 1, keys, n, d, &very_negative, 1.0f, scratch, o);
  for (int64_t c = 0; c < d; ++c) EXPECT_NEAR(o[c], k[c], 1e-6);
  // No keys: zero output.
  SinkAttentionHeads_hd(q, 1, keys, 0, d, &zero, 1.0f, scratch, o);
  for (int64_t c = 0; c < d; ++c) EXPECT_EQ(o[c], 0.0f);
}

// ---- compressor pooling ----

// Per channel softmax over the slots, in double.
void PoolRef(const std::vector<const float*>& a, const std::vector<const float*>& z, int64_t d,
             double* out) {
  for (int64_t c = 0; c < d; ++c) {
    double m = -1e300, s = 0, acc = 0;
    for (auto* zj : z) m = std::max(m, double(zj[c]));
    for (auto* zj : z) s += std::exp(zj[c] - m);
    for (size_t j = 0; j < a.size(); ++j) acc += std::exp(z[j][c] - m) / s * a[j][c];
    out[c] = acc;
  }
}

TEST(AttentionKernels, CompressorPoolNonOverlap) {
  const int64_t r = 8, d = 13;
  auto a = Randn(r * d, 6), z = Randn(r * d, 7, 2.0f);
  std::vector<float> out(d);
  CompressorPoolWindow_rd(a.data(), z.data(), nullptr, nullptr, r, d, false, out.data());
  std::vector<const float*> ap, zp;
  for (int64_t j = 0; j < r; ++j) ap.push_back(a.data() + j * d), zp.push_back(z.data() + j * d);
  std::vector<double> ref(d);
  PoolRef(ap, zp, d, ref.data());
  EXPECT_LT(MaxAbsDiff(out.data(), ref.data(), d), 1e-6);
  // Equal logits: the mean of the slots.
  std::vector<float> flat(r * d, 0.3f);
  CompressorPoolWindow_rd(a.data(), flat.data(), nullptr, nullptr, r, d, false, out.data());
  for (int64_t c = 0; c < d; ++c) {
    double mean = 0;
    for (int64_t j = 0; j < r; ++j) mean += a[j * d + c] / double(r);
    EXPECT_NEAR(out[c], mean, 1e-6);
  }
}

TEST(AttentionKernels, CompressorPoolOverlap) {
  // Ratio 4: rows are 2d wide; slots = previous window's [0, d) then current window's [d, 2d).
  const int64_t r = 4, d = 6, w = 2 * d;
  auto prev_a = Randn(r * w, 8), prev_z = Randn(r * w, 9), cur_a = Randn(r * w, 10),
       cur_z = Randn(r * w, 11);
  std::vector<float> out(d);
  CompressorPoolWindow_rd(cur_a.data(), cur_z.data(), prev_a.data(), prev_z.data(), r, d, true,
                          out.data());
  std::vector<const float*> ap, zp;
  for (int64_t j = 0; j < r; ++j) ap.push_back(prev_a.data() + j * w), zp.push_back(prev_z.data() + j * w);
  for (int64_t j = 0; j < r; ++j)
    ap.push_back(cur_a.data() + j * w + d), zp.push_back(cur_z.data() + j * w + d);
  std::vector<double> ref(d);
  PoolRef(ap, zp, d, ref.data());
  EXPECT_LT(MaxAbsDiff(out.data(), ref.data(), d), 1e-6);
  // First window: the missing previous slots weigh 0 (logit -inf), only the current half counts.
  CompressorPoolWindow_rd(cur_a.data(), cur_z.data(), nullptr, nullptr, r, d, true, out.data());
  ap.erase(ap.begin(), ap.begin() + r);
  zp.erase(zp.begin(), zp.begin() + r);
  PoolRef(ap, zp, d, ref.data());
  EXPECT_LT(MaxAbsDiff(out.data(), ref.data(), d), 1e-6);
}

// ---- indexer ----

TEST(AttentionKernels, IndexerScoresMatchReference) {
  const int64_t nh = 3, d = 20, n = 11;
  auto q = Randn(nh * d, 12), w = Randn(nh, 13), k = Randn(n * d, 14);
  std::vector<float> score(n);
  const float scale = 1.0f / std::sqrt(float(d));
  IndexerScores_hd(q.data(), w.data(), nh, d, k.data(), n, scale, score.data());
  for (int64_t e = 0; e < n; ++e) {
    double ref = 0;
    for (int64_t h = 0; h < nh; ++h) {
      double dot = 0;
      for (int64_t c = 0; c < d; ++c) dot += double(q[h * d + c]) * k[e * d + c];
      ref += std::max(dot, 0.0) * scale * w[h];
    }
    EXPECT_NEAR(score[e], ref, 1e-5);
  }
}

TEST(AttentionKernels, TopKPicksHighestTiesToLowerIndex) {
  const float s[8] = {0.5f, 2.0f, -1.0f, 2.0f, 7.0f, 2.0f, 0.5f, 3.0f};
  int32_t out[4];
  TopKAscending_n(s, 8, 4, out);  // 7 (4), 3 (7), then the first two 2.0: indices 1, 3
  EXPECT_EQ(std::vector<int32_t>(out, out + 4), (std::vector<int32_t>{1, 3, 4, 7}));
  const float nan = std::numeric_limits<float>::quiet_NaN();
  const float t[4] = {nan, -5.0f, nan, -6.0f};
  int32_t o2[2];
  TopKAscending_n(t, 4, 2, o2);  // NaN ranks lowest
  EXPECT_EQ(o2[0], 1);
  EXPECT_EQ(o2[1], 3);
  // Exactly k distinct indices from a larger random set, and they are the k largest.
  auto r = Randn(100, 15);
  std::vector<int32_t> pick(17);
  TopKAscending_n(r.data(), 100, 17, pick.data());
  std::vector<float> sorted = r;
  std::sort(sorted.begin(), sorted.end(), std::greater<float>());
  for (size_t i = 1; i < pick.size(); ++i) EXPECT_LT(pick[i - 1], pick[i]);
  for (int32_t i : pick) EXPECT_GE(r[i], sorted[16]);
}

}  // namespace
}  // namespace fm
