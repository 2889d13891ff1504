#include "kernels/cpu/attention_core.h"

#include <cmath>
#include <cstring>

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

void SinkAttentionHead_d(const float* q, const float* const* keys, int64_t n, int64_t d,
                         float sink, float scale, float* scratch, float* o) {
  float m = sink;
  for (int64_t i = 0; i < n; ++i) {
    scratch[i] = DotF32_n(q, keys[i], d) * scale;
    if (scratch[i] > m) m = scratch[i];
  }
  float denom = std::exp(sink - m);
  for (int64_t i = 0; i < n; ++i) {
    scratch[i] = std::exp(scratch[i] - m);
    denom += scratch[i];
  }
  for (int64_t c = 0; c < d; ++c) o[c] = 0.0f;
  for (int64_t i = 0; i < n; ++i) {
    const float p = scratch[i] / denom;
    const float* k = keys[i];
    for (int64_t c = 0; c < d; ++c) o[c] += p * k[c];
  }
}

}  // namespace fm
