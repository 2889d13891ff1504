// The MoE combine as a device function: MoeCombine's kernel computes it, and hc_post (HcPost,
// HcPostPre) takes it on the fly from the expert slots (ops.h HcPostInput), so a layer's MoE
// needs no combine launch and both give the same bits (one function, one order of adds).
#pragma once
#include <cuda_runtime.h>

#include <cstdint>

#include "kernels/cuda/ops.h"

namespace fm::cuda {

// Slots whose loads are issued together before their adds (k = 6 plus the shared row: one round).
constexpr int kCombineLoads = 8;

// sum_j w[t, j] contrib[t, j, h] for j < k in ascending order, then + contrib[t, k, h] when
// add_shared (contrib [T, k + 1, H]; else [T, k, H]).
__device__ __forceinline__ float MoeCombineAt(const float* contrib, const float* w, int64_t t,
                                              int k, bool add_shared, int64_t H, int64_t h) {
  const int64_t slots = k + (add_shared ? 1 : 0);
  const float* ct = contrib + t * slots * H + h;
  const float* wt = w + t * k;
  float acc = 0.0f;
  for (int j0 = 0; j0 < k; j0 += kCombineLoads) {
    float wv[kCombineLoads], cv[kCombineLoads];
#pragma unroll
    for (int q = 0; q < kCombineLoads; ++q)
      if (j0 + q < k) wv[q] = wt[j0 + q], cv[q] = ct[(j0 + q) * H];
#pragma unroll
    for (int q = 0; q < kCombineLoads; ++q)
      if (j0 + q < k) acc += wv[q] * cv[q];
  }
  if (add_shared) acc += ct[k * H];
  return acc;
}

// The value hc_post adds to the streams at (t, h): in.out's, or the combine of in's slots.
__device__ __forceinline__ float HcPostInputAt(const HcPostInput& in, int64_t t, int64_t H,
                                               int64_t h) {
  return in.contrib ? MoeCombineAt(in.contrib, in.w, t, static_cast<int>(in.k), true, H, h)
                    : in.out[t * H + h];
}

}  // namespace fm::cuda
