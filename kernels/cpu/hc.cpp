#include "kernels/cpu/hc.h"

#include <cmath>

namespace fm {

static float SigmoidF(float v) { return 1.0f / (1.0f + std::exp(-v)); }

float RmsInv(const float* x, int64_t len, float eps) {
  double ss = 0.0;
  for (int64_t i = 0; i < len; ++i) ss += static_cast<double>(x[i]) * x[i];
  const float mean = static_cast<float>(ss / static_cast<double>(len));
  return 1.0f / std::sqrt(mean + eps);
}

// comb[j*n+k] <- softmax over k of its logits + eh, then Sinkhorn: column, (row, column) x iters-1.
static void SinkhornComb(float* comb, int64_t n, int64_t iters, float eh) {
  for (int64_t j = 0; j < n; ++j) {
    float* row = comb + j * n;
    float mx = row[0];
    for (int64_t k = 1; k < n; ++k) mx = std::fmax(mx, row[k]);
    float sum = 0.0f;
    for (int64_t k = 0; k < n; ++k) {
      row[k] = std::exp(row[k] - mx);
      sum += row[k];
    }
    for (int64_t k = 0; k < n; ++k) row[k] = row[k] / sum + eh;
  }
  auto normalize_columns = [&] {
    for (int64_t k = 0; k < n; ++k) {
      float s = 0.0f;
      for (int64_t j = 0; j < n; ++j) s += comb[j * n + k];
      const float d = s + eh;
      for (int64_t j = 0; j < n; ++j) comb[j * n + k] /= d;
    }
  };
  normalize_columns();
  for (int64_t it = 1; it < iters; ++it) {
    for (int64_t j = 0; j < n; ++j) {
      float s = 0.0f;
      for (int64_t k = 0; k < n; ++k) s += comb[j * n + k];
      const float d = s + eh;
      for (int64_t k = 0; k < n; ++k) comb[j * n + k] /= d;
    }
    normalize_columns();
  }
}

void HcPreWeights_n(const float* mix, float rinv, const float* base, const float* scale, int64_t n,
                    int64_t iters, float hc_eps, float* pre, float* post, float* comb) {
  for (int64_t i = 0; i < n; ++i) {
    pre[i] = SigmoidF(mix[i] * rinv * scale[0] + base[i]) + hc_eps;
    post[i] = 2.0f * SigmoidF(mix[n + i] * rinv * scale[1] + base[n + i]);
  }
  for (int64_t c = 0; c < n * n; ++c) comb[c] = mix[2 * n + c] * rinv * scale[2] + base[2 * n + c];
  SinkhornComb(comb, n, iters, hc_eps);
}

void HcCollapse_nH(const float* x, const float* pre, int64_t n, int64_t H, float* y) {
  for (int64_t h = 0; h < H; ++h) {
    float acc = 0.0f;
    for (int64_t i = 0; i < n; ++i) acc += pre[i] * x[i * H + h];
    y[h] = acc;
  }
}

void HcPost_nH(const float* x, const float* out, const float* post, const float* comb, int64_t n,
               int64_t H, float* x_new) {
  for (int64_t k = 0; k < n; ++k) {
    float* dst = x_new + k * H;
    for (int64_t h = 0; h < H; ++h) {
      float acc = post[k] * out[h];
      for (int64_t j = 0; j < n; ++j) acc += comb[j * n + k] * x[j * H + h];
      dst[h] = acc;
    }
  }
}

void HcHeadWeights_n(const float* mix, float rinv, const float* base, float scale, int64_t n,
                     float hc_eps, float* pre) {
  for (int64_t i = 0; i < n; ++i) pre[i] = SigmoidF(mix[i] * rinv * scale + base[i]) + hc_eps;
}

}  // namespace fm
