// Scalar decoders of the checkpoint number formats for CUDA kernels, written with integer bit
// tricks so the device never does subnormal f32 arithmetic. __host__ __device__, and plain C++
// without nvcc, so a CPU test can check every code against common/numfmt.h.
#pragma once
#include <cstdint>
#include <cstring>

#ifdef __CUDACC__
#define FM_HD __host__ __device__ __forceinline__
#else
#define FM_HD inline
#endif

namespace fm::cuda {

FM_HD float BitsToF32(uint32_t u) {
#ifdef __CUDA_ARCH__
  return __uint_as_float(u);
#else
  float f;
  std::memcpy(&f, &u, 4);
  return f;
#endif
}

constexpr uint32_t kF32QuietNaNBits = 0x7FC00000u;

// e4m3fn: normal codes re-biased 7 -> 127 in the bits; subnormals m * 2^-9; 0x7F/0xFF NaN.
FM_HD float E4m3Decode(uint32_t byte) {
  const uint32_t mag = byte & 0x7Fu;
  float v = mag >= 0x08u ? BitsToF32((mag << 20) + (120u << 23)) : float(mag) * 0.001953125f;
  if (mag == 0x7Fu) v = BitsToF32(kF32QuietNaNBits);
  return (byte & 0x80u) ? -v : v;
}

// e2m1 nibble: magnitudes {0, .5, 1, 1.5, 2, 3, 4, 6}; normal codes re-biased 1 -> 127.
FM_HD float E2m1Decode(uint32_t nibble) {
  const uint32_t mag = nibble & 7u;
  const float v = mag >= 2u ? BitsToF32((mag << 22) + (126u << 23)) : float(mag) * 0.5f;
  return (nibble & 8u) ? -v : v;
}

// ue8m0 scale: 2^(b-127); b = 0 is the f32 subnormal 2^-127; 255 NaN.
FM_HD float E8m0Decode(uint32_t byte) {
  if (byte == 255u) return BitsToF32(kF32QuietNaNBits);
  return byte == 0u ? BitsToF32(0x00400000u) : BitsToF32(byte << 23);
}

FM_HD float Bf16Decode(uint32_t half) { return BitsToF32(half << 16); }

}  // namespace fm::cuda
