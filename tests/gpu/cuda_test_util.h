// Helpers shared by the CUDA kernel tests: host <-> device copies and a tolerance check.
#pragma once
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <random>
#include <string>
#include <vector>

#include "kernels/cuda/device.h"

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

}  // namespace cudatest
}  // namespace fm
