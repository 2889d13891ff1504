// The fused decode-layer kernels (kernels/cuda/fused_ops.h) against the CPU references they
// fuse: hc_post + hc_pre + RMSNorm (kernels/cpu/hc.h, rmsnorm.h), the q/kv/indexer norms and
// RoPE (rope.h), a token's cache updates with the compressor chain (compressor_pool.h), and
// decode attention with its key index and inverse RoPE (attention_core.h).
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>
#include <random>
#include <vector>

#include "kernels/cpu/attention_core.h"
#include "kernels/cpu/compressor_pool.h"
#include "kernels/cpu/hc.h"
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

std::vector<int32_t> Ints(const std::vector<int32_t>& v) { return v; }

// T rows of X through hc_post (with out) and hc_pre + RMSNorm; the shapes of the presets (H 64,
// 256, 2048) and a partial last block (H 100). Twice: the block counter is reset by the call.
TEST(CudaFused, HcPostPreMatchesCpu) {
  if (cuda::DeviceCount() == 0) GTEST_SKIP() << "no CUDA device";
  const int64_t n = 4, iters = 20, M = (2 + n) * n;
  const float eh = 1e-6f, eps = 1e-6f;
  for (int64_t H : {64, 100, 256, 2048}) {
    for (int64_t T : {1, 3}) {
      for (bool post_first : {false, true}) {
        SCOPED_TRACE("H " + std::to_string(H) + " T " + std::to_string(T) +
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
        auto dcount = ToDevice(std::vector<int32_t>{0});
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

TEST(CudaFused, HcPostPreRejectsBadShapes) {
  float f = 0;
  int32_t c = 0;
  const Status st = cuda::HcPostPre(&f, nullptr, &f, &f, &f, &f, &f, 1, 17, 64, 20, 1e-6f, 1e-6f,
                                    &f, &f, &f, &f, &c);
  EXPECT_NE(st.ToString().find("hc streams 17"), std::string::npos) << st.ToString();
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

// Tokens 0 .. 3r-1 of one compressor (ratio 4 overlapping with the indexer's one beside it, and
// ratio 128 plain at d 32): pending rows stored, each completed window's entry pooled, normed
// and RoPE'd at its first position; the kv row lands in its ring row.
TEST(CudaFused, CacheRowMatchesCpuCompressors) {
  if (cuda::DeviceCount() == 0) GTEST_SKIP() << "no CUDA device";
  struct Case { int64_t r, d; bool overlap; };
  for (const Case k : {Case{4, 32, true}, Case{4, 128, true}, Case{128, 32, false}}) {
    SCOPED_TRACE("ratio " + std::to_string(k.r) + " dim " + std::to_string(k.d));
    const int64_t width = k.overlap ? 2 * k.d : k.d, steps = 3 * k.r, W = 16, D = 32, rd = 16;
    const auto a = Random(steps * width, 1), z = Random(steps * width, 2);
    const auto ape = Random(k.r * width, 3), norm = Random(k.d, 4), kv = Random(steps * D, 5);
    const auto freqs = RopeInvFreqDefault(160000.0, rd);
    auto da = ToDevice(a), dz = ToDevice(z), dape = ToDevice(ape), dnorm = ToDevice(norm);
    auto dkv = ToDevice(kv), dfreq = ToDevice(freqs);
    auto pa = ToDevice(std::vector<float>(2 * k.r * width, NAN));
    auto pz = ToDevice(std::vector<float>(2 * k.r * width, NAN));
    auto entries = ToDevice(std::vector<float>(3 * k.d, NAN));
    auto keys = ToDevice(std::vector<float>(W * D, NAN));
    for (int64_t p = 0; p < steps; ++p) {
      const int32_t slot = static_cast<int32_t>(p % k.r);
      const cuda::CompressorStep st{slot, static_cast<int32_t>((p / k.r) % 2), p >= k.r,
                                    slot == k.r - 1, slot == k.r - 1 ? static_cast<int32_t>(p / k.r) : -1,
                                    static_cast<int32_t>(p + 1 - k.r)};
      auto dst = cuda::Upload(&st, sizeof st);
      ASSERT_TRUE(dst.ok());
      auto ring = ToDevice(std::vector<int32_t>{static_cast<int32_t>(p % W)});
      const cuda::CompressorRowArgs c{da.as<float>() + p * width, dz.as<float>() + p * width,
                                      dape.as<float>(), dnorm.as<float>(), pa.as<float>(),
                                      pz.as<float>(), entries.as<float>(), k.r, k.d, k.overlap};
      ASSERT_OK(cuda::CacheRow(dkv.as<float>() + p * D, D, keys.as<float>(), ring.as<int32_t>(), &c,
                               nullptr, dst->as<cuda::CompressorStep>(), dfreq.as<float>(), rd,
                               1e-6f));
    }
    // CPU: each window's rows with z + ape, pooled (the previous window beside it), norm, RoPE.
    std::vector<float> want(3 * k.d), zz(z);
    for (int64_t p = 0; p < steps; ++p)
      for (int64_t c = 0; c < width; ++c) zz[p * width + c] += ape[(p % k.r) * width + c];
    for (int64_t e = 0; e < 3; ++e) {
      const float* prev_a = e > 0 ? &a[(e - 1) * k.r * width] : nullptr;
      const float* prev_z = e > 0 ? &zz[(e - 1) * k.r * width] : nullptr;
      CompressorPoolWindow_rd(&a[e * k.r * width], &zz[e * k.r * width], prev_a, prev_z, k.r, k.d,
                              k.overlap, &want[e * k.d]);
      RmsNormRows_rd(&want[e * k.d], norm.data(), 1, k.d, 1e-6f, &want[e * k.d]);
      RopeRows_nd(&want[e * k.d], 1, k.d, rd, e * k.r, freqs.data(), false);
    }
    ExpectClose(ToHost(entries, 3 * k.d), want, 1e-5, "entries");
    const auto ring = ToHost(keys, W * D);
    for (int64_t p = std::max<int64_t>(0, steps - W); p < steps; ++p)
      for (int64_t c = 0; c < D; ++c) ASSERT_EQ(ring[(p % W) * D + c], kv[p * D + c]) << "pos " << p;
  }
}

// Decode attention: window ring rows then entries (all, or the indexer's picks), counts from the
// device; n = 0, partial warp rounds, long contexts; NaN in a key propagates as on the CPU.
TEST(CudaFused, SinkAttentionRopeMatchesCpu) {
  if (cuda::DeviceCount() == 0) GTEST_SKIP() << "no CUDA device";
  struct Case { int64_t nh, d, W, nwin, ne; bool picks; bool nan; };
  for (const Case k : {Case{4, 32, 16, 0, 0, false, false}, Case{4, 32, 16, 5, 0, false, false},
                       Case{4, 32, 16, 16, 3, true, false}, Case{16, 256, 128, 128, 37, false, false},
                       Case{2, 512, 128, 128, 1900, false, false}, Case{4, 32, 16, 9, 4, true, true}}) {
    SCOPED_TRACE("heads " + std::to_string(k.nh) + " d " + std::to_string(k.d) + " keys " +
                 std::to_string(k.nwin) + "+" + std::to_string(k.ne));
    const int64_t rd = 16, rows = k.W + k.ne * 2 + 1, win_start = k.nwin ? 7 % k.W : 0;
    auto kv = Random(rows * k.d, 1);
    const auto q = Random(k.nh * k.d, 2, 0.3f), sink = Random(k.nh, 3);
    const auto freqs = RopeInvFreqDefault(10000.0, rd);
    std::vector<int32_t> picks;
    for (int64_t j = 0; j < k.ne; ++j) picks.push_back(static_cast<int32_t>(2 * j + 1));
    std::vector<const float*> key_rows;
    for (int64_t i = 0; i < k.nwin; ++i) key_rows.push_back(&kv[((win_start + i) % k.W) * k.d]);
    for (int64_t j = 0; j < k.ne; ++j) key_rows.push_back(&kv[(k.W + (k.picks ? picks[j] : j)) * k.d]);
    if (k.nan) kv[(k.W + picks[1]) * k.d + 3] = NAN;
    const int32_t pos = 1234;
    auto dq = ToDevice(q), dkv = ToDevice(kv), dsink = ToDevice(sink), dfreq = ToDevice(freqs);
    auto dwin = ToDevice(Ints({static_cast<int32_t>(win_start), static_cast<int32_t>(k.nwin)}));
    auto dne = ToDevice(Ints({static_cast<int32_t>(k.ne)}));
    auto dcount = ToDevice(Ints({static_cast<int32_t>(k.nwin + k.ne)}));
    auto dpicks = ToDevice(picks.empty() ? std::vector<int32_t>{0} : picks);
    auto dpos = ToDevice(Ints({pos}));
    auto dout = ToDevice(std::vector<float>(k.nh * k.d, NAN));
    const float scale = 1.0f / std::sqrt(static_cast<float>(k.d));
    const cuda::AttentionArgs a{dq.as<float>(), k.nh, k.d, dkv.as<float>(), dwin.as<int32_t>(), k.W,
                                dne.as<int32_t>(), k.picks ? dpicks.as<int32_t>() : nullptr,
                                k.W + k.ne, dcount.as<int32_t>(), dsink.as<float>(), scale,
                                dpos.as<int32_t>(), dfreq.as<float>(), rd, dout.as<float>()};
    ASSERT_OK(cuda::SinkAttentionRope(a));
    std::vector<float> want(k.nh * k.d), scratch(k.nh * std::max<size_t>(key_rows.size(), 1));
    SinkAttentionHeads_hd(q.data(), k.nh, key_rows.data(), static_cast<int64_t>(key_rows.size()),
                          k.d, sink.data(), scale, scratch.data(), want.data());
    RopeRows_nd(want.data(), k.nh, k.d, rd, pos, freqs.data(), true);
    if (k.nan) for (float w : want) ASSERT_TRUE(std::isnan(w));
    ExpectClose(ToHost(dout, want.size()), want, 2e-5, "o");
  }
}

}  // namespace
}  // namespace fm
