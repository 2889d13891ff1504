// Row and element ops on CUDA: RMSNorm, clamped SwiGLU, interleaved RoPE (see ops.h).
#include <cuda_runtime.h>

#include <string>

#include "kernels/cuda/check.cuh"
#include "kernels/cuda/launch.h"
#include "kernels/cuda/ops.h"

namespace fm::cuda {
namespace {

constexpr int kNormThreads = 256;
constexpr int kElemThreads = 256;

// Sum of v over the block in a fixed order (thread partials, xor butterfly per warp, then the
// warp sums in warp order); every thread gets the same value.
__device__ float BlockSum(float v) {
  __shared__ float warp_sums[kNormThreads / 32];
  for (int off = 16; off > 0; off >>= 1) v += __shfl_xor_sync(0xffffffffu, v, off);
  if (threadIdx.x % 32 == 0) warp_sums[threadIdx.x / 32] = v;
  __syncthreads();
  float total = 0.0f;
  for (int w = 0; w < kNormThreads / 32; ++w) total += warp_sums[w];
  return total;
}

// y[r, :] = g * x[r, :] / sqrt(mean(x[r, :]^2) + eps); one block per row, thread t takes
// columns t, t + 256, ...
__global__ void RmsNormKernel(const float* x, const float* weight, float* y, int64_t dim,
                              float eps) {
  const int64_t row = blockIdx.x;
  const float* xr = x + row * dim;
  float* yr = y + row * dim;
  float ss = 0.0f;
  for (int64_t c = threadIdx.x; c < dim; c += kNormThreads) ss += xr[c] * xr[c];
  // 1/sqrt with IEEE sqrt and division (not rsqrtf) to stay close to the CPU reference.
  const float inv = 1.0f / sqrtf(BlockSum(ss) / static_cast<float>(dim) + eps);
  for (int64_t c = threadIdx.x; c < dim; c += kNormThreads) {
    const float v = xr[c] * inv;
    yr[c] = weight ? weight[c] * v : v;
  }
}

// out = silu(min(g, L)) * clip(u, -L, L); comparisons written so NaN passes through.
__global__ void SwiGluClampedKernel(const float* gate, const float* up, float* out, int64_t n,
                                    float limit) {
  const int64_t i = static_cast<int64_t>(blockIdx.x) * kElemThreads + threadIdx.x;
  if (i >= n) return;
  float g = gate[i], u = up[i];
  if (g > limit) g = limit;
  if (u > limit) u = limit;
  if (u < -limit) u = -limit;
  out[i] = g / (1.0f + expf(-g)) * u;
}

// One thread per (token, head, pair i): (a, b) -> (a cos - b sin, a sin + b cos).
__global__ void RopeInterleavedKernel(float* x, int64_t tokens, int64_t heads, int64_t head_dim,
                                      int64_t rd, const int32_t* pos, const float* freqs,
                                      bool inverse) {
  const int64_t half = rd / 2;
  const int64_t idx = static_cast<int64_t>(blockIdx.x) * kElemThreads + threadIdx.x;
  if (idx >= tokens * heads * half) return;
  const int64_t i = idx % half;
  const int64_t head = idx / half;  // token * heads + h
  const int64_t t = head / heads;
  const float angle = static_cast<float>(pos[t]) * freqs[i];
  float s, c;
  sincosf(angle, &s, &c);
  if (inverse) s = -s;
  float* p = x + head * head_dim + (head_dim - rd) + 2 * i;
  const float a = p[0], b = p[1];
  p[0] = a * c - b * s;
  p[1] = a * s + b * c;
}

}  // namespace

Status RmsNorm(const float* x, const float* weight, float* y, int64_t rows, int64_t dim,
               float eps) {
  if (rows < 0 || dim <= 0)
    return InvalidArgument("RmsNorm: rows " + std::to_string(rows) + ", dim " +
                           std::to_string(dim) + ": need rows >= 0 and dim > 0");
  if (!(eps >= 0.0f)) return InvalidArgument("RmsNorm: eps must be >= 0");
  if (rows == 0) return Status::Ok();
  if (!x || !y) return InvalidArgument("RmsNorm: x and y must be device pointers, got null");
  if (rows > 0x7FFFFFFF) return InvalidArgument("RmsNorm: rows " + std::to_string(rows) + " > 2^31-1");
  RmsNormKernel<<<static_cast<unsigned>(rows), kNormThreads, 0, CurrentStream()>>>(x, weight, y,
                                                                                  dim, eps);
  return LaunchStatus("RmsNormKernel");
}

Status SwiGluClamped(const float* gate, const float* up, float* out, int64_t n, float limit) {
  if (n < 0) return InvalidArgument("SwiGluClamped: n " + std::to_string(n) + " < 0");
  if (!(limit > 0.0f)) return InvalidArgument("SwiGluClamped: limit must be > 0 (+inf: no clamp)");
  if (n == 0) return Status::Ok();
  if (!gate || !up || !out)
    return InvalidArgument("SwiGluClamped: gate, up and out must be device pointers, got null");
  SwiGluClampedKernel<<<BlocksFor(n, kElemThreads), kElemThreads, 0, CurrentStream()>>>(
      gate, up, out, n, limit);
  return LaunchStatus("SwiGluClampedKernel");
}

Status RopeInterleaved(float* x, int64_t tokens, int64_t heads, int64_t head_dim, int64_t rd,
                       const int32_t* pos, const float* freqs, bool inverse) {
  const std::string shape = "RopeInterleaved: tokens " + std::to_string(tokens) + ", heads " +
                            std::to_string(heads) + ", head_dim " + std::to_string(head_dim) +
                            ", rd " + std::to_string(rd);
  if (tokens < 0 || heads <= 0 || head_dim <= 0)
    return InvalidArgument(shape + ": need tokens >= 0, heads > 0, head_dim > 0");
  if (rd <= 0 || rd % 2 != 0 || rd > head_dim)
    return InvalidArgument(shape + ": rd must be even, > 0 and <= head_dim");
  if (tokens == 0) return Status::Ok();
  if (!x || !pos || !freqs)
    return InvalidArgument("RopeInterleaved: x, pos and freqs must be device pointers, got null");
  RopeInterleavedKernel<<<BlocksFor(tokens * heads * (rd / 2), kElemThreads), kElemThreads, 0,
                          CurrentStream()>>>(
      x, tokens, heads, head_dim, rd, pos, freqs, inverse);
  return LaunchStatus("RopeInterleavedKernel");
}

}  // namespace fm::cuda
