// CUDA twins of the model's CPU ops beyond GEMV and the row ops: the router, hc_head, hc_post,
// the MoE combine and the embedding lookup, each against its CPU kernel. Device tests skip without a GPU; argument checks run everywhere.
#include <gtest/gtest.h>

#include <cmath>
#include <cstring>
#include <limits>
#include <random>
#include <set>
#include <string>
#include <vector>

#include "kernels/cpu/hc.h"
#include "kernels/cpu/router.h"
#include "kernels/cpu/swiglu.h"
#include "common/numfmt.h"
#include "kernels/cuda/ops.h"
#include "model/forward.h"
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

// The gate product and the router in one launch against Gemm and then RouterTopK: logits, ids
// and weights bit for bit, score (with bias) and hash layers, T = 1..20 (the last block routes
// up to 8 tokens a pass) and 40 (over 32 tokens: RouterTopK's launch after the product), each
// call twice (the block counter resets itself); an FP8 gate on the tensor-core core takes the
// two launches, with the same results.
TEST(CudaRouter, GateRouterTopKEqualsGemmThenRouter) {
  if (cuda::DeviceCount() == 0) GTEST_SKIP() << "no CUDA device";
  std::mt19937 rng(15);
  const int64_t E = 256, H = 512, k = 6, V = 50, Tmax = 40;
  const std::vector<float> x = RandomNormal(Tmax * H, rng), bias = RandomNormal(E, rng, 0.3f);
  std::vector<int64_t> tid2eid(V * k);
  for (int64_t i = 0; i < V * k; ++i) tid2eid[i] = (i * 53 + 11) % E;
  std::vector<int32_t> tokens(Tmax);
  for (int64_t t = 0; t < Tmax; ++t) tokens[t] = static_cast<int32_t>((t * 7) % V);
  DeviceBuffer dx = ToDevice(x), db = ToDevice(bias), de = ToDevice(tid2eid), dt = ToDevice(tokens);
  DeviceBuffer count = ToDevice(std::vector<int32_t>(1, 0));
  for (const WeightFormat f : {WeightFormat::kBF16, WeightFormat::kF32, WeightFormat::kFP8Block}) {
    const HostWeight gate = RandomWeight(f, E, H, rng);
    auto dg = cuda::UploadWeight(gate.w);
    ASSERT_TRUE(dg.ok()) << dg.status().ToString();
    WeightPathScope path(f == WeightFormat::kFP8Block ? cuda::WeightPath::kTensorCore
                                                      : cuda::WeightPath::kFma);
    for (const bool hash : {false, true}) {
      for (const int64_t T : {1, 3, 9, 20, 40}) {
        SCOPED_TRACE("format " + std::to_string(static_cast<int>(f)) + (hash ? " hash" : " score") +
                     " T " + std::to_string(T));
        const float* b = hash ? nullptr : db.as<float>();
        const int64_t* te = hash ? de.as<int64_t>() : nullptr;
        DeviceBuffer l1 = Zeros(T * E), l2 = Zeros(T * E), w1 = Zeros(T * k), w2 = Zeros(T * k);
        DeviceBuffer i1 = ToDevice(std::vector<int32_t>(T * k, -9)), i2 = ToDevice(std::vector<int32_t>(T * k, -9));
        ASSERT_OK(cuda::Gemm(dg->view(), dx.as<float>(), H, l1.as<float>(), E, T));
        ASSERT_OK(cuda::RouterTopK(l1.as<float>(), b, te, dt.as<int32_t>(), V, T, E, k, 2.5f,
                                   i1.as<int32_t>(), w1.as<float>()));
        for (int rep = 0; rep < 2; ++rep) {
          ASSERT_OK(cuda::GateRouterTopK(dg->view(), dx.as<float>(), H, T, l2.as<float>(), b, te,
                                         dt.as<int32_t>(), V, k, 2.5f, i2.as<int32_t>(),
                                         w2.as<float>(), count.as<int32_t>()));
          const auto la = ToHost(l1, T * E), lb = ToHost(l2, T * E);
          const auto wa = ToHost(w1, T * k), wb = ToHost(w2, T * k);
          EXPECT_EQ(std::memcmp(la.data(), lb.data(), la.size() * 4), 0) << "logits, rep " << rep;
          EXPECT_EQ(std::memcmp(wa.data(), wb.data(), wa.size() * 4), 0) << "weights, rep " << rep;
          std::vector<int32_t> ia(T * k), ib(T * k);
          ASSERT_OK(i1.CopyToHost(ia.data(), ia.size() * 4));
          ASSERT_OK(i2.CopyToHost(ib.data(), ib.size() * 4));
          EXPECT_EQ(ia, ib) << "ids, rep " << rep;
          EXPECT_NE(ib[0], -9) << "written";
        }
      }
    }
  }
  std::vector<int32_t> left(1);
  ASSERT_OK(count.CopyToHost(left.data(), 4));
  EXPECT_EQ(left[0], 0) << "the counter is back at 0";
  int32_t id = 0;
  float w = 0;
  const Status st = cuda::GateRouterTopK(QWeight{WeightFormat::kBF16, 2000, 8, &w, nullptr}, &w, 8,
                                         1, &w, nullptr, nullptr, nullptr, 0, 2, 1.0f, &id, &w, &id);
  EXPECT_NE(st.message().find("GateRouterTopK: experts 2000 outside [1, 1024]"), std::string::npos)
      << st.ToString();
}

