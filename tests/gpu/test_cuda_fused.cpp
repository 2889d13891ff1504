// The fused decode-layer kernels (kernels/cuda/fused_ops.h) against the CPU references they
// fuse: hc_post + hc_pre + RMSNorm (kernels/cpu/hc.h, rmsnorm.h), the q/kv/indexer norms and
// RoPE (rope.h), a token's cache updates with the compressor chain (compressor_pool.h), and
// decode attention with its key index and inverse RoPE (attention_core.h).
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstddef>
#include <cstring>
#include <limits>
#include <random>
#include <utility>
#include <vector>

#include "kernels/cpu/attention_core.h"
#include "kernels/cpu/compressor_pool.h"
#include "kernels/cpu/hc.h"
#include "kernels/cpu/indexer.h"
#include "kernels/cpu/rmsnorm.h"
#include "kernels/cpu/rope.h"
#include "kernels/cuda/fused_ops.h"
#include "tests/gpu/cuda_test_util.h"

namespace fm {
namespace {

using cudatest::ExpectClose;
using cudatest::ToDevice;
using cudatest::ToHost;

std::vector<float> Random(size_t n, uint32_t seed, float sd = 1.0f) {
  std::mt19937 rng(seed);
  std::normal_distribution<float> nd(0.0f, sd);
  std::vector<float> v(n);
  for (float& x : v) x = nd(rng);
  return v;
}

// T rows of X through hc_post (with out) and hc_pre + RMSNorm; the shapes of the presets (H 64,
// 256, 2048) and a partial last block (H 100), at 4 streams and at 2, 3 and 5 (the device's
// most: a Sinkhorn comb fits a warp). Twice: the block counters are reset by the call.
TEST(CudaFused, HcPostPreMatchesCpu) {
  if (cuda::DeviceCount() == 0) GTEST_SKIP() << "no CUDA device";
  const int64_t iters = 20;
  const float eh = 1e-6f, eps = 1e-6f;
  struct Shape { int64_t n, H; };
  for (const Shape sh : {Shape{4, 64}, Shape{4, 100}, Shape{4, 256}, Shape{4, 2048}, Shape{2, 100},
                         Shape{3, 100}, Shape{5, 100}}) {
    const int64_t n = sh.n, H = sh.H, M = (2 + n) * n;
    for (int64_t T : {1, 3, 9, 17}) {
      for (bool post_first : {false, true}) {
        SCOPED_TRACE("n " + std::to_string(n) + " H " + std::to_string(H) + " T " + std::to_string(T) +
                     (post_first ? " with hc_post" : ""));
        const auto x = Random(T * n * H, 1), out = Random(T * H, 2), fn = Random(M * n * H, 3, 0.05f);
        const auto base = Random(M, 4), scale = Random(3, 5), norm = Random(H, 6);
        std::vector<float> post0(T * n), comb0(T * n * n);
        for (float& v : post0) v = 0.5f + 0.1f * static_cast<float>(&v - post0.data());
        for (float& v : comb0) v = 0.25f + 0.01f * static_cast<float>(&v - comb0.data());
        // CPU: X' = hc_post(X) (or X), then hc_pre (double reference) and RMSNorm.
        std::vector<float> xn(T * n * H), y(T * H), post(T * n), comb(T * n * n);
        for (int64_t t = 0; t < T; ++t) {
          if (post_first)
            HcPost_nH(&x[t * n * H], &out[t * H], &post0[t * n], &comb0[t * n * n], n, H, &xn[t * n * H]);
          else
            std::memcpy(&xn[t * n * H], &x[t * n * H], n * H * sizeof(float));
          HcPreRef(&xn[t * n * H], fn.data(), base.data(), scale.data(), n, H, iters, eh, eps,
                   &y[t * H], &post[t * n], &comb[t * n * n]);
        }
        RmsNormRows_rd(y.data(), norm.data(), T, H, eps, y.data());
        auto dx = ToDevice(x), dout = ToDevice(out), dfn = ToDevice(fn), dbase = ToDevice(base);
        auto dscale = ToDevice(scale), dnorm = ToDevice(norm);
        auto dxn = ToDevice(std::vector<float>(T * n * H, NAN));
        auto dy = ToDevice(std::vector<float>(T * H, NAN));
        auto dpart = ToDevice(std::vector<float>(cuda::HcFusedPartials(T, n, H), NAN));
        auto dcount = ToDevice(std::vector<int32_t>(T, 0));
        std::vector<float> first;
        for (int rep = 0; rep < 2; ++rep) {
          auto dpost = ToDevice(post0), dcomb = ToDevice(comb0);
          ASSERT_OK(cuda::HcPostPre(dx.as<float>(), post_first ? dout.as<float>() : nullptr,
                                    dxn.as<float>(), dfn.as<float>(), dbase.as<float>(),
                                    dscale.as<float>(), dnorm.as<float>(), T, n, H, iters, eh, eps,
                                    dpost.as<float>(), dcomb.as<float>(), dy.as<float>(),
                                    dpart.as<float>(), dcount.as<int32_t>()));
          ExpectClose(ToHost(dy, T * H), y, 1e-4, "y");
          ExpectClose(ToHost(dpost, T * n), post, 1e-4, "post");
          ExpectClose(ToHost(dcomb, T * n * n), comb, 1e-4, "comb");
          if (post_first) ExpectClose(ToHost(dxn, T * n * H), xn, 1e-5, "x_new");
          const auto got = ToHost(dy, T * H);
          if (rep == 0) first = got;
          else EXPECT_EQ(std::memcmp(got.data(), first.data(), got.size() * 4), 0) << "replay bits";
        }
      }
    }
  }
}

// The FFN's hc_post taken straight from the MoE's expert slots (k routed + the shared row):
// every output bit equal to MoeCombine into a dense output followed by HcPostPre of it.
TEST(CudaFused, HcPostPreFromExpertSlotsHasTheCombineBits) {
  if (cuda::DeviceCount() == 0) GTEST_SKIP() << "no CUDA device";
  const int64_t n = 4, iters = 20, M = (2 + n) * n, k = 6;
  for (int64_t H : {100, 2048}) {
    for (int64_t T : {1, 5}) {
      SCOPED_TRACE("H " + std::to_string(H) + " T " + std::to_string(T));
      const auto x = Random(T * n * H, 11), slots = Random(T * (k + 1) * H, 12);
      const auto w = Random(T * k, 13, 0.3f), fn = Random(M * n * H, 14, 0.05f);
      const auto base = Random(M, 15), scale = Random(3, 16), norm = Random(H, 17);
      const auto post0 = Random(T * n, 18, 0.5f), comb0 = Random(T * n * n, 19, 0.3f);
      auto dx = ToDevice(x), ds = ToDevice(slots), dw = ToDevice(w), dfn = ToDevice(fn);
      auto dbase = ToDevice(base), dscale = ToDevice(scale), dnorm = ToDevice(norm);
      auto dsum = ToDevice(std::vector<float>(T * H, NAN));
      auto dpart = ToDevice(std::vector<float>(cuda::HcFusedPartials(T, n, H), NAN));
      auto dcount = ToDevice(std::vector<int32_t>(T, 0));
      std::vector<float> got[2][4];  // [dense, slots][y, post, comb, x_new]
      for (int way = 0; way < 2; ++way) {
        auto dpost = ToDevice(post0), dcomb = ToDevice(comb0);
        auto dxn = ToDevice(std::vector<float>(T * n * H, NAN));
        auto dy = ToDevice(std::vector<float>(T * H, NAN));
        cuda::HcPostInput in = cuda::HcPostInput::Slots(ds.as<float>(), dw.as<float>(), k);
        if (way == 0) {
          ASSERT_OK(cuda::MoeCombine(ds.as<float>(), dw.as<float>(), T, k, H, dsum.as<float>(), true));
          in = cuda::HcPostInput(dsum.as<float>());
        }
        ASSERT_OK(cuda::HcPostPre(dx.as<float>(), in, dxn.as<float>(), dfn.as<float>(),
                                  dbase.as<float>(), dscale.as<float>(), dnorm.as<float>(), T, n, H,
                                  iters, 1e-6f, 1e-6f, dpost.as<float>(), dcomb.as<float>(),
                                  dy.as<float>(), dpart.as<float>(), dcount.as<int32_t>()));
        got[way][0] = ToHost(dy, T * H);
        got[way][1] = ToHost(dpost, T * n);
        got[way][2] = ToHost(dcomb, T * n * n);
        got[way][3] = ToHost(dxn, T * n * H);
      }
      for (int o = 0; o < 4; ++o) {
        ASSERT_EQ(got[0][o].size(), got[1][o].size());
        EXPECT_EQ(std::memcmp(got[0][o].data(), got[1][o].data(), got[0][o].size() * 4), 0)
            << "output " << o;
        EXPECT_FALSE(std::isnan(got[1][o][0])) << "output " << o << " written";
      }
    }
  }
}

TEST(CudaFused, HcPostPreRejectsBadShapes) {
  float f = 0;
  int32_t c = 0;
  const Status st = cuda::HcPostPre(&f, nullptr, &f, &f, &f, &f, &f, 1, 6, 64, 20, 1e-6f, 1e-6f,
                                    &f, &f, &f, &f, &c);
  EXPECT_NE(st.ToString().find("hc streams 6, hidden 64, sinkhorn iters 20 (want tokens in "
                               "[0, 65535], streams in [1, 5]"),
            std::string::npos)
      << st.ToString();
  // Rows are grid.y: more than 65535 is refused, naming the count.
  const Status rows = cuda::HcPostPre(&f, nullptr, &f, &f, &f, &f, &f, 70000, 4, 64, 20, 1e-6f,
                                      1e-6f, &f, &f, &f, &f, &c);
  EXPECT_NE(rows.ToString().find("HcPostPre: tokens 70000"), std::string::npos) << rows.ToString();
  // The slice offsets are 32-bit: streams * hidden must stay below 2^31.
  const Status wide = cuda::HcPostPre(&f, nullptr, &f, &f, &f, &f, &f, 1, 4, int64_t{1} << 29, 20,
                                      1e-6f, 1e-6f, &f, &f, &f, &f, &c);
  EXPECT_NE(wide.ToString().find("hidden 536870912"), std::string::npos) << wide.ToString();
  EXPECT_NE(wide.ToString().find("streams * hidden < 2^31"), std::string::npos) << wide.ToString();
}

// q heads norm + RoPE, kv norm (weighted) + RoPE, indexer q RoPE and weights' scale, T rows at
// their own positions, for the tiny / bench / real head shapes.
TEST(CudaFused, AttnPrepMatchesCpu) {
  if (cuda::DeviceCount() == 0) GTEST_SKIP() << "no CUDA device";
  struct Shape { int64_t nh, d, rd, ni, di; };
  for (const Shape s : {Shape{4, 32, 16, 2, 32}, Shape{16, 256, 64, 8, 128}, Shape{2, 512, 64, 0, 0}}) {
    const int64_t T = 3;
    const std::vector<int32_t> pos = {0, 7, 1000};
    const auto freqs = RopeInvFreqDefault(10000.0, s.rd);
    auto q = Random(T * s.nh * s.d, 1), kv = Random(T * s.d, 2), kvn = Random(s.d, 3);
    auto iq = Random(T * std::max<int64_t>(s.ni, 1) * s.di + 1, 4), iw = Random(T * std::max<int64_t>(s.ni, 1), 5);
    q[5] = NAN;  // a NaN poisons its head only
    auto dq = ToDevice(q), dkv = ToDevice(kv), dkvn = ToDevice(kvn), diq = ToDevice(iq);
    auto diw = ToDevice(iw), dpos = ToDevice(pos), dfreq = ToDevice(freqs);
    const float scale = 1.0f / std::sqrt(static_cast<float>(std::max<int64_t>(s.ni, 1)));
    const cuda::AttnPrepArgs a{dq.as<float>(), s.nh, s.d, dkv.as<float>(), dkvn.as<float>(),
                               s.ni ? diq.as<float>() : nullptr, diw.as<float>(), s.ni, s.di,
                               scale, dpos.as<int32_t>(), dfreq.as<float>(), s.rd, 1e-6f};
    ASSERT_OK(cuda::AttnPrep(a, T));
    RmsNormRows_rd(q.data(), nullptr, T * s.nh, s.d, 1e-6f, q.data());
    RmsNormRows_rd(kv.data(), kvn.data(), T, s.d, 1e-6f, kv.data());
    for (int64_t t = 0; t < T; ++t) {
      RopeRows_nd(&q[t * s.nh * s.d], s.nh, s.d, s.rd, pos[t], freqs.data(), false);
      RopeRows_nd(&kv[t * s.d], 1, s.d, s.rd, pos[t], freqs.data(), false);
      if (s.ni) RopeRows_nd(&iq[t * s.ni * s.di], s.ni, s.di, s.rd, pos[t], freqs.data(), false);
    }
    for (int64_t i = 0; i < T * s.ni; ++i) iw[i] *= scale;
    ExpectClose(ToHost(dq, q.size()), q, 1e-5, "q");
    ExpectClose(ToHost(dkv, kv.size()), kv, 1e-5, "kv");
    ExpectClose(ToHost(diq, iq.size()), iq, 1e-5, "iq");
    ExpectClose(ToHost(diw, iw.size()), iw, 1e-6, "iw");
  }
}

// The position scalars of one row (as model/cuda/step_inputs.h lays them out per row), and
// the RowSteps over an uploaded array of them.
struct TestRow {
  int32_t ring_row, win_start, nwin, visible, entries, keys;
  cuda::CompressorStep comp;
};
cuda::RowSteps StepsOf(const cudatest::DeviceBuffer& rows) {
  const char* b = rows.as<const char>();
  auto at = [b](size_t off) { return reinterpret_cast<const int32_t*>(b + off); };
  return {at(offsetof(TestRow, ring_row)), at(offsetof(TestRow, win_start)),
          at(offsetof(TestRow, visible)), at(offsetof(TestRow, entries)),
          at(offsetof(TestRow, keys)),
          reinterpret_cast<const cuda::CompressorStep*>(b + offsetof(TestRow, comp)),
          sizeof(TestRow)};
}

template <class T>
cudatest::DeviceBuffer Upload(const std::vector<T>& v) {
  auto r = cuda::Upload(v.data(), v.size() * sizeof(T));
  EXPECT_TRUE(r.ok());
  return r.ok() ? std::move(r).value() : cudatest::DeviceBuffer();
}

// Tokens 0 .. 3r-1 of one compressor (ratio 4 overlapping, at the tiny and bench widths, and
// ratio 128 plain), each token one CacheRows launch of one row: pending rows stored, each
// completed window's entry pooled, normed and RoPE'd at its first position; the kv row lands in
// its ring row. With the indexer's compressor beside it (ratio 4), its entries into ikeys.
TEST(CudaFused, CacheRowsMatchesCpuCompressors) {
  if (cuda::DeviceCount() == 0) GTEST_SKIP() << "no CUDA device";
  struct Case { int64_t r, d; bool overlap; };
  for (const Case k : {Case{4, 32, true}, Case{4, 256, true}, Case{128, 32, false}}) {
    SCOPED_TRACE("ratio " + std::to_string(k.r) + " dim " + std::to_string(k.d));
    const int64_t width = k.overlap ? 2 * k.d : k.d, steps = 3 * k.r, W = 16, D = k.d, rd = 16;
    const auto a = Random(steps * width, 1), z = Random(steps * width, 2);
    const auto ape = Random(k.r * width, 3), norm = Random(k.d, 4), kv = Random(steps * D, 5);
    const auto freqs = RopeInvFreqDefault(160000.0, rd);
    auto da = ToDevice(a), dz = ToDevice(z), dape = ToDevice(ape), dnorm = ToDevice(norm);
    auto dkv = ToDevice(kv), dfreq = ToDevice(freqs);
    auto pa = ToDevice(std::vector<float>(2 * k.r * width, NAN));
    auto pz = ToDevice(std::vector<float>(2 * k.r * width, NAN));
    auto ipa = ToDevice(std::vector<float>(2 * k.r * width, NAN));
    auto ipz = ToDevice(std::vector<float>(2 * k.r * width, NAN));
    auto keys = ToDevice(std::vector<float>((W + 3) * D, NAN));
    auto ikeys = ToDevice(std::vector<float>(3 * k.d, NAN));
    const cuda::RowCache rc{keys.as<float>(), ikeys.as<float>(), nullptr, pa.as<float>(),
                            pz.as<float>(), ipa.as<float>(), ipz.as<float>(), 3, 0};
    auto table = Upload(std::vector<cuda::RowCache>{rc});
    // The indexer's compressor: the same inputs reversed, so its entries differ.
    const std::vector<float> ia(a.rbegin(), a.rend()), iz(z.rbegin(), z.rend());
    auto dia = ToDevice(ia), diz = ToDevice(iz);
    for (int64_t p = 0; p < steps; ++p) {
      const int32_t slot = static_cast<int32_t>(p % k.r);
      TestRow row{static_cast<int32_t>(p % W), 0, 0, 0, 0, 0,
                  {slot, static_cast<int32_t>((p / k.r) % 2), p >= k.r, slot == k.r - 1,
                   slot == k.r - 1 ? static_cast<int32_t>(p / k.r) : -1,
                   static_cast<int32_t>(p + 1 - k.r)}};
      auto drow = Upload(std::vector<TestRow>{row});
      const cuda::CompressorRowArgs c{da.as<float>() + p * width, dz.as<float>() + p * width,
                                      dape.as<float>(), dnorm.as<float>(), k.r, k.d, k.overlap};
      const cuda::CompressorRowArgs ic{dia.as<float>() + p * width, diz.as<float>() + p * width,
                                       dape.as<float>(), dnorm.as<float>(), k.r, k.d, k.overlap};
      const cuda::CacheRowsArgs cache{table.as<cuda::RowCache>(), W, StepsOf(drow), &c,
                                      k.r == 4 ? &ic : nullptr};
      ASSERT_OK(cuda::CacheRows(cache, 0, 1, dkv.as<float>() + p * D, D, dfreq.as<float>(), rd,
                                1e-6f));
    }
    // CPU: each window's rows with z + ape, pooled (the previous window beside it), norm, RoPE.
    auto entries_of = [&](const std::vector<float>& a_, const std::vector<float>& z_) {
      std::vector<float> want(3 * k.d), zz(z_);
      for (int64_t p = 0; p < steps; ++p)
        for (int64_t c = 0; c < width; ++c) zz[p * width + c] += ape[(p % k.r) * width + c];
      for (int64_t e = 0; e < 3; ++e) {
        const float* prev_a = e > 0 ? &a_[(e - 1) * k.r * width] : nullptr;
        const float* prev_z = e > 0 ? &zz[(e - 1) * k.r * width] : nullptr;
        CompressorPoolWindow_rd(&a_[e * k.r * width], &zz[e * k.r * width], prev_a, prev_z, k.r,
                                k.d, k.overlap, &want[e * k.d]);
        RmsNormRows_rd(&want[e * k.d], norm.data(), 1, k.d, 1e-6f, &want[e * k.d]);
        RopeRows_nd(&want[e * k.d], 1, k.d, rd, e * k.r, freqs.data(), false);
      }
      return want;
    };
    const auto got = ToHost(keys, (W + 3) * D);
    ExpectClose(std::vector<float>(got.begin() + W * D, got.end()), entries_of(a, z), 1e-5,
                "entries");
    if (k.r == 4) ExpectClose(ToHost(ikeys, 3 * k.d), entries_of(ia, iz), 1e-5, "index entries");
    for (int64_t p = std::max<int64_t>(0, steps - W); p < steps; ++p)
      for (int64_t c = 0; c < D; ++c) ASSERT_EQ(got[(p % W) * D + c], kv[p * D + c]) << "pos " << p;
  }
}

// AttnPrep with the cache rows (the decode step's one launch) against AttnPrep and then
// CacheRows: q, kv, iq, iw and every cache buffer bit for bit. Three rows of three sequences:
// row 0 completes a window with a previous one (pools 2r rows), row 1 completes its first
// window and has no ring row, row 2 only stores its pending row. Three layer kinds: ratio 4 with
// the indexer (two compressors and the indexer's heads), a compressor alone without the indexer
// (ratio 128's shape), and neither (a window-only layer: the ring store alone).
TEST(CudaFused, AttnPrepWithCacheRowsEqualsTheTwoLaunches) {
  if (cuda::DeviceCount() == 0) GTEST_SKIP() << "no CUDA device";
  const int64_t T = 3, nh = 4, D = 64, rd = 16, ni = 2, di = 64, r = 4, W = 8, width = 2 * D;
  const int64_t cache_floats = (W + 4) * D, pend_floats = 2 * r * width;
  const auto q = Random(T * nh * D, 1), kv = Random(T * D, 2), iq = Random(T * ni * di, 3);
  const auto iw = Random(T * ni, 4), kvn = Random(D, 5), a = Random(T * width, 6);
  const auto z = Random(T * width, 7), ape = Random(r * width, 8), norm = Random(D, 9);
  const auto ia = Random(T * width, 10), iz = Random(T * width, 11), pend = Random(pend_floats, 12);
  const auto freqs = RopeInvFreqDefault(10000.0, rd);
  const std::vector<int32_t> pos = {11, 3, 6};
  std::vector<TestRow> rows(T);
  rows[0] = {static_cast<int32_t>(11 % W), 0, 0, 0, 0, 0, {3, 0, 1, 1, 2, 8}};
  rows[1] = {-1, 0, 0, 0, 0, 0, {3, 0, 0, 1, 0, 0}};
  rows[2] = {static_cast<int32_t>(6 % W), 0, 0, 0, 0, 0, {2, 1, 1, 0, -1, 3}};
  auto dpos = Upload(pos), drows = Upload(rows), dfreq = ToDevice(freqs), dkvn = ToDevice(kvn);
  auto da = ToDevice(a), dz = ToDevice(z), dape = ToDevice(ape), dnorm = ToDevice(norm);
  auto dia = ToDevice(ia), diz = ToDevice(iz);
  for (const int comps : {2, 1, 0}) {  // 2: with the indexer; 1: a compressor alone; 0: none
    SCOPED_TRACE("compressors " + std::to_string(comps));
    std::vector<float> got[2];
    for (int way = 0; way < 2; ++way) {
      auto dq = ToDevice(q), dkv = ToDevice(kv), diq = ToDevice(iq), diw = ToDevice(iw);
      std::vector<cudatest::DeviceBuffer> bufs;  // a row's keys, ikeys, pend_a/z, ipend_a/z
      std::vector<cuda::RowCache> table;
      for (int64_t t = 0; t < T; ++t) {
        bufs.push_back(ToDevice(std::vector<float>(cache_floats, NAN)));
        bufs.push_back(ToDevice(std::vector<float>(4 * di, NAN)));
        for (int i = 0; i < 4; ++i) bufs.push_back(ToDevice(pend));
        auto f = [&](int i) { return bufs[6 * t + i].as<float>(); };
        table.push_back({f(0), f(1), nullptr, f(2), f(3), f(4), f(5), 4, 0});
      }
      auto dtable = Upload(table);
      const cuda::AttnPrepArgs prep{dq.as<float>(), nh, D, dkv.as<float>(), dkvn.as<float>(),
                                    comps == 2 ? diq.as<float>() : nullptr, diw.as<float>(), ni,
                                    di, 0.7f, dpos.as<int32_t>(), dfreq.as<float>(), rd, 1e-6f};
      const cuda::CompressorRowArgs c{da.as<float>(), dz.as<float>(), dape.as<float>(),
                                      dnorm.as<float>(), r, D, true};
      const cuda::CompressorRowArgs ic{dia.as<float>(), diz.as<float>(), dape.as<float>(),
                                       dnorm.as<float>(), r, di, true};
      const cuda::CacheRowsArgs cache{dtable.as<cuda::RowCache>(), W, StepsOf(drows),
                                      comps >= 1 ? &c : nullptr, comps == 2 ? &ic : nullptr};
      if (way == 0) {
        ASSERT_OK(cuda::AttnPrep(prep, T));
        ASSERT_OK(cuda::CacheRows(cache, 0, T, dkv.as<float>(), D, dfreq.as<float>(), rd, 1e-6f));
      } else {
        if (comps == 2) {   // an index compressor wider than the indexer's keys is refused
          cuda::CompressorRowArgs wide = ic;
          wide.dim = di + 4;
          const cuda::CacheRowsArgs bad{dtable.as<cuda::RowCache>(), W, StepsOf(drows), &c, &wide};
          const Status st = cuda::AttnPrep(prep, T, &bad);
          EXPECT_EQ(st.code(), Code::kInvalidArgument) << st.ToString();
          EXPECT_NE(st.message().find("index compressor dim"), std::string::npos) << st.ToString();
        }
        ASSERT_OK(cuda::AttnPrep(prep, T, &cache));
      }
      const std::pair<cudatest::DeviceBuffer*, int64_t> outs[] = {
          {&dq, T * nh * D}, {&dkv, T * D}, {&diq, T * ni * di}, {&diw, T * ni}};
      for (const auto& [b, n] : outs) {
        const auto h = ToHost(*b, n);
        got[way].insert(got[way].end(), h.begin(), h.end());
      }
      for (size_t i = 0; i < bufs.size(); ++i) {
        const auto h = ToHost(bufs[i], i % 6 == 0 ? cache_floats : i % 6 == 1 ? 4 * di : pend_floats);
        got[way].insert(got[way].end(), h.begin(), h.end());
      }
    }
    ASSERT_EQ(got[0].size(), got[1].size());
    EXPECT_EQ(std::memcmp(got[0].data(), got[1].data(), got[0].size() * sizeof(float)), 0);
    // The fused launch did write: row 0's ring row holds its normed kv; with a compressor its
    // entry 2 is pooled; row 1 (no ring row) stored nothing there.
    const int64_t ring0 = (11 % W) * D, per_row = cache_floats + 4 * di + 4 * pend_floats;
    const int64_t bufs0 = T * nh * D + T * D + T * ni * di + T * ni;
    EXPECT_EQ(std::memcmp(&got[1][bufs0 + ring0], &got[1][T * nh * D], D * sizeof(float)), 0);
    EXPECT_EQ(std::isnan(got[1][bufs0 + (W + 2) * D]), comps == 0);
    EXPECT_TRUE(std::isnan(got[1][bufs0 + per_row + 0]));
  }
}

// The indexer over two rows of two sequences in one launch: row 0 has more entries than k
// (scored and ranked, partial last tile, NaN scores rank lowest) or no more than k (all picked,
// in order, unscored); row 1's sequence holds no more than k (skipped: it attends every entry);
// at a few head and column counts: one partial head pass and slab (2 x 32), DeepSeek-V4-Flash's
// 64 x 128, two head passes and a partial slab (70 x 40). Then once more with a grid of one
// block (max_entries 1 only sizes the grid; the counters were reset).
TEST(CudaFused, IndexerTopKMatchesCpu) {
  if (cuda::DeviceCount() == 0) GTEST_SKIP() << "no CUDA device";
  const int64_t k = 4;
  struct Shape { int64_t nh, di; };
  for (const Shape sh : {Shape{2, 32}, Shape{64, 128}, Shape{70, 40}})
    for (int64_t visible : {3, 4, 37, 5000}) {
      const int64_t nh = sh.nh, di = sh.di;
      SCOPED_TRACE("heads " + std::to_string(nh) + " x " + std::to_string(di) + ", visible " +
                   std::to_string(visible));
      const int64_t max_entries = 5001;
      auto ikeys = Random(max_entries * di, 1);
      const auto iq = Random(2 * nh * di, 2), iw = Random(2 * nh, 3);
      if (visible > 10) ikeys[7 * di] = NAN;
      auto dkeys = ToDevice(ikeys), dq = ToDevice(iq), dw = ToDevice(iw);
      auto score = ToDevice(std::vector<float>(max_entries, NAN));
      const cuda::RowCache r0{nullptr, dkeys.as<float>(), score.as<float>(), nullptr, nullptr,
                              nullptr, nullptr, static_cast<int32_t>(max_entries), 0};
      const cuda::RowCache r1{nullptr, dkeys.as<float>(), score.as<float>(), nullptr, nullptr,
                              nullptr, nullptr, static_cast<int32_t>(k), 0};
      auto table = Upload(std::vector<cuda::RowCache>{r0, r1});
      TestRow row{};
      row.visible = static_cast<int32_t>(visible);
      auto rows = Upload(std::vector<TestRow>{row, row});
      auto picks = Upload(std::vector<int32_t>(2 * k, -7));
      auto counters = Upload(std::vector<int32_t>(2, 0));
      const float scale = 1.0f / std::sqrt(static_cast<float>(di));
      std::vector<float> want_score(visible);
      IndexerScores_hd(iq.data(), iw.data(), nh, di, ikeys.data(), visible, scale,
                       want_score.data());
      const int64_t m = std::min(visible, k);
      std::vector<int32_t> want(m);
      TopKAscending_n(want_score.data(), visible, m, want.data());
      for (const int64_t grid_entries : {max_entries, int64_t{1}}) {
        ASSERT_OK(cuda::IndexerTopK(table.as<cuda::RowCache>(), 0, 2, dq.as<float>(),
                                    dw.as<float>(), nh, di, scale, StepsOf(rows), grid_entries, k,
                                    picks.as<int32_t>(), counters.as<int32_t>()));
        std::vector<int32_t> got(2 * k);
        ASSERT_OK(picks.CopyToHost(got.data(), got.size() * 4));
        for (int64_t j = 0; j < m; ++j) EXPECT_EQ(got[j], want[j]) << "pick " << j;
        for (int64_t j = k; j < 2 * k; ++j) EXPECT_EQ(got[j], -7) << "row 1 was skipped";
        if (visible > k) ExpectClose(ToHost(score, visible), want_score, 1e-5, "scores");
        else EXPECT_TRUE(std::isnan(ToHost(score, 1)[0])) << "a row of <= k entries is not scored";
      }
    }
}

// The indexer's shape limits, each refused with the value that breaks it: head_dim a multiple
// of 4 (its 16-byte loads), max_entries within 2^30 (its 32-bit entry offsets).
TEST(CudaFused, IndexerTopKRejectsBadShapes) {
  float f = 0;
  int32_t c = 0;
  const cuda::RowCache rc{};
  const cuda::RowSteps steps{&c, &c, &c, &c, &c, nullptr, 0};
  const Status odd = cuda::IndexerTopK(&rc, 0, 1, &f, &f, 2, 30, 1.0f, steps, 100, 4, &c, &c);
  EXPECT_NE(odd.ToString().find("head_dim 30"), std::string::npos) << odd.ToString();
  EXPECT_NE(odd.ToString().find("head_dim a positive multiple of 4"), std::string::npos)
      << odd.ToString();
  const Status big = cuda::IndexerTopK(&rc, 0, 1, &f, &f, 2, 32, 1.0f, steps,
                                       (int64_t{1} << 30) + 1, 4, &c, &c);
  EXPECT_NE(big.ToString().find("max_entries 1073741825"), std::string::npos) << big.ToString();
}

// The ranking alone on long rows with many exact ties: 20003 entries (the old pairwise count
// stopped at 16384) whose keys repeat 50 distinct rows, one of them zero (score exactly 0), so
// equal scores are bit-equal on the device, plus NaN keys; the last key (in the partial last
// 16-byte vector of scores) 100 x the best row, the unique largest; k = 1, 512 and 19999. The
// picks must be the CPU's top k (ties to the lower index, NaN lowest) of the device's own scores.
TEST(CudaFused, IndexerTopKRanksLongRowsWithTies) {
  if (cuda::DeviceCount() == 0) GTEST_SKIP() << "no CUDA device";
  const int64_t nh = 2, di = 32, n = 20003;
  auto base = Random(50 * di, 21);
  for (int64_t c = 0; c < di; ++c) base[7 * di + c] = 0.0f;
  const auto iq = Random(nh * di, 22), iw = Random(nh, 23);
  std::vector<float> base_score(50);
  IndexerScores_hd(iq.data(), iw.data(), nh, di, base.data(), 50, 0.25f, base_score.data());
  const int64_t best = std::max_element(base_score.begin(), base_score.end()) - base_score.begin();
  ASSERT_GT(base_score[best], 0.0f);
  std::vector<float> ikeys(n * di);
  for (int64_t e = 0; e < n; ++e)
    for (int64_t c = 0; c < di; ++c)
      ikeys[e * di + c] = e == n - 1 ? 100.0f * base[best * di + c] : base[(e % 50) * di + c];
  for (int64_t e : {3, 777, 15000}) ikeys[e * di] = NAN;
  auto dkeys = ToDevice(ikeys), dq = ToDevice(iq), dw = ToDevice(iw);
  for (int64_t k : {1, 512, 19999}) {
    SCOPED_TRACE("k " + std::to_string(k));
    auto score = ToDevice(std::vector<float>(n, NAN));
    const cuda::RowCache r0{nullptr, dkeys.as<float>(), score.as<float>(), nullptr, nullptr,
                            nullptr, nullptr, static_cast<int32_t>(n), 0};
    auto table = Upload(std::vector<cuda::RowCache>{r0});
    TestRow row{};
    row.visible = static_cast<int32_t>(n);
    auto rows = Upload(std::vector<TestRow>{row});
    auto picks = Upload(std::vector<int32_t>(k, -7));
    auto counters = Upload(std::vector<int32_t>(1, 0));
    ASSERT_OK(cuda::IndexerTopK(table.as<cuda::RowCache>(), 0, 1, dq.as<float>(), dw.as<float>(),
                                nh, di, 0.25f, StepsOf(rows), n, k, picks.as<int32_t>(),
                                counters.as<int32_t>()));
    const std::vector<float> got_score = ToHost(score, n);
    std::vector<int32_t> want(k), got(k);
    TopKAscending_n(got_score.data(), n, k, want.data());
    ASSERT_OK(picks.CopyToHost(got.data(), got.size() * 4));
    EXPECT_EQ(got, want);
  }
}

// Decode attention over two rows of two sequences in one launch: window ring rows then entries
// (all, or the indexer's picks), counts from the device; n = 0, partial warp rounds, long
// contexts; NaN in a key propagates as on the CPU. Then each row in a launch of its own (the
// one-row kernel, keys batched a warp), bit for bit the same.
TEST(CudaFused, SinkAttentionRowsMatchesCpu) {
  if (cuda::DeviceCount() == 0) GTEST_SKIP() << "no CUDA device";
  struct Case { int64_t nh, d, W, nwin, ne; bool picks; bool nan; };
  for (const Case k : {Case{4, 32, 16, 0, 0, false, false}, Case{4, 32, 16, 5, 0, false, false},
                       Case{4, 32, 16, 16, 3, true, false}, Case{16, 256, 128, 128, 37, false, false},
                       Case{2, 512, 128, 128, 1900, false, false}, Case{4, 32, 16, 9, 4, true, true}}) {
    SCOPED_TRACE("heads " + std::to_string(k.nh) + " d " + std::to_string(k.d) + " keys " +
                 std::to_string(k.nwin) + "+" + std::to_string(k.ne));
    const int64_t rd = 16, topk = k.picks ? k.ne : 0;
    const int64_t max_entries = k.picks ? 2 * k.ne + 1 : k.ne, rows = k.W + max_entries;
    const auto freqs = RopeInvFreqDefault(10000.0, rd);
    const auto q = Random(2 * k.nh * k.d, 2, 0.3f), sink = Random(k.nh, 3);
    std::vector<int32_t> picks;
    for (int64_t j = 0; j < k.ne; ++j) picks.push_back(static_cast<int32_t>(2 * j + 1));
    picks.insert(picks.end(), picks.begin(), picks.end());  // row 1 the same
    std::vector<std::vector<float>> kv = {Random(rows * k.d, 10), Random(rows * k.d, 11)};
    if (k.nan) kv[0][(k.W + picks[1]) * k.d + 3] = NAN;
    const int32_t win_start[2] = {static_cast<int32_t>(k.nwin ? 7 : 0), 3};
    const int32_t pos[2] = {1234, 99};
    std::vector<TestRow> steps(2);
    for (int t = 0; t < 2; ++t) {
      steps[t].win_start = win_start[t];
      steps[t].nwin = static_cast<int32_t>(k.nwin);
      steps[t].entries = static_cast<int32_t>(k.ne);
      steps[t].keys = static_cast<int32_t>(k.nwin + k.ne);
    }
    auto dkv0 = ToDevice(kv[0]), dkv1 = ToDevice(kv[1]);
    std::vector<cuda::RowCache> table(2);
    table[0].keys = dkv0.as<float>();
    table[1].keys = dkv1.as<float>();
    table[0].max_entries = table[1].max_entries = static_cast<int32_t>(max_entries);
    auto dtable = Upload(table), dsteps = Upload(steps), dpicks = Upload(picks.empty() ? std::vector<int32_t>{0} : picks);
    auto dq = ToDevice(q), dsink = ToDevice(sink), dfreq = ToDevice(freqs);
    auto dpos = Upload(std::vector<int32_t>{pos[0], pos[1]});
    auto dout = ToDevice(std::vector<float>(2 * k.nh * k.d, NAN));
    const float scale = 1.0f / std::sqrt(static_cast<float>(k.d));
    const cuda::AttentionArgs a{dq.as<float>(), k.nh, k.d, dtable.as<cuda::RowCache>(), k.W,
                                k.ne > 0, topk, dpicks.as<int32_t>(), StepsOf(dsteps),
                                dsink.as<float>(), scale, dpos.as<int32_t>(), dfreq.as<float>(),
                                rd, dout.as<float>()};
    ASSERT_OK(cuda::SinkAttentionRows(a, 0, 2));
    std::vector<float> want(2 * k.nh * k.d);
    for (int t = 0; t < 2; ++t) {
      std::vector<const float*> key_rows;
      for (int64_t i = 0; i < k.nwin; ++i)
        key_rows.push_back(&kv[t][((win_start[t] + i) % k.W) * k.d]);
      for (int64_t j = 0; j < k.ne; ++j)
        key_rows.push_back(&kv[t][(k.W + (k.picks ? picks[j] : j)) * k.d]);
      std::vector<float> scratch(k.nh * std::max<size_t>(key_rows.size(), 1));
      float* o = &want[t * k.nh * k.d];
      SinkAttentionHeads_hd(&q[t * k.nh * k.d], k.nh, key_rows.data(),
                            static_cast<int64_t>(key_rows.size()), k.d, sink.data(), scale,
                            scratch.data(), o);
      RopeRows_nd(o, k.nh, k.d, rd, pos[t], freqs.data(), true);
    }
    if (k.nan) {
      for (int64_t i = 0; i < k.nh * k.d; ++i) ASSERT_TRUE(std::isnan(want[i]));
    }
    const std::vector<float> two_rows = ToHost(dout, want.size());
    ExpectClose(two_rows, want, 2e-5, "o");
    // Each row alone takes the one-row kernel (keys batched a warp): the same bits.
    auto dout1 = ToDevice(std::vector<float>(2 * k.nh * k.d, NAN));
    cuda::AttentionArgs a1 = a;
    a1.o = dout1.as<float>();
    ASSERT_OK(cuda::SinkAttentionRows(a1, 0, 1));
    ASSERT_OK(cuda::SinkAttentionRows(a1, 1, 1));
    const std::vector<float> one_row = ToHost(dout1, want.size());
    EXPECT_EQ(std::memcmp(one_row.data(), two_rows.data(), one_row.size() * 4), 0)
        << "one-row and many-row kernels differ";
  }
}

}  // namespace
}  // namespace fm
