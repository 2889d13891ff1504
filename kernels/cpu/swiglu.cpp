#include "kernels/cpu/swiglu.h"

#include <algorithm>
#include <cmath>

namespace fm {

void SwigluClamp_n(const float* gate, const float* up, int64_t n, float limit, float* out) {
  for (int64_t i = 0; i < n; ++i) {
    float g = gate[i], u = up[i];
    if (limit > 0.0f) {
      g = std::min(g, limit);
      u = std::clamp(u, -limit, limit);
    }
    out[i] = g / (1.0f + std::exp(-g)) * u;
  }
}

void MoeCombine_kH(const float* contrib, const float* w, int64_t k, int64_t H, float* y) {
  for (int64_t h = 0; h < H; ++h) {
    float acc = 0.0f;
    for (int64_t j = 0; j < k; ++j) acc += w[j] * contrib[j * H + h];
    y[h] = acc;
  }
}

void SwigluClampRef(const float* gate, const float* up, int64_t n, double limit, float* out) {
  for (int64_t i = 0; i < n; ++i) {
    double g = gate[i], u = up[i];
    if (limit > 0.0) {
      g = std::min(g, limit);
      u = std::clamp(u, -limit, limit);
    }
    out[i] = static_cast<float>(g / (1.0 + std::exp(-g)) * u);
  }
}

void MoeCombineRef(const float* contrib, const float* w, int64_t k, int64_t H, float* y) {
  for (int64_t h = 0; h < H; ++h) {
    double acc = 0.0;
    for (int64_t j = 0; j < k; ++j) acc += static_cast<double>(w[j]) * contrib[j * H + h];
    y[h] = static_cast<float>(acc);
  }
}

}  // namespace fm