// NaN logits (a broken activation upstream) still give k distinct ids inside [0, E): the experts
// then read valid weights, and the NaN reaches the output through the weights.
TEST(CudaRouter, NanLogitsStillPickDistinctExpertsInRange) {
  if (cuda::DeviceCount() == 0) GTEST_SKIP() << "no CUDA device";
  std::mt19937 rng(14);
  const int64_t T = 3, E = 256, k = 6;
  std::vector<float> logits = RandomNormal(T * E, rng, 2.0f);
  for (int64_t e = 0; e < E; e += 3) logits[e] = NAN;  // token 0: every third
  for (int64_t e = 0; e < E; ++e) logits[2 * E + e] = NAN;  // token 2: all of them
  std::vector<int32_t> ids;
  std::vector<float> w;
  DeviceRouter(logits, nullptr, nullptr, nullptr, T, E, k, 1.0f, &ids, &w);
  for (int64_t t = 0; t < T; ++t) {
    std::set<int32_t> seen;
    for (int64_t j = 0; j < k; ++j) {
      const int32_t id = ids[t * k + j];
      EXPECT_TRUE(id >= 0 && id < E) << "t " << t << " j " << j << " id " << id;
      EXPECT_TRUE(seen.insert(id).second) << "t " << t << " id " << id << " twice";
    }
  }
  for (int64_t j = 0; j < k; ++j) EXPECT_TRUE(std::isnan(w[2 * k + j]));
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
  Status s = cuda::HcHead(f, f, f, 1.0f, 1, 17, 8, 1e-6f, 1e-6f, f);
  EXPECT_NE(s.message().find("hc streams 17 outside [1, 16]"), std::string::npos) << s.ToString();
  s = cuda::HcPost(f, f, f, f, 1, 4, 8, f);
  EXPECT_NE(s.message().find("must not alias"), std::string::npos) << s.ToString();
  s = cuda::MoeCombine(f, f, 1, 0, 8, f);
  EXPECT_NE(s.message().find("top_k 0"), std::string::npos) << s.ToString();
  // Expert slots for hc_post need their weights.
  s = cuda::HcPost(f, cuda::HcPostInput::Slots(f, nullptr, 6), f, f, 1, 4, 8, f + 1);
  EXPECT_NE(s.message().find("HcPost: expert slots need their weights"), std::string::npos)
      << s.ToString();
  EXPECT_TRUE(cuda::HcHead(nullptr, nullptr, nullptr, 1.0f, 0, 4, 8, 1e-6f, 1e-6f, nullptr).ok());
}

