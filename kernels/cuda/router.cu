// The MoE router on CUDA (ops.h RouterTopK): the twin of kernels/cpu/router.h.
#include <cuda_runtime.h>

#include <string>

#include "kernels/cuda/check.cuh"
#include "kernels/cuda/launch.cuh"
#include "kernels/cuda/ops.h"

namespace fm::cuda {
namespace {

constexpr int kRouterWarps = 4;  // tokens a block, a warp each
constexpr int kRouterMaxExperts = 1024;
constexpr int kRouterPerLane = kRouterMaxExperts / 32;  // experts a lane holds: e = lane + 32 m

// Whether candidate (v, i) beats (bv, bi): larger value, ties to the lower index (the CPU
// insertion keeps the earlier of equal scores); i < 0 is "none".
__device__ bool Beats(float v, int i, float bv, int bi) {
  if (i < 0) return false;
  if (bi < 0) return true;
  return v > bv || (v == bv && i < bi);
}

// sqrt(softplus(v)), softplus as torch (threshold 20).
__device__ float RouterScore(float v) { return sqrtf(v > 20.0f ? v : log1pf(expf(v))); }

// One warp per token t (kRouterWarps a block). s[e] = RouterScore(logits[e]); ids = the k best
// s + bias, each pick the warp's argmax over the experts not yet taken (lane l holds experts
// l, l + 32, ... in registers; an xor butterfly, then lane 0's winner for every lane), or the
// token's tid2eid row (hash layers); w[j] = s[ids[j]] / (sum_j s[ids[j]] + 1e-20) * scale,
// summed in j order by lane 0. No block barrier: a pick costs a few shuffles, not a tree of
// __syncthreads (the old kernel: one block a token, 10 barriers a pick). Warps past T run the
// shuffles on dummy values (the emulation's shuffles are block-wide).
__global__ void RouterKernel(const float* logits, const float* bias, const int64_t* tid2eid,
                             const int32_t* tokens, int64_t vocab, int64_t T, int E, int k,
                             float routed_scale, int32_t* ids, float* w) {
  KernelPrologue();
  const int lane = threadIdx.x % 32;
  const int64_t t = static_cast<int64_t>(blockIdx.x) * kRouterWarps + threadIdx.x / 32;
  const bool live = t < T;
  const float* lt = logits + (live ? t : 0) * E;
  int32_t* out_ids = ids + t * k;
  if (tid2eid) {
    if (!live || lane != 0) return;
    const int64_t tok = tokens[t];
    if (tok < 0 || tok >= vocab) {
      for (int j = 0; j < k; ++j) out_ids[j] = -1, w[t * k + j] = NAN;
      return;
    }
    for (int j = 0; j < k; ++j) out_ids[j] = static_cast<int32_t>(tid2eid[tok * k + j]);
  } else {
    float key[kRouterPerLane];
#pragma unroll
    for (int m = 0; m < kRouterPerLane; ++m) {
      const int e = lane + 32 * m;
      key[m] = e < E ? RouterScore(lt[e]) + (bias ? bias[e] : 0.0f) : 0.0f;
    }
    uint32_t taken = 0;  // bit m: expert lane + 32 m is picked
    for (int j = 0; j < k; ++j) {
      float bv = 0.0f;
      int bi = -1;
#pragma unroll
      for (int m = 0; m < kRouterPerLane; ++m) {
        const int e = lane + 32 * m;
        if (e < E && !((taken >> m) & 1u) && Beats(key[m], e, bv, bi)) bv = key[m], bi = e;
      }
      for (int off = 16; off > 0; off >>= 1) {
        const float ov = __shfl_xor_sync(0xffffffffu, bv, off);
        const int oi = __shfl_xor_sync(0xffffffffu, bi, off);
        if (Beats(ov, oi, bv, bi)) bv = ov, bi = oi;
      }
      bi = __shfl_sync(0xffffffffu, bi, 0);
      if (bi >= 0 && bi % 32 == lane) taken |= 1u << (bi / 32);
      if (live && lane == 0) out_ids[j] = bi;
    }
    if (!live || lane != 0) return;
  }
  float sum = 0.0f;
  for (int j = 0; j < k; ++j) sum += RouterScore(lt[out_ids[j]]);
  const float denom = sum + 1e-20f;
  for (int j = 0; j < k; ++j) w[t * k + j] = RouterScore(lt[out_ids[j]]) / denom * routed_scale;
}

}  // namespace

Status RouterTopK(const float* logits, const float* bias, const int64_t* tid2eid,
                  const int32_t* tokens, int64_t vocab, int64_t T, int64_t E, int64_t k,
                  float routed_scale, int32_t* ids, float* w) {
  if (T < 0) return InvalidArgument("RouterTopK: tokens " + std::to_string(T) + " < 0");
  if (E < 1 || E > kRouterMaxExperts)
    return InvalidArgument("RouterTopK: experts " + std::to_string(E) + " outside [1, " +
                           std::to_string(kRouterMaxExperts) + "]");
  if (k < 1 || k > E)
    return InvalidArgument("RouterTopK: top_k " + std::to_string(k) + " outside [1, experts " +
                           std::to_string(E) + "]");
  if (bias && tid2eid)
    return InvalidArgument("RouterTopK: bias and tid2eid are exclusive (score or hash layer)");
  if (tid2eid && (!tokens || vocab < 1))
    return InvalidArgument("RouterTopK: hash routing needs the tokens and a vocab >= 1");
  if (!logits || !ids || !w) return InvalidArgument("RouterTopK: null logits, ids or w");
  if (T == 0) return Status::Ok();
  return Launch("RouterKernel", RouterKernel, BlocksFor(T, kRouterWarps), 32 * kRouterWarps, 0,
                logits, bias, tid2eid, tokens, vocab, T, static_cast<int>(E), static_cast<int>(k),
                routed_scale, ids, w);
}

}  // namespace fm::cuda
