// CUDA twins of the model's CPU ops beyond GEMV and the row ops: router, hyper-connections,
// MoE combine, the attention core, the indexer and the compressor's pooling, each against its
// CPU kernel. Device tests skip without a GPU; argument checks run everywhere.
#include <gtest/gtest.h>

#include <cmath>
#include <random>
#include <string>
#include <vector>

#include "kernels/cpu/attention_core.h"
#include "kernels/cpu/compressor_pool.h"
#include "kernels/cpu/hc.h"
#include "kernels/cpu/indexer.h"
#include "kernels/cpu/router.h"
#include "kernels/cpu/swiglu.h"
#include "kernels/cuda/ops.h"
#include "tests/gpu/cuda_test_util.h"

namespace fm {
namespace {

using namespace cudatest;
using cuda::DeviceBuffer;

// The device router for T tokens (hash layers: tid2eid [vocab, k] and the tokens' ids); ids and
// weights back on the host.
void DeviceRouter(const std::vector<float>& logits, const std::vector<float>* bias,
                  const std::vector<int64_t>* tid2eid, const std::vector<int32_t>* tokens,
                  int64_t T, int64_t E, int64_t k, float scale, std::vector<int32_t>* ids,
                  std::vector<float>* w) {
  DeviceBuffer dl = ToDevice(logits);
  DeviceBuffer db = bias ? ToDevice(*bias) : DeviceBuffer();
  DeviceBuffer de = tid2eid ? ToDevice(*tid2eid) : DeviceBuffer();
  DeviceBuffer dt = tokens ? ToDevice(*tokens) : DeviceBuffer();
  const int64_t vocab = tid2eid ? static_cast<int64_t>(tid2eid->size()) / k : 0;
  auto di = DeviceBuffer::Alloc(T * k * sizeof(int32_t));
  auto dw = DeviceBuffer::Alloc(T * k * sizeof(float));
  ASSERT_TRUE(di.ok() && dw.ok());
  ASSERT_OK(cuda::RouterTopK(dl.as<float>(), bias ? db.as<float>() : nullptr,
                             tid2eid ? de.as<int64_t>() : nullptr,
                             tokens ? dt.as<int32_t>() : nullptr, vocab, T, E, k, scale,
                             di->as<int32_t>(), dw->as<float>()));
  ids->resize(T * k);
  ASSERT_OK(di->CopyToHost(ids->data(), T * k * sizeof(int32_t)));
  *w = ToHost(*dw, T * k);
}

TEST(CudaArgs, RouterRejectsBadShapes) {
  float f[4] = {};
  int32_t ids[4] = {};
  int64_t e[4] = {};
  Status s = cuda::RouterTopK(f, nullptr, nullptr, nullptr, 0, 1, 0, 1, 1.0f, ids, f);
  EXPECT_NE(s.message().find("experts 0 outside [1, 1024]"), std::string::npos) << s.ToString();
  s = cuda::RouterTopK(f, nullptr, nullptr, nullptr, 0, 1, 4, 5, 1.0f, ids, f);
  EXPECT_NE(s.message().find("top_k 5 outside [1, experts 4]"), std::string::npos) << s.ToString();
  s = cuda::RouterTopK(f, f, e, ids, 2, 1, 4, 2, 1.0f, ids, f);
  EXPECT_NE(s.message().find("exclusive"), std::string::npos) << s.ToString();
  s = cuda::RouterTopK(f, nullptr, e, nullptr, 2, 1, 4, 2, 1.0f, ids, f);
  EXPECT_NE(s.message().find("hash routing needs the tokens"), std::string::npos) << s.ToString();
  EXPECT_TRUE(cuda::RouterTopK(f, nullptr, nullptr, nullptr, 0, 0, 4, 2, 1.0f, ids, f).ok());
}

// Score layers: the ids of the CPU router (top-k of s + bias), the weights within float
// rounding (expf/log1pf differ from the host's in the last bit).
TEST(CudaRouter, TopkWithBiasMatchesCpuRouter) {
  if (cuda::DeviceCount() == 0) GTEST_SKIP() << "no CUDA device";
  std::mt19937 rng(12);
  for (int64_t E : {64, 256, 1000}) {
    const int64_t T = 7, k = 6;
    std::vector<float> logits = RandomNormal(T * E, rng, 2.0f), bias = RandomNormal(E, rng, 0.5f);
    logits[3] = 25.0f;   // the softplus threshold
    std::vector<int32_t> ids;
    std::vector<float> w;
    DeviceRouter(logits, &bias, nullptr, nullptr, T, E, k, 2.5f, &ids, &w);
    for (int64_t t = 0; t < T; ++t) {
      std::vector<float> s(E), want_w(k);
      std::vector<int32_t> want_ids(k);
      RouterSqrtSoftplus_E(&logits[t * E], E, s.data());
      RouterTopkBias_E(s.data(), bias.data(), E, k, 2.5f, want_ids.data(), want_w.data());
      for (int64_t j = 0; j < k; ++j) EXPECT_EQ(ids[t * k + j], want_ids[j]) << "E " << E << " t " << t << " j " << j;
      ExpectClose(std::vector<float>(w.begin() + t * k, w.begin() + (t + 1) * k), want_w, 1e-6,
                  "weights E=" + std::to_string(E));
    }
  }
}

TEST(CudaRouter, EqualScoresPickTheLowestIndicesInOrder) {
  if (cuda::DeviceCount() == 0) GTEST_SKIP() << "no CUDA device";
  const int64_t E = 300, k = 8;
  std::vector<float> logits(E, 0.25f);
  std::vector<int32_t> ids;
  std::vector<float> w;
  DeviceRouter(logits, nullptr, nullptr, nullptr, 1, E, k, 1.0f, &ids, &w);
  for (int64_t j = 0; j < k; ++j) {
    EXPECT_EQ(ids[j], j);
    EXPECT_NEAR(w[j], 1.0f / k, 1e-7);
  }
}

TEST(CudaRouter, HashLayerTakesTheTokensRow) {
  if (cuda::DeviceCount() == 0) GTEST_SKIP() << "no CUDA device";
  std::mt19937 rng(13);
  const int64_t T = 4, E = 256, k = 6, V = 10;
  std::vector<float> logits = RandomNormal(T * E, rng, 2.0f);
  std::vector<int64_t> tid2eid(V * k);
  for (int64_t i = 0; i < V * k; ++i) tid2eid[i] = (i * 37 + 5) % E;
  const std::vector<int32_t> tokens = {7, 0, 9, 10};  // the last is outside the vocab
  std::vector<int32_t> ids;
  std::vector<float> w;
  DeviceRouter(logits, nullptr, &tid2eid, &tokens, T, E, k, 1.5f, &ids, &w);
  for (int64_t t = 0; t < T - 1; ++t) {
    std::vector<float> s(E), want_w(k);
    std::vector<int32_t> want_ids(k);
    RouterSqrtSoftplus_E(&logits[t * E], E, s.data());
    RouterHash_k(s.data(), &tid2eid[tokens[t] * k], k, 1.5f, want_ids.data(), want_w.data());
    for (int64_t j = 0; j < k; ++j) EXPECT_EQ(ids[t * k + j], want_ids[j]);
    ExpectClose(std::vector<float>(w.begin() + t * k, w.begin() + (t + 1) * k), want_w, 1e-6, "hash");
  }
  for (int64_t j = 0; j < k; ++j) {
    EXPECT_EQ(ids[(T - 1) * k + j], -1);
    EXPECT_TRUE(std::isnan(w[(T - 1) * k + j]));
  }
}

TEST(CudaArgs, HcAndCombineRejectBadShapes) {
  float f[4] = {};
  Status s = cuda::HcPre(f, f, f, f, 1, 17, 8, 1, 1e-6f, 1e-6f, f, f, f);
  EXPECT_NE(s.message().find("hc streams 17 outside [1, 16]"), std::string::npos) << s.ToString();
  s = cuda::HcPre(f, f, f, f, 1, 4, 8, 0, 1e-6f, 1e-6f, f, f, f);
  EXPECT_NE(s.message().find("sinkhorn iters 0"), std::string::npos) << s.ToString();
  s = cuda::HcPost(f, f, f, f, 1, 4, 8, f);
  EXPECT_NE(s.message().find("must not alias"), std::string::npos) << s.ToString();
  s = cuda::MoeCombine(f, f, 1, 0, 8, f);
  EXPECT_NE(s.message().find("top_k 0"), std::string::npos) << s.ToString();
  EXPECT_TRUE(cuda::HcHead(nullptr, nullptr, nullptr, 1.0f, 0, 4, 8, 1e-6f, 1e-6f, nullptr).ok());
}

// hc_pre / hc_head / hc_post and the combine against the CPU kernels on the same inputs.
TEST(CudaHc, PrePostHeadAndCombineMatchTheCpuKernels) {
  if (cuda::DeviceCount() == 0) GTEST_SKIP() << "no CUDA device";
  std::mt19937 rng(21);
  const int64_t T = 3, n = 4, H = 1000, iters = 20, mixes = (2 + n) * n, k = 6;
  const float eh = 1e-6f, eps = 1e-6f;
  const std::vector<float> x = RandomNormal(T * n * H, rng), mix = RandomNormal(T * mixes, rng, 30.0f);
  const std::vector<float> base = RandomNormal(mixes, rng, 0.5f), scale = {0.7f, 1.3f, 0.9f};
  const std::vector<float> out = RandomNormal(T * H, rng);
  std::vector<float> want_y(T * H), want_post(T * n), want_comb(T * n * n), want_x(T * n * H),
      want_head(T * H);
  for (int64_t t = 0; t < T; ++t) {
    std::vector<float> pre(n);
    const float rinv = RmsInv(&x[t * n * H], n * H, eps);
    HcPreWeights_n(&mix[t * mixes], rinv, base.data(), scale.data(), n, iters, eh, pre.data(),
                   &want_post[t * n], &want_comb[t * n * n]);
    HcCollapse_nH(&x[t * n * H], pre.data(), n, H, &want_y[t * H]);
    HcPost_nH(&x[t * n * H], &out[t * H], &want_post[t * n], &want_comb[t * n * n], n, H,
              &want_x[t * n * H]);
    HcHeadWeights_n(&mix[t * mixes], rinv, base.data(), 0.8f, n, eh, pre.data());
    HcCollapse_nH(&x[t * n * H], pre.data(), n, H, &want_head[t * H]);
  }
  DeviceBuffer dx = ToDevice(x), dmix = ToDevice(mix), dbase = ToDevice(base), dscale = ToDevice(scale);
  DeviceBuffer dout = ToDevice(out), dy = Zeros(T * H), dpost = Zeros(T * n), dcomb = Zeros(T * n * n);
  ASSERT_OK(cuda::HcPre(dx.as<float>(), dmix.as<float>(), dbase.as<float>(), dscale.as<float>(), T, n,
                        H, iters, eh, eps, dy.as<float>(), dpost.as<float>(), dcomb.as<float>()));
  ExpectClose(ToHost(dy, T * H), want_y, 1e-5, "hc_pre y");
  ExpectClose(ToHost(dpost, T * n), want_post, 1e-5, "hc_pre post");
  ExpectClose(ToHost(dcomb, T * n * n), want_comb, 1e-5, "hc_pre comb");
  // hc_post from the CPU's post/comb, so only the kernel itself is compared.
  DeviceBuffer cpost = ToDevice(want_post), ccomb = ToDevice(want_comb), dxn = Zeros(T * n * H);
  ASSERT_OK(cuda::HcPost(dx.as<float>(), dout.as<float>(), cpost.as<float>(), ccomb.as<float>(), T, n,
                         H, dxn.as<float>()));
  ExpectClose(ToHost(dxn, T * n * H), want_x, 1e-5, "hc_post");
  // hc_head takes mix [T, n]: the first n of each token's mix row here.
  std::vector<float> head_mix(T * n);
  for (int64_t t = 0; t < T; ++t)
    for (int64_t i = 0; i < n; ++i) head_mix[t * n + i] = mix[t * mixes + i];
  DeviceBuffer dhm = ToDevice(head_mix), dh = Zeros(T * H);
  ASSERT_OK(cuda::HcHead(dx.as<float>(), dhm.as<float>(), dbase.as<float>(), 0.8f, T, n, H, eh, eps,
                         dh.as<float>()));
  ExpectClose(ToHost(dh, T * H), want_head, 1e-5, "hc_head");
  // Combine: contrib [T, k, H], w [T, k].
  const std::vector<float> contrib = RandomNormal(T * k * H, rng), w = RandomNormal(T * k, rng);
  std::vector<float> want_c(T * H);
  for (int64_t t = 0; t < T; ++t) MoeCombine_kH(&contrib[t * k * H], &w[t * k], k, H, &want_c[t * H]);
  DeviceBuffer dc = ToDevice(contrib), dw = ToDevice(w), dyc = Zeros(T * H);
  ASSERT_OK(cuda::MoeCombine(dc.as<float>(), dw.as<float>(), T, k, H, dyc.as<float>()));
  ExpectClose(ToHost(dyc, T * H), want_c, 1e-6, "combine");
}

TEST(CudaArgs, SinkAttentionRejectsBadShapes) {
  float f[4] = {};
  int32_t idx[1] = {0};
  Status s = cuda::SinkAttention(f, 1, f, idx, 5000, 4, f, 1.0f, f);
  EXPECT_NE(s.message().find("keys 5000 outside [0, 4096]"), std::string::npos) << s.ToString();
  s = cuda::SinkAttention(f, 1, f, idx, 1, 0, f, 1.0f, f);
  EXPECT_NE(s.message().find("head_dim 0"), std::string::npos) << s.ToString();
  s = cuda::SinkAttention(f, 1, nullptr, nullptr, 3, 4, f, 1.0f, f);
  EXPECT_NE(s.message().find("null device pointer"), std::string::npos) << s.ToString();
}

// Against the CPU core on gathered rows: 64 heads of 512 over a ring and selected rows given
// by index (out of order, some repeated), a dominant sink, and no keys at all.
TEST(CudaAttention, SinkAttentionMatchesTheCpuCore) {
  if (cuda::DeviceCount() == 0) GTEST_SKIP() << "no CUDA device";
  std::mt19937 rng(31);
  for (int64_t n : {0, 1, 37, 640}) {
    const int64_t nh = 8, d = 512, rows = 700;
    const std::vector<float> q = RandomNormal(nh * d, rng), kv = RandomNormal(rows * d, rng);
    std::vector<float> sink = RandomNormal(nh, rng);
    sink[1] = 40.0f;   // dominates the denominator: o_1 ~ 0
    std::vector<int32_t> idx(n);
    for (int64_t i = 0; i < n; ++i) idx[i] = static_cast<int32_t>((i * 97 + 13) % rows);
    const float scale = 1.0f / std::sqrt(static_cast<float>(d));
    std::vector<const float*> keys(n);
    for (int64_t i = 0; i < n; ++i) keys[i] = &kv[idx[i] * d];
    std::vector<float> scratch(nh * std::max<int64_t>(n, 1)), want(nh * d);
    SinkAttentionHeads_hd(q.data(), nh, keys.data(), n, d, sink.data(), scale, scratch.data(), want.data());
    DeviceBuffer dq = ToDevice(q), dkv = ToDevice(kv), ds = ToDevice(sink), o = Zeros(nh * d);
    DeviceBuffer di = n ? ToDevice(idx) : DeviceBuffer();
    ASSERT_OK(cuda::SinkAttention(dq.as<float>(), nh, dkv.as<float>(), n ? di.as<int32_t>() : nullptr,
                                  n, d, ds.as<float>(), scale, o.as<float>()));
    ExpectClose(ToHost(o, nh * d), want, 1e-5, "attention n=" + std::to_string(n));
  }
}

TEST(CudaArgs, IndexerAndPoolRejectBadShapes) {
  float f[4] = {};
  int32_t out[4] = {};
  Status s = cuda::TopKAscending(f, 20000, 4, out);
  EXPECT_NE(s.message().find("n 20000 outside [0, 16384]"), std::string::npos) << s.ToString();
  s = cuda::TopKAscending(f, 3, 4, out);
  EXPECT_NE(s.message().find("k 4 outside [0, n 3]"), std::string::npos) << s.ToString();
  s = cuda::IndexerScores(f, f, 0, 4, f, 1, 1.0f, f);
  EXPECT_NE(s.message().find("heads 0"), std::string::npos) << s.ToString();
  s = cuda::CompressorPool(f, f, 0, 4, f);
  EXPECT_NE(s.message().find("slots 0"), std::string::npos) << s.ToString();
}

TEST(CudaIndexer, ScoresAndTopKMatchTheCpuIndexer) {
  if (cuda::DeviceCount() == 0) GTEST_SKIP() << "no CUDA device";
  std::mt19937 rng(41);
  const int64_t nh = 16, d = 128;
  for (int64_t n : {1, 100, 3000}) {
    const std::vector<float> q = RandomNormal(nh * d, rng), w = RandomNormal(nh, rng, 0.25f);
    const std::vector<float> keys = RandomNormal(n * d, rng);
    const float scale = 1.0f / std::sqrt(static_cast<float>(d));
    std::vector<float> want(n);
    IndexerScores_hd(q.data(), w.data(), nh, d, keys.data(), n, scale, want.data());
    DeviceBuffer dq = ToDevice(q), dw = ToDevice(w), dk = ToDevice(keys), ds = Zeros(n);
    ASSERT_OK(cuda::IndexerScores(dq.as<float>(), dw.as<float>(), nh, d, dk.as<float>(), n, scale,
                                  ds.as<float>()));
    ExpectClose(ToHost(ds, n), want, 1e-5, "indexer scores n=" + std::to_string(n));
  }
  // Top-k on fixed scores (so the comparison is exact): ties, NaN, k == n.
  for (int64_t n : {1, 50, 3000}) {
    std::vector<float> score = RandomNormal(n, rng);
    for (int64_t i = 0; i < n; i += 7) score[i] = 0.5f;   // ties
    if (n > 3) score[3] = NAN;
    for (int64_t k : {int64_t{1}, std::min<int64_t>(n, 17), n}) {
      std::vector<int32_t> want(k), got(k);
      TopKAscending_n(score.data(), n, k, want.data());
      DeviceBuffer ds = ToDevice(score);
      auto dout = DeviceBuffer::Alloc(k * sizeof(int32_t));
      ASSERT_TRUE(dout.ok());
      ASSERT_OK(cuda::TopKAscending(ds.as<float>(), n, k, dout->as<int32_t>()));
      ASSERT_OK(dout->CopyToHost(got.data(), k * sizeof(int32_t)));
      EXPECT_EQ(got, want) << "n " << n << " k " << k;
    }
  }
}

TEST(CudaCompressor, PoolMatchesTheCpuPool) {
  if (cuda::DeviceCount() == 0) GTEST_SKIP() << "no CUDA device";
  std::mt19937 rng(43);
  for (int64_t n : {1, 4, 8, 128}) {
    const int64_t d = 512;
    const std::vector<float> a = RandomNormal(n * d, rng);
    std::vector<float> z = RandomNormal(n * d, rng, 3.0f);
    if (n > 1)
      for (int64_t c = 0; c < d; c += 3) z[c] = -INFINITY;   // a first-window slot: weight 0
    std::vector<const float*> ap(n), zp(n);
    for (int64_t j = 0; j < n; ++j) ap[j] = &a[j * d], zp[j] = &z[j * d];
    std::vector<float> want(d);
    CompressorPool_nd(ap.data(), zp.data(), n, d, want.data());
    DeviceBuffer da = ToDevice(a), dz = ToDevice(z), dp = Zeros(d);
    ASSERT_OK(cuda::CompressorPool(da.as<float>(), dz.as<float>(), n, d, dp.as<float>()));
    ExpectClose(ToHost(dp, d), want, 1e-5, "pool n=" + std::to_string(n));
  }
}

}  // namespace
}  // namespace fm
