#include "common/numfmt.h"

namespace fm {

uint8_t F32ToE4m3(float f) {
  if (std::isnan(f)) return 0x7F;
  const uint8_t sign = std::signbit(f) ? 0x80 : 0;
  float a = std::fabs(f);
  if (a >= 448.0f) return sign | 0x7E;  // saturate to max finite
  // Exhaustive nearest search over the 127 non-negative finite codes: exact and simple.
  uint8_t best = 0;
  float best_err = std::numeric_limits<float>::infinity();
  for (uint8_t c = 0; c <= 0x7E; ++c) {
    float err = std::fabs(E4m3ToF32(c) - a);
    if (err < best_err || (err == best_err && (c & 1) == 0)) {
      best_err = err;
      best = c;
    }
  }
  return sign | best;
}

uint8_t F32ToE8m0Ceil(float x) {
  if (!(x > 0.0f)) return 0;
  int e = static_cast<int>(std::ceil(std::log2(x)));
  int b = e + 127;
  if (b < 0) b = 0;
  if (b > 254) b = 254;
  return static_cast<uint8_t>(b);
}

uint8_t F32ToFp4(float x) {
  static const float kMag[8] = {0.f, 0.5f, 1.f, 1.5f, 2.f, 3.f, 4.f, 6.f};
  const uint8_t sign = std::signbit(x) ? 8 : 0;
  float a = std::fabs(x);
  uint8_t best = 0;
  for (uint8_t i = 1; i < 8; ++i)
    if (std::fabs(kMag[i] - a) < std::fabs(kMag[best] - a)) best = i;
  return sign | best;
}

}  // namespace fm
