#include "kernels/cpu/norm_rows.h"

#include <cmath>

#include "kernels/cpu/hc.h"

namespace fm {

void RmsNormWeighted_H(const float* x, const float* g, int64_t H, float eps, float* y) {
  const float r = RmsInv(x, H, eps);
  for (int64_t h = 0; h < H; ++h) y[h] = g[h] * (x[h] * r);
}

void RmsNormWeightedRef(const float* x, const float* g, int64_t H, double eps, float* y) {
  double ss = 0.0;
  for (int64_t h = 0; h < H; ++h) ss += static_cast<double>(x[h]) * x[h];
  const double r = 1.0 / std::sqrt(ss / static_cast<double>(H) + eps);
  for (int64_t h = 0; h < H; ++h) y[h] = static_cast<float>(g[h] * (x[h] * r));
}

}  // namespace fm
