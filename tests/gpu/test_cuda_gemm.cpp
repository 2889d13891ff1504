// The weight-streaming products (kernels/cuda/gemv.cu: Gemm, GemmMany) against the CPU reference
// (MatvecRef) and against themselves: a token's result has the same bits whatever T, the other
// tokens or the other tasks of a GemmMany are (the experts: test_cuda_experts.cpp). Device tests
// skip without a GPU; the argument checks run everywhere.
#include <gtest/gtest.h>

#include <cmath>
#include <limits>
#include <random>
#include <string>
#include <vector>

#include "kernels/cpu/matvec.h"
#include "kernels/cuda/ops.h"
#include "tests/gpu/cuda_test_util.h"

namespace fm {
namespace {

using namespace cudatest;
using cuda::DeviceBuffer;

constexpr float kNaN = std::numeric_limits<float>::quiet_NaN();

// Gemm of T tokens (x rows of xs floats, y rows of ys) == Gemv of each token alone, bit for bit,
// and close to MatvecRef; y's padding untouched.
void CheckTokens(WeightFormat f, int64_t rows, int64_t cols, std::mt19937& rng) {
  const std::string what = PathName(cuda::GetWeightPath()) + " format " +
                           std::to_string(static_cast<int>(f)) + " [" + std::to_string(rows) +
                           ", " + std::to_string(cols) + "]";
  const int64_t Tmax = 32, xs = cols + 4, ys = rows + 3;
  HostWeight h = RandomWeight(f, rows, cols, rng);
  auto dw = cuda::UploadWeight(h.w);
  ASSERT_TRUE(dw.ok()) << dw.status().ToString();
  const std::vector<float> x = RandomNormal(Tmax * xs, rng);
  DeviceBuffer dx = ToDevice(x), dy1 = Zeros(rows);
  std::vector<std::vector<float>> alone(Tmax);
  for (int64_t t = 0; t < Tmax; ++t) {
    ASSERT_OK(cuda::Gemv(dw->view(), dx.as<float>() + t * xs, dy1.as<float>()));
    alone[t] = ToHost(dy1, rows);
    ExpectClose(alone[t], Ref(h.w, x.data() + t * xs), 1e-4, what + " t " + std::to_string(t));
  }
  for (int64_t T : kTokenCounts) {
    DeviceBuffer dy = ToDevice(std::vector<float>(T * ys, -5.0f));
    ASSERT_OK(cuda::Gemm(dw->view(), dx.as<float>(), xs, dy.as<float>(), ys, T));
    const std::vector<float> y = ToHost(dy, T * ys);
    for (int64_t t = 0; t < T; ++t)
      for (int64_t r = 0; r < ys; ++r) {
        if (r < rows)
          ASSERT_TRUE(SameBits(y[t * ys + r], alone[t][r])) << what << " T " << T << " t " << t << " r " << r;
        else
          ASSERT_EQ(y[t * ys + r], -5.0f) << what << " padding T " << T << " t " << t;
      }
  }
}

// Every format, vector and scalar paths, partial FP8 blocks (rows and cols not multiples of
// 128), tails where the format allows them, rows split among warps, T = 1..32.
// Both cores for FP8/FP4 (the tensor-core one: 16-row tiles, steps of 4 vectors, a partial last
// step, FP4 groups whose scale the f16 weights cannot hold on the FMA fallback).
TEST(CudaGemmTokens, EveryTokenHasItsGemvBitsForAnyT) {
  if (cuda::DeviceCount() == 0) GTEST_SKIP() << "no CUDA device";
  std::mt19937 rng(2024);
  for (cuda::WeightPath path : kWeightPaths) {
    WeightPathScope scope(path);
    CheckTokens(WeightFormat::kFP8Block, 75, 336, rng);    // vector path, 336 = 2*128 + 80
    CheckTokens(WeightFormat::kFP8Block, 130, 200, rng);   // scalar path (200 % 16 != 0)
    CheckTokens(WeightFormat::kFP4Block32, 37, 96, rng);
    CheckTokens(WeightFormat::kFP4Block32, 19, 352, rng);  // 11 groups: a partial step
    // Few rows, long rows: each row split among 8 warps.
    CheckTokens(WeightFormat::kFP8Block, 20, 4096, rng);
    CheckTokens(WeightFormat::kFP4Block32, 9, 2048, rng);
  }
  CheckTokens(WeightFormat::kBF16, 33, 24, rng);
  CheckTokens(WeightFormat::kBF16, 5, 1001, rng);        // scalar: odd cols
  CheckTokens(WeightFormat::kF32, 9, 36, rng);
  CheckTokens(WeightFormat::kF32, 3, 7, rng);
  CheckTokens(WeightFormat::kBF16, 7, 1001, rng);        // split among 2 warps, scalar path
}

// The tensor-core core's numbers against MatvecRef:
// - FP4 scales across the range folded into the f16 weights (2^-23..2^1: f16-subnormal weights
//   at the low end) and at its edges (103 and 129 take the FMA fallback, 104 and 128 the mma,
//   0 the fallback);
// - FP8 and FP4 with x of sigma 1e-5, 1e-3 and 1 (x's lo part is scaled by 2^11 so small x keeps its
//   bits);
// - every token == its Gemv, bit for bit.
TEST(CudaGemmTokens, TensorCoreScaleRangeAndSmallX) {
  if (cuda::DeviceCount() == 0) GTEST_SKIP() << "no CUDA device";
  WeightPathScope scope(cuda::WeightPath::kTensorCore);
  std::mt19937 rng(77);
  const int64_t rows = 24, cols = 256, T = 3;
  for (WeightFormat f : {WeightFormat::kFP4Block32, WeightFormat::kFP8Block}) {
    HostWeight h = RandomWeight(f, rows, cols, rng);
    if (f == WeightFormat::kFP4Block32) {
      std::uniform_int_distribution<int> in_range(104, 128);
      for (auto& b : h.scale) b = static_cast<uint8_t>(in_range(rng));
      const int64_t groups = cols / 32;
      h.scale[3 * groups + 0] = 103, h.scale[3 * groups + 1] = 104;
      h.scale[5 * groups + 2] = 128, h.scale[6 * groups + 3] = 129;
      h.scale[7 * groups + 4] = 0;
    }
    auto dw = cuda::UploadWeight(h.w);
    ASSERT_TRUE(dw.ok()) << dw.status().ToString();
    for (float sigma : {1e-5f, 1e-3f, 1.0f}) {
      const std::string what = "format " + std::to_string(static_cast<int>(f)) + " sigma " + std::to_string(sigma);
      const std::vector<float> x = RandomNormal(T * cols, rng, sigma);
      DeviceBuffer dx = ToDevice(x), dy = Zeros(T * rows), d1 = Zeros(rows);
      ASSERT_OK(cuda::Gemm(dw->view(), dx.as<float>(), cols, dy.as<float>(), rows, T));
      const std::vector<float> y = ToHost(dy, T * rows);
      for (int64_t t = 0; t < T; ++t) {
        const std::vector<float> yt(y.begin() + t * rows, y.begin() + (t + 1) * rows);
        ExpectClose(yt, Ref(h.w, x.data() + t * cols), 1e-4, what + " token " + std::to_string(t));
        ASSERT_OK(cuda::Gemv(dw->view(), dx.as<float>() + t * cols, d1.as<float>()));
        const std::vector<float> alone = ToHost(d1, rows);
        for (int64_t r = 0; r < rows; ++r)
          ASSERT_TRUE(SameBits(alone[r], yt[r])) << what << " t " << t << " r " << r;
      }
    }
  }
}

// A NaN in one token's x gives NaN only in that token's outputs; a NaN scale byte only in its rows.
// Both cores, FP4 (a NaN scale byte) and FP8 (a NaN e4m3 code, 0x7F).
TEST(CudaGemmTokens, NanStaysInItsTokenAndRows) {
  if (cuda::DeviceCount() == 0) GTEST_SKIP() << "no CUDA device";
  std::mt19937 rng(5);
  const int64_t rows = 40, cols = 128, T = 5;
  for (cuda::WeightPath path : kWeightPaths)
    for (WeightFormat f : {WeightFormat::kFP4Block32, WeightFormat::kFP8Block}) {
      WeightPathScope scope(path);
      const std::string what = PathName(path) + " format " + std::to_string(static_cast<int>(f));
      HostWeight h = RandomWeight(f, rows, cols, rng);
      if (f == WeightFormat::kFP4Block32) h.scale[7 * (cols / 32) + 2] = 0xFF;  // row 7, group 2
      else h.data[7 * cols + 77] = 0x7F;                                        // row 7, col 77
      std::vector<float> x = RandomNormal(T * cols, rng);
      x[2 * cols + 100] = kNaN;  // token 2
      auto dw = cuda::UploadWeight(h.w);
      ASSERT_TRUE(dw.ok()) << dw.status().ToString();
      DeviceBuffer dx = ToDevice(x), dy = Zeros(T * rows);
      ASSERT_OK(cuda::Gemm(dw->view(), dx.as<float>(), cols, dy.as<float>(), rows, T));
      const std::vector<float> y = ToHost(dy, T * rows);
      for (int64_t t = 0; t < T; ++t) {
        for (int64_t r = 0; r < rows; ++r)
          EXPECT_EQ(std::isnan(y[t * rows + r]), t == 2 || r == 7) << what << " t " << t << " r " << r;
        ExpectClose(std::vector<float>(y.begin() + t * rows, y.begin() + (t + 1) * rows),
                    Ref(h.w, x.data() + t * cols), 1e-4, what + " token " + std::to_string(t));
      }
    }
}

// Four products of different formats and shapes in one launch == each one's Gemm, bit for bit;
// with a norm weight == RmsNorm then Gemm, bit for bit.
class CudaGemmManyPaths : public WeightCoreTest {};
INSTANTIATE_TEST_SUITE_P(Cores, CudaGemmManyPaths, ::testing::ValuesIn(kWeightPaths), CoreName);

TEST_P(CudaGemmManyPaths, TasksEqualTheirOwnGemm) {
  if (cuda::DeviceCount() == 0) GTEST_SKIP() << "no CUDA device";
  std::mt19937 rng(31);
  const int64_t cols = 256;
  const struct { WeightFormat f; int64_t rows; } specs[] = {{WeightFormat::kFP8Block, 150},
      {WeightFormat::kFP4Block32, 33}, {WeightFormat::kBF16, 64}, {WeightFormat::kF32, 5}};
  std::vector<HostWeight> hw;
  std::vector<cuda::DeviceWeight> dw;
  for (const auto& s : specs) {
    hw.push_back(RandomWeight(s.f, s.rows, cols, rng));
    auto d = cuda::UploadWeight(hw.back().w);
    ASSERT_TRUE(d.ok()) << d.status().ToString();
    dw.push_back(std::move(d).value());
  }
  const std::vector<float> g = RandomNormal(cols, rng);
  DeviceBuffer dg = ToDevice(g), dn = Zeros(32 * cols);
  for (int64_t T : {3, 9}) {
    const std::vector<float> x = RandomNormal(T * cols, rng);
    DeviceBuffer dx = ToDevice(x);
    for (bool norm : {false, true}) {
      std::vector<DeviceBuffer> many, one;
      std::vector<cuda::GemvTask> tasks;
      for (size_t i = 0; i < dw.size(); ++i) {
        many.push_back(Zeros(T * dw[i].rows));
        one.push_back(Zeros(T * dw[i].rows));
        tasks.push_back({dw[i].view(), dx.as<float>(), cols, many.back().as<float>(), dw[i].rows});
      }
      ASSERT_OK(cuda::GemmMany(tasks.data(), tasks.size(), T, norm ? dg.as<float>() : nullptr, 1e-6f));
      const float* xin = dx.as<float>();
      if (norm) {
        ASSERT_OK(cuda::RmsNorm(dx.as<float>(), dg.as<float>(), dn.as<float>(), T, cols, 1e-6f));
        xin = dn.as<float>();
      }
      for (size_t i = 0; i < dw.size(); ++i) {
        const int64_t rows = dw[i].rows;
        ASSERT_OK(cuda::Gemm(dw[i].view(), xin, cols, one[i].as<float>(), rows, T));
        const std::vector<float> a = ToHost(many[i], T * rows), b = ToHost(one[i], T * rows);
        for (int64_t j = 0; j < T * rows; ++j)
          ASSERT_TRUE(SameBits(a[j], b[j])) << "task " << i << " norm " << norm << " T " << T << " [" << j << "]";
        if (!norm)
          for (int64_t t = 0; t < T; ++t)
            ExpectClose(std::vector<float>(a.begin() + t * rows, a.begin() + (t + 1) * rows),
                        Ref(hw[i].w, x.data() + t * cols), 1e-4, "task " + std::to_string(i));
      }
    }
  }
}

// The grouped wo_a: G row-slice tasks whose slices start inside FP8 128-row scale blocks, one
// launch, == the whole wo_a's Gemm on each group's x, rows of that group, bit for bit at these
// sizes, where both take one slice a row. (At the real wo_a [8192, 4096] a 1024-row group takes 8
// slices and the whole product 1, so only groups equal groups; wo_a is only ever computed as
// groups, by one device or by tp members alike.)
TEST_P(CudaGemmManyPaths, GroupedRowSlicesEqualPerGroupGemm) {
  if (cuda::DeviceCount() == 0) GTEST_SKIP() << "no CUDA device";
  std::mt19937 rng(8);
  const int64_t G = 4, R = 48, gin = 160, T = 3;  // rows 48, 96, 144: inside scale blocks
  const HostWeight h = RandomWeight(WeightFormat::kFP8Block, G * R, gin, rng);
  auto dw = cuda::UploadWeight(h.w);
  ASSERT_TRUE(dw.ok()) << dw.status().ToString();
  const std::vector<float> o = RandomNormal(T * G * gin, rng);
  DeviceBuffer dox = ToDevice(o), du = ToDevice(std::vector<float>(T * G * R, -1.0f));
  DeviceBuffer dfull = Zeros(T * G * R);
  std::vector<cuda::GemvTask> tasks;
  for (int64_t g = 0; g < G; ++g)
    tasks.push_back({dw->view(), dox.as<float>() + g * gin, G * gin, du.as<float>() + g * R, G * R,
                     g * R, R});
  ASSERT_OK(cuda::GemmMany(tasks.data(), tasks.size(), T));
  const std::vector<float> u = ToHost(du, T * G * R);
  for (int64_t g = 0; g < G; ++g) {
    ASSERT_OK(cuda::Gemm(dw->view(), dox.as<float>() + g * gin, G * gin, dfull.as<float>(), G * R, T));
    const std::vector<float> full = ToHost(dfull, T * G * R);
    for (int64_t t = 0; t < T; ++t)
      for (int64_t r = g * R; r < (g + 1) * R; ++r)
        ASSERT_TRUE(SameBits(u[t * G * R + r], full[t * G * R + r])) << "g " << g << " t " << t << " r " << r;
  }
}

// A tensor-parallel member's share of a weight (model/tp.h): rows [r0, r0 + n) with plan_rows
// = the whole weight's rows have the bits of those rows of the whole product, also for a share
// that a product of its own size would split among more warps (2048 rows: 4 warps a row group;
// 1024: 8), from the weight itself and from an upload of just those rows.
TEST(CudaGemmMany, RowShareWithPlanRowsHasTheWholeProductsBits) {
  if (cuda::DeviceCount() == 0) GTEST_SKIP() << "no CUDA device";
  std::mt19937 rng(21);
  const int64_t rows = 2048, cols = 4096, T = 2, r0 = 1024, n = 1024;
  const HostWeight h = RandomWeight(WeightFormat::kBF16, rows, cols, rng);
  auto dw = cuda::UploadWeight(h.w);
  ASSERT_TRUE(dw.ok()) << dw.status().ToString();
  QWeight share;
  ASSERT_TRUE(SliceRows(h.w, r0, n, &share));
  auto dshare = cuda::UploadWeight(share);
  ASSERT_TRUE(dshare.ok()) << dshare.status().ToString();
  const std::vector<float> x = RandomNormal(T * cols, rng);
  DeviceBuffer dx = ToDevice(x), dfull = Zeros(T * rows), da = Zeros(T * n), db = Zeros(T * n);
  ASSERT_OK(cuda::Gemm(dw->view(), dx.as<float>(), cols, dfull.as<float>(), rows, T));
  const cuda::GemvTask tasks[] = {
      {dw->view(), dx.as<float>(), cols, da.as<float>(), n, r0, n, rows},
      {dshare->view(), dx.as<float>(), cols, db.as<float>(), n, 0, n, rows}};
  ASSERT_OK(cuda::GemmMany(tasks, 2, T));
  const std::vector<float> full = ToHost(dfull, T * rows), a = ToHost(da, T * n),
                           b = ToHost(db, T * n);
  for (int64_t t = 0; t < T; ++t)
    for (int64_t r = 0; r < n; ++r) {
      ASSERT_TRUE(SameBits(a[t * n + r], full[t * rows + r0 + r])) << "t " << t << " r " << r;
      ASSERT_TRUE(SameBits(b[t * n + r], full[t * rows + r0 + r])) << "t " << t << " r " << r;
    }
}

TEST(CudaArgs, GemmManyRejectsBadTasks) {
  std::vector<uint8_t> bytes(4096);
  float* f = reinterpret_cast<float*>(bytes.data());
  const QWeight w{WeightFormat::kBF16, 4, 64, bytes.data(), nullptr};
  const QWeight w2{WeightFormat::kBF16, 4, 32, bytes.data(), nullptr};
  Status s = cuda::GemmMany(nullptr, 0, 1);
  EXPECT_NE(s.message().find("0 tasks (want 1..8)"), std::string::npos) << s.ToString();
  std::vector<cuda::GemvTask> nine(9, cuda::GemvTask{w, f, 64, f, 4});
  s = cuda::GemmMany(nine.data(), nine.size(), 1);
  EXPECT_NE(s.message().find("9 tasks"), std::string::npos) << s.ToString();
  std::vector<cuda::GemvTask> t = {{w, f, 64, f, 4}, {w, f, 64, f, 4, 3, 2}};
  s = cuda::GemmMany(t.data(), t.size(), 2);
  EXPECT_NE(s.message().find("GemmMany task 1: rows [3, +2) outside the weight's 4 rows"),
            std::string::npos) << s.ToString();
  t = {{w, f, 64, f, 4}, {w2, f, 64, f, 4}};
  s = cuda::GemmMany(t.data(), t.size(), 2, f, 1e-6f);
  EXPECT_NE(s.message().find("task 1: cols 32 differ from task 0's 64"), std::string::npos) << s.ToString();
  t = {{w, f, 64, f, 4}, {w, nullptr, 64, f, 4}};
  s = cuda::GemmMany(t.data(), t.size(), 2);
  EXPECT_NE(s.message().find("task 1: x and y must be device pointers"), std::string::npos) << s.ToString();
  s = cuda::GemmMany(t.data(), t.size(), 2, f, -1.0f);
  EXPECT_NE(s.message().find("eps must be >= 0"), std::string::npos) << s.ToString();
  t = {{w, f, 64, f, 4, 0, 0, -1}};
  s = cuda::GemmMany(t.data(), t.size(), 2);
  EXPECT_NE(s.message().find("plan_rows -1 < 0"), std::string::npos) << s.ToString();
}

// Blocks of a launch read the x's while others write the y's: an output that is also an input
// races on a GPU, and the emulation (blocks one after another) would not show it. Disjoint
// columns of one strided buffer are fine, and give the bits of separate buffers.
TEST(CudaArgs, GemmManyRefusesAnOutputThatIsAnInput) {
  if (cuda::DeviceCount() == 0) GTEST_SKIP() << "no CUDA device";
  std::mt19937 rng(5);
  const int64_t rows = 4, cols = 64, T = 3, S = 80;  // a [T, S] buffer: x in [0, 64), y after
  const HostWeight h = RandomWeight(WeightFormat::kBF16, rows, cols, rng);
  auto dw = cuda::UploadWeight(h.w);
  ASSERT_TRUE(dw.ok()) << dw.status().ToString();
  const std::vector<float> x = RandomNormal(T * S, rng);
  DeviceBuffer buf = ToDevice(x), dx = ToDevice(x), dy = Zeros(T * rows);
  float* b = buf.as<float>();
  const QWeight w = dw->view();
  // y in columns [64, 68) of the rows x reads [0, 64) of: allowed, same bits as apart.
  cuda::GemvTask t[2] = {{w, b, S, b + 64, S}, {w, dx.as<float>(), S, dy.as<float>(), rows}};
  ASSERT_OK(cuda::GemmMany(t, 2, T));
  const std::vector<float> got = ToHost(buf, T * S), want = ToHost(dy, T * rows);
  for (int64_t i = 0; i < T; ++i)
    for (int64_t r = 0; r < rows; ++r)
      EXPECT_TRUE(SameBits(got[i * S + 64 + r], want[i * rows + r])) << i << " " << r;
  // Columns [62, 66): the last two overlap x's columns of every row.
  t[0].y = b + 62;
  Status s = cuda::GemmMany(t, 2, T);
  EXPECT_NE(s.message().find("GemmMany: task 0's y overlaps task 0's x"), std::string::npos)
      << s.ToString();
  // Row 1's x starts where row 0's y (at column S - 2, 4 floats) ends: only T = 1 is clear.
  t[0].y = b + S - 2;
  s = cuda::GemmMany(t, 2, T);
  EXPECT_NE(s.message().find("task 0's y overlaps task 0's x"), std::string::npos) << s.ToString();
  ASSERT_OK(cuda::GemmMany(t, 2, 1));
  // Task 1 reads what task 0 writes (an in-place chain) and a single in-place Gemv.
  t[0].y = dy.as<float>();
  t[1].x = dy.as<float>();
  t[1].y = b + 64;
  s = cuda::GemmMany(t, 2, 1);
  EXPECT_NE(s.message().find("task 0's y overlaps task 1's x"), std::string::npos) << s.ToString();
  s = cuda::Gemv(w, b, b + 8);
  EXPECT_NE(s.message().find("Gemm: task 0's y overlaps task 0's x"), std::string::npos)
      << s.ToString();
  // The norm weight [cols] in a y.
  t[1] = {w, dx.as<float>(), S, b + 64, S};
  s = cuda::GemmMany(t, 2, T, dy.as<float>() + 2, 1e-6f);
  EXPECT_NE(s.message().find("task 0's y overlaps the norm weight"), std::string::npos)
      << s.ToString();
}

}  // namespace
}  // namespace fm
