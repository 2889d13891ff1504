// Small glue kernels of the device decode step (kernels/cuda/ops.h): strided row copies, sums,
// scaling, the key-row index of decode attention and the compressor's window bookkeeping. The
// position-dependent ones read their counts and rows from device memory, so a captured step
// replays at any position. Each output element is written by one thread with one operation
// (a copy or one add), so results are exact.
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

// i < max_keys: window ring rows oldest first, then the entry rows; nothing past the counts.
__global__ void KeyIndexKernel(const int32_t* win, int64_t window, const int32_t* entries,
                               const int32_t* picks, int64_t entry_row0, int64_t max_keys,
                               int32_t* idx) {
  const int64_t i = static_cast<int64_t>(blockIdx.x) * kThreads + threadIdx.x;
  const int64_t win_start = win[0], nwin = win[1], ne = entries ? entries[0] : 0;
  if (i >= max_keys || i >= nwin + ne) return;
  if (i < nwin) {
    idx[i] = static_cast<int32_t>((win_start + i) % window);
  } else {
    const int64_t e = picks ? picks[i - nwin] : i - nwin;
    idx[i] = static_cast<int32_t>(entry_row0 + e);
  }
}

__global__ void ScatterRowKernel(const float* src, int64_t width, float* dst, int64_t stride,
                                 const int32_t* row) {
  const int64_t c = static_cast<int64_t>(blockIdx.x) * kThreads + threadIdx.x;
  const int64_t r = row[0];
  if (r >= 0 && c < width) dst[r * stride + c] = src[c];
}

// pend_{a,z}[parity][slot] = a, z + ape[slot].
__global__ void CompressorStoreKernel(const float* a, const float* z, const float* ape, int64_t r,
                                      int64_t width, const CompressorStep* st, float* pend_a,
                                      float* pend_z) {
  const int64_t c = static_cast<int64_t>(blockIdx.x) * kThreads + threadIdx.x;
  if (c >= width) return;
  const int64_t row = (st->parity * r + st->slot) * width;
  pend_a[row + c] = a[c];
  pend_z[row + c] = z[c] + ape[st->slot * width + c];
}

// Thread (j, c) of 2r x d gathers slot j channel c of the window that this token completes.
__global__ void CompressorGatherKernel(const float* pend_a, const float* pend_z, int64_t r,
                                       int64_t d, int64_t width, bool overlap,
                                       const CompressorStep* st, float* ga, float* gz,
                                       int32_t* count) {
  const int64_t i = static_cast<int64_t>(blockIdx.x) * kThreads + threadIdx.x;
  const bool prev = overlap && st->has_prev;
  const int64_t n = st->emit ? (prev ? 2 * r : r) : 0;
  if (i == 0) count[0] = static_cast<int32_t>(n);
  if (i >= n * d) return;
  const int64_t j = i / d, c = i % d;
  int64_t src;
  if (prev && j < r)  // the previous window's first-half channels
    src = ((st->parity ^ 1) * r + j) * width + c;
  else                // this window's (second half when overlapping)
    src = (st->parity * r + (prev ? j - r : j)) * width + (overlap ? d : 0) + c;
  ga[i] = pend_a[src];
  gz[i] = pend_z[src];
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
  CopyRowsKernel<<<BlocksFor(rows * width, kThreads), kThreads, 0, CurrentStream()>>>(
      src, src_stride, dst, dst_stride, rows, width);
  return LaunchStatus("CopyRowsKernel");
}

Status AddVectors(const float* a, const float* b, float* y, int64_t n) {
  if (n < 0) return InvalidArgument("AddVectors: n " + std::to_string(n) + " < 0");
  if (n == 0) return Status::Ok();
  if (!a || !b || !y) return InvalidArgument("AddVectors: null device pointer");
  AddKernel<<<BlocksFor(n, kThreads), kThreads, 0, CurrentStream()>>>(a, b, y, n);
  return LaunchStatus("AddKernel");
}

Status ScaleVector(const float* x, float s, float* y, int64_t n) {
  if (n < 0) return InvalidArgument("ScaleVector: n " + std::to_string(n) + " < 0");
  if (n == 0) return Status::Ok();
  if (!x || !y) return InvalidArgument("ScaleVector: null device pointer");
  ScaleKernel<<<BlocksFor(n, kThreads), kThreads, 0, CurrentStream()>>>(x, s, y, n);
  return LaunchStatus("ScaleKernel");
}

Status KeyIndex(const int32_t* win, int64_t window, const int32_t* entries,
                const int32_t* picks, int64_t entry_row0, int64_t max_keys, int32_t* idx) {
  if (window < 1 || entry_row0 < 0 || max_keys < 0)
    return InvalidArgument("KeyIndex: window " + std::to_string(window) + ", entry row " +
                           std::to_string(entry_row0) + ", max keys " + std::to_string(max_keys));
  if (max_keys == 0) return Status::Ok();
  if (!win || !idx) return InvalidArgument("KeyIndex: null device pointer");
  KeyIndexKernel<<<BlocksFor(max_keys, kThreads), kThreads, 0, CurrentStream()>>>(
      win, window, entries, picks, entry_row0, max_keys, idx);
  return LaunchStatus("KeyIndexKernel");
}

Status ScatterRow(const float* src, int64_t width, float* dst, int64_t stride,
                  const int32_t* row) {
  if (width < 0 || stride < width)
    return InvalidArgument("ScatterRow: width " + std::to_string(width) + ", stride " +
                           std::to_string(stride) + " (stride must be >= width)");
  if (width == 0) return Status::Ok();
  if (!src || !dst || !row) return InvalidArgument("ScatterRow: null device pointer");
  ScatterRowKernel<<<BlocksFor(width, kThreads), kThreads, 0, CurrentStream()>>>(src, width, dst,
                                                                                stride, row);
  return LaunchStatus("ScatterRowKernel");
}

Status CompressorStore(const float* a, const float* z, const float* ape, int64_t r,
                       int64_t width, const CompressorStep* step, float* pend_a, float* pend_z) {
  if (r < 1 || width < 1)
    return InvalidArgument("CompressorStore: ratio " + std::to_string(r) + ", width " +
                           std::to_string(width) + " (want both >= 1)");
  if (!a || !z || !ape || !step || !pend_a || !pend_z)
    return InvalidArgument("CompressorStore: null device pointer");
  CompressorStoreKernel<<<BlocksFor(width, kThreads), kThreads, 0, CurrentStream()>>>(
      a, z, ape, r, width, step, pend_a, pend_z);
  return LaunchStatus("CompressorStoreKernel");
}

Status CompressorGather(const float* pend_a, const float* pend_z, int64_t r, int64_t d,
                        bool overlap, const CompressorStep* step, float* ga, float* gz,
                        int32_t* count) {
  if (r < 1 || d < 1)
    return InvalidArgument("CompressorGather: ratio " + std::to_string(r) + ", dim " +
                           std::to_string(d) + " (want both >= 1)");
  if (!pend_a || !pend_z || !step || !ga || !gz || !count)
    return InvalidArgument("CompressorGather: null device pointer");
  const int64_t width = overlap ? 2 * d : d;
  CompressorGatherKernel<<<BlocksFor(2 * r * d, kThreads), kThreads, 0, CurrentStream()>>>(
      pend_a, pend_z, r, d, width, overlap, step, ga, gz, count);
  return LaunchStatus("CompressorGatherKernel");
}

}  // namespace fm::cuda
