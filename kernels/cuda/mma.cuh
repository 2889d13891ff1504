// The tensor-core pieces of gemv_tc.cuh: one warp-wide mma.sync m16n8k16 (f16 operands, f32
// sums) and the f16 packing it needs. On the device they are single instructions; without nvcc
// (tests/gpu/emulate.sh) the same functions run in plain C++, the mma as an exchange through
// shared slots between two __syncwarp (every lane of the warp must call it, as on a GPU).
#pragma once
#include <cuda_runtime.h>
#ifdef __CUDACC__
#include <cuda_fp16.h>
#include <cuda_fp8.h>
#endif

#include <cstdint>

#include "kernels/cuda/quant_decode.h"

namespace fm::cuda {

#ifndef __CUDA_ARCH__
// f16 bits -> f32, exact (subnormals, inf, NaN included).
inline float F16ToF32(uint32_t h) {
  const uint32_t sign = (h & 0x8000u) << 16, e = (h >> 10) & 0x1Fu, m = h & 0x3FFu;
  float v;
  if (e == 0x1Fu) v = BitsToF32(0x7F800000u | (m << 13));            // inf / NaN
  else if (e == 0) v = static_cast<float>(m) * 5.9604644775390625e-8f;  // m * 2^-24
  else v = BitsToF32(((e + 112u) << 23) | (m << 13));
  return sign ? -v : v;
}

// f32 -> f16 bits, round to nearest even (overflow to inf, NaN stays NaN).
inline uint32_t F32ToF16(float f) {
  uint32_t u;
  std::memcpy(&u, &f, 4);
  const uint32_t sign = (u >> 16) & 0x8000u, a = u & 0x7FFFFFFFu;
  if (a > 0x7F800000u) return sign | 0x7E00u;
  if (a >= 0x477FF000u) return sign | 0x7C00u;  // rounds past 65504
  if (a < 0x38800000u) {                        // below 2^-14: a multiple of 2^-24
    const float q = BitsToF32(a) * 16777216.0f;  // exact; nearbyint rounds half to even
    return sign | static_cast<uint32_t>(__builtin_nearbyintf(q));
  }
  const uint32_t r = a + 0xFFFu + ((a >> 13) & 1u);  // round to 10 mantissa bits, ties to even
  return sign | ((r - (112u << 23)) >> 13);
}
#endif

// Two e4m3 bytes (lowest first) -> their f16x2 (element 0 in the low half), exact.
__device__ __forceinline__ uint32_t E4m3x2ToF16x2(uint32_t two) {
#ifdef __CUDA_ARCH__
  const __half2_raw h =
      __nv_cvt_fp8x2_to_halfraw2(static_cast<__nv_fp8x2_storage_t>(two & 0xFFFFu), __NV_E4M3);
  return static_cast<uint32_t>(h.x) | (static_cast<uint32_t>(h.y) << 16);
#else
  return F32ToF16(E4m3Decode(two & 0xFFu)) | (F32ToF16(E4m3Decode((two >> 8) & 0xFFu)) << 16);
#endif
}

// a * b per f16 half, rounded once (exact where the product is an f16).
__device__ __forceinline__ uint32_t MulF16x2(uint32_t a, uint32_t b) {
#ifdef __CUDA_ARCH__
  // _rn: a plain mul.f16x2 may be fused with a following add; this product must round alone.
  __half2 r = __hmul2_rn(*reinterpret_cast<const __half2*>(&a),
                         *reinterpret_cast<const __half2*>(&b));
  return *reinterpret_cast<uint32_t*>(&r);
#else
  return F32ToF16(F16ToF32(a & 0xFFFFu) * F16ToF32(b & 0xFFFFu)) |
         (F32ToF16(F16ToF32(a >> 16) * F16ToF32(b >> 16)) << 16);
#endif
}

// (a, b) as two f16x2 parts: hi = f16(x) and lo = f16((x - hi) * 2^11), so x = hi + lo 2^-11 to
// ~22 bits (the 2^11 keeps lo out of the f16 subnormals down to |x| ~ 2^-13; it cannot overflow:
// |x - hi| <= |x| 2^-11). The mma takes each part; the caller sums lo's products times 2^-11.
// |x| past the f16 range (65504) gives inf/NaN (docs/gpu-kernels.md).
__device__ __forceinline__ void SplitF16x2(float a, float b, uint32_t& hi, uint32_t& lo) {
#ifdef __CUDA_ARCH__
  const __half2 h = __floats2half2_rn(a, b);
  const float2 back = __half22float2(h);
  const __half2 l = __floats2half2_rn((a - back.x) * 2048.0f, (b - back.y) * 2048.0f);
  hi = *reinterpret_cast<const uint32_t*>(&h);
  lo = *reinterpret_cast<const uint32_t*>(&l);
#else
  const uint32_t ha = F32ToF16(a), hb = F32ToF16(b);
  hi = ha | (hb << 16);
  lo = F32ToF16((a - F16ToF32(ha)) * 2048.0f) | (F32ToF16((b - F16ToF32(hb)) * 2048.0f) << 16);
#endif
}

// c += A B for the warp: A [16, 16] f16, B [16, 8] f16, c [16, 8] f32. Lane l = 4 g + t holds
// (PTX ISA, mma.m16n8k16 .f16): a[0] = A[g][2t, 2t+1], a[1] = A[g+8][2t, 2t+1],
// a[2] = A[g][2t+8, 2t+9], a[3] = A[g+8][2t+8, 2t+9] (lower column in the low half);
// b[0] = B[2t, 2t+1][g], b[1] = B[2t+8, 2t+9][g]; c[0], c[1] = C[g][2t, 2t+1], c[2], c[3] = C[g+8][..].
__device__ __forceinline__ void MmaF16(const uint32_t (&a)[4], const uint32_t (&b)[2], float (&c)[4]) {
#ifdef __CUDA_ARCH__
  asm volatile(
      "mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, "
      "{%8, %9}, {%0, %1, %2, %3};\n"
      : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b[0]), "r"(b[1]));
#else
  // Every thread posts its fragments, then reads its warp's: C + sum over k in order (each
  // product of two f16 is exact in f32).
  __shared__ uint32_t frag[1024][6];
  const unsigned me = threadIdx.x, warp0 = me & ~31u, g = (me & 31u) >> 2, t = me & 3u;
  for (int i = 0; i < 4; ++i) frag[me][i] = a[i];
  frag[me][4] = b[0], frag[me][5] = b[1];
  __syncwarp();
  auto half_at = [&](unsigned lane, int reg, unsigned k) {
    const uint32_t v = frag[warp0 + lane][reg];
    return F16ToF32((k & 1u) ? v >> 16 : v & 0xFFFFu);
  };
  auto A = [&](unsigned r, unsigned k) {
    return half_at(4 * (r % 8) + (k % 8) / 2, (r >= 8 ? 1 : 0) + (k >= 8 ? 2 : 0), k);
  };
  auto B = [&](unsigned k, unsigned n) { return half_at(4 * n + (k % 8) / 2, 4 + (k >= 8 ? 1 : 0), k); };
  float d[4];
  for (int i = 0; i < 4; ++i) {
    const unsigned r = g + (i >= 2 ? 8 : 0), n = 2 * t + (i & 1);
    float s = c[i];
    for (unsigned k = 0; k < 16; ++k) s += A(r, k) * B(k, n);
    d[i] = s;
  }
  __syncwarp();
  for (int i = 0; i < 4; ++i) c[i] = d[i];
#endif
}

}  // namespace fm::cuda
