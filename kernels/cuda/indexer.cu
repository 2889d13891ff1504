// The Lightning indexer and the compressor's pooling on CUDA (ops.h): twins of
// kernels/cpu/indexer.h and kernels/cpu/compressor_pool.h.
#include <cuda_runtime.h>

#include <string>

#include "kernels/cuda/check.cuh"
#include "kernels/cuda/launch.h"
#include "kernels/cuda/ops.h"

namespace fm::cuda {
namespace {

constexpr int kThreads = 256;
constexpr int kTopKMaxN = 16384;

// One thread per key e: score[e] = sum_h (relu(q_h . k_e) * scale) * w[h], h ascending.
__global__ void IndexerScoresKernel(const float* q, const float* w, int nh, int64_t d,
                                    const float* keys, int64_t n, const int32_t* count,
                                    float scale, float* score) {
  const int64_t e = static_cast<int64_t>(blockIdx.x) * kThreads + threadIdx.x;
  if (e >= n || (count && e >= count[0])) return;
  const float* k = keys + e * d;
  float acc = 0.0f;
  for (int h = 0; h < nh; ++h) {
    float dot = 0.0f;
    for (int64_t c = 0; c < d; ++c) dot += q[h * d + c] * k[c];
    acc += ((dot > 0.0f ? dot : 0.0f) * scale) * w[h];
  }
  score[e] = acc;
}

// NaN ranks lowest.
__device__ float RankKey(float v) { return v != v ? -INFINITY : v; }

// One block: element e is chosen when fewer than k elements come before it in the strict order
// (score descending, index ascending); thread 0 then writes the chosen indices ascending.
__global__ void TopKAscendingKernel(const float* score, int n_max, const int32_t* count, int k,
                                    int32_t* out) {
  __shared__ bool chosen[kTopKMaxN];
  const int n = count ? max(0, min(count[0], n_max)) : n_max;
  for (int e = threadIdx.x; e < n; e += kThreads) {
    const float ke = RankKey(score[e]);
    int before = 0;
    for (int j = 0; j < n && before < k; ++j) {
      const float kj = RankKey(score[j]);
      if (kj > ke || (kj == ke && j < e)) ++before;
    }
    chosen[e] = before < k;
  }
  __syncthreads();
  if (threadIdx.x == 0) {
    int m = 0;
    for (int e = 0; e < n && m < k; ++e)
      if (chosen[e]) out[m++] = e;
  }
}

// One thread per channel c: pooled[c] = sum_j softmax_j(z[j][c]) * a[j][c], j ascending.
__global__ void CompressorPoolKernel(const float* a, const float* z, int64_t n_max,
                                     const int32_t* count, int64_t d, float* pooled) {
  const int64_t c = static_cast<int64_t>(blockIdx.x) * kThreads + threadIdx.x;
  if (c >= d) return;
  const int64_t n = count ? max(0, min(count[0], static_cast<int>(n_max))) : n_max;
  if (n == 0) {
    pooled[c] = 0.0f;
    return;
  }
  float m = z[c];
  for (int64_t j = 1; j < n; ++j) m = z[j * d + c] > m ? z[j * d + c] : m;
  float sum = 0.0f;
  for (int64_t j = 0; j < n; ++j) sum += expf(z[j * d + c] - m);
  float acc = 0.0f;
  for (int64_t j = 0; j < n; ++j) acc += (expf(z[j * d + c] - m) / sum) * a[j * d + c];
  pooled[c] = acc;
}

}  // namespace

Status IndexerScores(const float* q, const float* w, int64_t nh, int64_t d, const float* keys,
                     int64_t n, float scale, float* score, const int32_t* count) {
  if (nh < 1 || d < 1 || n < 0)
    return InvalidArgument("IndexerScores: heads " + std::to_string(nh) + ", head_dim " +
                           std::to_string(d) + ", keys " + std::to_string(n) +
                           " (want heads >= 1, head_dim >= 1, keys >= 0)");
  if (n == 0) return Status::Ok();
  if (!q || !w || !keys || !score) return InvalidArgument("IndexerScores: null device pointer");
  IndexerScoresKernel<<<BlocksFor(n, kThreads), kThreads, 0, CurrentStream()>>>(
      q, w, static_cast<int>(nh), d, keys, n, count, scale, score);
  return LaunchStatus("IndexerScoresKernel");
}

Status TopKAscending(const float* score, int64_t n, int64_t k, int32_t* out,
                     const int32_t* count) {
  if (n < 0 || n > kTopKMaxN)
    return InvalidArgument("TopKAscending: n " + std::to_string(n) + " outside [0, " +
                           std::to_string(kTopKMaxN) + "]");
  if (k < 0 || k > n)
    return InvalidArgument("TopKAscending: k " + std::to_string(k) + " outside [0, n " +
                           std::to_string(n) + "]");
  if (k == 0) return Status::Ok();
  if (!score || !out) return InvalidArgument("TopKAscending: null device pointer");
  TopKAscendingKernel<<<1, kThreads, 0, CurrentStream()>>>(score, static_cast<int>(n), count,
                                                           static_cast<int>(k), out);
  return LaunchStatus("TopKAscendingKernel");
}

Status CompressorPool(const float* a, const float* z, int64_t n, int64_t d, float* pooled,
                      const int32_t* count) {
  if (n < 1 || d < 1)
    return InvalidArgument("CompressorPool: slots " + std::to_string(n) + ", width " +
                           std::to_string(d) + " (want both >= 1)");
  if (!a || !z || !pooled) return InvalidArgument("CompressorPool: null device pointer");
  CompressorPoolKernel<<<BlocksFor(d, kThreads), kThreads, 0, CurrentStream()>>>(a, z, n, count, d,
                                                                                pooled);
  return LaunchStatus("CompressorPoolKernel");
}

}  // namespace fm::cuda
