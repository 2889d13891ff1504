// The attention core on CUDA (ops.h SinkAttention): the twin of kernels/cpu/attention_core.h.
#include <cuda_runtime.h>

#include <string>

#include "kernels/cuda/check.cuh"
#include "kernels/cuda/ops.h"

namespace fm::cuda {
namespace {

constexpr int kAttnThreads = 256;
constexpr int kAttnMaxKeys = 4096;

// One block per head over n keys (min(*count, n_max) when counted on the device): thread i
// scores keys i, i + 256, ... (s = scale * q . k, c ascending);
// thread 0 takes the max (with the sink) and the softmax denominator in key order; then thread
// c sums o[c] = sum_i p_i k_i[c], i ascending. Every order depends only on n and d.
__global__ void SinkAttentionKernel(const float* q, const float* kv, const int32_t* idx, int n_max,
                                    const int32_t* count, int64_t d, const float* sink,
                                    float scale, float* o) {
  __shared__ float p[kAttnMaxKeys];
  __shared__ float denom_s;
  const int64_t h = blockIdx.x;
  const int n = count ? max(0, min(count[0], n_max)) : n_max;
  const float* qh = q + h * d;
  for (int i = threadIdx.x; i < n; i += kAttnThreads) {
    const float* k = kv + static_cast<int64_t>(idx[i]) * d;
    float acc = 0.0f;
    for (int64_t c = 0; c < d; ++c) acc += qh[c] * k[c];
    p[i] = acc * scale;
  }
  __syncthreads();
  if (threadIdx.x == 0) {
    float m = sink[h];
    for (int i = 0; i < n; ++i) m = p[i] > m ? p[i] : m;
    float den = expf(sink[h] - m);
    for (int i = 0; i < n; ++i) {
      p[i] = expf(p[i] - m);
      den += p[i];
    }
    denom_s = den;
  }
  __syncthreads();
  const float den = denom_s;
  for (int64_t c = threadIdx.x; c < d; c += kAttnThreads) {
    float acc = 0.0f;
    for (int i = 0; i < n; ++i) acc += p[i] / den * kv[static_cast<int64_t>(idx[i]) * d + c];
    o[h * d + c] = acc;
  }
}

}  // namespace

Status SinkAttention(const float* q, int64_t nh, const float* kv, const int32_t* idx, int64_t n,
                     int64_t d, const float* sink, float scale, float* o, const int32_t* count) {
  if (nh < 0) return InvalidArgument("SinkAttention: heads " + std::to_string(nh) + " < 0");
  if (n < 0 || n > kAttnMaxKeys)
    return InvalidArgument("SinkAttention: keys " + std::to_string(n) + " outside [0, " +
                           std::to_string(kAttnMaxKeys) + "]");
  if (d < 1) return InvalidArgument("SinkAttention: head_dim " + std::to_string(d) + " < 1");
  if (nh == 0) return Status::Ok();
  if (!q || !sink || !o || (n > 0 && (!kv || !idx)))
    return InvalidArgument("SinkAttention: null device pointer");
  SinkAttentionKernel<<<static_cast<unsigned>(nh), kAttnThreads, 0, CurrentStream()>>>(
      q, kv, idx, static_cast<int>(n), count, d, sink, scale, o);
  return LaunchStatus("SinkAttentionKernel");
}

}  // namespace fm::cuda
