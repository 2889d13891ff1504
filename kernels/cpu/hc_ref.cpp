// Plain double-precision references of the hyper-connection kernels (kernels/cpu/hc.h).
#include <cmath>
#include <vector>

#include "kernels/cpu/hc.h"

namespace fm {

static double SigmoidD(double v) { return 1.0 / (1.0 + std::exp(-v)); }

// Normalised flatten(X) as HF's unweighted RMSNorm gives it, in double.
static std::vector<double> NormedFlat(const float* x, int64_t len, double eps) {
  double ss = 0.0;
  for (int64_t i = 0; i < len; ++i) ss += static_cast<double>(x[i]) * x[i];
  const double r = 1.0 / std::sqrt(ss / static_cast<double>(len) + eps);
  std::vector<double> f(len);
  for (int64_t i = 0; i < len; ++i) f[i] = x[i] * r;
  return f;
}

static std::vector<double> Mix(const std::vector<double>& f, const float* fn, int64_t rows) {
  const int64_t len = static_cast<int64_t>(f.size());
  std::vector<double> m(rows, 0.0);
  for (int64_t r = 0; r < rows; ++r)
    for (int64_t c = 0; c < len; ++c) m[r] += static_cast<double>(fn[r * len + c]) * f[c];
  return m;
}

void HcPreRef(const float* x, const float* fn, const float* base, const float* scale, int64_t n,
              int64_t H, int64_t iters, double hc_eps, double rms_eps, float* y, float* post,
              float* comb) {
  const std::vector<double> m = Mix(NormedFlat(x, n * H, rms_eps), fn, (2 + n) * n);
  std::vector<double> pre(n), c(n * n);
  for (int64_t i = 0; i < n; ++i) {
    pre[i] = SigmoidD(m[i] * scale[0] + base[i]) + hc_eps;
    post[i] = static_cast<float>(2.0 * SigmoidD(m[n + i] * scale[1] + base[n + i]));
  }
  for (int64_t j = 0; j < n; ++j) {
    double mx = -INFINITY, sum = 0.0;
    for (int64_t k = 0; k < n; ++k) {
      c[j * n + k] = m[2 * n + j * n + k] * scale[2] + base[2 * n + j * n + k];
      mx = std::fmax(mx, c[j * n + k]);
    }
    for (int64_t k = 0; k < n; ++k) sum += std::exp(c[j * n + k] - mx);
    for (int64_t k = 0; k < n; ++k) c[j * n + k] = std::exp(c[j * n + k] - mx) / sum + hc_eps;
  }
  auto cols = [&] {
    for (int64_t k = 0; k < n; ++k) {
      double s = 0.0;
      for (int64_t j = 0; j < n; ++j) s += c[j * n + k];
      for (int64_t j = 0; j < n; ++j) c[j * n + k] /= s + hc_eps;
    }
  };
  cols();
  for (int64_t it = 1; it < iters; ++it) {
    for (int64_t j = 0; j < n; ++j) {
      double s = 0.0;
      for (int64_t k = 0; k < n; ++k) s += c[j * n + k];
      for (int64_t k = 0; k < n; ++k) c[j * n + k] /= s + hc_eps;
    }
    cols();
  }
  for (int64_t i = 0; i < n * n; ++i) comb[i] = static_cast<float>(c[i]);
  for (int64_t h = 0; h < H; ++h) {
    double acc = 0.0;
    for (int64_t i = 0; i < n; ++i) acc += pre[i] * x[i * H + h];
    y[h] = static_cast<float>(acc);
  }
}

void HcPostRef(const float* x, const float* out, const float* post, const float* comb, int64_t n,
               int64_t H, float* x_new) {
  for (int64_t k = 0; k < n; ++k)
    for (int64_t h = 0; h < H; ++h) {
      double acc = static_cast<double>(post[k]) * out[h];
      for (int64_t j = 0; j < n; ++j) acc += static_cast<double>(comb[j * n + k]) * x[j * H + h];
      x_new[k * H + h] = static_cast<float>(acc);
    }
}

void HcHeadRef(const float* x, const float* fn, const float* base, double scale, int64_t n,
               int64_t H, double hc_eps, double rms_eps, float* y) {
  const std::vector<double> m = Mix(NormedFlat(x, n * H, rms_eps), fn, n);
  for (int64_t h = 0; h < H; ++h) {
    double acc = 0.0;
    for (int64_t i = 0; i < n; ++i) acc += (SigmoidD(m[i] * scale + base[i]) + hc_eps) * x[i * H + h];
    y[h] = static_cast<float>(acc);
  }
}

}  // namespace fm
