#include "kernels/cpu/rope.h"

#include <algorithm>
#include <cmath>

namespace fm {

std::vector<float> RopeInvFreqDefault(double theta, int64_t rd) {
  std::vector<float> f(static_cast<size_t>(rd / 2));
  for (int64_t i = 0; i < rd / 2; ++i) {
    const float expo = static_cast<float>(2 * i) / static_cast<float>(rd);
    const float base_pow = static_cast<float>(std::pow(theta, static_cast<double>(expo)));
    f[i] = 1.0f / base_pow;
  }
  return f;
}

std::vector<float> RopeInvFreqYarn(double theta, int64_t rd, double factor, double beta_fast,
                                   double beta_slow, int64_t original_max_pos) {
  const double pi = 3.14159265358979323846;
  auto corr = [&](double rotations) {
    return static_cast<double>(rd) * std::log(static_cast<double>(original_max_pos) /
                                              (rotations * 2.0 * pi)) /
           (2.0 * std::log(theta));
  };
  const double lo = std::max(std::floor(corr(beta_fast)), 0.0);
  double hi = std::min(std::ceil(corr(beta_slow)), static_cast<double>(rd - 1));
  if (lo == hi) hi += 0.001;
  const float lo_f = static_cast<float>(lo), span_f = static_cast<float>(hi - lo);
  std::vector<float> f(static_cast<size_t>(rd / 2));
  for (int64_t i = 0; i < rd / 2; ++i) {
    const float expo = static_cast<float>(2 * i) / static_cast<float>(rd);
    const float base_pow = static_cast<float>(std::pow(theta, static_cast<double>(expo)));
    const float extrapolated = 1.0f / base_pow;
    const float interpolated = 1.0f / (static_cast<float>(factor) * base_pow);
    const float ramp = std::clamp((static_cast<float>(i) - lo_f) / span_f, 0.0f, 1.0f);
    const float keep = 1.0f - ramp;  // HF's inv_freq_extrapolation_factor
    f[i] = interpolated * (1.0f - keep) + extrapolated * keep;
  }
  return f;
}

void RopeRows_nd(float* x, int64_t n, int64_t dim, int64_t rd, int64_t pos, const float* inv_freq,
                 bool inverse) {
  const int64_t half = rd / 2;
  float cs[kRopeMaxDim / 2], sn[kRopeMaxDim / 2];  // rd <= kRopeMaxDim: checked at bind time
  for (int64_t i = 0; i < half; ++i) {
    const float angle = static_cast<float>(pos) * inv_freq[i];  // f32 product, as HF
    cs[i] = static_cast<float>(std::cos(static_cast<double>(angle)));
    const float s = static_cast<float>(std::sin(static_cast<double>(angle)));
    sn[i] = inverse ? -s : s;
  }
  for (int64_t r = 0; r < n; ++r) {
    float* p = x + r * dim + (dim - rd);
    for (int64_t i = 0; i < half; ++i) {
      const float a = p[2 * i], b = p[2 * i + 1];
      p[2 * i] = a * cs[i] + (-b) * sn[i];
      p[2 * i + 1] = b * cs[i] + a * sn[i];
    }
  }
}

}  // namespace fm
