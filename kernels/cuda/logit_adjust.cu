// Logit adjustments on the device (sample_ops.h AdjustLogits): the twin of model/sampler.cpp's
// Sampler::Adjusted. A block per row, in Adjusted's order: the biases, the min_tokens mask, the
// penalties, min-p, a barrier between each. A rule's change to an id depends on that id alone,
// so the ids of a phase run on the block's threads in any order; the mask's "anything else
// left" is a count and min-p's threshold a max, neither of which depends on the order.
#include <cuda_runtime.h>

#include <cfloat>
#include <cmath>
#include <string>

#include "kernels/cuda/check.cuh"
#include "kernels/cuda/launch.cuh"
#include "kernels/cuda/sample_ops.h"

namespace fm::cuda {
namespace {

constexpr int kAdjustThreads = 256;
// Logits a thread has in flight in a pass over the row: one block reads the whole row (the
// real vocabulary's 517 KB, from L2 after the head wrote it), so a load at a time would wait
// ~500 round trips a pass; 16 issued before the first use wait ~32.
constexpr int kAdjustLoads = 16;

// Comparisons only (the emulation compiles this file as plain C++, without CUDA's globals).
__device__ bool IsNan(float v) { return v != v; }
__device__ bool IsFinite(float v) { return v == v && v != INFINITY && v != -INFINITY; }

// Adjusted's `set`: a finite logit takes v clamped to +-FLT_MAX (a tiny repetition penalty must
// not make it +inf); NaN and +-inf stay as they are.
__device__ void SetFinite(float* l, double v) {
  if (!IsFinite(*l)) return;
  const double lo = -static_cast<double>(FLT_MAX), hi = static_cast<double>(FLT_MAX);
  *l = static_cast<float>(v < lo ? lo : (hi < v ? hi : v));
}

// The largest value other than NaN (+-inf included; -inf when none): a max in any order.
__device__ float BlockMaxNotNan(float v, float* sh) {
  const int tid = threadIdx.x;
  sh[tid] = v;
  __syncthreads();
  for (int s = kAdjustThreads / 2; s > 0; s >>= 1) {
    if (tid < s && sh[tid + s] > sh[tid]) sh[tid] = sh[tid + s];
    __syncthreads();
  }
  const float r = sh[0];
  __syncthreads();
  return r;
}

// f(i, l[i]) for each of the thread's ids of the row, kAdjustLoads loads issued before the
// first f (ids tid, tid + kAdjustThreads, ...: each load a warp makes is 32 neighbours).
template <class F>
__device__ void ForEachLogit(const float* l, int64_t vocab, F&& f) {
  for (int64_t base = threadIdx.x; base < vocab; base += int64_t{kAdjustThreads} * kAdjustLoads) {
    float v[kAdjustLoads];
#pragma unroll
    for (int j = 0; j < kAdjustLoads; ++j) {
      const int64_t i = base + int64_t{j} * kAdjustThreads;
      v[j] = i < vocab ? l[i] : 0.0f;
    }
#pragma unroll
    for (int j = 0; j < kAdjustLoads; ++j) {
      const int64_t i = base + int64_t{j} * kAdjustThreads;
      if (i < vocab) f(i, v[j]);
    }
  }
}

__global__ void AdjustLogitsKernel(float* logits, int64_t vocab, const AdjustRow* rows,
                                   const LogitEdit* edits, const float* biases) {
  KernelPrologue();
  __shared__ int left_sum;
  __shared__ float maxes[kAdjustThreads];
  const int tid = threadIdx.x;
  const AdjustRow r = rows[blockIdx.x];
  float* l = logits + static_cast<int64_t>(r.row) * vocab;
  auto valid = [&](const LogitEdit& e) { return e.id >= 0 && e.id < vocab; };
  // 1. logit_bias, each id's values in the request's order.
  for (int i = r.edit_begin + tid; i < r.edit_end; i += kAdjustThreads) {
    const LogitEdit e = edits[i];
    if (!valid(e)) continue;
    for (int b = e.bias_begin; b < e.bias_end; ++b)
      SetFinite(&l[e.id], static_cast<double>(l[e.id]) + biases[b]);
  }
  __syncthreads();
  // 2. The min_tokens ids -> -inf, unless no other logit is finite: the finite logits minus the
  // finite held ones (each id is listed once).
  if (r.mask) {
    int left = 0;
    ForEachLogit(l, vocab, [&](int64_t, float v) { left += IsFinite(v) ? 1 : 0; });
    for (int i = r.edit_begin + tid; i < r.edit_end; i += kAdjustThreads) {
      const LogitEdit e = edits[i];
      if (valid(e) && e.held && IsFinite(l[e.id])) --left;
    }
    if (tid == 0) left_sum = 0;
    __syncthreads();
    atomicAdd(&left_sum, left);  // integers: exact in any order
    __syncthreads();
    if (left_sum > 0)
      for (int i = r.edit_begin + tid; i < r.edit_end; i += kAdjustThreads) {
        const LogitEdit e = edits[i];
        if (valid(e) && e.held && !IsNan(l[e.id])) l[e.id] = -INFINITY;
      }
    __syncthreads();
  }
  // 3. The penalties: repetition (prompt or generated), then frequency + presence (generated).
  for (int i = r.edit_begin + tid; i < r.edit_end; i += kAdjustThreads) {
    const LogitEdit e = edits[i];
    if (!valid(e)) continue;
    if (e.seen)
      SetFinite(&l[e.id], l[e.id] > 0.0f ? static_cast<double>(l[e.id]) / r.repetition
                                         : static_cast<double>(l[e.id]) * r.repetition);
    if (e.generated) SetFinite(&l[e.id], static_cast<double>(l[e.id]) - e.subtract);
  }
  __syncthreads();
  // 4. min-p: p_i / p_max = exp((l_i - l_max) / T) below min_p is out.
  if (r.min_p) {
    float top = -INFINITY;
    ForEachLogit(l, vocab, [&](int64_t, float v) {
      if (!IsNan(v) && v > top) top = v;
    });
    top = BlockMaxNotNan(top, maxes);
    if (IsFinite(top))
      ForEachLogit(l, vocab, [&](int64_t i, float v) {
        if ((static_cast<double>(v) - top) * r.inv_t < r.floor) l[i] = -INFINITY;
      });
  }
}

}  // namespace

Status AdjustLogits(float* logits, int64_t vocab, const AdjustRow* rows, int64_t n,
                    const LogitEdit* edits, const float* biases) {
  if (!logits || !rows || !edits || !biases)
    return InvalidArgument("AdjustLogits: null logits, rows, edits or biases");
  if (n <= 0 || n > 65535)
    return InvalidArgument("AdjustLogits: rows " + std::to_string(n) + " outside [1, 65535]");
  if (vocab <= 0 || vocab > (int64_t{1} << 31) - 1)
    return InvalidArgument("AdjustLogits: vocab " + std::to_string(vocab) + " outside [1, 2^31)");
  return Launch("AdjustLogitsKernel", AdjustLogitsKernel, static_cast<unsigned>(n), kAdjustThreads,
                0, logits, vocab, rows, edits, biases);
}

}  // namespace fm::cuda
