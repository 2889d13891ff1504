#include "kernels/cpu/rmsnorm.h"

#include <cmath>

namespace fm {

void RmsNormRows_rd(const float* x, const float* g, int64_t rows, int64_t dim, float eps, float* y) {
  for (int64_t r = 0; r < rows; ++r) {
    const float* xr = x + r * dim;
    float* yr = y + r * dim;
    double ss = 0.0;
    for (int64_t i = 0; i < dim; ++i) ss += static_cast<double>(xr[i]) * xr[i];
    // Like HF: the mean in f32, then rsqrt(mean + eps) in f32, then weight * normalized.
    const float mean = static_cast<float>(ss / static_cast<double>(dim));
    const float inv = 1.0f / std::sqrt(mean + eps);
    if (g) {
      for (int64_t i = 0; i < dim; ++i) yr[i] = g[i] * (xr[i] * inv);
    } else {
      for (int64_t i = 0; i < dim; ++i) yr[i] = xr[i] * inv;
    }
  }
}

}  // namespace fm
