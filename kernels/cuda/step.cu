// Small glue kernels of the device decode step (kernels/cuda/ops.h): strided row copies, sums,
// scaling and the key-row index of decode attention. Each output element is written by one
// thread with one operation, so results are exact.
#include <cuda_runtime.h>

#include <string>

#include "kernels/cuda/check.cuh"
#include "kernels/cuda/launch.h"
#include "kernels/cuda/ops.h"

namespace fm::cuda {
namespace {

constexpr int kThreads = 256;

// dst[r * dst_stride + c] = src[r * src_stride + c], r < rows, c < width.
__global__ void CopyRowsKernel(const float* src, int64_t src_stride, float* dst,
                               int64_t dst_stride, int64_t rows, int64_t width) {
  const int64_t i = static_cast<int64_t>(blockIdx.x) * kThreads + threadIdx.x;
  if (i >= rows * width) return;
  const int64_t r = i / width, c = i % width;
  dst[r * dst_stride + c] = src[r * src_stride + c];
}

__global__ void AddKernel(const float* a, const float* b, float* y, int64_t n) {
  const int64_t i = static_cast<int64_t>(blockIdx.x) * kThreads + threadIdx.x;
  if (i < n) y[i] = a[i] + b[i];
}

__global__ void ScaleKernel(const float* x, float s, float* y, int64_t n) {
  const int64_t i = static_cast<int64_t>(blockIdx.x) * kThreads + threadIdx.x;
  if (i < n) y[i] = x[i] * s;
}

__global__ void KeyIndexKernel(int64_t win_start, int64_t nwin, int64_t window,
                               int64_t entries, const int32_t* picks, int64_t entry_row0,
                               int32_t* idx) {
  const int64_t i = static_cast<int64_t>(blockIdx.x) * kThreads + threadIdx.x;
  if (i >= nwin + entries) return;
  if (i < nwin) {
    idx[i] = static_cast<int32_t>((win_start + i) % window);
  } else {
    const int64_t e = picks ? picks[i - nwin] : i - nwin;
    idx[i] = static_cast<int32_t>(entry_row0 + e);
  }
}

}  // namespace

Status CopyRows(const float* src, int64_t src_stride, float* dst, int64_t dst_stride,
                int64_t rows, int64_t width) {
  if (rows < 0 || width < 0 || src_stride < width || dst_stride < width)
    return InvalidArgument("CopyRows: rows " + std::to_string(rows) + ", width " +
                           std::to_string(width) + ", strides " + std::to_string(src_stride) +
                           "/" + std::to_string(dst_stride) + " (strides must be >= width)");
  if (rows * width == 0) return Status::Ok();
  if (!src || !dst) return InvalidArgument("CopyRows: null device pointer");
  CopyRowsKernel<<<BlocksFor(rows * width, kThreads), kThreads>>>(src, src_stride, dst,
                                                                   dst_stride, rows, width);
  return LaunchStatus("CopyRowsKernel");
}

Status AddVectors(const float* a, const float* b, float* y, int64_t n) {
  if (n < 0) return InvalidArgument("AddVectors: n " + std::to_string(n) + " < 0");
  if (n == 0) return Status::Ok();
  if (!a || !b || !y) return InvalidArgument("AddVectors: null device pointer");
  AddKernel<<<BlocksFor(n, kThreads), kThreads>>>(a, b, y, n);
  return LaunchStatus("AddKernel");
}

Status ScaleVector(const float* x, float s, float* y, int64_t n) {
  if (n < 0) return InvalidArgument("ScaleVector: n " + std::to_string(n) + " < 0");
  if (n == 0) return Status::Ok();
  if (!x || !y) return InvalidArgument("ScaleVector: null device pointer");
  ScaleKernel<<<BlocksFor(n, kThreads), kThreads>>>(x, s, y, n);
  return LaunchStatus("ScaleKernel");
}

Status KeyIndex(int64_t win_start, int64_t nwin, int64_t window, int64_t entries,
                const int32_t* picks, int64_t entry_row0, int32_t* idx) {
  if (win_start < 0 || nwin < 0 || nwin > window || entries < 0 || entry_row0 < 0)
    return InvalidArgument("KeyIndex: window start " + std::to_string(win_start) + ", " +
                           std::to_string(nwin) + " of " + std::to_string(window) +
                           " window rows, " + std::to_string(entries) + " entries");
  if (nwin + entries == 0) return Status::Ok();
  if (!idx) return InvalidArgument("KeyIndex: null device pointer");
  KeyIndexKernel<<<BlocksFor(nwin + entries, kThreads), kThreads>>>(
      win_start, nwin, window, entries, picks, entry_row0, idx);
  return LaunchStatus("KeyIndexKernel");
}

}  // namespace fm::cuda