// hc_head / hc_post and the combine against the CPU kernels on the same inputs (hc_post's post
// and comb from the CPU's hc_pre weights).
TEST(CudaHc, PostHeadAndCombineMatchTheCpuKernels) {
  if (cuda::DeviceCount() == 0) GTEST_SKIP() << "no CUDA device";
  std::mt19937 rng(21);
  const int64_t T = 3, n = 4, H = 1000, iters = 20, mixes = (2 + n) * n, k = 6;
  const float eh = 1e-6f, eps = 1e-6f;
  const std::vector<float> x = RandomNormal(T * n * H, rng), mix = RandomNormal(T * mixes, rng, 30.0f);
  const std::vector<float> base = RandomNormal(mixes, rng, 0.5f), scale = {0.7f, 1.3f, 0.9f};
  const std::vector<float> out = RandomNormal(T * H, rng);
  std::vector<float> want_post(T * n), want_comb(T * n * n), want_x(T * n * H), want_head(T * H);
  for (int64_t t = 0; t < T; ++t) {
    std::vector<float> pre(n);
    const float rinv = RmsInv(&x[t * n * H], n * H, eps);
    HcPreWeights_n(&mix[t * mixes], rinv, base.data(), scale.data(), n, iters, eh, pre.data(),
                   &want_post[t * n], &want_comb[t * n * n]);
    HcPost_nH(&x[t * n * H], &out[t * H], &want_post[t * n], &want_comb[t * n * n], n, H,
              &want_x[t * n * H]);
    HcHeadWeights_n(&mix[t * mixes], rinv, base.data(), 0.8f, n, eh, pre.data());
    HcCollapse_nH(&x[t * n * H], pre.data(), n, H, &want_head[t * H]);
  }
  DeviceBuffer dx = ToDevice(x), dbase = ToDevice(base), dout = ToDevice(out);
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
  // hc_post straight from the expert slots [T, k + 1, H] (the shared row last): the bits of
  // MoeCombine(add_shared) into an output and hc_post of that output.
  const std::vector<float> slots = RandomNormal(T * (k + 1) * H, rng);
  DeviceBuffer ds = ToDevice(slots), dsum = Zeros(T * H), dx2 = Zeros(T * n * H), dx3 = Zeros(T * n * H);
  ASSERT_OK(cuda::MoeCombine(ds.as<float>(), dw.as<float>(), T, k, H, dsum.as<float>(), true));
  ASSERT_OK(cuda::HcPost(dx.as<float>(), dsum.as<float>(), cpost.as<float>(), ccomb.as<float>(), T,
                         n, H, dx2.as<float>()));
  ASSERT_OK(cuda::HcPost(dx.as<float>(), cuda::HcPostInput::Slots(ds.as<float>(), dw.as<float>(), k),
                         cpost.as<float>(), ccomb.as<float>(), T, n, H, dx3.as<float>()));
  const std::vector<float> two = ToHost(dx2, T * n * H), one = ToHost(dx3, T * n * H);
  EXPECT_EQ(std::memcmp(two.data(), one.data(), two.size() * sizeof(float)), 0);
  std::vector<float> sum(T * H), want_x2(T * n * H);
  for (int64_t t = 0; t < T; ++t) {
    for (int64_t h = 0; h < H; ++h) {  // MoeCombine_kH's sum, then the shared row
      float acc = 0.0f;
      for (int64_t j = 0; j < k; ++j) acc += w[t * k + j] * slots[(t * (k + 1) + j) * H + h];
      sum[t * H + h] = acc + slots[(t * (k + 1) + k) * H + h];
    }
    HcPost_nH(&x[t * n * H], &sum[t * H], &want_post[t * n], &want_comb[t * n * n], n, H,
              &want_x2[t * n * H]);
  }
  ExpectClose(one, want_x2, 1e-5, "hc_post of the slots");
}

TEST(CudaArgs, EmbedRowsRejectsBadShapes) {
  float x = 0.0f;
  int32_t id = 0;
  EXPECT_EQ(cuda::EmbedRows(&x, false, 0, 4, &id, 1, 1, &x).code(), Code::kInvalidArgument);
  EXPECT_EQ(cuda::EmbedRows(&x, false, 8, 4, &id, -1, 1, &x).code(), Code::kInvalidArgument);
  EXPECT_EQ(cuda::EmbedRows(&x, false, 8, 4, &id, 1, 0, &x).code(), Code::kInvalidArgument);
  EXPECT_EQ(cuda::EmbedRows(nullptr, false, 8, 4, &id, 1, 1, &x).code(), Code::kInvalidArgument);
  EXPECT_TRUE(cuda::EmbedRows(nullptr, false, 8, 4, nullptr, 0, 1, nullptr).ok());  // no rows
}

// The device lookup == EmbedManifold (the CPU shard's) bit for bit, BF16 and F32 tables, H not
// a multiple of the block, repeated ids and both ends of the vocabulary; an id the host would
// have refused gives NaN rows, not a read outside the table.
TEST(CudaEmbed, RowsEqualTheCpuEmbedManifold) {
  if (cuda::DeviceCount() == 0) GTEST_SKIP() << "no CUDA device";
  std::mt19937 rng(14);
  const int64_t V = 37, H = 300, n = 4;
  const std::vector<int32_t> ids = {0, 36, 5, 5, 17};
  const int64_t T = static_cast<int64_t>(ids.size());
  const std::vector<float> f32 = RandomNormal(V * H, rng);
  std::vector<uint16_t> bf16(V * H);
  for (size_t i = 0; i < bf16.size(); ++i) bf16[i] = F32ToBf16(f32[i]);
  for (const bool is_bf16 : {true, false}) {
    TensorView table;
    table.dtype = is_bf16 ? DType::kBF16 : DType::kF32;
    table.shape = {V, H};
    table.data = is_bf16 ? reinterpret_cast<const uint8_t*>(bf16.data())
                         : reinterpret_cast<const uint8_t*>(f32.data());
    table.nbytes = V * H * (is_bf16 ? 2 : 4);
    std::vector<float> want(T * n * H);
    EmbedManifold(table, ids, n, H, want.data());
    auto dtable = cuda::Upload(table.data, table.nbytes);
    ASSERT_TRUE(dtable.ok());
    DeviceBuffer dids = ToDevice(ids), dx = Zeros(T * n * H);
    ASSERT_OK(cuda::EmbedRows(dtable->data(), is_bf16, V, H, dids.as<int32_t>(), T, n,
                              dx.as<float>()));
    const std::vector<float> got = ToHost(dx, T * n * H);
    for (size_t i = 0; i < got.size(); ++i)
      ASSERT_TRUE(SameBits(got[i], want[i])) << (is_bf16 ? "bf16" : "f32") << " element " << i;
    const std::vector<int32_t> bad = {V};
    DeviceBuffer dbad = ToDevice(bad), dy = Zeros(n * H);
    ASSERT_OK(cuda::EmbedRows(dtable->data(), is_bf16, V, H, dbad.as<int32_t>(), 1, n,
                              dy.as<float>()));
    for (float v : ToHost(dy, n * H)) ASSERT_TRUE(std::isnan(v));
  }
}

