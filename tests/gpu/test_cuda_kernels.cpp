// CUDA kernels vs their CPU references, and CUDA graph capture/replay. Device tests skip without
// a GPU; the decoder and argument-check tests run everywhere (they never touch the device).
#include <gtest/gtest.h>

#include <cmath>
#include <cstring>
#include <random>
#include <string>
#include <vector>

#include "common/device_transfers.h"
#include "common/numfmt.h"
#include "kernels/cpu/matvec.h"
#include "kernels/cuda/ops.h"
#include "kernels/cuda/quant_decode.h"
#include "tests/gpu/cuda_test_util.h"

namespace fm {
namespace {

using namespace cudatest;
using cuda::DeviceBuffer;

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
  Status s = cuda::RmsNorm(dummy, nullptr, dummy, 2, 0, 1e-6f);
  EXPECT_NE(s.message().find("dim 0"), std::string::npos) << s.ToString();
  s = cuda::AddVectors(dummy, dummy, dummy, -1);
  EXPECT_NE(s.message().find("AddVectors: n -1 < 0"), std::string::npos) << s.ToString();
  s = cuda::AddVectors(dummy, nullptr, dummy, 4);
  EXPECT_NE(s.message().find("null device pointer"), std::string::npos) << s.ToString();
  // Empty work is valid and touches nothing.
  EXPECT_TRUE(cuda::RmsNorm(nullptr, nullptr, nullptr, 0, 8, 1e-6f).ok());
  EXPECT_TRUE(cuda::AddVectors(nullptr, nullptr, nullptr, 0).ok());
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

// Every copy counts its bytes for the buffer's device (common/device_transfers.h): Upload as
// load traffic, the copies as step traffic, each direction apart; a refused copy counts nothing.
TEST(CudaDevice, CopiesCountTheirBytesByPhaseAndDirection) {
  if (cuda::DeviceCount() == 0) GTEST_SKIP() << "no CUDA device";
  std::vector<uint8_t> host(1000, 7);
  DeviceTransfers t0 = TransfersOf(0);
  auto b = cuda::Upload(host.data(), 1000);
  ASSERT_TRUE(b.ok()) << b.status().ToString();
  ASSERT_EQ(b->device(), 0);
  DeviceTransfers t1 = TransfersOf(0);
  EXPECT_EQ(t1.load.host_to_device - t0.load.host_to_device, 1000u);
  EXPECT_EQ(t1.load.device_to_host, t0.load.device_to_host);
  EXPECT_EQ(t1.step.host_to_device, t0.step.host_to_device);
  EXPECT_EQ(t1.step.device_to_host, t0.step.device_to_host);

  ASSERT_OK(b->CopyFromHost(host.data(), 300, 100));
  ASSERT_OK(b->CopyFromHostAsync(host.data(), 200));
  ASSERT_OK(b->CopyToHost(host.data(), 999, 1));
  EXPECT_EQ(b->CopyToHost(host.data(), 2, 999).code(), Code::kOutOfRange);
  EXPECT_EQ(b->CopyFromHost(host.data(), 1001).code(), Code::kOutOfRange);
  ASSERT_OK(b->CopyToHost(host.data(), 0));
  ASSERT_OK(cuda::Synchronize());
  DeviceTransfers t2 = TransfersOf(0);
  EXPECT_EQ(t2.step.host_to_device - t1.step.host_to_device, 500u);
  EXPECT_EQ(t2.step.device_to_host - t1.step.device_to_host, 999u);
  EXPECT_EQ(t2.load.host_to_device, t1.load.host_to_device);
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

// Gemm over T tokens with padded strides: every token's row equals Gemv of that token (same
// bits), for every format; the padding between rows of y stays untouched.
TEST(CudaGemm, EachTokenEqualsItsGemvBitForBit) {
  if (cuda::DeviceCount() == 0) GTEST_SKIP() << "no CUDA device";
  std::mt19937 rng(77);
  const int64_t T = 5;
  for (WeightFormat f : {WeightFormat::kFP8Block, WeightFormat::kFP4Block32, WeightFormat::kBF16,
                         WeightFormat::kF32}) {
    const int64_t rows = 75, cols = 160, xs = cols + 4, ys = rows + 3;
    const HostWeight h = RandomWeight(f, rows, cols, rng);
    const std::vector<float> x = RandomNormal(T * xs, rng);
    auto dw = cuda::UploadWeight(h.w);
    ASSERT_TRUE(dw.ok()) << dw.status().ToString();
    DeviceBuffer dx = ToDevice(x), dy = ToDevice(std::vector<float>(T * ys, -5.0f));
    ASSERT_OK(cuda::Gemm(dw->view(), dx.as<float>(), xs, dy.as<float>(), ys, T));
    const std::vector<float> y = ToHost(dy, T * ys);
    for (int64_t t = 0; t < T; ++t) {
      const std::vector<float> xt(x.begin() + t * xs, x.begin() + t * xs + cols);
      const std::vector<float> want = DeviceGemv(h, xt);
      for (int64_t r = 0; r < ys; ++r) {
        if (r < rows)
          ASSERT_TRUE(SameBits(y[t * ys + r], want[r])) << static_cast<int>(f) << " t " << t << " r " << r;
        else
          ASSERT_EQ(y[t * ys + r], -5.0f) << "padding t " << t << " r " << r;
      }
    }
  }
}

TEST(CudaArgs, GemmRejectsShortStrides) {
  std::vector<uint8_t> bytes(4096);
  const QWeight w{WeightFormat::kBF16, 4, 64, bytes.data(), nullptr};
  float* f = reinterpret_cast<float*>(bytes.data());
  Status s = cuda::Gemm(w, f, 63, f, 4, 2);
  EXPECT_NE(s.message().find("strides x 63, y 4 for a [4, 64] weight"), std::string::npos)
      << s.ToString();
  s = cuda::Gemm(w, f, 64, f, 4, -1);
  EXPECT_NE(s.message().find("tokens -1 < 0"), std::string::npos) << s.ToString();
  EXPECT_TRUE(cuda::Gemm(w, f, 64, f, 4, 0).ok());
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

// ---- CUDA graphs ----------------------------------------------------------------------

// A captured graph records the launches, not their results: replays read the device memory of
// the moment (an input changed after the capture is honoured); a blocking copy inside the
// capture fails it with the CUDA error. AddVectors' sums of small integers are exact.
TEST(CudaGraph, ReplayReadsTheDeviceInputsOfEachLaunch) {
  if (cuda::DeviceCount() == 0) GTEST_SKIP() << "no CUDA device";
  auto stream = cuda::Stream::Create();
  ASSERT_TRUE(stream.ok()) << stream.status().ToString();
  DeviceBuffer a = ToDevice(std::vector<float>{1, 2, 3, 4});
  DeviceBuffer y = ToDevice(std::vector<float>(8, 0.0f));
  auto graph = cuda::Graph::Capture(*stream, [&] {
    // y[0..4) += a (in place), y[4..8) = a + a.
    FM_RETURN_IF_ERROR(cuda::AddVectors(a.as<float>(), y.as<float>(), y.as<float>(), 4));
    return cuda::AddVectors(a.as<float>(), a.as<float>(), y.as<float>() + 4, 4);
  });
  ASSERT_TRUE(graph.ok()) << graph.status().ToString();
  EXPECT_EQ(graph->nodes(), 2u);
  EXPECT_EQ(ToHost(y, 8), std::vector<float>(8, 0.0f)) << "capturing ran a kernel";
  ASSERT_OK(graph->Launch(*stream));
  ASSERT_OK(stream->Synchronize());
  EXPECT_EQ(ToHost(y, 8), (std::vector<float>{1, 2, 3, 4, 2, 4, 6, 8}));
  const std::vector<float> a2 = {10, 20, 30, 40};
  ASSERT_OK(a.CopyFromHost(a2.data(), a2.size() * sizeof(float)));
  ASSERT_OK(graph->Launch(*stream));
  ASSERT_OK(stream->Synchronize());
  EXPECT_EQ(ToHost(y, 8), (std::vector<float>{11, 22, 33, 44, 20, 40, 60, 80}));

  float host[4];
  auto bad = cuda::Graph::Capture(*stream, [&] { return a.CopyToHost(host, sizeof host); });
  EXPECT_FALSE(bad.ok());
  EXPECT_NE(bad.status().message().find("capturing a CUDA graph"), std::string::npos)
      << bad.status().ToString();
  // Nor an asynchronous one: each replay would copy again, where no counter sees it.
  const DeviceTransfers before = TransfersOf(0);
  auto copy = cuda::Graph::Capture(*stream, [&] { return a.CopyFromHostAsync(host, sizeof host); });
  EXPECT_FALSE(copy.ok());
  EXPECT_NE(copy.status().message().find("a host<->device copy while capturing a graph"),
            std::string::npos)
      << copy.status().ToString();
  EXPECT_EQ(TransfersOf(0).step.host_to_device, before.step.host_to_device);
  // The stream works again after the failed capture.
  ASSERT_OK(graph->Launch(*stream));
  ASSERT_OK(stream->Synchronize());
  EXPECT_EQ(ToHost(y, 8), (std::vector<float>{21, 42, 63, 84, 20, 40, 60, 80}));
}

TEST(CudaGraph, TheDefaultStreamCannotBeCaptured) {
  cuda::Stream none;
  auto g = cuda::Graph::Capture(none, [] { return Status::Ok(); });
  EXPECT_FALSE(g.ok());
  EXPECT_NE(g.status().message().find("default stream"), std::string::npos) << g.status().ToString();
}

}  // namespace
}  // namespace fm
