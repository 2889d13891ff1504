// Matmul (the optimized keep-quant kernels) against MatvecRef, and its determinism contract.
#include <gtest/gtest.h>

#include <cmath>
#include <cstring>
#include <limits>
#include <random>
#include <vector>

#include "common/membw.h"
#include "common/numfmt.h"
#include "common/thread_pool.h"
#include "kernels/cpu/matvec.h"

namespace fm {
namespace {

// A weight with its own storage.
struct OwnedWeight {
  QWeight w;
  std::vector<uint8_t> data, scale;
  void Bind() {
    w.data = data.data();
    w.scale = scale.empty() ? nullptr : scale.data();
  }
};

// Well-scaled random values: N(0, 0.05) for F32/BF16; every non-NaN e4m3 code (subnormals
// and +-448 included) and every e2m1 code, with e8m0 scales 2^-12 .. 2^-4.
OwnedWeight MakeWeight(WeightFormat f, int64_t rows, int64_t cols, uint32_t seed) {
  std::mt19937 rng(seed);
  std::normal_distribution<float> normal(0.0f, 0.05f);
  std::uniform_int_distribution<int> scale_exp(127 - 12, 127 - 4), byte(0, 255);
  OwnedWeight o;
  o.w.format = f;
  o.w.rows = rows;
  o.w.cols = cols;
  const size_t n = static_cast<size_t>(rows * cols);
  switch (f) {
    case WeightFormat::kF32:
      o.data.resize(n * 4);
      for (size_t i = 0; i < n; ++i) {
        const float v = normal(rng);
        std::memcpy(&o.data[i * 4], &v, 4);
      }
      break;
    case WeightFormat::kBF16:
      o.data.resize(n * 2);
      for (size_t i = 0; i < n; ++i) {
        const uint16_t h = F32ToBf16(normal(rng));
        std::memcpy(&o.data[i * 2], &h, 2);
      }
      break;
    case WeightFormat::kFP8Block:
      o.data.resize(n);
      for (auto& b : o.data) {
        b = static_cast<uint8_t>(byte(rng));
        if ((b & 0x7F) == 0x7F) b ^= 1;  // no NaN codes
      }
      o.scale.resize(static_cast<size_t>((rows + 127) / 128 * ((cols + 127) / 128)));
      for (auto& s : o.scale) s = static_cast<uint8_t>(scale_exp(rng));
      break;
    case WeightFormat::kFP4Block32:
      o.data.resize(n / 2);
      for (auto& b : o.data) b = static_cast<uint8_t>(byte(rng));
      o.scale.resize(static_cast<size_t>(rows * (cols / 32)));
      for (auto& s : o.scale) s = static_cast<uint8_t>(scale_exp(rng));
      break;
  }
  o.Bind();
  return o;
}

// The same weight with every element replaced by its absolute value (sign bits cleared).
OwnedWeight AbsWeight(const OwnedWeight& in) {
  OwnedWeight o = in;
  switch (in.w.format) {
    case WeightFormat::kF32:
      for (size_t i = 3; i < o.data.size(); i += 4) o.data[i] &= 0x7F;
      break;
    case WeightFormat::kBF16:
      for (size_t i = 1; i < o.data.size(); i += 2) o.data[i] &= 0x7F;
      break;
    case WeightFormat::kFP8Block:
      for (auto& b : o.data) b &= 0x7F;
      break;
    case WeightFormat::kFP4Block32:
      for (auto& b : o.data) b &= 0x77;
      break;
  }
  o.Bind();
  return o;
}

std::vector<float> RandomInputs(int64_t n, uint32_t seed) {
  std::mt19937 rng(seed);
  std::normal_distribution<float> normal(0.0f, 1.0f);
  std::vector<float> x(static_cast<size_t>(n));
  for (auto& v : x) v = normal(rng);
  return x;
}

std::vector<float> RunMatmul(const QWeight& w, const std::vector<float>& x, int64_t T,
                       ThreadPool* pool) {
  std::vector<float> y(static_cast<size_t>(T * w.rows), -1.0f);
  Matmul(w, x.data(), T, y.data(), pool);
  return y;
}

// Every output within 1e-5 of the reference, relative to sum_c |W[r,c] x[c]| (the scale of
// its float summation error, fair to outputs that cancel to ~0) and to the largest output.
void ExpectMatchesRef(const OwnedWeight& o, int64_t T, ThreadPool* pool) {
  const QWeight& w = o.w;
  const OwnedWeight abs_w = AbsWeight(o);
  const auto x = RandomInputs(T * w.cols, 7);
  const auto y = RunMatmul(w, x, T, pool);
  std::vector<float> ref(static_cast<size_t>(w.rows)), bound(static_cast<size_t>(w.rows));
  for (int64_t t = 0; t < T; ++t) {
    std::vector<float> xt(x.begin() + t * w.cols, x.begin() + (t + 1) * w.cols);
    MatvecRef(w, xt.data(), ref.data());
    for (auto& v : xt) v = std::fabs(v);
    MatvecRef(abs_w.w, xt.data(), bound.data());
    double max_ref = 0.0;
    for (float v : ref) max_ref = std::max(max_ref, std::fabs(static_cast<double>(v)));
    ASSERT_GT(max_ref, 0.0);
    for (int64_t r = 0; r < w.rows; ++r) {
      const double err = std::fabs(static_cast<double>(y[t * w.rows + r]) - ref[r]);
      ASSERT_LE(err, 1e-5 * bound[r]) << "t=" << t << " r=" << r << " y=" << y[t * w.rows + r]
                                      << " ref=" << ref[r];
      ASSERT_LE(err, 1e-5 * max_ref) << "t=" << t << " r=" << r;
    }
  }
}

const WeightFormat kFormats[] = {WeightFormat::kF32, WeightFormat::kBF16,
                                 WeightFormat::kFP8Block, WeightFormat::kFP4Block32};

TEST(Matmul, EachFormatMatchesRef) {
  ThreadPool pool(2);
  for (WeightFormat f : kFormats) {
    SCOPED_TRACE(static_cast<int>(f));
    const auto o = MakeWeight(f, 256, 1024, 1);
    ExpectMatchesRef(o, 1, &pool);
    ExpectMatchesRef(o, 5, &pool);
  }
}

TEST(Matmul, Fp8PartialEdgeBlocks) {
  ThreadPool pool(2);
  // rows and cols not multiples of 128 (partial scale blocks on both edges), cols not a
  // multiple of 16 (partial last chunk), and a matrix smaller than one block.
  const int64_t shapes[][2] = {{200, 300}, {129, 1000}, {130, 129}, {5, 7}, {1, 1}};
  for (const auto& s : shapes) {
    SCOPED_TRACE(std::to_string(s[0]) + "x" + std::to_string(s[1]));
    const auto o = MakeWeight(WeightFormat::kFP8Block, s[0], s[1], 2);
    ExpectMatchesRef(o, 1, &pool);
    ExpectMatchesRef(o, 6, &pool);
  }
}

TEST(Matmul, ColsNotMultipleOf128) {
  ThreadPool pool(3);
  for (int64_t cols : {33, 100, 200}) {
    SCOPED_TRACE(cols);
    ExpectMatchesRef(MakeWeight(WeightFormat::kF32, 67, cols, 3), 3, &pool);
    ExpectMatchesRef(MakeWeight(WeightFormat::kBF16, 67, cols, 4), 3, &pool);
  }
  for (int64_t cols : {32, 96, 160}) {
    SCOPED_TRACE(cols);
    ExpectMatchesRef(MakeWeight(WeightFormat::kFP4Block32, 67, cols, 5), 1, &pool);
    ExpectMatchesRef(MakeWeight(WeightFormat::kFP4Block32, 67, cols, 5), 9, &pool);
  }
}

// One row of 32 FP4 inputs by hand: byte j holds element 2j in its LOW nibble. With one-hot
// inputs each output is exactly one decoded weight, so the nibble order and the e2m1 table
// are checked value by value.
TEST(Matmul, Fp4NibbleOrderHandBuilt) {
  const float kE2m1[16] = {0, .5f, 1, 1.5f, 2, 3, 4, 6, -0.f, -.5f, -1, -1.5f, -2, -3, -4, -6};
  OwnedWeight o;
  o.w.format = WeightFormat::kFP4Block32;
  o.w.rows = 1;
  o.w.cols = 32;
  o.data.resize(16);
  for (int j = 0; j < 16; ++j) o.data[j] = static_cast<uint8_t>(j | ((15 - j) << 4));
  o.scale = {127 + 1};  // x2
  o.Bind();
  for (int c = 0; c < 32; ++c) {
    std::vector<float> x(32, 0.0f);
    x[c] = 1.0f;
    float y = 0.0f;
    Matmul(o.w, x.data(), 1, &y, nullptr);
    const int nibble = (c % 2 == 0) ? c / 2 : 15 - c / 2;
    EXPECT_EQ(y, 2.0f * kE2m1[nibble]) << "input " << c;
  }
  // The byte 0x21 alone: element 0 = 0.5 (nibble 1), element 1 = 1.0 (nibble 2).
  o.data.assign(16, 0);
  o.data[0] = 0x21;
  o.scale = {127};
  o.Bind();
  std::vector<float> x(32, 0.0f);
  x[0] = 1.0f;
  x[1] = 10.0f;
  float y = 0.0f;
  Matmul(o.w, x.data(), 1, &y, nullptr);
  EXPECT_EQ(y, 0.5f + 10.0f);
}

// Every e8m0 scale byte from 0 (2^-127, subnormal) to 252 (the largest for which 6 * S is
// finite: beyond, inf * 0 from the other inputs makes the sum NaN, as in the reference) times
// every e2m1 code, one row per scale: decoded FP4 weights equal Fp4ToF32(n) * E8m0ToF32(s).
TEST(Matmul, Fp4DecodeExactEveryScale) {
  OwnedWeight o;
  o.w.format = WeightFormat::kFP4Block32;
  o.w.rows = 253;
  o.w.cols = 32;
  for (int r = 0; r < 253; ++r) {
    for (int j = 0; j < 16; ++j) o.data.push_back(static_cast<uint8_t>(j | ((15 - j) << 4)));
    o.scale.push_back(static_cast<uint8_t>(r));
  }
  o.Bind();
  std::vector<float> y(253);
  for (int c = 0; c < 32; ++c) {
    std::vector<float> x(32, 0.0f);
    x[c] = 1.0f;
    Matmul(o.w, x.data(), 1, y.data(), nullptr);
    const int nibble = (c % 2 == 0) ? c / 2 : 15 - c / 2;
    for (int r = 0; r < 253; ++r)
      EXPECT_EQ(y[r], Fp4ToF32(static_cast<uint8_t>(nibble)) * E8m0ToF32(static_cast<uint8_t>(r)))
          << "input " << c << " scale byte " << r;
  }
}

// One-hot inputs make each output one decoded weight: FP8 decoding equals the
// reference for every non-NaN code, including scales >= 2^8 (the two-multiply path) and
// tiny scales (subnormal products).
TEST(Matmul, Fp8DecodeBitExactAllCodes) {
  for (uint8_t scale : {uint8_t{127 - 9}, uint8_t{127}, uint8_t{127 + 8}, uint8_t{127 + 100},
                        uint8_t{1}}) {
    OwnedWeight o;
    o.w.format = WeightFormat::kFP8Block;
    o.w.rows = 256;
    o.w.cols = 1;
    for (int c = 0; c < 256; ++c) o.data.push_back(static_cast<uint8_t>(c));
    o.scale = {scale, scale};
    o.Bind();
    const float x = 1.0f;
    std::vector<float> y(256);
    Matmul(o.w, &x, 1, y.data(), nullptr);
    for (int c = 0; c < 256; ++c) {
      if ((c & 0x7F) == 0x7F) continue;  // NaN codes: documented deviation
      const float want = E4m3ToF32(static_cast<uint8_t>(c)) * E8m0ToF32(scale);
      // == : the sum starts at +0, so -0 (code 0x80) comes out as +0; all else bit-exact.
      EXPECT_EQ(y[c], want) << "code " << c << " scale " << int(scale);
    }
  }
}

// The reduction-order contract (matvec.cpp) written out: 16 lane sums, chunk j in increasing
// order, one fma per weight with the reference's weight e4m3 * S, then the fixed lane tree.
std::vector<float> Fp8OrderRef(const OwnedWeight& o, const std::vector<float>& x) {
  const QWeight& w = o.w;
  const int64_t cb = (w.cols + 127) / 128;
  std::vector<float> y(static_cast<size_t>(w.rows));
  for (int64_t r = 0; r < w.rows; ++r) {
    float acc[16] = {};
    for (int64_t c = 0; c < w.cols; ++c) {
      const float wr = E4m3ToF32(o.data[r * w.cols + c]) * E8m0ToF32(o.scale[(r / 128) * cb + c / 128]);
      acc[c % 16] = std::fma(wr, x[c], acc[c % 16]);
    }
    for (int width = 8; width > 0; width /= 2)
      for (int l = 0; l < width; ++l) acc[l] = acc[l] + acc[l + width];
    y[r] = acc[0];
  }
  return y;
}

// FP8's fast decode (x scaled by the block factor instead of every weight) gives the bits of
// the plain order, for ordinary, tiny and huge scales and for x that forces the fallback
// (subnormal, huge, zero, inf).
TEST(Matmul, Fp8ScaledInputsBitIdenticalToTheReductionOrder) {
  const std::vector<std::vector<uint8_t>> scale_sets = {
      {129, 118, 125, 119}, {1, 2, 127 - 100, 3}, {127 + 100, 127 + 120, 254, 127 + 2}};
  std::mt19937 rng(11);
  std::uniform_int_distribution<int> byte(0, 255);
  for (const auto& scales : scale_sets)
    for (int xcase = 0; xcase < 5; ++xcase) {
      OwnedWeight o;
      o.w.format = WeightFormat::kFP8Block;
      o.w.rows = 256;
      o.w.cols = 256;   // 2 x 2 blocks
      for (int64_t i = 0; i < o.w.rows * o.w.cols; ++i) {
        int b = byte(rng);
        if ((b & 0x7F) == 0x7F) b ^= 1;   // no NaN codes
        o.data.push_back(static_cast<uint8_t>(b));
      }
      for (int64_t r = 0; r < o.w.rows; ++r) o.data[r * o.w.cols + 200] = 0x30;   // e4m3 0.5
      o.scale = scales;
      o.Bind();
      std::vector<float> x = RandomInputs(o.w.cols, 5 + xcase);
      if (xcase == 1) x[17] = 1e-41f;            // subnormal
      if (xcase == 2) x[200] = std::ldexp(1.0f, 125);   // x * 2^10 overflows, 0.5 * 2^2 * x not
      if (xcase == 3) x[3] = 0.0f, x[250] = std::numeric_limits<float>::infinity();
      if (xcase == 4)   // x * 2^-118 is subnormal (inexact); each product stays on the grid
        for (auto& v : x) v = std::ldexp(1.0f + std::fabs(v) * 0.3f, -9);
      const auto want = Fp8OrderRef(o, x);
      const auto got = RunMatmul(o.w, x, 1, nullptr);
      for (int64_t r = 0; r < o.w.rows; ++r) {
        if (std::isnan(want[r])) {
          EXPECT_TRUE(std::isnan(got[r])) << "row " << r;
          continue;
        }
        EXPECT_EQ(std::memcmp(&got[r], &want[r], 4), 0)
            << "row " << r << " x case " << xcase << " scale " << int(scales[0]) << ": " << got[r]
            << " vs " << want[r];
      }
    }
}

TEST(Matmul, Fp8NanScaleGivesNan) {
  auto o = MakeWeight(WeightFormat::kFP8Block, 130, 256, 6);
  o.scale[1] = 255;  // row block 0, column block 1
  o.Bind();
  const auto y = RunMatmul(o.w, RandomInputs(256, 1), 1, nullptr);
  EXPECT_TRUE(std::isnan(y[0]));
  EXPECT_TRUE(std::isnan(y[127]));
  EXPECT_FALSE(std::isnan(y[128]));
}

TEST(Matmul, ThreadCountBitIdentical) {
  ThreadPool p1(1), p2(2), p3(3);
  for (WeightFormat f : kFormats) {
    SCOPED_TRACE(static_cast<int>(f));
    const auto o = MakeWeight(f, 333, 640, 8);
    for (int64_t T : {1, 7}) {
      const auto x = RandomInputs(T * 640, 9);
      const auto y0 = RunMatmul(o.w, x, T, nullptr);
      for (ThreadPool* p : {&p1, &p2, &p3}) {
        const auto y = RunMatmul(o.w, x, T, p);
        EXPECT_EQ(std::memcmp(y.data(), y0.data(), y.size() * 4), 0)
            << "T=" << T << " threads=" << p->size();
      }
    }
  }
}

// One MatmulMany over products of every format, shape and batch size (a zero-row product
// and an invalid FP4 one among them) gives each the bits of its own Matmul.
TEST(Matmul, ManyBitIdenticalToEachAlone) {
  ThreadPool pool(2);
  std::vector<OwnedWeight> ws;
  std::vector<int64_t> Ts;
  uint32_t seed = 20;
  for (WeightFormat f : kFormats)
    for (int64_t T : {1, 5}) {
      ws.push_back(MakeWeight(f, 131 + 4 * T, 256, seed++));
      Ts.push_back(T);
    }
  ws.push_back(MakeWeight(WeightFormat::kFP8Block, 0, 256, seed++));
  Ts.push_back(3);
  ws.push_back(MakeWeight(WeightFormat::kFP4Block32, 9, 64, seed++));
  ws.back().w.cols = 48;  // not a multiple of 32: NaN, as Matmul gives
  Ts.push_back(1);
  std::vector<std::vector<float>> xs, ys;
  std::vector<MatmulJob> jobs;
  for (size_t i = 0; i < ws.size(); ++i) {
    xs.push_back(RandomInputs(Ts[i] * ws[i].w.cols, 30 + static_cast<uint32_t>(i)));
    ys.emplace_back(static_cast<size_t>(Ts[i] * ws[i].w.rows), -1.0f);
  }
  for (size_t i = 0; i < ws.size(); ++i) jobs.push_back({&ws[i].w, xs[i].data(), Ts[i], ys[i].data()});
  MatmulMany(jobs, &pool);
  for (size_t i = 0; i < ws.size(); ++i) {
    const auto alone = RunMatmul(ws[i].w, xs[i], Ts[i], nullptr);
    ASSERT_EQ(alone.size(), ys[i].size());
    EXPECT_TRUE(alone.empty() || std::memcmp(alone.data(), ys[i].data(), alone.size() * 4) == 0)
        << "product " << i;
  }
  EXPECT_TRUE(std::isnan(ys.back()[0]));
}

// Row 3 of a batch of 7 is bit-identical to that row alone (and so is every other row), for
// every format and for shapes with partial tiles, blocks and chunks.
TEST(Matmul, BatchRowsBitIdenticalToAlone) {
  ThreadPool pool(2);
  const int64_t T = 7;
  for (WeightFormat f : kFormats) {
    const int64_t cols = f == WeightFormat::kFP4Block32 ? 352 : 345;
    SCOPED_TRACE(static_cast<int>(f));
    const auto o = MakeWeight(f, 131, cols, 10);
    const auto x = RandomInputs(T * cols, 11);
    const auto yb = RunMatmul(o.w, x, T, &pool);
    for (int64_t t = 0; t < T; ++t) {
      const std::vector<float> xt(x.begin() + t * cols, x.begin() + (t + 1) * cols);
      const auto y1 = RunMatmul(o.w, xt, 1, &pool);
      EXPECT_EQ(std::memcmp(y1.data(), yb.data() + t * o.w.rows, y1.size() * 4), 0)
          << "batch row " << t;
    }
    // The same row inside a batch of a different size.
    const std::vector<float> x3(x.begin() + 3 * cols, x.begin() + 5 * cols);
    const auto y2 = RunMatmul(o.w, x3, 2, &pool);
    EXPECT_EQ(std::memcmp(y2.data(), yb.data() + 3 * o.w.rows, o.w.rows * 4), 0);
  }
}

// Small integers: every product and partial sum is exact in f32, so the result is exact.
TEST(Matmul, F32ExactSmallCase) {
  const float w[3 * 5] = {1, 2, 3, 4, 5, -1, 0, 1, 0, -1, 10, 20, 30, 40, 50};
  const float x[2 * 5] = {1, 1, 1, 1, 1, 5, 4, 3, 2, 1};
  QWeight q;
  q.format = WeightFormat::kF32;
  q.rows = 3;
  q.cols = 5;
  q.data = w;
  float y[6];
  Matmul(q, x, 2, y, nullptr);
  const float want[6] = {15, -1, 150, 35, -3, 350};
  for (int i = 0; i < 6; ++i) EXPECT_EQ(y[i], want[i]) << i;
}

TEST(Matmul, Fp4ColsNotMultipleOf32IsNan) {
  OwnedWeight o;
  o.w.format = WeightFormat::kFP4Block32;
  o.w.rows = 2;
  o.w.cols = 48;
  o.data.assign(48, 0x11);
  o.scale.assign(4, 127);
  o.Bind();
  const auto y = RunMatmul(o.w, std::vector<float>(48, 1.0f), 1, nullptr);
  EXPECT_TRUE(std::isnan(y[0]));
  EXPECT_TRUE(std::isnan(y[1]));
}

TEST(MemBandwidth, ProbeMeasuresSomething) {
  ThreadPool pool(2);
  const double gbps = MeasureReadBandwidthGBps(&pool, 64u << 20);
  EXPECT_GT(gbps, 0.5);
  EXPECT_LT(gbps, 10000.0);
  EXPECT_EQ(MeasureReadBandwidthGBps(nullptr, 100), 0.0);  // less than one page
}

}  // namespace
}  // namespace fm
