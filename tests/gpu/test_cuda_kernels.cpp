// CUDA kernels vs their CPU references. Device tests skip without a GPU; the decoder and
// argument-check tests run everywhere (they never touch the device).
#include <gtest/gtest.h>

#include <cmath>
#include <cstring>
#include <random>
#include <string>
#include <vector>

#include "common/numfmt.h"
#include "kernels/cpu/matvec.h"
#include "kernels/cpu/attention_core.h"
#include "kernels/cpu/compressor_pool.h"
#include "kernels/cpu/hc.h"
#include "kernels/cpu/indexer.h"
#include "kernels/cpu/router.h"
#include "kernels/cpu/swiglu.h"
#include "kernels/cuda/ops.h"
#include "kernels/cuda/quant_decode.h"

namespace fm {
namespace {

using cuda::DeviceBuffer;

#define ASSERT_OK(expr)                                  \
  do {                                                   \
    const ::fm::Status st_ = (expr);                     \
    ASSERT_TRUE(st_.ok()) << #expr << ": " << st_.ToString(); \
  } while (0)

template <typename T>
DeviceBuffer ToDevice(const std::vector<T>& v) {
  auto r = cuda::Upload(v.data(), v.size() * sizeof(T));
  EXPECT_TRUE(r.ok()) << r.status().ToString();
  return r.ok() ? std::move(r).value() : DeviceBuffer();
}

std::vector<float> ToHost(const DeviceBuffer& b, size_t n) {
  std::vector<float> v(n);
  const Status s = b.CopyToHost(v.data(), n * sizeof(float));
  EXPECT_TRUE(s.ok()) << s.ToString();
  return v;
}

bool SameBits(float a, float b) { return std::memcmp(&a, &b, 4) == 0; }

// |got - want| <= rel * max(|want_i|, rms(want)) elementwise; NaN must meet NaN.
void ExpectClose(const std::vector<float>& got, const std::vector<float>& want, double rel,
                 const std::string& what) {
  ASSERT_EQ(got.size(), want.size()) << what;
  double ss = 0;
  size_t finite = 0;
  for (float w : want) {
    if (!std::isfinite(w)) continue;
    ss += double(w) * w;
    ++finite;
  }
  const double rms = finite ? std::sqrt(ss / finite) : 0.0;
  int bad = 0;
  for (size_t i = 0; i < got.size() && bad < 5; ++i) {
    const double tol = rel * std::max<double>(std::fabs(want[i]), rms);
    const bool ok = std::isnan(want[i]) ? std::isnan(got[i])
                                        : std::fabs(double(got[i]) - want[i]) <= tol;
    if (!ok) {
      ++bad;
      ADD_FAILURE() << what << " [" << i << "]: got " << got[i] << " want " << want[i]
                    << " (tol " << tol << ")";
    }
  }
}

std::vector<float> RandomNormal(size_t n, std::mt19937& rng, float sigma = 1.0f) {
  std::normal_distribution<float> d(0.0f, sigma);
  std::vector<float> v(n);
  for (auto& x : v) x = d(rng);
  return v;
}

std::vector<uint8_t> RandomScales(size_t n, std::mt19937& rng) {
  std::uniform_int_distribution<int> d(124, 130);  // 2^-3 .. 2^3
  std::vector<uint8_t> v(n);
  for (auto& s : v) s = static_cast<uint8_t>(d(rng));
  return v;
}

// Host bytes of a random weight plus the QWeight over them.
struct HostWeight {
  std::vector<uint8_t> data, scale;
  QWeight w;
};

HostWeight RandomWeight(WeightFormat format, int64_t rows, int64_t cols, std::mt19937& rng) {
  HostWeight h;
  const size_t n = static_cast<size_t>(rows * cols);
  const std::vector<float> vals = RandomNormal(n, rng);
  switch (format) {
    case WeightFormat::kF32:
      h.data.resize(n * 4);
      std::memcpy(h.data.data(), vals.data(), n * 4);
      break;
    case WeightFormat::kBF16:
      h.data.resize(n * 2);
      for (size_t i = 0; i < n; ++i) {
        const uint16_t b = F32ToBf16(vals[i]);
        std::memcpy(h.data.data() + 2 * i, &b, 2);
      }
      break;
    case WeightFormat::kFP8Block:
      h.data.resize(n);
      for (size_t i = 0; i < n; ++i) h.data[i] = F32ToE4m3(vals[i]);
      h.scale = RandomScales(static_cast<size_t>((rows + 127) / 128 * ((cols + 127) / 128)), rng);
      break;
    case WeightFormat::kFP4Block32: {
      std::uniform_int_distribution<int> byte(0, 255);  // every nibble is a valid e2m1 code
      h.data.resize(n / 2);
      for (auto& b : h.data) b = static_cast<uint8_t>(byte(rng));
      h.scale = RandomScales(static_cast<size_t>(rows * (cols / 32)), rng);
      break;
    }
  }
  h.w.format = format;
  h.w.rows = rows;
  h.w.cols = cols;
  h.w.data = h.data.data();
  h.w.scale = h.scale.empty() ? nullptr : h.scale.data();
  return h;
}

// Gemv on the device with x at float offset `x_offset` of its buffer (offset 1 forces the
// scalar kernel), returns y.
std::vector<float> DeviceGemv(const HostWeight& h, const std::vector<float>& x, int x_offset = 0) {
  auto dw = cuda::UploadWeight(h.w);
  EXPECT_TRUE(dw.ok()) << dw.status().ToString();
  if (!dw.ok()) return {};
  std::vector<float> xp(x_offset, 0.0f);
  xp.insert(xp.end(), x.begin(), x.end());
  DeviceBuffer dx = ToDevice(xp);
  auto dy = DeviceBuffer::Alloc(h.w.rows * sizeof(float));
  EXPECT_TRUE(dy.ok()) << dy.status().ToString();
  if (!dy.ok()) return {};
  const Status s = cuda::Gemv(dw->view(), dx.as<float>() + x_offset, dy->as<float>());
  EXPECT_TRUE(s.ok()) << s.ToString();
  return ToHost(*dy, h.w.rows);
}

std::vector<float> RefGemv(const HostWeight& h, const std::vector<float>& x) {
  std::vector<float> y(h.w.rows);
  MatvecRef(h.w, x.data(), y.data());
  return y;
}

void CheckGemv(WeightFormat format, const std::vector<std::pair<int64_t, int64_t>>& shapes,
               int x_offset = 0) {
  std::mt19937 rng(1234);
  for (auto [rows, cols] : shapes) {
    const HostWeight h = RandomWeight(format, rows, cols, rng);
    const std::vector<float> x = RandomNormal(cols, rng);
    ExpectClose(DeviceGemv(h, x, x_offset), RefGemv(h, x), 1e-4,
                "gemv [" + std::to_string(rows) + ", " + std::to_string(cols) + "]");
  }
}

// ---- decoders (CPU) ------------------------------------------------------------------------

TEST(QuantDecode, E4m3MatchesNumfmtForEveryByte) {
  for (int b = 0; b < 256; ++b) {
    const float want = E4m3ToF32(static_cast<uint8_t>(b)), got = cuda::E4m3Decode(b);
    EXPECT_TRUE(std::isnan(want) ? std::isnan(got) : SameBits(got, want))
        << b << ": " << got << " vs " << want;
  }
}

TEST(QuantDecode, E2m1MatchesNumfmtForEveryNibble) {
  for (int n = 0; n < 16; ++n)
    EXPECT_TRUE(SameBits(cuda::E2m1Decode(n), Fp4ToF32(static_cast<uint8_t>(n)))) << n;
}

TEST(QuantDecode, E8m0MatchesNumfmtForEveryByte) {
  for (int b = 0; b < 256; ++b) {
    const float want = E8m0ToF32(static_cast<uint8_t>(b)), got = cuda::E8m0Decode(b);
    EXPECT_TRUE(std::isnan(want) ? std::isnan(got) : SameBits(got, want)) << b;
  }
}

TEST(QuantDecode, Bf16MatchesNumfmtForEveryCode) {
  for (uint32_t h = 0; h < 65536; ++h) {
    const float want = Bf16ToF32(static_cast<uint16_t>(h)), got = cuda::Bf16Decode(h);
    ASSERT_TRUE(SameBits(got, want) || (std::isnan(want) && std::isnan(got))) << h;
  }
}

// ---- argument checks (CPU: they fail before any device call) ------------------------------

TEST(CudaArgs, GemvAndUploadRejectBadWeights) {
  std::vector<uint8_t> bytes(4096), scales(64);
  QWeight w{WeightFormat::kFP4Block32, 4, 48, bytes.data(), scales.data()};
  Status s = cuda::UploadWeight(w).status();
  EXPECT_EQ(s.code(), Code::kInvalidArgument);
  EXPECT_NE(s.message().find("multiple of 32"), std::string::npos) << s.ToString();
  EXPECT_NE(s.message().find("[4, 48]"), std::string::npos) << s.ToString();

  w = {WeightFormat::kFP8Block, 4, 64, bytes.data(), nullptr};
  s = cuda::Gemv(w, reinterpret_cast<float*>(bytes.data()), reinterpret_cast<float*>(bytes.data()));
  EXPECT_EQ(s.code(), Code::kInvalidArgument);
  EXPECT_NE(s.message().find("scale is null"), std::string::npos) << s.ToString();

  w = {WeightFormat::kBF16, 0, 64, bytes.data(), nullptr};
  s = cuda::UploadWeight(w).status();
  EXPECT_NE(s.message().find("rows and cols"), std::string::npos) << s.ToString();

  w = {WeightFormat::kBF16, 4, 64, bytes.data(), nullptr};
  s = cuda::Gemv(w, nullptr, nullptr);
  EXPECT_EQ(s.code(), Code::kInvalidArgument);
  EXPECT_NE(s.message().find("x and y"), std::string::npos) << s.ToString();
}

TEST(CudaArgs, ElementwiseOpsRejectBadShapes) {
  float dummy[4] = {};
  int32_t pos[1] = {0};
  Status s = cuda::RopeInterleaved(dummy, 1, 1, 64, 63, pos, dummy, false);
  EXPECT_EQ(s.code(), Code::kInvalidArgument);
  EXPECT_NE(s.message().find("rd 63"), std::string::npos) << s.ToString();
  s = cuda::RopeInterleaved(dummy, 1, 1, 64, 128, pos, dummy, false);
  EXPECT_NE(s.message().find("rd must be even, > 0 and <= head_dim"), std::string::npos) << s.ToString();
  s = cuda::RmsNorm(dummy, nullptr, dummy, 2, 0, 1e-6f);
  EXPECT_NE(s.message().find("dim 0"), std::string::npos) << s.ToString();
  s = cuda::SwiGluClamped(dummy, dummy, dummy, 4, 0.0f);
  EXPECT_NE(s.message().find("limit must be > 0"), std::string::npos) << s.ToString();
  s = cuda::SwiGluClamped(nullptr, dummy, dummy, 4, 10.0f);
  EXPECT_NE(s.message().find("device pointers"), std::string::npos) << s.ToString();
  // Empty work is valid and touches nothing.
  EXPECT_TRUE(cuda::RmsNorm(nullptr, nullptr, nullptr, 0, 8, 1e-6f).ok());
  EXPECT_TRUE(cuda::SwiGluClamped(nullptr, nullptr, nullptr, 0, 10.0f).ok());
}

TEST(CudaDevice, AllocWithoutDeviceIsAStatus) {
  if (cuda::DeviceCount() > 0) GTEST_SKIP() << "has a CUDA device";
  auto b = DeviceBuffer::Alloc(1024);
  ASSERT_FALSE(b.ok());
  EXPECT_NE(b.status().message().find("cudaMalloc"), std::string::npos) << b.status().ToString();
  EXPECT_TRUE(DeviceBuffer::Alloc(0).ok());  // empty buffers need no device
}

// ---- device buffer ------------------------------------------------------------------------

TEST(CudaDevice, BufferRoundTripAndRangeChecks) {
  if (cuda::DeviceCount() == 0) GTEST_SKIP() << "no CUDA device";
  std::vector<float> v = {1.5f, -2.0f, 3.25f, 0.0f};
  DeviceBuffer b = ToDevice(v);
  ASSERT_EQ(b.size(), 16u);
  EXPECT_EQ(ToHost(b, 4), v);
  float one = 0;
  ASSERT_OK(b.CopyToHost(&one, 4, 8));
  EXPECT_EQ(one, 3.25f);
  const Status s = b.CopyFromHost(v.data(), 16, 4);
  EXPECT_EQ(s.code(), Code::kOutOfRange);
  DeviceBuffer moved = std::move(b);
  EXPECT_EQ(b.data(), nullptr);
  EXPECT_EQ(ToHost(moved, 4), v);
}

// ---- GEMV ---------------------------------------------------------------------------------

TEST(CudaGemv, Fp8MatchesMatvecRef) {
  if (cuda::DeviceCount() == 0) GTEST_SKIP() << "no CUDA device";
  // 200: scalar kernel; 336 = 2*128 + 80: partial column block; 129/257/300: partial row block.
  CheckGemv(WeightFormat::kFP8Block,
            {{1, 16}, {1, 128}, {3, 200}, {129, 336}, {300, 384}, {257, 4096}});
}

TEST(CudaGemv, Fp8UnalignedXUsesScalarKernel) {
  if (cuda::DeviceCount() == 0) GTEST_SKIP() << "no CUDA device";
  CheckGemv(WeightFormat::kFP8Block, {{130, 256}, {5, 1024}}, /*x_offset=*/1);
}

TEST(CudaGemv, Fp8NanCodeAndNanScalePropagate) {
  if (cuda::DeviceCount() == 0) GTEST_SKIP() << "no CUDA device";
  std::mt19937 rng(7);
  HostWeight h = RandomWeight(WeightFormat::kFP8Block, 200, 256, rng);
  h.data[5 * 256 + 7] = 0x7F;  // e4m3 NaN in row 5
  h.scale[1 * 2 + 1] = 255;    // e8m0 NaN: row block 1 (rows 128..199), column block 1
  const std::vector<float> x = RandomNormal(256, rng);
  const std::vector<float> got = DeviceGemv(h, x), want = RefGemv(h, x);
  ASSERT_EQ(got.size(), 200u);
  for (int r = 0; r < 200; ++r) EXPECT_EQ(std::isnan(got[r]), r == 5 || r >= 128) << r;
  ExpectClose(got, want, 1e-4, "fp8 with NaN codes");
}

TEST(CudaGemv, Fp4MatchesMatvecRef) {
  if (cuda::DeviceCount() == 0) GTEST_SKIP() << "no CUDA device";
  // 96: three groups (lanes 3..31 idle); 1056 = 33 groups: lane 0 takes two.
  CheckGemv(WeightFormat::kFP4Block32, {{1, 32}, {7, 96}, {2, 1056}, {65, 2080}, {300, 4096}});
  CheckGemv(WeightFormat::kFP4Block32, {{9, 2048}}, /*x_offset=*/1);
}

TEST(CudaGemv, Bf16MatchesMatvecRef) {
  if (cuda::DeviceCount() == 0) GTEST_SKIP() << "no CUDA device";
  CheckGemv(WeightFormat::kBF16, {{1, 8}, {5, 24}, {33, 1001}, {130, 4096}});
}

TEST(CudaGemv, F32MatchesMatvecRef) {
  if (cuda::DeviceCount() == 0) GTEST_SKIP() << "no CUDA device";
  CheckGemv(WeightFormat::kF32, {{3, 7}, {24, 16384}});  // 24 x 16384: the hc_attn_fn shape
}

TEST(CudaGemv, RepeatedRunsAreBitIdentical) {
  if (cuda::DeviceCount() == 0) GTEST_SKIP() << "no CUDA device";
  std::mt19937 rng(99);
  const HostWeight h = RandomWeight(WeightFormat::kFP8Block, 257, 4096, rng);
  const std::vector<float> x = RandomNormal(4096, rng);
  const std::vector<float> a = DeviceGemv(h, x), b = DeviceGemv(h, x);
  ASSERT_EQ(a.size(), 257u);
  EXPECT_EQ(std::memcmp(a.data(), b.data(), a.size() * 4), 0);
}

// ---- RMSNorm ------------------------------------------------------------------------------

std::vector<float> RefRmsNorm(const std::vector<float>& x, const std::vector<float>* g,
                              int64_t rows, int64_t dim, double eps) {
  std::vector<float> y(x.size());
  for (int64_t r = 0; r < rows; ++r) {
    double ss = 0;
    for (int64_t c = 0; c < dim; ++c) ss += double(x[r * dim + c]) * x[r * dim + c];
    const double inv = 1.0 / std::sqrt(ss / dim + eps);
    for (int64_t c = 0; c < dim; ++c)
      y[r * dim + c] = static_cast<float>((g ? (*g)[c] : 1.0) * x[r * dim + c] * inv);
  }
  return y;
}

TEST(CudaRmsNorm, MatchesHostReference) {
  if (cuda::DeviceCount() == 0) GTEST_SKIP() << "no CUDA device";
  std::mt19937 rng(5);
  for (int64_t rows : {1, 3})
    for (int64_t dim : {1, 31, 256, 257, 4096, 4097})
      for (bool weighted : {false, true}) {
        const std::vector<float> x = RandomNormal(rows * dim, rng, 3.0f);
        const std::vector<float> g = RandomNormal(dim, rng);
        DeviceBuffer dx = ToDevice(x), dg = ToDevice(g);
        auto dy = DeviceBuffer::Alloc(x.size() * 4);
        ASSERT_TRUE(dy.ok()) << dy.status().ToString();
        ASSERT_OK(cuda::RmsNorm(dx.as<float>(), weighted ? dg.as<float>() : nullptr,
                                dy->as<float>(), rows, dim, 1e-6f));
        ExpectClose(ToHost(*dy, x.size()), RefRmsNorm(x, weighted ? &g : nullptr, rows, dim, 1e-6),
                    1e-5, "rmsnorm " + std::to_string(rows) + "x" + std::to_string(dim));
      }
}

TEST(CudaRmsNorm, InPlaceEqualsOutOfPlace) {
  if (cuda::DeviceCount() == 0) GTEST_SKIP() << "no CUDA device";
  std::mt19937 rng(6);
  const int64_t rows = 4, dim = 512;  // e.g. 4 heads of a per-head q norm
  const std::vector<float> x = RandomNormal(rows * dim, rng), g = RandomNormal(dim, rng);
  DeviceBuffer dx = ToDevice(x), dg = ToDevice(g), dinplace = ToDevice(x);
  auto dy = DeviceBuffer::Alloc(x.size() * 4);
  ASSERT_TRUE(dy.ok());
  ASSERT_OK(cuda::RmsNorm(dx.as<float>(), dg.as<float>(), dy->as<float>(), rows, dim, 1e-6f));
  ASSERT_OK(cuda::RmsNorm(dinplace.as<float>(), dg.as<float>(), dinplace.as<float>(), rows, dim,
                          1e-6f));
  const std::vector<float> a = ToHost(*dy, x.size()), b = ToHost(dinplace, x.size());
  EXPECT_EQ(std::memcmp(a.data(), b.data(), a.size() * 4), 0);
}

// ---- clamped SwiGLU -----------------------------------------------------------------------

double RefSwiGlu(double g, double u, double limit) {
  g = std::min(g, limit);
  u = std::clamp(u, -limit, limit);
  return g / (1.0 + std::exp(-g)) * u;
}

std::vector<float> DeviceSwiGlu(const std::vector<float>& g, const std::vector<float>& u,
                                float limit) {
  DeviceBuffer dg = ToDevice(g), du = ToDevice(u);
  auto dout = DeviceBuffer::Alloc(g.size() * 4);
  EXPECT_TRUE(dout.ok());
  if (!dout.ok()) return {};
  const Status s = cuda::SwiGluClamped(dg.as<float>(), du.as<float>(), dout->as<float>(),
                                       static_cast<int64_t>(g.size()), limit);
  EXPECT_TRUE(s.ok()) << s.ToString();
  return ToHost(*dout, g.size());
}

TEST(CudaSwiGlu, MatchesHostReference) {
  if (cuda::DeviceCount() == 0) GTEST_SKIP() << "no CUDA device";
  std::mt19937 rng(8);
  for (int64_t n : {1, 1000, 4097}) {
    const std::vector<float> g = RandomNormal(n, rng, 8.0f), u = RandomNormal(n, rng, 8.0f);
    std::vector<float> want(n);
    for (int64_t i = 0; i < n; ++i) want[i] = static_cast<float>(RefSwiGlu(g[i], u[i], 10.0));
    ExpectClose(DeviceSwiGlu(g, u, 10.0f), want, 1e-5, "swiglu n=" + std::to_string(n));
  }
}

TEST(CudaSwiGlu, ClampsGateAboveAndUpBothWays) {
  if (cuda::DeviceCount() == 0) GTEST_SKIP() << "no CUDA device";
  const std::vector<float> g = {20.0f, 20.0f, -50.0f, 0.0f, 1.0f, NAN};
  const std::vector<float> u = {-30.0f, 30.0f, 3.0f, 5.0f, 2.0f, 1.0f};
  const std::vector<float> got = DeviceSwiGlu(g, u, 10.0f);
  ASSERT_EQ(got.size(), 6u);
  const double silu10 = 10.0 / (1.0 + std::exp(-10.0));  // 9.99954602...
  EXPECT_NEAR(got[0], -10.0 * silu10, 1e-4);
  EXPECT_NEAR(got[1], 10.0 * silu10, 1e-4);
  EXPECT_NEAR(got[2], -50.0 / (1.0 + std::exp(50.0)) * 3.0, 1e-12);  // gate not clamped below
  EXPECT_EQ(got[3], 0.0f);
  EXPECT_NEAR(got[4], 2.0 / (1.0 + std::exp(-1.0)), 1e-6);
  EXPECT_TRUE(std::isnan(got[5]));
}

// ---- interleaved RoPE ---------------------------------------------------------------------

std::vector<float> RopeFreqs(int64_t rd, double theta) {
  std::vector<float> f(rd / 2);
  for (int64_t i = 0; i < rd / 2; ++i) f[i] = static_cast<float>(std::pow(theta, -2.0 * i / rd));
  return f;
}

void RefRope(std::vector<float>& x, int64_t tokens, int64_t heads, int64_t d, int64_t rd,
             const std::vector<int32_t>& pos, const std::vector<float>& freqs, bool inverse) {
  for (int64_t t = 0; t < tokens; ++t)
    for (int64_t h = 0; h < heads; ++h)
      for (int64_t i = 0; i < rd / 2; ++i) {
        const float angle = static_cast<float>(pos[t]) * freqs[i];  // f32, as the kernel
        const double c = std::cos(double(angle)), s = (inverse ? -1 : 1) * std::sin(double(angle));
        float* p = &x[(t * heads + h) * d + d - rd + 2 * i];
        const double a = p[0], b = p[1];
        p[0] = static_cast<float>(a * c - b * s);
        p[1] = static_cast<float>(a * s + b * c);
      }
}

struct RopeCase {
  int64_t tokens, heads, d, rd;
  double theta;
};
const RopeCase kRopeCases[] = {{3, 1, 512, 64, 10000.0}, {3, 4, 128, 64, 160000.0},
                               {3, 2, 16, 16, 10000.0}};
const std::vector<int32_t> kPositions = {0, 7, 65537};

TEST(CudaRope, MatchesHostReference) {
  if (cuda::DeviceCount() == 0) GTEST_SKIP() << "no CUDA device";
  std::mt19937 rng(11);
  for (const RopeCase& rc : kRopeCases)
    for (bool inverse : {false, true}) {
      const std::vector<float> x = RandomNormal(rc.tokens * rc.heads * rc.d, rng);
      const std::vector<float> freqs = RopeFreqs(rc.rd, rc.theta);
      DeviceBuffer dx = ToDevice(x), dpos = ToDevice(kPositions), df = ToDevice(freqs);
      ASSERT_OK(cuda::RopeInterleaved(dx.as<float>(), rc.tokens, rc.heads, rc.d, rc.rd,
                                      dpos.as<int32_t>(), df.as<float>(), inverse));
      const std::vector<float> got = ToHost(dx, x.size());
      std::vector<float> want = x;
      RefRope(want, rc.tokens, rc.heads, rc.d, rc.rd, kPositions, freqs, inverse);
      const std::string what = "rope D=" + std::to_string(rc.d) + " rd=" + std::to_string(rc.rd);
      ExpectClose(got, want, 1e-5, what);
      for (int64_t t = 0; t < rc.tokens; ++t)
        for (int64_t h = 0; h < rc.heads; ++h)
          for (int64_t c = 0; c < rc.d; ++c) {
            const int64_t i = (t * rc.heads + h) * rc.d + c;
            // Position 0 is the identity; the first D-rd channels are never touched.
            if (kPositions[t] == 0 || c < rc.d - rc.rd) {
              ASSERT_TRUE(SameBits(got[i], x[i])) << what << " t=" << t << " c=" << c;
            }
          }
    }
}

TEST(CudaRope, InverseUndoesForward) {
  if (cuda::DeviceCount() == 0) GTEST_SKIP() << "no CUDA device";
  std::mt19937 rng(12);
  const int64_t tokens = 3, heads = 8, d = 512, rd = 64;
  const std::vector<float> x = RandomNormal(tokens * heads * d, rng);
  DeviceBuffer dx = ToDevice(x), dpos = ToDevice(kPositions), df = ToDevice(RopeFreqs(rd, 1e4));
  ASSERT_OK(cuda::RopeInterleaved(dx.as<float>(), tokens, heads, d, rd, dpos.as<int32_t>(),
                                  df.as<float>(), false));
  ASSERT_OK(cuda::RopeInterleaved(dx.as<float>(), tokens, heads, d, rd, dpos.as<int32_t>(),
                                  df.as<float>(), true));
  ExpectClose(ToHost(dx, x.size()), x, 1e-5, "rope^-1(rope(x))");
}

}  // namespace
}  // namespace fm

