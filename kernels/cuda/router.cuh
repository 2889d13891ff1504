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
// holds experts l, l + 32, ... and their s in registers; an xor butterfly carrying the s along,
// then lane 0's winner for every lane), or the token's tid2eid row (a token
// outside [0, vocab): ids -1, weights NaN); w[j] = s[ids[j]] / (sum_j s[ids[j]] + 1e-20) * scale,
// summed in j order by lane 0, each s computed once (w holds it until the sum is known). Logits
// are read through L2 (__ldcg): in a fused launch other blocks wrote them.
__device__ __forceinline__ void RouteToken(const RouterParams& r, const float* logits, int64_t t,
                                           bool live, int lane) {
  const float* lt = logits + (live ? t : 0) * r.E;
  int32_t* out_ids = r.ids + t * r.k;
  float* out_w = r.w + t * r.k;
  float sum = 0.0f;  // lane 0: the picks' s in j order
  if (r.tid2eid) {
    if (!live || lane != 0) return;
    const int64_t tok = r.tokens[t];
    if (tok < 0 || tok >= r.vocab) {
      for (int j = 0; j < r.k; ++j) out_ids[j] = -1, out_w[j] = NAN;
      return;
    }
    for (int j = 0; j < r.k; ++j) {
      const int32_t id = static_cast<int32_t>(r.tid2eid[tok * r.k + j]);
      const float s = RouterScore(__ldcg(lt + id));
      out_ids[j] = id;
      out_w[j] = s;
      sum += s;
    }
  } else {
    // Register slots m < groups hold experts; the loops stop there (a warp-uniform exit: at
    // E = 256, 8 of the 32 slots), so the unused slots cost no instructions.
    const int groups = static_cast<int>((r.E + 31) / 32);
    float key[kRouterPerLane], score[kRouterPerLane];
#pragma unroll
    for (int m = 0; m < kRouterPerLane; ++m) {
      if (m >= groups) break;
      const int e = lane + 32 * m;
      score[m] = e < r.E ? RouterScore(__ldcg(lt + e)) : 0.0f;
      key[m] = e < r.E ? score[m] + (r.bias ? r.bias[e] : 0.0f) : 0.0f;
    }
    uint32_t taken = 0;  // bit m: expert lane + 32 m is picked
    for (int j = 0; j < r.k; ++j) {
      float bv = 0.0f, bs = 0.0f;  // the best key, and its expert's s
      int bi = -1;
#pragma unroll
      for (int m = 0; m < kRouterPerLane; ++m) {
        if (m >= groups) break;
        const int e = lane + 32 * m;
        if (e < r.E && !((taken >> m) & 1u) && Beats(key[m], e, bv, bi))
          bv = key[m], bi = e, bs = score[m];
      }
      for (int off = 16; off > 0; off >>= 1) {
        const float ov = __shfl_xor_sync(0xffffffffu, bv, off);
        const int oi = __shfl_xor_sync(0xffffffffu, bi, off);
        const float os = __shfl_xor_sync(0xffffffffu, bs, off);
        if (Beats(ov, oi, bv, bi)) bv = ov, bi = oi, bs = os;
      }
      bi = __shfl_sync(0xffffffffu, bi, 0);  // >= 0: k <= E leaves a candidate every pick
      const float s = __shfl_sync(0xffffffffu, bs, 0);
      if (bi % 32 == lane) taken |= 1u << (bi / 32);
      if (live && lane == 0) {
        out_ids[j] = bi;
        out_w[j] = s;
        sum += s;
      }
    }
    if (!live || lane != 0) return;
  }
  const float denom = sum + 1e-20f;
  for (int j = 0; j < r.k; ++j) out_w[j] = out_w[j] / denom * r.routed_scale;
}

// RouterTopK's argument checks (op names the caller in the error), for T tokens of E experts.
Status CheckRouter(const char* op, int64_t T, const RouterParams& r);

}  // namespace fm::cuda
