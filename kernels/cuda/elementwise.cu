// Row and element ops on CUDA (ops.h): RMSNorm and the vector sum.
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

// y[i] = a[i] + b[i], one thread per element.
__global__ void AddKernel(const float* a, const float* b, float* y, int64_t n) {
  const int64_t i = static_cast<int64_t>(blockIdx.x) * kElemThreads + threadIdx.x;
  if (i < n) y[i] = a[i] + b[i];
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

Status AddVectors(const float* a, const float* b, float* y, int64_t n) {
  if (n < 0) return InvalidArgument("AddVectors: n " + std::to_string(n) + " < 0");
  if (n == 0) return Status::Ok();
  if (!a || !b || !y) return InvalidArgument("AddVectors: null device pointer");
  AddKernel<<<BlocksFor(n, kElemThreads), kElemThreads, 0, CurrentStream()>>>(a, b, y, n);
  return LaunchStatus("AddKernel");
}

}  // namespace fm::cuda
