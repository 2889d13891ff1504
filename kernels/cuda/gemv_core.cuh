// The weight-streaming core shared by gemv.cu (Gemm, GemmMany) and experts.cu: a warp streams
// kWarpRows weight rows at once, each lane with kWarpRows * kLoadsAhead independent 16-byte
// loads in flight, decodes every weight element once and applies it to up to kTokenTile token
// vectors (one f32 accumulator per row and token). A lane takes its share of the row's 16-byte
// vectors in ascending order (with rows split among `slices` warps, every 32 slices-th) and folds
// each vector's dot (a fixed chain over its elements) into its accumulator once; the warp sums
// lanes with a fixed xor butterfly and the caller sums slices in order. The slice count depends on
// the weight's shape only, so a token's result depends on neither the tile size nor the other
// rows or tokens: a row of Gemm over T tokens has the bits of Gemv of that token alone.
#pragma once
#include <cuda_runtime.h>
#ifdef __CUDACC__
#include <cuda_fp16.h>
#include <cuda_fp8.h>
#endif

#include <string>

#include "common/status.h"
#include "common/tensor.h"
#include "kernels/cuda/bits.cuh"
#include "kernels/cuda/launch.cuh"
#include "kernels/cuda/quant_decode.h"

namespace fm::cuda {

constexpr int kGemvThreads = 256;
constexpr int kGemvWarps = kGemvThreads / 32;
constexpr int kWarpRows = 4;     // weight rows a warp streams together (they share x loads)
constexpr int kLoadsAhead = 2;   // 16-byte loads per row a lane issues before the first use
constexpr int kTokenTile = 4;    // most tokens one pass over the weight serves
// Warps a launch wants resident to keep ~64 KB of loads in flight per SM on a 132-SM H100/H200
// (16 warps an SM); a product with fewer row groups splits each row among warps (gemv.cu).
constexpr int64_t kTargetWarps = 2048;
// Blocks an SM the weight-streaming kernels (GemvTasksKernel, ExpertsKernel at T = 1) are built
// for, i.e. their register cap 65536 / (kGemvThreads x this). H100/H200 (sm_90): 2, 16 warps an
// SM keeping ~64 KB of loads in flight (4.4 TB/s x ~0.7 us of DRAM latency is ~23 KB an SM).
// GB10 (sm_121): 1, as its 273 GB/s needs ~6 KB in flight an SM, which one block's 8 warps hold
// five times over, and under the 128-register cap of 2 the decode instances spilled (ptxas -v).
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 1200
constexpr int kStreamBlocksPerSm = 1;
#else
constexpr int kStreamBlocksPerSm = 2;
#endif
// DecodeE2m1x4 yields e2m1 * 2^-14 (an exact f16 bit pattern); sums are scaled back once.
constexpr float kE2m1Unscale = 16384.0f;

// Sum over the 32 lanes; every lane ends with the same bits (xor pairs add commutatively).
__device__ __forceinline__ float WarpSum(float v) {
  for (int off = 16; off > 0; off >>= 1) v += __shfl_xor_sync(0xffffffffu, v, off);
  return v;
}

// The kWarpRows rows a warp streams: rows row[i] of the weights data[i] (FP8/FP4: scale[i]),
// all of one format and column count.
struct WarpRows {
  const void* data[kWarpRows];
  const uint8_t* scale[kWarpRows];
  int64_t row[kWarpRows];
};

__host__ __device__ constexpr int VecElems(WeightFormat f) {
  return f == WeightFormat::kFP4Block32 ? 32
         : f == WeightFormat::kFP8Block ? 16
         : f == WeightFormat::kBF16     ? 8
                                        : 4;
}

// Four e4m3 bytes of `word` (lowest first) -> f32, exact. Device: the e4m3x2 -> f16x2 hardware
// conversion (e4m3 is a subset of f16; 0x7F/0xFF stay NaN).
__device__ __forceinline__ void DecodeE4m3x4(uint32_t word, float (&w)[4]) {
#ifdef __CUDA_ARCH__
  const float2 a = __half22float2(__half2(__nv_cvt_fp8x2_to_halfraw2(
      static_cast<__nv_fp8x2_storage_t>(word & 0xFFFFu), __NV_E4M3)));
  const float2 b = __half22float2(__half2(__nv_cvt_fp8x2_to_halfraw2(
      static_cast<__nv_fp8x2_storage_t>(word >> 16), __NV_E4M3)));
  w[0] = a.x, w[1] = a.y, w[2] = b.x, w[3] = b.y;
#else
  for (int i = 0; i < 4; ++i) w[i] = E4m3Decode((word >> (8 * i)) & 0xFFu);
#endif
}

// Four e2m1 nibbles (bits 0..15) -> f16x2 of elements (0, 1) and (2, 3), each e2m1 * 2^-14,
// exact: a nibble's magnitude bits (e1 e0 m) placed at f16 bits 11..9 are the f16 of
// e2m1 * 2^-14 (exponent field e, top mantissa bit m; e = 0 is the f16 subnormal m * 2^-15), its
// sign goes to bit 15; a few bit operations a pair.
__host__ __device__ __forceinline__ void E2m1x4ToF16x2(uint32_t bits, uint32_t (&h)[2]) {
  const uint32_t p01 = ((bits & 0x000Fu) << 9) | ((bits & 0x00F0u) << 21);
  const uint32_t p23 = ((bits & 0x0F00u) << 1) | ((bits & 0xF000u) << 13);
  h[0] = (p01 & 0x0E000E00u) | ((p01 << 3) & 0x80008000u);
  h[1] = (p23 & 0x0E000E00u) | ((p23 << 3) & 0x80008000u);
}

// Four e2m1 nibbles (bits 0..15, element 0 lowest) -> e2m1 * 2^-14 as f32, exact. Device: the
// f16x2 above, then an exact conversion.
__device__ __forceinline__ void DecodeE2m1x4(uint32_t bits, float (&w)[4]) {
#ifdef __CUDA_ARCH__
  uint32_t h[2];
  E2m1x4ToF16x2(bits, h);
  __half2_raw r01, r23;
  r01.x = static_cast<unsigned short>(h[0]), r01.y = static_cast<unsigned short>(h[0] >> 16);
  r23.x = static_cast<unsigned short>(h[1]), r23.y = static_cast<unsigned short>(h[1] >> 16);
  const float2 a = __half22float2(__half2(r01)), b = __half22float2(__half2(r23));
  w[0] = a.x, w[1] = a.y, w[2] = b.x, w[3] = b.y;
#else
  for (int i = 0; i < 4; ++i) w[i] = E2m1Decode((bits >> (4 * i)) & 0xFu) * (1.0f / kE2m1Unscale);
#endif
}

// Elements 4j..4j+3 of one 16-byte vector of format F.
template <WeightFormat F>
__device__ __forceinline__ void DecodeChunk(const uint4& q, int j, float (&w)[4]) {
  if constexpr (F == WeightFormat::kFP8Block) {
    DecodeE4m3x4(Word(q, j), w);
  } else if constexpr (F == WeightFormat::kFP4Block32) {
    DecodeE2m1x4(Word(q, j / 2) >> (16 * (j % 2)), w);
  } else if constexpr (F == WeightFormat::kBF16) {
    const uint32_t a = Word(q, 2 * j), b = Word(q, 2 * j + 1);
    w[0] = BitsToF32(a << 16), w[1] = BitsToF32(a & 0xFFFF0000u);
    w[2] = BitsToF32(b << 16), w[3] = BitsToF32(b & 0xFFFF0000u);
  } else {
    w[0] = BitsToF32(q.x), w[1] = BitsToF32(q.y), w[2] = BitsToF32(q.z), w[3] = BitsToF32(q.w);
  }
}

// Bytes of one row of `cols` elements (no scales).
__host__ __device__ constexpr int64_t RowBytes(WeightFormat f, int64_t cols) {
  return f == WeightFormat::kFP4Block32 ? cols / 2
         : f == WeightFormat::kFP8Block ? cols
         : f == WeightFormat::kBF16     ? cols * 2
                                        : cols * 4;
}

// Byte address of row r's first vector, and of its scale row (FP8: the row's 128-row block).
template <WeightFormat F>
__device__ __forceinline__ const uint4* RowVectors(const void* data, int64_t r, int64_t cols) {
  return reinterpret_cast<const uint4*>(static_cast<const uint8_t*>(data) + r * RowBytes(F, cols));
}
template <WeightFormat F>
__device__ __forceinline__ const uint8_t* RowScales(const uint8_t* scale, int64_t r, int64_t cols) {
  if constexpr (F == WeightFormat::kFP8Block) return scale + (r / 128) * ((cols + 127) / 128);
  if constexpr (F == WeightFormat::kFP4Block32) return scale + r * (cols / 32);
  return scale;
}

// Most bytes of weight data a block asks L2 for before its predecessors finish (PrefetchRows):
// 264 resident blocks (2 an SM) x 128 KiB = 34 MB, inside the H100/H200's 50 MB L2.
constexpr int64_t kPrefetchBlockBytes = 128 << 10;

// Launch-overlap prologue of a weight-streaming block (launch.cuh): rows [r0, r0 + n) of a
// [*, cols] weight of `format` (data and scale bytes) into L2, the data capped at
// kPrefetchBlockBytes; warp w's lane 0 takes the w-th eighth. Reads weights only.
__device__ __forceinline__ void PrefetchRows(WeightFormat format, const void* data,
                                             const uint8_t* scale, int64_t r0, int64_t n,
                                             int64_t cols) {
  if (n <= 0 || threadIdx.x % 32 != 0) return;
  const int64_t row_bytes = RowBytes(format, cols);
  const int64_t bytes = n * row_bytes < kPrefetchBlockBytes ? n * row_bytes : kPrefetchBlockBytes;
  const int64_t part = (bytes / kGemvWarps + 15) / 16 * 16, w = threadIdx.x / 32;
  if (w * part < bytes)
    PrefetchL2(static_cast<const uint8_t*>(data) + r0 * row_bytes + w * part,
               bytes - w * part < part ? bytes - w * part : part);
  if (w == 0 && format == WeightFormat::kFP4Block32)
    PrefetchL2(RowScales<WeightFormat::kFP4Block32>(scale, r0, cols), n * (cols / 32));
  if (w == 0 && format == WeightFormat::kFP8Block)  // the 128-row blocks of rows r0..r0+n-1
    PrefetchL2(RowScales<WeightFormat::kFP8Block>(scale, r0, cols),
               ((r0 + n - 1) / 128 - r0 / 128 + 1) * ((cols + 127) / 128));
}

// Columns c..c+3 of x (16-byte aligned), or g * (x * inv) with an RMSNorm weight g.
__device__ __forceinline__ float4 NormedX4(const float* x, const float* g, float inv, int64_t c) {
  float4 a = __ldg(reinterpret_cast<const float4*>(x + c));
  if (g) {
    const float4 gg = __ldg(reinterpret_cast<const float4*>(g + c));
    a.x = gg.x * (a.x * inv), a.y = gg.y * (a.y * inv);
    a.z = gg.z * (a.z * inv), a.w = gg.w * (a.w * inv);
  }
  return a;
}

// Chunks of a vector AccVector decodes at once at T = 1: 2 fit sm_90's 128 registers (ptxas -v);
// on sm_121 (GB10) the decode instance then spilled 300 bytes, so one at a time there (no spills).
// The chain over the elements is the same either way: the same bits.
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 1200
constexpr int kT1ChunkUnroll = 1;
#else
constexpr int kT1ChunkUnroll = 2;
#endif

// acc[i][t] += vector v of row i (q[i]) . x_t[columns of v], x_t = xs[t] (or g * (xs[t] * inv[t])
// with an RMSNorm weight g). The dot is a chain over the elements, then one add to acc.
template <WeightFormat F, int NT>
__device__ __forceinline__ void AccVector(const uint4 (&q)[kWarpRows],
                                          const uint8_t* const (&srow)[kWarpRows], int64_t v,
                                          const float* const (&xs)[NT], const float* g,
                                          const float (&inv)[NT], float (&acc)[kWarpRows][NT]) {
  constexpr int kElems = VecElems(F);
  const int64_t c0 = v * kElems;
  float p[kWarpRows][NT];
#pragma unroll
  for (int i = 0; i < kWarpRows; ++i)
#pragma unroll
    for (int t = 0; t < NT; ++t) p[i][t] = 0.0f;
  // Chunks one at a time beyond one token: unrolled, the decoded chunks of all rows and the x of
  // every token would be live at once and spill (ptxas -v); T = 1: kT1ChunkUnroll.
#pragma unroll(NT == 1 ? kT1ChunkUnroll : 1)
  for (int j = 0; j < kElems / 4; ++j) {
    float w[kWarpRows][4];
#pragma unroll
    for (int i = 0; i < kWarpRows; ++i) DecodeChunk<F>(q[i], j, w[i]);
#pragma unroll
    for (int t = 0; t < NT; ++t) {
      const float4 a = NormedX4(xs[t], g, inv[t], c0 + 4 * j);
#pragma unroll
      for (int i = 0; i < kWarpRows; ++i) {
        p[i][t] = fmaf(w[i][0], a.x, p[i][t]);
        p[i][t] = fmaf(w[i][1], a.y, p[i][t]);
        p[i][t] = fmaf(w[i][2], a.z, p[i][t]);
        p[i][t] = fmaf(w[i][3], a.w, p[i][t]);
      }
    }
  }
#pragma unroll
  for (int i = 0; i < kWarpRows; ++i) {
    if constexpr (F == WeightFormat::kFP8Block || F == WeightFormat::kFP4Block32) {
      const float s = E8m0Decode(srow[i][F == WeightFormat::kFP8Block ? v / 8 : v]);
#pragma unroll
      for (int t = 0; t < NT; ++t) {
        const float part = F == WeightFormat::kFP4Block32 ? p[i][t] * kE2m1Unscale : p[i][t];
        acc[i][t] = fmaf(part, s, acc[i][t]);
      }
    } else {
#pragma unroll
      for (int t = 0; t < NT; ++t) acc[i][t] += p[i][t];
    }
  }
}

// The vector path: cols a multiple of VecElems(F), data and every x_t 16-byte aligned. The lane
// takes vectors first, first + step, ... (first = lane + 32 slice, step = 32 slices).
template <WeightFormat F, int NT>
__device__ __forceinline__ void StreamRowsVec(const WarpRows& rows, int64_t cols,
                                              const float* const (&xs)[NT], const float* g,
                                              const float (&inv)[NT], int64_t first, int step,
                                              float (&acc)[kWarpRows][NT]) {
  const int64_t nvec = cols / VecElems(F);
  const uint4* wr[kWarpRows];
  const uint8_t* sr[kWarpRows];
#pragma unroll
  for (int i = 0; i < kWarpRows; ++i) {
    wr[i] = RowVectors<F>(rows.data[i], rows.row[i], cols);
    sr[i] = RowScales<F>(rows.scale[i], rows.row[i], cols);
  }
  int64_t v = first;
#pragma unroll 1
  for (; v + step * (kLoadsAhead - 1) < nvec; v += step * kLoadsAhead) {
    uint4 q[kLoadsAhead][kWarpRows];
#pragma unroll
    for (int u = 0; u < kLoadsAhead; ++u)
#pragma unroll
      for (int i = 0; i < kWarpRows; ++i) q[u][i] = __ldg(wr[i] + v + step * u);
#pragma unroll
    for (int u = 0; u < kLoadsAhead; ++u) AccVector<F, NT>(q[u], sr, v + step * u, xs, g, inv, acc);
  }
#pragma unroll 1
  for (; v < nvec; v += step) {
    uint4 q[kWarpRows];
#pragma unroll
    for (int i = 0; i < kWarpRows; ++i) q[i] = __ldg(wr[i] + v);
    AccVector<F, NT>(q, sr, v, xs, g, inv, acc);
  }
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

// Any format, shape and alignment: the lane takes columns first, first + step, ...
template <int NT>
__device__ __forceinline__ void StreamRowsScalar(WeightFormat format, const WarpRows& rows,
                                                 int64_t cols, const float* const (&xs)[NT],
                                                 const float* g, const float (&inv)[NT],
                                                 int64_t first, int step,
                                                 float (&acc)[kWarpRows][NT]) {
#pragma unroll 1
  for (int64_t c = first; c < cols; c += step) {
    float w[kWarpRows];
#pragma unroll
    for (int i = 0; i < kWarpRows; ++i)
      w[i] = WeightAt(format, rows.data[i], rows.scale[i], rows.row[i], c, cols);
#pragma unroll
    for (int t = 0; t < NT; ++t) {
      const float a = g ? g[c] * (xs[t][c] * inv[t]) : xs[t][c];
#pragma unroll
      for (int i = 0; i < kWarpRows; ++i) acc[i][t] = fmaf(w[i], a, acc[i][t]);
    }
  }
}

// One lane's partials acc[i][t] of rows x tokens (zeroed here), on the format's vector path
// when `vec`, else the scalar one. A row's vectors (scalar path: columns) are dealt to `slices`
// warps, lane l of slice w taking l + 32 w, then every 32 slices-th; the caller sums the slices.
template <int NT>
__device__ __forceinline__ void StreamRows(WeightFormat format, bool vec, const WarpRows& rows,
                                           int64_t cols, const float* const (&xs)[NT],
                                           const float* g, const float (&inv)[NT], int lane,
                                           int slice, int slices, float (&acc)[kWarpRows][NT]) {
#pragma unroll
  for (int i = 0; i < kWarpRows; ++i)
#pragma unroll
    for (int t = 0; t < NT; ++t) acc[i][t] = 0.0f;
  const int64_t first = lane + 32 * slice;
  const int step = 32 * slices;
  if (!vec) return StreamRowsScalar<NT>(format, rows, cols, xs, g, inv, first, step, acc);
  switch (format) {
    case WeightFormat::kFP8Block:
      return StreamRowsVec<WeightFormat::kFP8Block, NT>(rows, cols, xs, g, inv, first, step, acc);
    case WeightFormat::kFP4Block32:
      return StreamRowsVec<WeightFormat::kFP4Block32, NT>(rows, cols, xs, g, inv, first, step, acc);
    case WeightFormat::kBF16:
      return StreamRowsVec<WeightFormat::kBF16, NT>(rows, cols, xs, g, inv, first, step, acc);
    case WeightFormat::kF32:
      return StreamRowsVec<WeightFormat::kF32, NT>(rows, cols, xs, g, inv, first, step, acc);
  }
}

// ---- host side: launch choices and argument checks shared by the launchers ----

// The token tile a launch compiles for (each kernel is instantiated per tile, so the T = 1 decode
// kernel keeps the registers of one token): a pass serves up to 4 tokens; T = 3 runs a tile of 4
// whose idle token repeats a live token's x and is never stored; T > 4 loops over tiles (the
// block's rows come back from L1/L2, not DRAM).
inline int TokenTile(int64_t T) { return T >= 3 ? kTokenTile : T == 2 ? 2 : 1; }

inline bool Aligned16(const void* p) { return reinterpret_cast<uintptr_t>(p) % 16 == 0; }

inline const char* FormatName(WeightFormat f) {
  switch (f) {
    case WeightFormat::kF32: return "F32";
    case WeightFormat::kBF16: return "BF16";
    case WeightFormat::kFP8Block: return "FP8 block";
    case WeightFormat::kFP4Block32: return "FP4 block32";
  }
  return "?";
}

inline bool HasScale(WeightFormat f) {
  return f == WeightFormat::kFP8Block || f == WeightFormat::kFP4Block32;
}

// Whether the format's vector path takes these columns (pointers are checked by the caller).
inline bool VectorCols(WeightFormat format, int64_t cols) {
  return cols % VecElems(format) == 0;
}

inline Status ValidateWeight(const QWeight& w, const std::string& who) {
  const std::string what = who + ": " + FormatName(w.format) + " weight [" +
                           std::to_string(w.rows) + ", " + std::to_string(w.cols) + "]";
  if (w.rows <= 0 || w.cols <= 0) return InvalidArgument(what + ": rows and cols must be > 0");
  if (w.format == WeightFormat::kFP4Block32 && w.cols % 32 != 0)
    return InvalidArgument(what + ": cols must be a multiple of 32 (one e8m0 scale per 32)");
  if (!w.data) return InvalidArgument(what + ": data is null");
  if (HasScale(w.format) && !w.scale) return InvalidArgument(what + ": scale is null");
  return Status::Ok();
}

}  // namespace fm::cuda
