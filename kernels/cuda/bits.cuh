// Bit-level device helpers shared by the kernels: a 16-byte vector's 32-bit words, and a float's
// rank as unsigned bits ordered like the float.
#pragma once
#include <cuda_runtime.h>

#include <cstdint>

namespace fm::cuda {

// Word i (0..3, lowest address first) of a 16-byte load.
__device__ __forceinline__ uint32_t Word(const uint4& q, int i) {
  return i == 0 ? q.x : i == 1 ? q.y : i == 2 ? q.z : q.w;
}

// A score's rank as ordered bits: a larger float, larger bits. NaN ranks as -inf (lowest), and
// -0 as +0: they compare equal, so among them (as among any equal scores) the index decides.
__device__ __forceinline__ uint32_t RankBits(float v) {
  if (v != v) v = -INFINITY;
  if (v == 0.0f) v = 0.0f;
  const uint32_t u = __float_as_uint(v);
  return (u & 0x80000000u) ? ~u : (u | 0x80000000u);
}

}  // namespace fm::cuda
