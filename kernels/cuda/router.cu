// The MoE router on CUDA (ops.h RouterTopK): the twin of kernels/cpu/router.h.
#include <cuda_runtime.h>

#include <string>

#include "kernels/cuda/check.cuh"
#include "kernels/cuda/launch.cuh"
#include "kernels/cuda/ops.h"

namespace fm::cuda {
namespace {

constexpr int kRouterThreads = 256;
constexpr int kRouterMaxExperts = 1024;

// Whether candidate (v, i) beats (bv, bi): larger value, ties to the lower index (the CPU
// insertion keeps the earlier of equal scores); i < 0 is "none".
__device__ bool Beats(float v, int i, float bv, int bi) {
  if (i < 0) return false;
  if (bi < 0) return true;
  return v > bv || (v == bv && i < bi);
}

// One block per token. s[e] = sqrt(softplus(logits[e])); ids = the k best s + bias, one
// block-wide argmax per pick (thread partials, then a fixed tree), or the token's tid2eid row
// (hash layers); w[j] = s[ids[j]] / (sum_j s[ids[j]] + 1e-20) * scale, summed in j order.
__global__ void RouterKernel(const float* logits, const float* bias, const int64_t* tid2eid,
                             const int32_t* tokens, int64_t vocab, int E, int k,
                             float routed_scale, int32_t* ids, float* w) {
  KernelPrologue();
  __shared__ float score[kRouterMaxExperts];
  __shared__ float key[kRouterMaxExperts];
  __shared__ bool taken[kRouterMaxExperts];
  __shared__ float best_v[kRouterThreads];
  __shared__ int best_i[kRouterThreads];
  const int64_t t = blockIdx.x;
  const int tid = threadIdx.x;
  for (int e = tid; e < E; e += kRouterThreads) {
    const float v = logits[t * E + e];
    const float sp = v > 20.0f ? v : log1pf(expf(v));   // softplus as torch (threshold 20)
    score[e] = sqrtf(sp);
    key[e] = score[e] + (bias ? bias[e] : 0.0f);
    taken[e] = false;
  }
  __syncthreads();
  int32_t* out_ids = ids + t * k;
  if (tid2eid) {
    const int64_t tok = tokens[t];
    if (tok < 0 || tok >= vocab) {
      if (tid == 0)
        for (int j = 0; j < k; ++j) out_ids[j] = -1, w[t * k + j] = NAN;
      return;
    }
    if (tid == 0)
      for (int j = 0; j < k; ++j) out_ids[j] = static_cast<int32_t>(tid2eid[tok * k + j]);
  } else {
    for (int j = 0; j < k; ++j) {
      float bv = 0.0f;
      int bi = -1;
      for (int e = tid; e < E; e += kRouterThreads)
        if (!taken[e] && Beats(key[e], e, bv, bi)) bv = key[e], bi = e;
      best_v[tid] = bv;
      best_i[tid] = bi;
      __syncthreads();
      for (int half = kRouterThreads / 2; half > 0; half /= 2) {
        if (tid < half && Beats(best_v[tid + half], best_i[tid + half], best_v[tid], best_i[tid])) {
          best_v[tid] = best_v[tid + half];
          best_i[tid] = best_i[tid + half];
        }
        __syncthreads();
      }
      if (tid == 0) {
        out_ids[j] = best_i[0];
        taken[best_i[0]] = true;
      }
      __syncthreads();
    }
  }
  if (tid == 0) {
    float sum = 0.0f;
    for (int j = 0; j < k; ++j) sum += score[out_ids[j]];
    const float denom = sum + 1e-20f;
    for (int j = 0; j < k; ++j) w[t * k + j] = score[out_ids[j]] / denom * routed_scale;
  }
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
  return Launch("RouterKernel", RouterKernel, static_cast<unsigned>(T), kRouterThreads, 0, logits,
                bias, tid2eid, tokens, vocab, static_cast<int>(E), static_cast<int>(k),
                routed_scale, ids, w);
}

}  // namespace fm::cuda
