// The MoE experts of a whole step in two launches (ops.h ExpertsUpGate, ExpertsDown) through
// the weight-streaming core of gemv_core.cuh. grid.y = slot (token t, expert j; the shared
// expert is slot j == k), grid.x = row block. The block of an expert's first slot serves every
// slot of that expert, up to 4 per pass over the weight rows; the other slots' blocks exit at
// once. Up/gate: a warp streams rows r, r+1 of W1 and of W3 together (the four rows of the
// core) and writes SwiGLU of each pair; down: four rows of W2.
#include <cuda_runtime.h>

#include <algorithm>
#include <cmath>
#include <limits>
#include <string>

#include "kernels/cuda/check.cuh"
#include "kernels/cuda/gemv_core.cuh"
#include "kernels/cuda/gemv_tc.cuh"
#include "kernels/cuda/launch.cuh"
#include "kernels/cuda/ops.h"

namespace fm::cuda {
namespace {

// One weight as the kernel reads it.
struct ExpertMat {
  const void* data;
  const uint8_t* scale;
};

struct ExpertsLaunch {
  WeightFormat format;  // the routed experts'
  bool vec;
  int64_t rows, cols, E;
  const void* const* datas[2];  // routed: [0] W1 or W2, [1] W3 (device arrays [E])
  const uint8_t* const* scales[2];
  WeightFormat shared_format;
  bool shared_vec, has_shared, up_gate;
  int64_t shared_rows, shared_cols;
  ExpertMat shared[2];  // s1, s3 or s2
  float limit;
  const int32_t* ids;
  int64_t T, k;
  const float* x;  // up/gate: token rows; down: slot rows
  int64_t x_stride;
  float* y;  // slot rows
  int64_t y_stride;
  bool prefetch;  // launch overlap (launch.cuh): the shared expert's rows into L2 before the wait
};

__device__ __forceinline__ int64_t Slots(const ExpertsLaunch& p) {
  return p.k + (p.has_shared ? 1 : 0);
}

// The expert of slot s: its routed id, E for the shared expert, or -1 - s for an id outside
// [0, E) (a group of its own). 32-bit: slots are grid.y (< 65536), and every block scans them.
__device__ int SlotKey(const ExpertsLaunch& p, int s) {
  const int per_token = static_cast<int>(Slots(p)), t = s / per_token, j = s % per_token;
  if (j == p.k) return static_cast<int>(p.E);
  const int32_t e = p.ids[t * static_cast<int>(p.k) + j];
  return e >= 0 && e < p.E ? e : -1 - s;
}

// silu(min(g, L)) * clip(u, -L, L), as SwiGluClampedKernel; comparisons let NaN through.
__device__ __forceinline__ float SwiGlu(float g, float u, float limit) {
  if (g > limit) g = limit;
  if (u > limit) u = limit;
  if (u < -limit) u = -limit;
  return g / (1.0f + expf(-g)) * u;
}

// Slots tile[0..n) (NT >= n; the rest repeat tile[0] and are not stored) of the warp's rows.
template <int NT>
__device__ void ExpertTile(const ExpertsLaunch& p, WeightFormat format, bool vec, int64_t cols,
                           const WarpRows& rows, int64_t r_out, int nout, const int64_t* tile,
                           int n, int lane) {
  const float* xs[NT];
  const float inv[NT] = {};
#pragma unroll
  for (int t = 0; t < NT; ++t) {
    const int64_t s = tile[t < n ? t : 0];
    xs[t] = p.x + (p.up_gate ? s / Slots(p) : s) * p.x_stride;
  }
  float acc[kWarpRows][NT];
  StreamRows<NT>(format, vec, rows, cols, xs, nullptr, inv, lane, 0, 1, acc);
  if (p.up_gate) {
#pragma unroll
    for (int o = 0; o < kWarpRows / 2; ++o)
#pragma unroll
      for (int t = 0; t < NT; ++t) {
        const float g = WarpSum(acc[2 * o][t]), u = WarpSum(acc[2 * o + 1][t]);
        if (lane == 0 && o < nout && t < n) p.y[tile[t] * p.y_stride + r_out + o] = SwiGlu(g, u, p.limit);
      }
  } else {
#pragma unroll
    for (int i = 0; i < kWarpRows; ++i)
#pragma unroll
      for (int t = 0; t < NT; ++t) {
        const float v = WarpSum(acc[i][t]);
        if (lane == 0 && i < nout && t < n) p.y[tile[t] * p.y_stride + r_out + i] = v;
      }
  }
}

// Tensor-core twin of ExpertTile: slots tile[0..n) (n <= 8) through the warp's 16 mma rows.
// Up/gate: stream 0 = W1 row r_out + g, stream 1 = W3's, so a lane holds both halves of its
// SwiGLU; down: W2 rows r_out + g and r_out + g + 8.
__device__ void ExpertTileTc(const ExpertsLaunch& p, WeightFormat format, int64_t cols,
                             const ExpertMat& m0, const ExpertMat& m1, int64_t out_rows,
                             int64_t r_out, int nout, const int64_t* tile, int n, int lane) {
  const int gl = lane >> 2, tq = lane & 3;
  TcRows rows;
#pragma unroll
  for (int i = 0; i < 2; ++i) {
    const int64_t r = r_out + gl + (p.up_gate ? 0 : 8 * i);
    rows.data[i] = (p.up_gate && i == 1 ? m1 : m0).data;
    rows.scale[i] = (p.up_gate && i == 1 ? m1 : m0).scale;
    rows.row[i] = r < out_rows ? r : out_rows - 1;
  }
  auto x_of = [&](int t) {
    return t < n ? p.x + (p.up_gate ? tile[t] / Slots(p) : tile[t]) * p.x_stride : nullptr;
  };
  // The pass's x staged once for the block when it fits (every thread; the caller's barrier
  // after the pass keeps it until every warp is done).
  __shared__ uint4 stage[kTcStageBytes / 16];
  const bool staged = TcStageFits(format, cols, n);
  if (staged) {
    TcStageX(format, stage, cols, n, x_of, nullptr, nullptr);
    __syncthreads();
  }
  const TcLaneX lx{x_of(gl < n ? gl : 0), gl < n, 1.0f, {x_of(2 * tq), x_of(2 * tq + 1)},
                   {1.0f, 1.0f}, nullptr,
                   staged ? stage + (gl < n ? gl : 0) * TcStageStride(format, cols) : nullptr};
  float d[4];
  StreamTileTc<true>(format, rows, cols, lx, lane, 0, 1, d);
#pragma unroll
  for (int q = 0; q < 4; ++q) {
    const int row = gl + (q >= 2 ? 8 : 0), t = 2 * tq + (q & 1);
    if (p.up_gate) {
      if (q < 2 && gl < nout && t < n) p.y[tile[t] * p.y_stride + r_out + gl] = SwiGlu(d[q], d[q + 2], p.limit);
    } else if (row < nout && t < n) {
      p.y[tile[t] * p.y_stride + r_out + row] = d[q];
    }
  }
}

// T = 1 (the decode step) has kStreamBlocksPerSm blocks an SM (on sm_90 two: 128 registers); the
// wider tiles would spill under that cap, so they keep one block an SM.
// kTc: every slot of the launch takes the tensor-core core, 8 slots a pass (an instance of its
// own, NT = 1: the two cores in one body would not fit the decode instance's 128 registers).
template <int NT, bool kTc>
__global__ void __launch_bounds__(kGemvThreads, NT == 1 ? kStreamBlocksPerSm : 1)
    ExpertsKernel(const ExpertsLaunch p) {
  const int per_warp = (kTc ? kTcRows : kWarpRows) / (p.up_gate ? 2 : 1);
  const int64_t block_row = static_cast<int64_t>(blockIdx.x) * kGemvWarps * per_warp;
  AllowDependents();
  // Only the shared expert's weights are known before the router's ids: its slot of token 0
  // (slot k) is the block that streams them.
  if (p.prefetch && p.has_shared && blockIdx.y == p.k) {
    const int64_t left = p.shared_rows - block_row, rows = kGemvWarps * per_warp;
    const int64_t n = left < rows ? left : rows;
    for (int i = 0; i < (p.up_gate ? 2 : 1); ++i)
      PrefetchRows(p.shared_format, p.shared[i].data, p.shared[i].scale, block_row, n,
                   p.shared_cols);
  }
  WaitPredecessors();
  const int s = static_cast<int>(blockIdx.y), key = SlotKey(p, s);
  // The expert's first slot serves this one: the block's threads look at the slots before s
  // together (a decode step of 32 sequences has 224 slots, each block asks).
  __shared__ int served;
  if (threadIdx.x == 0) served = 0;
  __syncthreads();
  for (int e = threadIdx.x; e < s; e += kGemvThreads)
    if (SlotKey(p, e) == key) served = 1;
  __syncthreads();
  if (served) return;
  const bool is_shared = key == p.E;
  const int64_t out_rows = is_shared ? p.shared_rows : p.rows;
  if (block_row >= out_rows) return;
  if (key < 0) {
    const int64_t end = block_row + kGemvWarps * per_warp;
    for (int64_t r = block_row + threadIdx.x; r < end && r < out_rows; r += kGemvThreads)
      p.y[s * p.y_stride + r] = __int_as_float(0x7fc00000);
    return;
  }
  // Two named matrices, not an array: a run-time index would put it in local memory. Scales
  // are null for BF16/F32 experts.
  auto routed = [&](int i) {
    return ExpertMat{p.datas[i][key], p.scales[i] ? p.scales[i][key] : nullptr};
  };
  const ExpertMat m0 = is_shared ? p.shared[0] : routed(0);
  const ExpertMat m1 = !p.up_gate ? m0 : is_shared ? p.shared[1] : routed(1);
  const int lane = threadIdx.x % 32;
  const int64_t r_out = block_row + (threadIdx.x / 32) * per_warp;
  const int64_t left = out_rows - r_out;
  const int nout = left <= 0 ? 0 : left < per_warp ? static_cast<int>(left) : per_warp;
  // Warps past the last row stream it again (never stored): every warp takes the same path.
  WarpRows rows;
#pragma unroll
  for (int j = 0; j < kWarpRows; ++j) {
    const ExpertMat& m = p.up_gate && j % 2 == 1 ? m1 : m0;
    const int64_t r = r_out + (p.up_gate ? j / 2 : j);
    rows.data[j] = m.data;
    rows.scale[j] = m.scale;
    rows.row[j] = r < out_rows ? r : out_rows - 1;
  }
  const WeightFormat format = is_shared ? p.shared_format : p.format;
  const bool vec = is_shared ? p.shared_vec : p.vec;
  const int64_t cols = is_shared ? p.shared_cols : p.cols;
  __shared__ int64_t tile[NT > kTcTokens ? NT : kTcTokens];
  __shared__ int64_t tile_n, tile_next;
  const int slots = static_cast<int>(p.T * Slots(p)), per_pass = kTc ? kTcTokens : NT;
  for (int next = s; next < slots;) {
    if (threadIdx.x == 0) {  // the next (up to) per_pass slots of this expert, ascending
      int n = 0, e = next;
      for (; e < slots && n < per_pass; ++e)
        if (SlotKey(p, e) == key) tile[n++] = e;
      tile_n = n;
      tile_next = e;
    }
    __syncthreads();
    const int n = static_cast<int>(tile_n);
    next = tile_next;
    if constexpr (kTc) {
      if (n > 0) ExpertTileTc(p, format, cols, m0, m1, out_rows, r_out, nout, tile, n, lane);
    } else {
      if (n > 0) ExpertTile<NT>(p, format, vec, cols, rows, r_out, nout, tile, n, lane);
    }
    __syncthreads();  // tile is rewritten by the next pass
  }
}

std::string Shape(const char* who, const DevExperts& w) {
  return std::string(who) + ": " + FormatName(w.format) + " experts [" + std::to_string(w.E) +
         " x " + std::to_string(w.rows) + ", " + std::to_string(w.cols) + "]";
}

// Checks the routed set (its shape stands in as a QWeight for the format checks).
Status ValidateExperts(const DevExperts& w, const char* who, const char* name) {
  QWeight q;
  q.format = w.format;
  q.rows = w.rows;
  q.cols = w.cols;
  q.data = w.datas;
  q.scale = reinterpret_cast<const uint8_t*>(w.scales);
  FM_RETURN_IF_ERROR(ValidateWeight(q, std::string(who) + " " + name));
  if (w.E <= 0) return InvalidArgument(Shape(who, w) + ": " + name + " needs E > 0");
  return Status::Ok();
}

// The common checks and launch; `a`/`b` the routed sets (b null for down), `sa`/`sb` the shared
// weights (sb null for down).
Status LaunchExperts(const char* who, const DevExperts& a, const DevExperts* b,
                     const QWeight* sa, const QWeight* sb, const int32_t* ids, int64_t T,
                     int64_t k, const float* x, int64_t x_stride, int64_t x_width, float limit,
                     float* y, int64_t y_stride) {
  const std::string w = who;
  if (T < 0 || k < 0) return InvalidArgument(w + ": tokens " + std::to_string(T) + ", k " + std::to_string(k) + " (want >= 0)");
  if (k == 0 && !sa) return InvalidArgument(w + ": k 0 and no shared expert: nothing to compute");
  ExpertsLaunch p{};
  p.up_gate = b != nullptr;
  if (k > 0) {
    FM_RETURN_IF_ERROR(ValidateExperts(a, who, p.up_gate ? "w1" : "w2"));
    if (b) {
      FM_RETURN_IF_ERROR(ValidateExperts(*b, who, "w3"));
      if (b->format != a.format || b->rows != a.rows || b->cols != a.cols || b->E != a.E)
        return InvalidArgument(Shape(who, *b) + ": w3 differs from w1 " + Shape(who, a));
    }
    if (!ids) return InvalidArgument(w + ": ids must be a device pointer, got null");
  }
  if (sa) {
    FM_RETURN_IF_ERROR(ValidateWeight(*sa, w + (b ? " shared w1" : " shared w2")));
    if (sb) {
      FM_RETURN_IF_ERROR(ValidateWeight(*sb, w + " shared w3"));
      if (sb->format != sa->format || sb->rows != sa->rows || sb->cols != sa->cols)
        return InvalidArgument(w + ": shared w3 [" + std::to_string(sb->rows) + ", " + std::to_string(sb->cols) + "] differs from shared w1");
    }
    if (p.up_gate && k > 0 && sa->cols != a.cols)
      return InvalidArgument(w + ": shared expert cols " + std::to_string(sa->cols) + " != routed cols " + std::to_string(a.cols));
    if (!p.up_gate && k > 0 && sa->rows != a.rows)
      return InvalidArgument(w + ": shared w2 rows " + std::to_string(sa->rows) + " != routed rows " + std::to_string(a.rows));
  }
  const int64_t cols = std::max(k > 0 ? a.cols : 0, sa ? sa->cols : 0);
  const int64_t out_rows = std::max(k > 0 ? a.rows : 0, sa ? sa->rows : 0);
  if (cols > x_width) return InvalidArgument(w + ": x rows of " + std::to_string(x_width) + " floats for " + std::to_string(cols) + " columns");
  if (!(limit > 0.0f)) return InvalidArgument(w + ": limit must be > 0 (+inf: no clamp)");
  if (y_stride < out_rows)
    return InvalidArgument(w + ": output stride " + std::to_string(y_stride) + " < " + std::to_string(out_rows) + " rows");
  const int64_t slots = T * (k + (sa ? 1 : 0));
  if (slots > 65535) return InvalidArgument(w + ": " + std::to_string(slots) + " slots > 65535");
  if (T == 0) return Status::Ok();
  if (!x || !y) return InvalidArgument(w + ": x and the output must be device pointers, got null");
  const bool x_vec = Aligned16(x) && (x_stride * 4) % 16 == 0;
  p.format = a.format;
  p.vec = x_vec && VectorCols(a.format, a.cols);  // DeviceWeight buffers are 256-byte aligned
  p.rows = a.rows, p.cols = a.cols, p.E = k > 0 ? a.E : 0;
  p.datas[0] = a.datas, p.scales[0] = a.scales;
  if (b) p.datas[1] = b->datas, p.scales[1] = b->scales;
  p.has_shared = sa != nullptr;
  if (sa) {
    p.shared_format = sa->format;
    p.shared_vec = x_vec && Aligned16(sa->data) && (!sb || Aligned16(sb->data)) && VectorCols(sa->format, sa->cols);
    p.shared_rows = sa->rows, p.shared_cols = sa->cols;
    p.shared[0] = ExpertMat{sa->data, sa->scale};
    if (sb) p.shared[1] = ExpertMat{sb->data, sb->scale};
  }
  p.limit = limit;
  p.ids = ids;
  p.T = T, p.k = k;
  p.x = x, p.x_stride = x_stride, p.y = y, p.y_stride = y_stride;
  p.prefetch = launch_overlap.load(std::memory_order_relaxed);
  // The tensor-core core when asked for and every weight of the launch takes it.
  const bool tc = GetWeightPath() == WeightPath::kTensorCore &&
                  (k == 0 || (p.vec && TcFormat(a.format))) &&
                  (!sa || (p.shared_vec && TcFormat(sa->format)));
  const int64_t block_rows = kGemvWarps * (tc ? kTcRows : kWarpRows) / (p.up_gate ? 2 : 1);
  const dim3 grid(static_cast<unsigned>((out_rows + block_rows - 1) / block_rows), static_cast<unsigned>(slots));
  // An expert has at most T slots in practice (one per token). While the step's routed picks
  // do not outnumber the experts (decode batches: T k <= E), nearly every expert has one slot,
  // and a wider tile would multiply its decode work by idle tokens; only the shared expert
  // then makes T passes (over weights L2 keeps).
  switch (tc ? 0 : k > 0 && T * k <= a.E ? 1 : TokenTile(T)) {
    case 0: return Launch("ExpertsKernel", ExpertsKernel<1, true>, grid, kGemvThreads, 0, p);
    case 1: return Launch("ExpertsKernel", ExpertsKernel<1, false>, grid, kGemvThreads, 0, p);
    case 2: return Launch("ExpertsKernel", ExpertsKernel<2, false>, grid, kGemvThreads, 0, p);
    default: return Launch("ExpertsKernel", ExpertsKernel<4, false>, grid, kGemvThreads, 0, p);
  }
}

}  // namespace

Status ExpertsUpGate(const DevExperts& w1, const DevExperts& w3, const int32_t* ids, int64_t T,
                     int64_t k, const float* x, int64_t x_stride, float limit,
                     const SharedExpert* shared, float* h, int64_t h_stride) {
  const int64_t width = T > 1 ? x_stride : (k > 0 ? w1.cols : shared ? shared->w1.cols : 0);
  return LaunchExperts("ExpertsUpGate", w1, &w3, shared ? &shared->w1 : nullptr,
                       shared ? &shared->w3 : nullptr, ids, T, k, x, x_stride, width, limit, h,
                       h_stride);
}

Status ExpertsDown(const DevExperts& w2, const int32_t* ids, int64_t T, int64_t k, const float* h,
                   int64_t h_stride, const SharedExpert* shared, float* contrib) {
  const int64_t H = k > 0 ? w2.rows : shared ? shared->w2.rows : 0;
  return LaunchExperts("ExpertsDown", w2, nullptr, shared ? &shared->w2 : nullptr, nullptr, ids,
                       T, k, h, h_stride, h_stride, std::numeric_limits<float>::infinity(),
                       contrib, H);
}

}  // namespace fm::cuda
