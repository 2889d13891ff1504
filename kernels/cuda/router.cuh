// The MoE router of one token as a warp's device function: RouterTopK's kernel (router.cu) runs
// it, and so does the gate product's last block when the router rides in its launch
// (gemv.cu GateRouterTopK), so both give the same ids and weights.
#pragma once
#include <cuda_runtime.h>

#include <cstdint>

#include "common/status.h"

namespace fm::cuda {

constexpr int kRouterMaxExperts = 1024;
constexpr int kRouterPerLane = kRouterMaxExperts / 32;  // experts a lane holds: e = lane + 32 m

// What routes the tokens besides their logits (ops.h RouterTopK's arguments).
struct RouterParams {
  const float* bias;       // [E] (score layers) or null
  const int64_t* tid2eid;  // [vocab, k] (hash layers) or null
  const int32_t* tokens;   // [T] (hash layers)
  int64_t vocab;
  int64_t E, k;  // E <= kRouterMaxExperts, 1 <= k <= E (CheckRouter)
  float routed_scale;
  int32_t* ids;  // [T, k]
  float* w;      // [T, k]
};

// Whether candidate (v, i) beats (bv, bi): larger value, ties to the lower index (the CPU
// insertion keeps the earlier of equal scores); i < 0 is "none".
__device__ __forceinline__ bool Beats(float v, int i, float bv, int bi) {
  if (i < 0) return false;
  if (bi < 0) return true;
  return v > bv || (v == bv && i < bi);
}

// sqrt(softplus(v)), softplus as torch (threshold 20).
__device__ __forceinline__ float RouterScore(float v) {
  return sqrtf(v > 20.0f ? v : log1pf(expf(v)));
}

// Token t's routing by the calling warp (live: t is a token; a warp without one still makes
// every shuffle, as the emulation's block-wide shuffles need). s[e] = RouterScore(logits[t, e]);
// ids = the k best s + bias, each pick the warp's argmax over the experts not yet taken (lane l
// holds experts l, l + 32, ... in registers; an xor butterfly, then lane 0's winner for every
// lane), or the token's tid2eid row (a token outside [0, vocab): ids -1, weights NaN);
// w[j] = s[ids[j]] / (sum_j s[ids[j]] + 1e-20) * scale, summed in j order by lane 0. Logits are
// read through L2 (__ldcg): in a fused launch other blocks wrote them.
__device__ __forceinline__ void RouteToken(const RouterParams& r, const float* logits, int64_t t,
                                           bool live, int lane) {
  const float* lt = logits + (live ? t : 0) * r.E;
  int32_t* out_ids = r.ids + t * r.k;
  if (r.tid2eid) {
    if (!live || lane != 0) return;
    const int64_t tok = r.tokens[t];
    if (tok < 0 || tok >= r.vocab) {
      for (int j = 0; j < r.k; ++j) out_ids[j] = -1, r.w[t * r.k + j] = NAN;
      return;
    }
    for (int j = 0; j < r.k; ++j) out_ids[j] = static_cast<int32_t>(r.tid2eid[tok * r.k + j]);
  } else {
    float key[kRouterPerLane];
#pragma unroll
    for (int m = 0; m < kRouterPerLane; ++m) {
      const int e = lane + 32 * m;
      key[m] = e < r.E ? RouterScore(__ldcg(lt + e)) + (r.bias ? r.bias[e] : 0.0f) : 0.0f;
    }
    uint32_t taken = 0;  // bit m: expert lane + 32 m is picked
    for (int j = 0; j < r.k; ++j) {
      float bv = 0.0f;
      int bi = -1;
#pragma unroll
      for (int m = 0; m < kRouterPerLane; ++m) {
        const int e = lane + 32 * m;
        if (e < r.E && !((taken >> m) & 1u) && Beats(key[m], e, bv, bi)) bv = key[m], bi = e;
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
  for (int j = 0; j < r.k; ++j) sum += RouterScore(__ldcg(lt + out_ids[j]));
  const float denom = sum + 1e-20f;
  for (int j = 0; j < r.k; ++j)
    r.w[t * r.k + j] = RouterScore(__ldcg(lt + out_ids[j])) / denom * r.routed_scale;
}

// RouterTopK's argument checks (op names the caller in the error), for T tokens of E experts.
Status CheckRouter(const char* op, int64_t T, const RouterParams& r);

}  // namespace fm::cuda