// CopyRowPieces == the plain loop bit for bit (NaN payloads included): a column slice with
// strides, a join of two side-by-side pieces, a gather (src rows) and a scatter (dst rows) with
// a width that is not a multiple of the block; bad shapes are refused.
TEST(CudaCopyRowPieces, EqualsThePlainLoop) {
  if (cuda::DeviceCount() == 0) GTEST_SKIP() << "no CUDA device";
  std::mt19937 rng(15);
  const int64_t rows = 7, stride = 300, width = 257;
  std::vector<float> src = RandomNormal(rows * stride, rng);
  src[2 * stride + 5] = std::numeric_limits<float>::quiet_NaN();
  DeviceBuffer dsrc = ToDevice(src);
  struct Case {
    int64_t src_off, src_stride, dst_off, dst_stride, n;
    std::vector<int32_t> src_row, dst_row;
  };
  const std::vector<Case> cases = {
      {3, stride, 0, width, rows, {}, {}},                     // columns [3, 260) -> [7, 257]
      {0, stride, 257, 2 * width + 1, rows, {}, {}},           // the right half of a join
      {40, stride, 0, width, 5, {6, 0, 2, 2, 4}, {}},          // a gather, a row twice
      {1, stride, 2, 260, 4, {}, {5, 1, 0, 3}},                // a scatter
      {0, stride, 0, width, 3, {2, 4, 6}, {2, 0, 1}},          // both
  };
  for (size_t ci = 0; ci < cases.size(); ++ci) {
    const Case& k = cases[ci];
    const int64_t dst_rows = 8;
    std::vector<float> want(dst_rows * k.dst_stride, -1.0f);
    for (int64_t i = 0; i < k.n; ++i) {
      const int64_t sr = k.src_row.empty() ? i : k.src_row[i];
      const int64_t dr = k.dst_row.empty() ? i : k.dst_row[i];
      for (int64_t c = 0; c < width; ++c)
        want[dr * k.dst_stride + k.dst_off + c] = src[sr * k.src_stride + k.src_off + c];
    }
    DeviceBuffer ddst = ToDevice(std::vector<float>(want.size(), -1.0f));
    DeviceBuffer dsr = k.src_row.empty() ? DeviceBuffer() : ToDevice(k.src_row);
    DeviceBuffer ddr = k.dst_row.empty() ? DeviceBuffer() : ToDevice(k.dst_row);
    ASSERT_OK(cuda::CopyRowPieces(dsrc.as<float>() + k.src_off, k.src_stride,
                                  dsr.as<int32_t>(), ddst.as<float>() + k.dst_off, k.dst_stride,
                                  ddr.as<int32_t>(), k.n, width));
    const std::vector<float> got = ToHost(ddst, want.size());
    for (size_t i = 0; i < got.size(); ++i)
      ASSERT_TRUE(SameBits(got[i], want[i])) << "case " << ci << " element " << i;
  }
  float x = 0.0f;
  EXPECT_EQ(cuda::CopyRowPieces(&x, 4, nullptr, &x, 8, nullptr, 1, 5).code(), Code::kInvalidArgument);
  EXPECT_EQ(cuda::CopyRowPieces(&x, 8, nullptr, &x, 4, nullptr, 1, 5).code(), Code::kInvalidArgument);
  EXPECT_EQ(cuda::CopyRowPieces(&x, 8, nullptr, &x, 8, nullptr, -1, 5).code(), Code::kInvalidArgument);
  EXPECT_EQ(cuda::CopyRowPieces(nullptr, 8, nullptr, &x, 8, nullptr, 1, 5).code(), Code::kInvalidArgument);
  EXPECT_TRUE(cuda::CopyRowPieces(nullptr, 8, nullptr, nullptr, 8, nullptr, 0, 5).ok());
}

}  // namespace
}  // namespace fm
