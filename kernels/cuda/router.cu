// The MoE router on CUDA (ops.h RouterTopK): the twin of kernels/cpu/router.h.
#include <cuda_runtime.h>

#include <string>

#include "kernels/cuda/check.cuh"
#include "kernels/cuda/launch.cuh"
#include "kernels/cuda/ops.h"
#include "kernels/cuda/router.cuh"

namespace fm::cuda {
namespace {

constexpr int kRouterWarps = 4;  // tokens a block, a warp each

// One warp per token (RouteToken), kRouterWarps a block. No block barrier: a pick costs a few
// shuffles, not a tree of __syncthreads (until 2026-12-05: one block a token, 10 barriers a
// pick, the same ids and weights).
__global__ void RouterKernel(const float* logits, RouterParams r, int64_t T) {
  KernelPrologue();
  const int64_t t = static_cast<int64_t>(blockIdx.x) * kRouterWarps + threadIdx.x / 32;
  RouteToken(r, logits, t, t < T, static_cast<int>(threadIdx.x % 32));
}

}  // namespace

Status CheckRouter(const char* op, int64_t T, const RouterParams& r) {
  const std::string who(op);
  const int64_t E = r.E;
  if (T < 0) return InvalidArgument(who + ": tokens " + std::to_string(T) + " < 0");
  if (E < 1 || E > kRouterMaxExperts)
    return InvalidArgument(who + ": experts " + std::to_string(E) + " outside [1, " +
                           std::to_string(kRouterMaxExperts) + "]");
  if (r.k < 1 || r.k > E)
    return InvalidArgument(who + ": top_k " + std::to_string(r.k) + " outside [1, experts " +
                           std::to_string(E) + "]");
  if (r.bias && r.tid2eid)
    return InvalidArgument(who + ": bias and tid2eid are exclusive (score or hash layer)");
  if (r.tid2eid && (!r.tokens || r.vocab < 1))
    return InvalidArgument(who + ": hash routing needs the tokens and a vocab >= 1");
  if (!r.ids || !r.w) return InvalidArgument(who + ": null logits, ids or w");
  return Status::Ok();
}

Status RouterTopK(const float* logits, const float* bias, const int64_t* tid2eid,
                  const int32_t* tokens, int64_t vocab, int64_t T, int64_t E, int64_t k,
                  float routed_scale, int32_t* ids, float* w) {
  const RouterParams r{bias, tid2eid, tokens, vocab, E, k, routed_scale, ids, w};
  FM_RETURN_IF_ERROR(CheckRouter("RouterTopK", T, r));
  if (!logits) return InvalidArgument("RouterTopK: null logits, ids or w");
  if (T == 0) return Status::Ok();
  return Launch("RouterKernel", RouterKernel, BlocksFor(T, kRouterWarps), 32 * kRouterWarps, 0,
                logits, r, T);
}

}  // namespace fm::cuda
