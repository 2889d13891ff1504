// Number formats of the official checkpoint (MODEL.md "Number formats"), decoded exactly.
// Plain scalar functions; kernels use the tables for speed, tests check tables against these.
#pragma once
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>

namespace fm {

// BF16 = upper 16 bits of an f32.
inline float Bf16ToF32(uint16_t b) {
  uint32_t u = static_cast<uint32_t>(b) << 16;
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}
// Round to nearest even (NaN stays NaN).
inline uint16_t F32ToBf16(float f) {
  uint32_t u;
  std::memcpy(&u, &f, 4);
  if ((u & 0x7fffffffu) > 0x7f800000u) return static_cast<uint16_t>((u >> 16) | 0x40);
  u += 0x7fffu + ((u >> 16) & 1u);
  return static_cast<uint16_t>(u >> 16);
}

// F8_E4M3 (e4m3fn): bias 7, no infinities, 0x7F/0xFF NaN, max 448, subnormals m*2^-9.
inline float E4m3ToF32(uint8_t b) {
  const int sign = b >> 7, exp = (b >> 3) & 0xF, man = b & 0x7;
  float v;
  if (exp == 0xF && man == 0x7) return std::numeric_limits<float>::quiet_NaN();
  if (exp == 0) v = std::ldexp(static_cast<float>(man), -9);
  else v = std::ldexp(1.0f + man / 8.0f, exp - 7);
  return sign ? -v : v;
}
// Nearest e4m3 value (ties to even mantissa), saturating at +-448. Used by mkmodel.
uint8_t F32ToE4m3(float f);

// F8_E8M0 (ue8m0) scale: 2^(b-127); 255 = NaN.
inline float E8m0ToF32(uint8_t b) {
  if (b == 255) return std::numeric_limits<float>::quiet_NaN();
  return std::ldexp(1.0f, static_cast<int>(b) - 127);
}
// Smallest power-of-two exponent byte whose value is >= x (x > 0). Used by mkmodel.
uint8_t F32ToE8m0Ceil(float x);

// FP4 e2m1 nibble: sign bit 3, magnitude index bits 0-2 into {0,.5,1,1.5,2,3,4,6}.
inline float Fp4ToF32(uint8_t nibble) {
  static const float kMag[8] = {0.f, 0.5f, 1.f, 1.5f, 2.f, 3.f, 4.f, 6.f};
  const float m = kMag[nibble & 7];
  return (nibble & 8) ? -m : m;
}
// Nearest e2m1 nibble for x (ties to the lower magnitude index), saturating at +-6.
uint8_t F32ToFp4(float x);

}  // namespace fm