namespace fm {
namespace {

// The device router for T tokens; ids and weights back on the host.
void DeviceRouter(const std::vector<float>& logits, const std::vector<float>* bias,
                  const std::vector<int64_t>* eids, int64_t T, int64_t E, int64_t k, float scale,
                  std::vector<int32_t>* ids, std::vector<float>* w) {
  DeviceBuffer dl = ToDevice(logits);
  DeviceBuffer db = bias ? ToDevice(*bias) : DeviceBuffer();
  DeviceBuffer de = eids ? ToDevice(*eids) : DeviceBuffer();
  auto di = DeviceBuffer::Alloc(T * k * sizeof(int32_t));
  auto dw = DeviceBuffer::Alloc(T * k * sizeof(float));
  ASSERT_TRUE(di.ok() && dw.ok());
  ASSERT_OK(cuda::RouterTopK(dl.as<float>(), bias ? db.as<float>() : nullptr,
                             eids ? de.as<int64_t>() : nullptr, T, E, k, scale, di->as<int32_t>(),
                             dw->as<float>()));
  ids->resize(T * k);
  ASSERT_OK(di->CopyToHost(ids->data(), T * k * sizeof(int32_t)));
  *w = ToHost(*dw, T * k);
}

TEST(CudaArgs, RouterRejectsBadShapes) {
  float f[4] = {};
  int32_t ids[4] = {};
  int64_t e[4] = {};
  Status s = cuda::RouterTopK(f, nullptr, nullptr, 1, 0, 1, 1.0f, ids, f);
  EXPECT_NE(s.message().find("experts 0 outside [1, 1024]"), std::string::npos) << s.ToString();
  s = cuda::RouterTopK(f, nullptr, nullptr, 1, 4, 5, 1.0f, ids, f);
  EXPECT_NE(s.message().find("top_k 5 outside [1, experts 4]"), std::string::npos) << s.ToString();
  s = cuda::RouterTopK(f, f, e, 1, 4, 2, 1.0f, ids, f);
  EXPECT_NE(s.message().find("exclusive"), std::string::npos) << s.ToString();
  EXPECT_TRUE(cuda::RouterTopK(f, nullptr, nullptr, 0, 4, 2, 1.0f, ids, f).ok());
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
    DeviceRouter(logits, &bias, nullptr, T, E, k, 2.5f, &ids, &w);
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
  DeviceRouter(logits, nullptr, nullptr, 1, E, k, 1.0f, &ids, &w);
  for (int64_t j = 0; j < k; ++j) {
    EXPECT_EQ(ids[j], j);
    EXPECT_NEAR(w[j], 1.0f / k, 1e-7);
  }
}

TEST(CudaRouter, HashLayerTakesTheTokensRow) {
  if (cuda::DeviceCount() == 0) GTEST_SKIP() << "no CUDA device";
  std::mt19937 rng(13);
  const int64_t T = 3, E = 256, k = 6;
  std::vector<float> logits = RandomNormal(T * E, rng, 2.0f);
  std::vector<int64_t> eids(T * k);
  for (int64_t i = 0; i < T * k; ++i) eids[i] = (i * 37 + 5) % E;
  std::vector<int32_t> ids;
  std::vector<float> w;
  DeviceRouter(logits, nullptr, &eids, T, E, k, 1.5f, &ids, &w);
  for (int64_t t = 0; t < T; ++t) {
    std::vector<float> s(E), want_w(k);
    std::vector<int32_t> want_ids(k);
    RouterSqrtSoftplus_E(&logits[t * E], E, s.data());
    RouterHash_k(s.data(), &eids[t * k], k, 1.5f, want_ids.data(), want_w.data());
    for (int64_t j = 0; j < k; ++j) EXPECT_EQ(ids[t * k + j], want_ids[j]);
    ExpectClose(std::vector<float>(w.begin() + t * k, w.begin() + (t + 1) * k), want_w, 1e-6, "hash");
  }
}

}  // namespace
}  // namespace fm

namespace fm {
namespace {

DeviceBuffer Zeros(size_t floats) {
  auto r = DeviceBuffer::Alloc(floats * sizeof(float));
  EXPECT_TRUE(r.ok()) << r.status().ToString();
  return r.ok() ? std::move(r).value() : DeviceBuffer();
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

}  // namespace
}  // namespace fm

namespace fm {
namespace {

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

}  // namespace
}  // namespace fm

namespace fm {
namespace {

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
