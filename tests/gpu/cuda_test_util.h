// Helpers shared by the CUDA kernel tests: host <-> device copies and a tolerance check.
#pragma once
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <random>
#include <string>
#include <vector>

#include "common/numfmt.h"
#include "common/tensor.h"
#include "kernels/cpu/matvec.h"
#include "kernels/cuda/device.h"
#include "kernels/cuda/ops.h"

namespace fm {
namespace cudatest {

using cuda::DeviceBuffer;

#define ASSERT_OK(expr)                                  \
  do {                                                   \
    const ::fm::Status st_ = (expr);                     \
    ASSERT_TRUE(st_.ok()) << #expr << ": " << st_.ToString(); \
  } while (0)

template <typename T>
inline DeviceBuffer ToDevice(const std::vector<T>& v) {
  auto r = cuda::Upload(v.data(), v.size() * sizeof(T));
  EXPECT_TRUE(r.ok()) << r.status().ToString();
  return r.ok() ? std::move(r).value() : DeviceBuffer();
}

inline std::vector<float> ToHost(const DeviceBuffer& b, size_t n) {
  std::vector<float> v(n);
  const Status s = b.CopyToHost(v.data(), n * sizeof(float));
  EXPECT_TRUE(s.ok()) << s.ToString();
  return v;
}

inline bool SameBits(float a, float b) { return std::memcmp(&a, &b, 4) == 0; }

// |got - want| <= rel * max(|want_i|, rms(want)) elementwise; NaN must meet NaN.
inline void ExpectClose(const std::vector<float>& got, const std::vector<float>& want, double rel,
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

inline std::vector<float> RandomNormal(size_t n, std::mt19937& rng, float sigma = 1.0f) {
  std::normal_distribution<float> d(0.0f, sigma);
  std::vector<float> v(n);
  for (auto& x : v) x = d(rng);
  return v;
}

inline DeviceBuffer Zeros(size_t floats) {
  auto r = DeviceBuffer::Alloc(floats * sizeof(float));
  EXPECT_TRUE(r.ok()) << r.status().ToString();
  return r.ok() ? std::move(r).value() : DeviceBuffer();
}

inline std::vector<uint8_t> RandomScales(size_t n, std::mt19937& rng) {
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

inline HostWeight RandomWeight(WeightFormat format, int64_t rows, int64_t cols, std::mt19937& rng) {
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

// The core for FP8/FP4 weights (ops.h SetWeightPath) for the rest of a scope, then the one
// before it again.
class WeightPathScope {
 public:
  explicit WeightPathScope(cuda::WeightPath path) : old_(cuda::GetWeightPath()) {
    cuda::SetWeightPath(path);
  }
  ~WeightPathScope() { cuda::SetWeightPath(old_); }
  WeightPathScope(const WeightPathScope&) = delete;
  WeightPathScope& operator=(const WeightPathScope&) = delete;

 private:
  cuda::WeightPath old_;
};
inline const cuda::WeightPath kWeightPaths[] = {cuda::WeightPath::kFma,
                                                cuda::WeightPath::kTensorCore};
inline std::string PathName(cuda::WeightPath p) {
  return p == cuda::WeightPath::kFma ? "fma" : "tensor-core";
}
// A test run once on each weight core (the parameter), named by the core.
class WeightCoreTest : public ::testing::TestWithParam<cuda::WeightPath> {
 protected:
  WeightPathScope scope_{GetParam()};
};
inline std::string CoreName(const ::testing::TestParamInfo<cuda::WeightPath>& info) {
  return info.param == cuda::WeightPath::kFma ? "Fma" : "TensorCore";
}

// The token counts of the weight-streaming tests (T = 1..32), and y = W x by MatvecRef.
inline const int64_t kTokenCounts[] = {1, 2, 3, 5, 8, 17, 32};
inline std::vector<float> Ref(const QWeight& w, const float* x) {
  std::vector<float> y(w.rows);
  MatvecRef(w, x, y.data());
  return y;
}

// Launch overlap (ops.h SetLaunchOverlap) for the rest of a scope, then the setting before it.
class LaunchOverlapScope {
 public:
  explicit LaunchOverlapScope(bool on) : old_(cuda::GetLaunchOverlap()) {
    cuda::SetLaunchOverlap(on);
  }
  ~LaunchOverlapScope() { cuda::SetLaunchOverlap(old_); }
  LaunchOverlapScope(const LaunchOverlapScope&) = delete;
  LaunchOverlapScope& operator=(const LaunchOverlapScope&) = delete;

 private:
  bool old_;
};

}  // namespace cudatest
}  // namespace fm
