// Keep-quant GEMV on CUDA: y[r] = sum_c W_real[r, c] * x[c], one warp per output row.
// Vector kernels: each lane reads 16 contiguous weight bytes per step (a warp reads 512
// contiguous bytes), keeps one f32 partial, and the warp reduces with a fixed xor butterfly.
// The scalar kernel serves shapes or pointers the vector loads cannot (odd cols, unaligned x).
#include <cuda_runtime.h>

#include <string>

#include "kernels/cuda/check.cuh"
#include "kernels/cuda/ops.h"
#include "kernels/cuda/quant_decode.h"

namespace fm::cuda {
namespace {

constexpr int kWarpsPerBlock = 8;

// Sum over the 32 lanes; every lane ends with the same bits (xor pairs add commutatively).
__device__ __forceinline__ float WarpSum(float v) {
  for (int off = 16; off > 0; off >>= 1) v += __shfl_xor_sync(0xffffffffu, v, off);
  return v;
}

__device__ __forceinline__ int64_t WarpRow() {
  return static_cast<int64_t>(blockIdx.x) * kWarpsPerBlock + threadIdx.x / 32;
}

// Four e4m3 bytes of `word` (lowest byte first) dotted with x[0..3].
__device__ __forceinline__ float DotE4m3x4(uint32_t word, float4 x) {
  return E4m3Decode(word & 0xFF) * x.x + E4m3Decode((word >> 8) & 0xFF) * x.y +
         E4m3Decode((word >> 16) & 0xFF) * x.z + E4m3Decode(word >> 24) * x.w;
}

// Eight e2m1 nibbles of `word` (element 2j in the low nibble of byte j) dotted with x[0..7].
__device__ __forceinline__ float DotE2m1x8(uint32_t word, float4 lo, float4 hi) {
  return E2m1Decode(word & 0xF) * lo.x + E2m1Decode((word >> 4) & 0xF) * lo.y +
         E2m1Decode((word >> 8) & 0xF) * lo.z + E2m1Decode((word >> 12) & 0xF) * lo.w +
         E2m1Decode((word >> 16) & 0xF) * hi.x + E2m1Decode((word >> 20) & 0xF) * hi.y +
         E2m1Decode((word >> 24) & 0xF) * hi.z + E2m1Decode(word >> 28) * hi.w;
}

// Two bf16 of `word` (element 0 in the low half) dotted with x[0..1].
__device__ __forceinline__ float DotBf16x2(uint32_t word, float x0, float x1) {
  return Bf16Decode(word & 0xFFFF) * x0 + Bf16Decode(word >> 16) * x1;
}

// Each Row* function is one lane's partial of row r (the warp sums the partials).
// FP8 e4m3, cols % 16 == 0: lane step = 16 columns, all inside one 128-column scale block.
__device__ __forceinline__ float RowFp8x16(const uint8_t* w, const uint8_t* scale,
                                           const float* x, int64_t r, int64_t cols, int lane) {
  const uint4* wr = reinterpret_cast<const uint4*>(w + r * cols);
  const uint8_t* sr = scale + (r / 128) * ((cols + 127) / 128);
  const float4* x4 = reinterpret_cast<const float4*>(x);
  float acc = 0.0f;
#pragma unroll 4
  for (int64_t v = lane; v < cols / 16; v += 32) {
    const uint4 q = __ldg(wr + v);
    const float part = DotE4m3x4(q.x, __ldg(x4 + 4 * v)) + DotE4m3x4(q.y, __ldg(x4 + 4 * v + 1)) +
                       DotE4m3x4(q.z, __ldg(x4 + 4 * v + 2)) + DotE4m3x4(q.w, __ldg(x4 + 4 * v + 3));
    acc += part * E8m0Decode(sr[v / 8]);
  }
  return acc;
}

// FP4 e2m1: lane step = one 32-column scale group = 16 bytes.
__device__ __forceinline__ float RowFp4x32(const uint8_t* w, const uint8_t* scale,
                                           const float* x, int64_t r, int64_t cols, int lane) {
  const int64_t groups = cols / 32;
  const uint4* wr = reinterpret_cast<const uint4*>(w + r * (cols / 2));
  const uint8_t* sr = scale + r * groups;
  const float4* x4 = reinterpret_cast<const float4*>(x);
  float acc = 0.0f;
#pragma unroll 4
  for (int64_t g = lane; g < groups; g += 32) {
    const uint4 q = __ldg(wr + g);
    const float4* xg = x4 + 8 * g;
    const float part = DotE2m1x8(q.x, __ldg(xg), __ldg(xg + 1)) +
                       DotE2m1x8(q.y, __ldg(xg + 2), __ldg(xg + 3)) +
                       DotE2m1x8(q.z, __ldg(xg + 4), __ldg(xg + 5)) +
                       DotE2m1x8(q.w, __ldg(xg + 6), __ldg(xg + 7));
    acc += part * E8m0Decode(sr[g]);
  }
  return acc;
}

// BF16, cols % 8 == 0: lane step = 8 columns.
__device__ __forceinline__ float RowBf16x8(const uint16_t* w, const float* x, int64_t r,
                                           int64_t cols, int lane) {
  const uint4* wr = reinterpret_cast<const uint4*>(w + r * cols);
  const float4* x4 = reinterpret_cast<const float4*>(x);
  float acc = 0.0f;
#pragma unroll 4
  for (int64_t v = lane; v < cols / 8; v += 32) {
    const uint4 q = __ldg(wr + v);
    const float4 a = __ldg(x4 + 2 * v), b = __ldg(x4 + 2 * v + 1);
    acc += DotBf16x2(q.x, a.x, a.y) + DotBf16x2(q.y, a.z, a.w) + DotBf16x2(q.z, b.x, b.y) +
           DotBf16x2(q.w, b.z, b.w);
  }
  return acc;
}

// F32, cols % 4 == 0: lane step = 4 columns.
__device__ __forceinline__ float RowF32x4(const float* w, const float* x, int64_t r,
                                          int64_t cols, int lane) {
  const float4* wr = reinterpret_cast<const float4*>(w + r * cols);
  const float4* x4 = reinterpret_cast<const float4*>(x);
  float acc = 0.0f;
#pragma unroll 4
  for (int64_t v = lane; v < cols / 4; v += 32) {
    const float4 q = __ldg(wr + v), a = __ldg(x4 + v);
    acc += q.x * a.x + q.y * a.y + q.z * a.z + q.w * a.w;
  }
  return acc;
}

// W_real[r, c] element by element (the device twin of MatvecRef's WeightAt).
__device__ __forceinline__ float WeightAt(WeightFormat format, const void* data,
                                          const uint8_t* scale, int64_t r, int64_t c,
                                          int64_t cols) {
  const int64_t i = r * cols + c;
  switch (format) {
    case WeightFormat::kF32: return static_cast<const float*>(data)[i];
    case WeightFormat::kBF16: return Bf16Decode(static_cast<const uint16_t*>(data)[i]);
    case WeightFormat::kFP8Block:
      return E4m3Decode(static_cast<const uint8_t*>(data)[i]) *
             E8m0Decode(scale[(r / 128) * ((cols + 127) / 128) + c / 128]);
    case WeightFormat::kFP4Block32: {
      const uint8_t byte = static_cast<const uint8_t*>(data)[i / 2];
      return E2m1Decode((c & 1) ? (byte >> 4) : (byte & 0xF)) * E8m0Decode(scale[i / 32]);
    }
  }
  return 0.0f;
}

// Any format and shape: lane c takes columns c, c+32, ...
__device__ __forceinline__ float RowScalar(WeightFormat format, const void* data,
                                           const uint8_t* scale, const float* x, int64_t r,
                                           int64_t cols, int lane) {
  float acc = 0.0f;
  for (int64_t c = lane; c < cols; c += 32) acc += WeightAt(format, data, scale, r, c, cols) * x[c];
  return acc;
}

// One row's lane partial: the vector path of the format when `vec` (the launcher checked
// alignment and cols), else the scalar one.
__device__ __forceinline__ float RowPartial(WeightFormat format, bool vec, const void* data,
                                            const uint8_t* scale, const float* x, int64_t r,
                                            int64_t cols, int lane) {
  if (vec) {
    const auto* bytes = static_cast<const uint8_t*>(data);
    switch (format) {
      case WeightFormat::kFP8Block: return RowFp8x16(bytes, scale, x, r, cols, lane);
      case WeightFormat::kFP4Block32: return RowFp4x32(bytes, scale, x, r, cols, lane);
      case WeightFormat::kBF16:
        return RowBf16x8(static_cast<const uint16_t*>(data), x, r, cols, lane);
      case WeightFormat::kF32: return RowF32x4(static_cast<const float*>(data), x, r, cols, lane);
    }
  }
  return RowScalar(format, data, scale, x, r, cols, lane);
}

// One warp per output row and token; a warp exits as a whole, so the shuffles see every lane.
// blockIdx.x = row block * T + t: the T tokens' products of a row block are neighbours in launch
// order, so their weight rows come from device memory about once and from L2 for the others.
__global__ void GemmKernel(WeightFormat format, bool vec, const void* data, const uint8_t* scale,
                           const float* x, int64_t x_stride, float* y, int64_t y_stride,
                           int64_t rows, int64_t cols, int64_t T) {
  const int64_t t = blockIdx.x % T;
  const int64_t r = (blockIdx.x / T) * kWarpsPerBlock + threadIdx.x / 32;
  if (r >= rows) return;
  const int lane = threadIdx.x % 32;
  const float acc = WarpSum(RowPartial(format, vec, data, scale, x + t * x_stride, r, cols, lane));
  if (lane == 0) y[t * y_stride + r] = acc;
}

// blockIdx.y = j: row r of expert ids[j] times x + j * x_stride into y[j, r].
__global__ void GemvExpertsKernel(WeightFormat format, bool vec, const void* const* datas,
                                  const uint8_t* const* scales, int64_t E, const int32_t* ids,
                                  const float* x, int64_t x_stride, float* y, int64_t rows,
                                  int64_t cols) {
  const int64_t r = WarpRow(), j = blockIdx.y;
  if (r >= rows) return;
  const int lane = threadIdx.x % 32;
  const int32_t e = ids[j];
  if (e < 0 || e >= E) {
    if (lane == 0) y[j * rows + r] = __int_as_float(0x7fc00000);
    return;
  }
  const float acc =
      WarpSum(RowPartial(format, vec, datas[e], scales[e], x + j * x_stride, r, cols, lane));
  if (lane == 0) y[j * rows + r] = acc;
}

bool Aligned16(const void* p) { return reinterpret_cast<uintptr_t>(p) % 16 == 0; }

const char* FormatName(WeightFormat f) {
  switch (f) {
    case WeightFormat::kF32: return "F32";
    case WeightFormat::kBF16: return "BF16";
    case WeightFormat::kFP8Block: return "FP8 block";
    case WeightFormat::kFP4Block32: return "FP4 block32";
  }
  return "?";
}

size_t DataBytes(const QWeight& w) {
  const size_t n = static_cast<size_t>(w.rows) * static_cast<size_t>(w.cols);
  switch (w.format) {
    case WeightFormat::kF32: return n * 4;
    case WeightFormat::kBF16: return n * 2;
    case WeightFormat::kFP8Block: return n;
    case WeightFormat::kFP4Block32: return n / 2;
  }
  return 0;
}

size_t ScaleBytes(const QWeight& w) {
  switch (w.format) {
    case WeightFormat::kFP8Block:
      return static_cast<size_t>((w.rows + 127) / 128) * static_cast<size_t>((w.cols + 127) / 128);
    case WeightFormat::kFP4Block32: return static_cast<size_t>(w.rows) * (w.cols / 32);
    default: return 0;
  }
}

bool HasScale(WeightFormat f) {
  return f == WeightFormat::kFP8Block || f == WeightFormat::kFP4Block32;
}

Status ValidateWeight(const QWeight& w, const char* who) {
  const std::string what = std::string(who) + ": " + FormatName(w.format) + " weight [" +
                           std::to_string(w.rows) + ", " + std::to_string(w.cols) + "]";
  if (w.rows <= 0 || w.cols <= 0) return InvalidArgument(what + ": rows and cols must be > 0");
  if (w.format == WeightFormat::kFP4Block32 && w.cols % 32 != 0)
    return InvalidArgument(what + ": cols must be a multiple of 32 (one e8m0 scale per 32)");
  if (!w.data) return InvalidArgument(what + ": data is null");
  if (HasScale(w.format) && !w.scale) return InvalidArgument(what + ": scale is null");
  return Status::Ok();
}

}  // namespace

QWeight DeviceWeight::view() const {
  QWeight w;
  w.format = format;
  w.rows = rows;
  w.cols = cols;
  w.data = data.data();
  w.scale = scale.as<const uint8_t>();
  return w;
}

Result<DeviceWeight> UploadWeight(const QWeight& host) {
  FM_RETURN_IF_ERROR(ValidateWeight(host, "UploadWeight"));
  DeviceWeight d;
  d.format = host.format;
  d.rows = host.rows;
  d.cols = host.cols;
  FM_ASSIGN_OR_RETURN(d.data, Upload(host.data, DataBytes(host)));
  if (HasScale(host.format)) {
    FM_ASSIGN_OR_RETURN(d.scale, Upload(host.scale, ScaleBytes(host)));
  }
  return Result<DeviceWeight>(std::move(d));
}

namespace {

// Whether the format's vector path takes these columns (pointers checked by the caller).
bool VectorCols(WeightFormat format, int64_t cols) {
  switch (format) {
    case WeightFormat::kFP8Block: return cols % 16 == 0;
    case WeightFormat::kFP4Block32: return true;
    case WeightFormat::kBF16: return cols % 8 == 0;
    case WeightFormat::kF32: return cols % 4 == 0;
  }
  return false;
}

dim3 GemvGrid(int64_t rows, int64_t k) {
  return dim3(static_cast<unsigned>((rows + kWarpsPerBlock - 1) / kWarpsPerBlock),
              static_cast<unsigned>(k));
}

}  // namespace

Status Gemm(const QWeight& w, const float* x, int64_t x_stride, float* y, int64_t y_stride,
            int64_t T) {
  FM_RETURN_IF_ERROR(ValidateWeight(w, "Gemm"));
  if (T < 0) return InvalidArgument("Gemm: tokens " + std::to_string(T) + " < 0");
  if (T > 1 && (x_stride < w.cols || y_stride < w.rows))
    return InvalidArgument("Gemm: strides x " + std::to_string(x_stride) + ", y " +
                           std::to_string(y_stride) + " for a [" + std::to_string(w.rows) +
                           ", " + std::to_string(w.cols) + "] weight (want x >= cols, y >= rows)");
  if (T == 0) return Status::Ok();
  if (!x || !y) return InvalidArgument("Gemm: x and y must be device pointers, got null");
  const int64_t blocks = (w.rows + kWarpsPerBlock - 1) / kWarpsPerBlock * T;
  if (blocks > 0x7FFFFFFF) return InvalidArgument("Gemm: " + std::to_string(blocks) + " blocks");
  const bool vec = Aligned16(x) && (T == 1 || (x_stride * 4) % 16 == 0) && Aligned16(w.data) &&
                   VectorCols(w.format, w.cols);
  GemmKernel<<<static_cast<unsigned>(blocks), 32 * kWarpsPerBlock, 0, CurrentStream()>>>(
      w.format, vec, w.data, w.scale, x, x_stride, y, y_stride, w.rows, w.cols, T);
  return LaunchStatus("GemmKernel");
}

Status Gemv(const QWeight& w, const float* x, float* y) { return Gemm(w, x, 0, y, 0, 1); }

Status GemvExperts(WeightFormat format, int64_t rows, int64_t cols, const void* const* datas,
                   const uint8_t* const* scales, int64_t E, const int32_t* ids, int64_t k,
                   const float* x, int64_t x_stride, float* y) {
  QWeight shape;
  shape.format = format;
  shape.rows = rows;
  shape.cols = cols;
  shape.data = datas;  // stands in for the per-expert pointers in the shape checks
  shape.scale = reinterpret_cast<const uint8_t*>(scales);
  FM_RETURN_IF_ERROR(ValidateWeight(shape, "GemvExperts"));
  if (E <= 0 || k <= 0 || k > 65535)
    return InvalidArgument("GemvExperts: E " + std::to_string(E) + ", k " + std::to_string(k) +
                           " (need E > 0, 0 < k <= 65535)");
  if (x_stride < 0) return InvalidArgument("GemvExperts: x_stride < 0");
  if (!ids || !x || !y) return InvalidArgument("GemvExperts: null device pointer");
  // DeviceWeight buffers are cudaMalloc'd (256-byte aligned): only x decides the vector path.
  const bool vec = Aligned16(x) && (x_stride * 4) % 16 == 0 && VectorCols(format, cols);
  GemvExpertsKernel<<<GemvGrid(rows, k), 32 * kWarpsPerBlock, 0, CurrentStream()>>>(
      format, vec, datas, scales, E, ids, x, x_stride, y, rows, cols);
  return LaunchStatus("GemvExpertsKernel");
}

}  // namespace fm::cuda
