// The weight-streaming kernels (kernels/cuda/gemv.cu, experts.cu) against the CPU references
// (MatvecRef, SwigluClampRef) and against themselves: a token's result has the same bits
// whatever T, the other tokens, the other tasks of a GemmMany or the other slots of an expert
// launch are. Device tests skip without a GPU; the argument checks run everywhere.
#include <gtest/gtest.h>

#include <cmath>
#include <limits>
#include <random>
#include <string>
#include <vector>

#include "kernels/cpu/matvec.h"
#include "kernels/cpu/swiglu.h"
#include "kernels/cuda/ops.h"
#include "tests/gpu/cuda_test_util.h"

namespace fm {
namespace {

using namespace cudatest;
using cuda::DeviceBuffer;

constexpr float kNaN = std::numeric_limits<float>::quiet_NaN();
const int64_t kTokenCounts[] = {1, 2, 3, 5, 8, 17, 32};

std::vector<float> Ref(const QWeight& w, const float* x) {
  std::vector<float> y(w.rows);
  MatvecRef(w, x, y.data());
  return y;
}

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

// A test run once on each weight core (the parameter), named by the core.
class WeightCoreTest : public ::testing::TestWithParam<cuda::WeightPath> {
 protected:
  WeightPathScope scope_{GetParam()};
};
std::string CoreName(const ::testing::TestParamInfo<cuda::WeightPath>& info) {
  return info.param == cuda::WeightPath::kFma ? "Fma" : "TensorCore";
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

// ---- experts ---------------------------------------------------------------------------------

// E routed FP4 experts w1, w3 [I, H], w2 [H, I] and an FP8 shared expert (Is), host and device.
struct Experts {
  int64_t E = 0, I = 0, H = 0, Is = 0;
  std::vector<HostWeight> w1, w3, w2;
  HostWeight s1, s3, s2;
  std::vector<cuda::DeviceWeight> d1, d3, d2;
  cuda::DeviceWeight ds1, ds3, ds2;
  DeviceBuffer p1, p3, p2, q1, q3, q2;  // device arrays of data / scale pointers

  cuda::DevExperts Set(const std::vector<cuda::DeviceWeight>& d, const DeviceBuffer& p,
                       const DeviceBuffer& q) const {
    return {d[0].format, d[0].rows, d[0].cols, E, p.as<const void* const>(),
            q.as<const uint8_t* const>()};
  }
  cuda::SharedExpert Shared() const { return {ds1.view(), ds3.view(), ds2.view()}; }
};

void UploadSet(const std::vector<HostWeight>& h, std::vector<cuda::DeviceWeight>* d,
               DeviceBuffer* datas, DeviceBuffer* scales) {
  std::vector<const void*> p;
  std::vector<const uint8_t*> q;
  for (const HostWeight& w : h) {
    auto u = cuda::UploadWeight(w.w);
    ASSERT_TRUE(u.ok()) << u.status().ToString();
    d->push_back(std::move(u).value());
    p.push_back(d->back().data.data());
    q.push_back(d->back().scale.as<const uint8_t>());
  }
  *datas = ToDevice(p);
  *scales = ToDevice(q);
}

cuda::DeviceWeight UploadOne(const HostWeight& h) {
  auto u = cuda::UploadWeight(h.w);
  EXPECT_TRUE(u.ok()) << u.status().ToString();
  return u.ok() ? std::move(u).value() : cuda::DeviceWeight();
}

void MakeExperts(Experts* x, std::mt19937& rng) {
  for (int64_t e = 0; e < x->E; ++e) {
    x->w1.push_back(RandomWeight(WeightFormat::kFP4Block32, x->I, x->H, rng));
    x->w3.push_back(RandomWeight(WeightFormat::kFP4Block32, x->I, x->H, rng));
    x->w2.push_back(RandomWeight(WeightFormat::kFP4Block32, x->H, x->I, rng));
  }
  x->s1 = RandomWeight(WeightFormat::kFP8Block, x->Is, x->H, rng);
  x->s3 = RandomWeight(WeightFormat::kFP8Block, x->Is, x->H, rng);
  x->s2 = RandomWeight(WeightFormat::kFP8Block, x->H, x->Is, rng);
  UploadSet(x->w1, &x->d1, &x->p1, &x->q1);
  UploadSet(x->w3, &x->d3, &x->p3, &x->q3);
  UploadSet(x->w2, &x->d2, &x->p2, &x->q2);
  x->ds1 = UploadOne(x->s1);
  x->ds3 = UploadOne(x->s3);
  x->ds2 = UploadOne(x->s2);
}

// h and contrib of T tokens (slots [T, k + 1]) from the two launches.
void RunExperts(const Experts& x, const std::vector<int32_t>& ids, int64_t T, int64_t k,
                const std::vector<float>& in, float limit, int64_t hs, std::vector<float>* h,
                std::vector<float>* c) {
  const cuda::SharedExpert sh = x.Shared();
  DeviceBuffer di = ids.empty() ? DeviceBuffer() : ToDevice(ids), dx = ToDevice(in);
  DeviceBuffer dh = ToDevice(std::vector<float>(T * (k + 1) * hs, -7.0f));
  DeviceBuffer dc = Zeros(T * (k + 1) * x.H);
  ASSERT_OK(cuda::ExpertsUpGate(x.Set(x.d1, x.p1, x.q1), x.Set(x.d3, x.p3, x.q3),
                                di.as<int32_t>(), T, k, dx.as<float>(), x.H, limit, &sh,
                                dh.as<float>(), hs));
  ASSERT_OK(cuda::ExpertsDown(x.Set(x.d2, x.p2, x.q2), di.as<int32_t>(), T, k, dh.as<float>(), hs,
                              &sh, dc.as<float>()));
  *h = ToHost(dh, T * (k + 1) * hs);
  *c = ToHost(dc, T * (k + 1) * x.H);
}

// Both launches against MatvecRef + SwigluClampRef for T = 1..32 with repeated experts and one
// id outside [0, E) (NaN rows); every slot has the bits of the same token run alone (T = 1).
// Routed FP4 and shared FP8 experts on either core.
class CudaExpertsPaths : public WeightCoreTest {};
INSTANTIATE_TEST_SUITE_P(Cores, CudaExpertsPaths, ::testing::ValuesIn(kWeightPaths), CoreName);

TEST_P(CudaExpertsPaths, UpGateAndDownMatchReferenceAndAreBatchIndependent) {
  if (cuda::DeviceCount() == 0) GTEST_SKIP() << "no CUDA device";
  std::mt19937 rng(61);
  Experts x;
  x.E = 5, x.I = 64, x.H = 96, x.Is = 80;
  MakeExperts(&x, rng);
  const int64_t k = 3, hs = 80, S = k + 1;
  const float limit = 2.0f;
  for (int64_t T : kTokenCounts) {
    std::uniform_int_distribution<int> pick(0, 4);
    std::vector<int32_t> ids(T * k);
    for (auto& e : ids) e = pick(rng);
    if (T > 1) ids[k + 1] = 9;  // token 1, slot 1: bad id
    const std::vector<float> in = RandomNormal(T * x.H, rng);
    std::vector<float> h, c;
    RunExperts(x, ids, T, k, in, limit, hs, &h, &c);
    for (int64_t t = 0; t < T; ++t) {
      const float* xt = in.data() + t * x.H;
      for (int64_t j = 0; j < S; ++j) {
        const int64_t s = t * S + j;
        const std::string what = "T " + std::to_string(T) + " slot " + std::to_string(s);
        const bool shared = j == k;
        const int32_t e = shared ? 0 : ids[t * k + j];
        std::vector<float> gh(h.begin() + s * hs, h.begin() + s * hs + (shared ? x.Is : x.I));
        std::vector<float> gc(c.begin() + s * x.H, c.begin() + (s + 1) * x.H);
        if (!shared && e >= x.E) {
          for (float v : gh) ASSERT_TRUE(std::isnan(v)) << what;
          for (float v : gc) ASSERT_TRUE(std::isnan(v)) << what;
          continue;
        }
        const std::vector<float> g = Ref(shared ? x.s1.w : x.w1[e].w, xt);
        const std::vector<float> u = Ref(shared ? x.s3.w : x.w3[e].w, xt);
        std::vector<float> want(g.size());
        SwigluClampRef(g.data(), u.data(), g.size(), limit, want.data());
        ExpectClose(gh, want, 1e-4, what + " h");
        ExpectClose(gc, Ref(shared ? x.s2.w : x.w2[e].w, gh.data()), 1e-4, what + " contrib");
      }
    }
    // The same tokens one at a time: the same bits (batch-composition independence).
    for (int64_t t = 0; t < T; ++t) {
      const std::vector<int32_t> id1(ids.begin() + t * k, ids.begin() + (t + 1) * k);
      const std::vector<float> in1(in.begin() + t * x.H, in.begin() + (t + 1) * x.H);
      std::vector<float> h1, c1;
      RunExperts(x, id1, 1, k, in1, limit, hs, &h1, &c1);
      for (int64_t i = 0; i < S * hs; ++i)
        ASSERT_TRUE(SameBits(h1[i], h[t * S * hs + i]) || (std::isnan(h1[i]) && std::isnan(h[t * S * hs + i])))
            << "T " << T << " t " << t << " h " << i;
      for (int64_t i = 0; i < S * x.H; ++i)
        ASSERT_TRUE(SameBits(c1[i], c[t * S * x.H + i]) || (std::isnan(c1[i]) && std::isnan(c[t * S * x.H + i])))
            << "T " << T << " t " << t << " contrib " << i;
    }
  }
}

// Eight tokens of one expert over wide rows (H = I = 1280): a pass of 8 slots whose x does not
// fit the tensor-core core's shared-memory stage (each lane splits its own x), against each
// token alone (staged): the same bits, in both launches.
TEST_P(CudaExpertsPaths, WideRowsOfManySlotsHaveTheirAloneBits) {
  if (cuda::DeviceCount() == 0) GTEST_SKIP() << "no CUDA device";
  std::mt19937 rng(67);
  Experts x;
  x.E = 1, x.I = 1280, x.H = 1280, x.Is = 128;
  MakeExperts(&x, rng);
  const int64_t T = 8, k = 1, S = k + 1, hs = x.I;
  const std::vector<int32_t> ids(T * k, 0);
  const std::vector<float> in = RandomNormal(T * x.H, rng);
  std::vector<float> h, c;
  RunExperts(x, ids, T, k, in, 2.0f, hs, &h, &c);
  for (int64_t t : {0, 5}) {
    const std::vector<float> in1(in.begin() + t * x.H, in.begin() + (t + 1) * x.H);
    std::vector<float> h1, c1;
    RunExperts(x, {0}, 1, k, in1, 2.0f, hs, &h1, &c1);
    for (int64_t j = 0; j < S; ++j) {  // the routed slot, then the shared one
      const int64_t rows = j < k ? x.I : x.Is;
      for (int64_t i = 0; i < rows; ++i)
        ASSERT_TRUE(SameBits(h1[j * hs + i], h[(t * S + j) * hs + i])) << "t " << t << " slot " << j << " h " << i;
      for (int64_t i = 0; i < x.H; ++i)
        ASSERT_TRUE(SameBits(c1[j * x.H + i], c[(t * S + j) * x.H + i])) << "t " << t << " slot " << j << " c " << i;
    }
  }
}

// A slot of ExpertsDown has the bits of Gemm with its expert's weight alone, at shapes where that
// Gemm takes one slice a row as the experts do (not at the real w2: ops.h).
TEST_P(CudaExpertsPaths, DownSlotEqualsGemmOfItsExpert) {
  if (cuda::DeviceCount() == 0) GTEST_SKIP() << "no CUDA device";
  std::mt19937 rng(3);
  Experts x;
  x.E = 3, x.I = 64, x.H = 96, x.Is = 64;
  MakeExperts(&x, rng);
  const int64_t T = 2, k = 2, hs = 64;
  const std::vector<int32_t> ids = {2, 0, 0, 1};
  const std::vector<float> hin = RandomNormal(T * (k + 1) * hs, rng);
  DeviceBuffer di = ToDevice(ids), dh = ToDevice(hin), dc = Zeros(T * (k + 1) * x.H), dy = Zeros(x.H);
  const cuda::SharedExpert sh = x.Shared();
  ASSERT_OK(cuda::ExpertsDown(x.Set(x.d2, x.p2, x.q2), di.as<int32_t>(), T, k, dh.as<float>(), hs,
                              &sh, dc.as<float>()));
  const std::vector<float> c = ToHost(dc, T * (k + 1) * x.H);
  for (int64_t s = 0; s < T * (k + 1); ++s) {
    const int64_t t = s / (k + 1), j = s % (k + 1);
    const QWeight w = j == k ? x.ds2.view() : x.d2[ids[t * k + j]].view();
    ASSERT_OK(cuda::Gemv(w, dh.as<float>() + s * hs, dy.as<float>()));
    const std::vector<float> y = ToHost(dy, x.H);
    for (int64_t r = 0; r < x.H; ++r) ASSERT_TRUE(SameBits(c[s * x.H + r], y[r])) << "slot " << s << " r " << r;
  }
}

// k = 0 with the shared expert (the EP path): only the shared slots; MoeCombine adds the shared
// row of [T, k + 1, H] contributions last.
TEST_P(CudaExpertsPaths, SharedOnlyAndCombineWithSharedRow) {
  if (cuda::DeviceCount() == 0) GTEST_SKIP() << "no CUDA device";
  std::mt19937 rng(17);
  Experts x;
  x.E = 2, x.I = 64, x.H = 96, x.Is = 80;
  MakeExperts(&x, rng);
  const int64_t T = 3, hs = 80;
  const std::vector<float> in = RandomNormal(T * x.H, rng);
  std::vector<float> h, c;
  RunExperts(x, {}, T, 0, in, std::numeric_limits<float>::infinity(), hs, &h, &c);
  for (int64_t t = 0; t < T; ++t) {
    const std::vector<float> g = Ref(x.s1.w, in.data() + t * x.H), u = Ref(x.s3.w, in.data() + t * x.H);
    std::vector<float> want(x.Is);
    SwigluClampRef(g.data(), u.data(), x.Is, 0.0, want.data());
    ExpectClose(std::vector<float>(h.begin() + t * hs, h.begin() + t * hs + x.Is), want, 1e-4, "shared h");
  }
  const int64_t k = 2, H = 16;
  const std::vector<float> contrib = RandomNormal(T * (k + 1) * H, rng), w = RandomNormal(T * k, rng);
  DeviceBuffer dc = ToDevice(contrib), dw = ToDevice(w), dy = Zeros(T * H);
  ASSERT_OK(cuda::MoeCombine(dc.as<float>(), dw.as<float>(), T, k, H, dy.as<float>(), true));
  const std::vector<float> y = ToHost(dy, T * H);
  for (int64_t t = 0; t < T; ++t)
    for (int64_t i = 0; i < H; ++i) {
      float want = 0.0f;
      for (int64_t j = 0; j < k; ++j) want += w[t * k + j] * contrib[(t * (k + 1) + j) * H + i];
      want += contrib[(t * (k + 1) + k) * H + i];
      EXPECT_NEAR(y[t * H + i], want, 1e-5f * (1.0f + std::fabs(want))) << t << " " << i;
    }
}

TEST(CudaArgs, ExpertsRejectBadArguments) {
  std::vector<uint8_t> bytes(4096);
  float* f = reinterpret_cast<float*>(bytes.data());
  const void* const* p = reinterpret_cast<const void* const*>(bytes.data());
  const uint8_t* const* q = reinterpret_cast<const uint8_t* const*>(bytes.data());
  const int32_t* ids = reinterpret_cast<const int32_t*>(bytes.data());
  const cuda::DevExperts w{WeightFormat::kFP4Block32, 64, 96, 4, p, q};
  cuda::DevExperts bad = w;
  bad.cols = 80;
  Status s = cuda::ExpertsUpGate(bad, bad, ids, 1, 2, f, 96, 1.0f, nullptr, f, 64);
  EXPECT_NE(s.message().find("ExpertsUpGate w1: FP4 block32 weight [64, 80]: cols must be a multiple of 32"),
            std::string::npos) << s.ToString();
  bad = w;
  bad.rows = 32;
  s = cuda::ExpertsUpGate(w, bad, ids, 1, 2, f, 96, 1.0f, nullptr, f, 64);
  EXPECT_NE(s.message().find("w3 differs from w1"), std::string::npos) << s.ToString();
  s = cuda::ExpertsUpGate(w, w, nullptr, 1, 2, f, 96, 1.0f, nullptr, f, 64);
  EXPECT_NE(s.message().find("ids must be a device pointer"), std::string::npos) << s.ToString();
  s = cuda::ExpertsUpGate(w, w, ids, 1, 2, f, 96, 0.0f, nullptr, f, 64);
  EXPECT_NE(s.message().find("limit must be > 0"), std::string::npos) << s.ToString();
  s = cuda::ExpertsUpGate(w, w, ids, 1, 2, f, 96, 1.0f, nullptr, f, 32);
  EXPECT_NE(s.message().find("output stride 32 < 64 rows"), std::string::npos) << s.ToString();
  s = cuda::ExpertsUpGate(w, w, ids, 1, 0, f, 96, 1.0f, nullptr, f, 64);
  EXPECT_NE(s.message().find("k 0 and no shared expert"), std::string::npos) << s.ToString();
  s = cuda::ExpertsDown(w, ids, 2, 2, f, 32, nullptr, f);
  EXPECT_NE(s.message().find("x rows of 32 floats for 96 columns"), std::string::npos) << s.ToString();
  const cuda::SharedExpert sh{{WeightFormat::kFP8Block, 64, 128, bytes.data(), bytes.data()},
                              {WeightFormat::kFP8Block, 64, 128, bytes.data(), bytes.data()},
                              {WeightFormat::kFP8Block, 96, 64, bytes.data(), bytes.data()}};
  s = cuda::ExpertsUpGate(w, w, ids, 1, 2, f, 96, 1.0f, &sh, f, 64);
  EXPECT_NE(s.message().find("shared expert cols 128 != routed cols 96"), std::string::npos) << s.ToString();
  s = cuda::ExpertsUpGate(w, w, ids, -1, 2, f, 96, 1.0f, nullptr, f, 64);
  EXPECT_NE(s.message().find("tokens -1"), std::string::npos) << s.ToString();
}

}  // namespace
}  // namespace fm
