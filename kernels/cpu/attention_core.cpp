#include "kernels/cpu/attention_core.h"

#include <cmath>
#include <cstring>
#include <vector>

namespace fm {

// Eight f32 lanes; element-wise IEEE ops (no FMA: -ffp-contract=off), so lane l is exactly the
// scalar sum of a[i]*b[i] over i = l mod 8, on any ISA the compiler lowers this to.
typedef float F32x8 __attribute__((vector_size(32)));

float DotF32_n(const float* a, const float* b, int64_t n) {
  F32x8 acc = {0, 0, 0, 0, 0, 0, 0, 0};
  int64_t i = 0;
  for (; i + 8 <= n; i += 8) {
    F32x8 x, y;
    std::memcpy(&x, a + i, sizeof(x));
    std::memcpy(&y, b + i, sizeof(y));
    acc += x * y;
  }
  float lane[8];
  std::memcpy(lane, &acc, sizeof(lane));
  for (int64_t l = 0; i < n; ++i, ++l) lane[l] += a[i] * b[i];
  const float s0 = (lane[0] + lane[4]) + (lane[2] + lane[6]);
  const float s1 = (lane[1] + lane[5]) + (lane[3] + lane[7]);
  return s0 + s1;
}

void SinkAttentionHeads_hd(const float* q, int64_t nh, const float* const* keys, int64_t n,
                           int64_t d, const float* sink, float scale, float* scratch, float* o) {
  // Key-major loops so each shared key row is read once for all nh heads; per head the
  // operations and their order are those of one head alone.
  for (int64_t i = 0; i < n; ++i) {
    for (int64_t h = 0; h < nh; ++h) scratch[h * n + i] = DotF32_n(q + h * d, keys[i], d) * scale;
  }
  std::vector<float> denom(static_cast<size_t>(nh));
  for (int64_t h = 0; h < nh; ++h) {
    float* s = scratch + h * n;
    float m = sink[h];
    for (int64_t i = 0; i < n; ++i) m = s[i] > m ? s[i] : m;
    float den = std::exp(sink[h] - m);
    for (int64_t i = 0; i < n; ++i) {
      s[i] = std::exp(s[i] - m);
      den += s[i];
    }
    denom[h] = den;
  }
  for (int64_t c = 0; c < nh * d; ++c) o[c] = 0.0f;
  for (int64_t i = 0; i < n; ++i) {
    const float* k = keys[i];
    for (int64_t h = 0; h < nh; ++h) {
      const float p = scratch[h * n + i] / denom[h];
      float* oh = o + h * d;
      for (int64_t c = 0; c < d; ++c) oh[c] += p * k[c];
    }
  }
}

}  // namespace fm
