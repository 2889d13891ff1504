// Row and element ops on CUDA (ops.h): RMSNorm, the vector sum, the embedding lookup and row
// piece copies.
#include <cuda_runtime.h>

#include <algorithm>
#include <string>

#include "kernels/cuda/check.cuh"
#include "kernels/cuda/launch.cuh"
#include "kernels/cuda/ops.h"
#include "kernels/cuda/quant_decode.h"

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
  KernelPrologue();
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
  KernelPrologue();
  const int64_t i = static_cast<int64_t>(blockIdx.x) * kElemThreads + threadIdx.x;
  if (i < n) y[i] = a[i] + b[i];
}

// x[t, j, :] = table[ids[t], :] in f32 for every stream j; block (c, t) takes columns
// [c * 256, (c + 1) * 256) of row t, a thread one column.
__global__ void EmbedRowsKernel(const void* table, bool bf16, int64_t vocab, int64_t H,
                                const int32_t* ids, int64_t n, float* x) {
  KernelPrologue();
  const int64_t t = blockIdx.y;
  const int64_t c = static_cast<int64_t>(blockIdx.x) * kElemThreads + threadIdx.x;
  if (c >= H) return;
  const int32_t id = ids[t];
  float v = __int_as_float(0x7fc00000);  // NaN: an id the caller should have refused
  if (id >= 0 && id < vocab) {
    const int64_t at = static_cast<int64_t>(id) * H + c;
    v = bf16 ? Bf16Decode(static_cast<const uint16_t*>(table)[at])
             : static_cast<const float*>(table)[at];
  }
  for (int64_t j = 0; j < n; ++j) x[(t * n + j) * H + c] = v;
}

// dst[dst_row(i) * dst_stride + c] = src[src_row(i) * src_stride + c]; block (c, i) takes
// columns [c * 256, (c + 1) * 256) of piece i, a thread one column.
__global__ void CopyRowPiecesKernel(const float* src, int64_t src_stride, const int32_t* src_row,
                                    float* dst, int64_t dst_stride, const int32_t* dst_row,
                                    int64_t width) {
  KernelPrologue();
  const int64_t i = blockIdx.y;
  const int64_t c = static_cast<int64_t>(blockIdx.x) * kElemThreads + threadIdx.x;
  if (c >= width) return;
  const int64_t s = src_row ? src_row[i] : i, d = dst_row ? dst_row[i] : i;
  dst[d * dst_stride + c] = src[s * src_stride + c];
}

}  // namespace

Status CopyRowPieces(const float* src, int64_t src_stride, const int32_t* src_row, float* dst,
                     int64_t dst_stride, const int32_t* dst_row, int64_t n, int64_t width) {
  if (n < 0 || width < 0 || src_stride < width || dst_stride < width)
    return InvalidArgument("CopyRowPieces: n " + std::to_string(n) + ", width " +
                           std::to_string(width) + ", strides " + std::to_string(src_stride) +
                           " / " + std::to_string(dst_stride) +
                           ": need n, width >= 0 and both strides >= width");
  if (n == 0 || width == 0) return Status::Ok();
  if (!src || !dst) return InvalidArgument("CopyRowPieces: null device pointer");
  for (int64_t i0 = 0; i0 < n; i0 += 65535) {   // grid.y: at most 65535 pieces a launch
    const int64_t m = std::min<int64_t>(65535, n - i0);
    const dim3 grid(BlocksFor(width, kElemThreads), static_cast<unsigned>(m));
    FM_RETURN_IF_ERROR(Launch(
        "CopyRowPiecesKernel", CopyRowPiecesKernel, grid, kElemThreads, 0,
        src_row ? src : src + i0 * src_stride, src_stride, src_row ? src_row + i0 : nullptr,
        dst_row ? dst : dst + i0 * dst_stride, dst_stride, dst_row ? dst_row + i0 : nullptr, width));
  }
  return Status::Ok();
}

Status EmbedRows(const void* table, bool bf16, int64_t vocab, int64_t H, const int32_t* ids,
                 int64_t T, int64_t n, float* x) {
  if (T < 0 || vocab <= 0 || H <= 0 || n <= 0)
    return InvalidArgument("EmbedRows: T " + std::to_string(T) + ", vocab " +
                           std::to_string(vocab) + ", H " + std::to_string(H) + ", n " +
                           std::to_string(n) + ": need T >= 0 and the rest > 0");
  if (T == 0) return Status::Ok();
  if (!table || !ids || !x) return InvalidArgument("EmbedRows: null device pointer");
  if (T > 65535) return InvalidArgument("EmbedRows: T " + std::to_string(T) + " > 65535");
  const dim3 grid(BlocksFor(H, kElemThreads), static_cast<unsigned>(T));
  return Launch("EmbedRowsKernel", EmbedRowsKernel, grid, kElemThreads, 0, table, bf16, vocab, H,
                ids, n, x);
}

Status RmsNorm(const float* x, const float* weight, float* y, int64_t rows, int64_t dim,
               float eps) {
  if (rows < 0 || dim <= 0)
    return InvalidArgument("RmsNorm: rows " + std::to_string(rows) + ", dim " +
                           std::to_string(dim) + ": need rows >= 0 and dim > 0");
  if (!(eps >= 0.0f)) return InvalidArgument("RmsNorm: eps must be >= 0");
  if (rows == 0) return Status::Ok();
  if (!x || !y) return InvalidArgument("RmsNorm: x and y must be device pointers, got null");
  if (rows > 0x7FFFFFFF) return InvalidArgument("RmsNorm: rows " + std::to_string(rows) + " > 2^31-1");
  return Launch("RmsNormKernel", RmsNormKernel, static_cast<unsigned>(rows), kNormThreads, 0, x,
                weight, y, dim, eps);
}

Status AddVectors(const float* a, const float* b, float* y, int64_t n) {
  if (n < 0) return InvalidArgument("AddVectors: n " + std::to_string(n) + " < 0");
  if (n == 0) return Status::Ok();
  if (!a || !b || !y) return InvalidArgument("AddVectors: null device pointer");
  return Launch("AddKernel", AddKernel, BlocksFor(n, kElemThreads), kElemThreads, 0, a, b, y, n);
}

}  // namespace fm::cuda
