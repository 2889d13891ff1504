// What the fused decode-layer kernels share (fused.cu, attention.cu): blocks of 256 threads
// (8 warps), block sums as warp butterflies then the warp sums in warp order (so every result
// depends only on the shapes, never on timing), RoPE of a row, a row's position scalars, and the
// launchers' common argument checks.
#pragma once
#include <cuda_runtime.h>

#include <cstdint>
#include <string>

#include "common/status.h"
#include "kernels/cuda/fused_ops.h"

namespace fm::cuda::fused {

constexpr int kThreads = 256;
constexpr int kWarps = kThreads / 32;

__device__ inline float SigmoidF(float v) { return 1.0f / (1.0f + expf(-v)); }

__device__ inline float WarpSum(float v) {
  for (int off = 16; off > 0; off >>= 1) v += __shfl_xor_sync(0xffffffffu, v, off);
  return v;
}

// Sum over the block (warp butterflies, then the warp sums in warp order); all threads get it.
__device__ inline float BlockSum(float v) {
  __shared__ float warp_sums[kWarps];
  v = WarpSum(v);
  if (threadIdx.x % 32 == 0) warp_sums[threadIdx.x / 32] = v;
  __syncthreads();
  float total = 0.0f;
  for (int w = 0; w < kWarps; ++w) total += warp_sums[w];
  __syncthreads();
  return total;
}

// In place on the rd/2 pairs at the end of a row of width d: (a, b) rotated by pos * freqs[i]
// (negated when inverse), angle in f32 as kernels/cpu/rope.h. Block-strided over the pairs.
__device__ inline void RopeRow(float* row, int64_t d, int64_t rd, int32_t pos, const float* freqs,
                        bool inverse) {
  for (int64_t i = threadIdx.x; i < rd / 2; i += kThreads) {
    float s, c;
    sincosf(static_cast<float>(pos) * freqs[i], &s, &c);
    if (inverse) s = -s;
    float* p = row + (d - rd) + 2 * i;
    const float a = p[0], b = p[1];
    p[0] = a * c - b * s;
    p[1] = a * s + b * c;
  }
}

// Row t's field of a RowSteps pointer.
template <class T>
__device__ inline const T* RowField(const T* row0, int64_t stride, int64_t t) {
  return reinterpret_cast<const T*>(reinterpret_cast<const char*>(row0) + t * stride);
}

// rd even, > 0 and <= d (op names the caller).
Status CheckRope(const char* op, int64_t d, int64_t rd);
// Rows [row0, row0 + rows) of a row table: row0 >= 0, rows <= 65535 (grid.y), a table if any.
Status CheckRows(const char* op, const RowCache* table, int64_t row0, int64_t rows);

}  // namespace fm::cuda::fused
