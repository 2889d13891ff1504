// Keep-quant GEMV/GEMM on CUDA: y_t[r] = sum_c W_real[r, c] * x_t[c] for T tokens, through the
// weight-streaming core of gemv_core.cuh (4 rows a warp, 8 rows of 16-byte loads in flight a
// lane, each weight decoded once for up to 4 tokens). One kernel serves Gemv, Gemm and
// GemmMany: a launch carries up to kMaxGemvTasks products (their own weights, x and y) by
// value, so a captured graph bakes them, and blocks map to (task, row block) through a prefix
// table. A task with few rows splits each row among 2-8 warps of its block (its `slices`), so
// even a [1024, 4096] product keeps every SM streaming. With SetWeightPath(kTensorCore) an FP8 or
// FP4 task runs on gemv_tc.cuh instead (16-row tiles, 8 tokens a pass, TcSlices), in the same
// launch as the other formats' tasks.
#include <cuda_runtime.h>

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <string>

#include "kernels/cuda/check.cuh"
#include "kernels/cuda/gemv_core.cuh"
#include "kernels/cuda/gemv_tc.cuh"
#include "kernels/cuda/launch.cuh"
#include "kernels/cuda/ops.h"
#include "kernels/cuda/router.cuh"

namespace fm::cuda {
namespace {

// One product as the kernel reads it: rows [row0, row0 + rows) of a [*, cols] weight.
struct GemvTaskK {
  WeightFormat format;
  bool vec;
  bool tc;  // the tensor-core core (gemv_tc.cuh): 16-row tiles, 8 tokens a pass
  const void* data;
  const uint8_t* scale;
  int64_t row0, rows, cols;
  const float* x;
  int64_t x_stride;
  float* y;
  int64_t y_stride;
  int slices;  // warps sharing each row group (1, 2, 4 or 8); a block has 8 / slices groups
};

std::atomic<WeightPath> g_weight_path{WeightPath::kFma};

struct GemvLaunch {
  GemvTaskK task[kMaxGemvTasks];
  int64_t block_end[kMaxGemvTasks];  // block_end[i]: the first block past task i's blocks
  int ntasks;
  int64_t T;
  const float* norm;  // RMSNorm weight [cols] of every task's x, or null
  float eps;
  bool prefetch;  // launch overlap (launch.cuh): the block's weight rows into L2 before the wait
  RouterParams route;    // GateRouterTopK: the router over task 0's y (its logits)
  int32_t* route_count;  // its block counter; null: no router
};

// inv[t] = 1 / sqrt(mean(x_t^2) + eps) for tokens t0..t0+n-1 into shared memory, summed in
// RmsNormKernel's order (thread c takes columns c, c + 256, ...; warps xor-reduce; the 8 warp
// sums in order), so the prologue gives RmsNorm's bits. Every thread of the block calls it.
__device__ void TileInvRms(const float* x, int64_t x_stride, int64_t t0, int64_t n, int64_t cols,
                           float eps, float* inv) {
  __shared__ float warp_sums[kGemvWarps];
  for (int64_t t = 0; t < n; ++t) {
    const float* xr = x + (t0 + t) * x_stride;
    float ss = 0.0f;
    for (int64_t c = threadIdx.x; c < cols; c += kGemvThreads) ss += xr[c] * xr[c];
    ss = WarpSum(ss);
    if (threadIdx.x % 32 == 0) warp_sums[threadIdx.x / 32] = ss;
    __syncthreads();
    if (threadIdx.x == 0) {
      float total = 0.0f;
      for (int w = 0; w < kGemvWarps; ++w) total += warp_sums[w];
      inv[t] = 1.0f / sqrtf(total / static_cast<float>(cols) + eps);
    }
    __syncthreads();
  }
}

// Tokens t0..t0+NT-1 (those >= T repeat token t0 and are not stored) of the warp's rows, its
// slice of them; with slices, the group's first warp sums the slices' sums in slice order.
template <int NT>
__device__ void TaskTile(const GemvTaskK& k, const WarpRows& rows, int64_t r_rel, int nrows,
                         int64_t t0, int64_t T, const float* g, const float* inv_sh, int lane,
                         int slice) {
  __shared__ float slice_sums[kGemvWarps][kWarpRows][NT];
  const float* xs[NT];
  float inv[NT];
#pragma unroll
  for (int t = 0; t < NT; ++t) {
    xs[t] = k.x + (t0 + t < T ? t0 + t : t0) * k.x_stride;
    inv[t] = g ? inv_sh[t] : 1.0f;
  }
  float acc[kWarpRows][NT];
  StreamRows<NT>(k.format, k.vec, rows, k.cols, xs, g, inv, lane, slice, k.slices, acc);
  const int warp = threadIdx.x / 32;
#pragma unroll
  for (int i = 0; i < kWarpRows; ++i)
#pragma unroll
    for (int t = 0; t < NT; ++t) {
      float s = WarpSum(acc[i][t]);
      if (k.slices == 1) {
        if (lane == 0 && i < nrows && t0 + t < T) k.y[(t0 + t) * k.y_stride + r_rel + i] = s;
      } else if (lane == 0) {
        slice_sums[warp][i][t] = s;
      }
    }
  if (k.slices == 1) return;
  __syncthreads();
  if (slice == 0 && lane < kWarpRows * NT) {
    const int i = lane / NT, t = lane % NT;
    float s = slice_sums[warp][i][t];
    for (int w = 1; w < k.slices; ++w) s += slice_sums[warp + w][i][t];
    if (i < nrows && t0 + t < T) k.y[(t0 + t) * k.y_stride + r_rel + i] = s;
  }
  __syncthreads();  // slice_sums is rewritten by the next tile
}

// Tensor-core twin of TaskTile: tokens t0..t0+7 (those >= T idle) of the warp's 16-row tile
// at r_rel, its slice of the columns; the tile's first warp sums the slices in slice order.
// stage: the tokens' staged x (TcStageX), or null (always, unless kMayStage).
template <bool kMayStage>
__device__ void TcTaskTile(const GemvTaskK& k, int64_t r_rel, int64_t t0, int64_t T,
                          const float* g, const float* inv_sh, const uint4* stage, int lane,
                          int slice) {
  __shared__ float tc_sums[kGemvWarps][32][4];
  const int gl = lane >> 2, tq = lane & 3;
  TcRows rows;
#pragma unroll
  for (int i = 0; i < 2; ++i) {
    const int64_t r = r_rel + gl + 8 * i;
    rows.data[i] = k.data;
    rows.scale[i] = k.scale;
    rows.row[i] = k.row0 + (r < k.rows ? r : k.rows - 1);
  }
  auto x_of = [&](int t) { return t0 + t < T ? k.x + (t0 + t) * k.x_stride : nullptr; };
  auto inv_of = [&](int t) { return g ? inv_sh[t] : 1.0f; };
  const bool live_g = t0 + gl < T;
  const TcLaneX lx{x_of(live_g ? gl : 0), live_g, inv_of(live_g ? gl : 0),
                   {x_of(2 * tq), x_of(2 * tq + 1)}, {inv_of(2 * tq), inv_of(2 * tq + 1)}, g,
                   stage ? stage + (live_g ? gl : 0) * TcStageStride(k.format, k.cols) : nullptr};
  float d[4];
  // FP4 (tests and benches only: a checkpoint's FP4 weights are routed experts) 2 steps ahead
  // in the staging instance, which spilled on sm_90 with kTcAhead.
  StreamTileTc<kMayStage, kMayStage ? 2 : kTcAhead>(k.format, rows, k.cols, lx, lane, slice,
                                                     k.slices, d);
  if (k.slices > 1) {
    const int warp = threadIdx.x / 32;
#pragma unroll
    for (int q = 0; q < 4; ++q) tc_sums[warp][lane][q] = d[q];
    __syncthreads();
    if (slice == 0)
      for (int w = 1; w < k.slices; ++w)
#pragma unroll
        for (int q = 0; q < 4; ++q) d[q] += tc_sums[warp + w][lane][q];
    __syncthreads();  // tc_sums is rewritten by the next tile
  }
  if (slice != 0) return;
#pragma unroll
  for (int q = 0; q < 4; ++q) {
    const int64_t r = r_rel + gl + (q >= 2 ? 8 : 0), t = t0 + 2 * tq + (q & 1);
    if (r < k.rows && t < T) k.y[t * k.y_stride + r] = d[q];
  }
}

// A tensor-core task's block: 8 / slices tiles of 16 rows, all T tokens 8 at a time, with
// kMayStage each pass's x staged in shared memory first when it fits. (The launch that mixes
// cores leaves staging out: it would not fit that kernel's registers with the FMA core.)
template <bool kMayStage>
__device__ void TcTaskBlock(const GemvLaunch& p, const GemvTaskK& k, int64_t block, int lane,
                            int warp, int slice) {
  __shared__ float inv_sh[kTcTokens];
  __shared__ uint4 stage[kTcStageBytes / 16];
  const int64_t r_rel = (block * (kGemvWarps / k.slices) + warp / k.slices) * kTcRows;
  for (int64_t t0 = 0; t0 < p.T; t0 += kTcTokens) {
    const int n = static_cast<int>(p.T - t0 < kTcTokens ? p.T - t0 : kTcTokens);
    if (p.norm) TileInvRms(k.x, k.x_stride, t0, n, k.cols, p.eps, inv_sh);
    const bool staged = kMayStage && TcStageFits(k.format, k.cols, n);
    if (staged) {
      TcStageX(k.format, stage, k.cols, n, [&](int i) { return k.x + (t0 + i) * k.x_stride; },
               p.norm, inv_sh);
      __syncthreads();
    }
    TcTaskTile<kMayStage>(k, r_rel, t0, p.T, p.norm, inv_sh, staged ? stage : nullptr, lane, slice);
    if (p.norm || staged) __syncthreads();  // inv_sh and stage are rewritten by the next tile
  }
}

// An FMA task's block: 8 / slices groups of 4 rows, all T tokens in tiles of NT. Warps past the
// task's last row stream its last row again (never stored), so every warp takes the same path
// through the barriers.
template <int NT>
__device__ void FmaTaskBlock(const GemvLaunch& p, const GemvTaskK& k, int64_t block, int lane,
                             int warp, int slice) {
  const int64_t r_rel = (block * (kGemvWarps / k.slices) + warp / k.slices) * kWarpRows;
  const int64_t left = k.rows - r_rel;
  const int nrows = left <= 0 ? 0 : left < kWarpRows ? static_cast<int>(left) : kWarpRows;
  WarpRows rows;
#pragma unroll
  for (int j = 0; j < kWarpRows; ++j) {
    rows.data[j] = k.data;
    rows.scale[j] = k.scale;
    rows.row[j] = k.row0 + (r_rel + j < k.rows ? r_rel + j : k.rows - 1);
  }
  __shared__ float inv_sh[NT];
  for (int64_t t0 = 0; t0 < p.T; t0 += NT) {
    if (p.norm) TileInvRms(k.x, k.x_stride, t0, p.T - t0 < NT ? p.T - t0 : NT, k.cols, p.eps, inv_sh);
    TaskTile<NT>(k, rows, r_rel, nrows, t0, p.T, p.norm, inv_sh, lane, slice);
    if (p.norm) __syncthreads();  // inv_sh is rewritten by the next tile
  }
}

// The router after the gate's product (GateRouterTopK): the last block to finish (the counter,
// which it resets) routes every token, warp w tokens w, w + 8, ... (every warp makes the same
// passes: the emulation's shuffles are block-wide). Only in the FMA instance of kRouteTile
// tokens a pass: in the 4-token one it spilled 100 bytes under the 128-register cap, and the
// 1-token one is the decode products' (on sm_121, under that cap, it already spilled). At most
// kRouteMaxTokens (one block routes them 8 at a time); a longer step takes RouterTopK's launch.
constexpr int kRouteTile = 2;
constexpr int64_t kRouteMaxTokens = 32;
__device__ void RouteAfterLastBlock(const RouterParams r, const float* logits, int64_t T,
                                    int32_t* counter) {
  __shared__ bool last;
  __threadfence();
  __syncthreads();
  if (threadIdx.x == 0) last = atomicAdd(counter, 1) == static_cast<int>(gridDim.x) - 1;
  __syncthreads();
  if (!last) return;
  __threadfence();
  if (threadIdx.x == 0) *counter = 0;
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  for (int64_t t0 = 0; t0 < T; t0 += kGemvWarps)
    RouteToken(r, logits, t0 + warp, t0 + warp < T, lane);
}

// Which cores a launch's tasks take; each combination is an instance of its own, so FMA-only
// launches keep their registers and tensor-core-only ones carry no FMA body.
enum GemvCores { kFmaTasks, kMixedTasks, kTcTasks };

// Block b: task i with block_end[i-1] <= b < block_end[i], its row block b - block_end[i-1].
// kStreamBlocksPerSm blocks an SM: every instance fits its register cap without spills (the
// build fails on a spill: kernels/cuda/CMakeLists.txt).
template <int NT, int kCores>
__global__ void __launch_bounds__(kGemvThreads, kStreamBlocksPerSm)
    GemvTasksKernel(const GemvLaunch p) {
  int i = 0;
  while (i + 1 < p.ntasks && blockIdx.x >= p.block_end[i]) ++i;
  const GemvTaskK& k = p.task[i];
  const int64_t block = blockIdx.x - (i > 0 ? p.block_end[i - 1] : 0);
  const int lane = threadIdx.x % 32, warp = threadIdx.x / 32, slice = warp % k.slices;
  AllowDependents();
  if (p.prefetch) {
    const int64_t block_rows = kGemvWarps / k.slices * (k.tc ? kTcRows : kWarpRows);
    const int64_t first = block * block_rows, left = k.rows - first;
    PrefetchRows(k.format, k.data, k.scale, k.row0 + first, left < block_rows ? left : block_rows,
                 k.cols);
  }
  WaitPredecessors();
  if constexpr (kCores == kTcTasks) {
    return TcTaskBlock<true>(p, k, block, lane, warp, slice);
  } else {
    if (kCores == kMixedTasks && k.tc) return TcTaskBlock<false>(p, k, block, lane, warp, slice);
    FmaTaskBlock<NT>(p, k, block, lane, warp, slice);
    if constexpr (kCores == kFmaTasks && NT == kRouteTile)
      if (p.route_count) RouteAfterLastBlock(p.route, p.task[0].y, p.T, p.route_count);
  }
}

// The kCores instance for the launch's token tile NT (TokenTile). A launch that mixes cores
// takes its FMA tasks (the small BF16/F32 products beside tensor-core ones) 2 tokens a pass at
// most: its 4-token instance spilled on sm_90 under the 128-register cap (ptxas -v). A token's
// bits do not depend on the tile.
template <int kCores>
Status LaunchWithTile(int nt, unsigned grid, const GemvLaunch& p) {
  constexpr int kWidest = kCores == kMixedTasks ? 2 : kTokenTile;
  if (nt == 1)
    return Launch("GemvTasksKernel", GemvTasksKernel<1, kCores>, grid, kGemvThreads, 0, p);
  if (nt == 2 || kWidest == 2)
    return Launch("GemvTasksKernel", GemvTasksKernel<2, kCores>, grid, kGemvThreads, 0, p);
  return Launch("GemvTasksKernel", GemvTasksKernel<kWidest, kCores>, grid, kGemvThreads, 0, p);
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

// Warps sharing each 4-row group of a [rows, cols] product: doubled from 1 while the launch's
// warps stay under kTargetWarps and each lane keeps at least one 16-byte vector of every row
// (for the shapes only, so a token's bits never depend on T).
int RowSlices(int64_t rows, int64_t cols, WeightFormat format) {
  const int64_t groups = (rows + kWarpRows - 1) / kWarpRows, vectors = cols / VecElems(format);
  int s = 1;
  while (s < kGemvWarps && groups * s < kTargetWarps && vectors >= 64 * s) s *= 2;
  return s;
}

// Checks task i and fills its kernel view; `who` names the op in errors.
Status PrepareTask(const GemvTask& task, int64_t T, const float* norm, const std::string& who,
                   GemvTaskK* k) {
  FM_RETURN_IF_ERROR(ValidateWeight(task.w, who));
  const QWeight& w = task.w;
  const int64_t rows = task.rows > 0 ? task.rows : w.rows - task.row0;
  if (task.row0 < 0 || task.rows < 0 || rows <= 0 || task.row0 + rows > w.rows)
    return InvalidArgument(who + ": rows [" + std::to_string(task.row0) + ", +" +
                           std::to_string(task.rows) + ") outside the weight's " +
                           std::to_string(w.rows) + " rows");
  if (T > 1 && (task.x_stride < w.cols || task.y_stride < rows))
    return InvalidArgument(who + ": strides x " + std::to_string(task.x_stride) + ", y " +
                           std::to_string(task.y_stride) + " for a [" + std::to_string(w.rows) +
                           ", " + std::to_string(w.cols) + "] weight (want x >= cols, y >= rows)");
  if (task.plan_rows < 0)
    return InvalidArgument(who + ": plan_rows " + std::to_string(task.plan_rows) + " < 0");
  if (!task.x || !task.y)
    return InvalidArgument(who + ": x and y must be device pointers, got null");
  const bool x_vec = Aligned16(task.x) && (T == 1 || (task.x_stride * 4) % 16 == 0);
  const bool vec = x_vec && (!norm || Aligned16(norm)) && Aligned16(w.data) &&
                   VectorCols(w.format, w.cols);
  // The tensor-core core also for T = 1 only with a stride that keeps every x_t aligned, so a
  // token's core (and bits) never depend on T.
  const bool tc = vec && (task.x_stride * 4) % 16 == 0 && w.cols < (int64_t{1} << 31) &&
                  TcFormat(w.format) && GetWeightPath() == WeightPath::kTensorCore;
  const int64_t plan = task.plan_rows > 0 ? task.plan_rows : rows;
  *k = GemvTaskK{w.format, vec, tc, w.data, w.scale, task.row0, rows, w.cols, task.x,
                 task.x_stride, task.y, task.y_stride,
                 tc ? TcSlices(plan, w.cols, w.format) : RowSlices(plan, w.cols, w.format)};
  return Status::Ok();
}

int64_t FloorDiv(int64_t a, int64_t b) { return a >= 0 ? a / b : -((-a + b - 1) / b); }  // b > 0

// Floats a + t * sa + [0, la) for t < na, and b + t * sb + [0, lb) for t < nb: do the two sets
// share a byte? One pass over the first set's rows, each asking which rows of the second can
// reach it.
bool RowsOverlap(const float* a, int64_t la, int64_t sa, int64_t na, const float* b, int64_t lb,
                 int64_t sb, int64_t nb) {
  const int64_t d = static_cast<int64_t>(reinterpret_cast<uintptr_t>(b) -
                                         reinterpret_cast<uintptr_t>(a));  // bytes
  la *= 4, sa *= 4, lb *= 4, sb *= 4;
  if (sb == 0) nb = 1;
  // Apart as wholes (the usual case: separate buffers): no row can meet.
  if (d >= (na - 1) * sa + la || -d >= (nb - 1) * sb + lb) return false;
  for (int64_t t = 0; t < na; ++t) {
    const int64_t lo = t * sa - d, hi = lo + la;  // row t of a, in bytes from b: [lo, hi)
    if (nb == 1) {
      if (lo < lb && hi > 0) return true;
      continue;
    }
    // Rows u of b with u * sb < hi and u * sb + lb > lo.
    const int64_t u0 = std::max<int64_t>(0, FloorDiv(lo - lb, sb) + 1);
    const int64_t u1 = std::min<int64_t>(nb, -FloorDiv(-hi, sb));
    if (u0 < u1) return true;
  }
  return false;
}

// Blocks of one launch read every task's x (and the norm) through the non-coherent cache while
// others write the y's, so an output that is also an input is a race on a GPU (the emulation,
// running blocks one after another, cannot show it): refused.
Status CheckNoOutputIsAnInput(const GemvTaskK* k, int ntasks, int64_t T, const float* norm,
                              const std::string& who) {
  for (int i = 0; i < ntasks; ++i) {
    const int64_t y_len = k[i].rows, y_stride = T > 1 ? k[i].y_stride : 0;
    for (int j = 0; j < ntasks; ++j) {
      if (RowsOverlap(k[i].y, y_len, y_stride, T, k[j].x, k[j].cols, T > 1 ? k[j].x_stride : 0, T))
        return InvalidArgument(who + ": task " + std::to_string(i) + "'s y overlaps task " +
                               std::to_string(j) + "'s x (an output may not be an input)");
    }
    if (norm && RowsOverlap(k[i].y, y_len, y_stride, T, norm, k[i].cols, 0, 1))
      return InvalidArgument(who + ": task " + std::to_string(i) + "'s y overlaps the norm weight");
  }
  return Status::Ok();
}

// With `route` (GateRouterTopK: one task, its y the logits [T, E]) the FMA instance routes the
// tokens after the product; a tensor-core gate or more than kRouteMaxTokens tokens run
// RouterTopK's launch after it instead.
Status LaunchTasks(const GemvTask* tasks, int64_t ntasks, int64_t T, const float* norm, float eps,
                   const std::string& who, const RouterParams* route = nullptr,
                   int32_t* route_count = nullptr) {
  if (ntasks < 1 || ntasks > kMaxGemvTasks || !tasks)
    return InvalidArgument(who + ": " + std::to_string(ntasks) + " tasks (want 1.." +
                           std::to_string(kMaxGemvTasks) + ")");
  if (T < 0) return InvalidArgument(who + ": tokens " + std::to_string(T) + " < 0");
  if (norm && !(eps >= 0.0f)) return InvalidArgument(who + ": eps must be >= 0");
  GemvLaunch p{};
  int64_t blocks = 0;
  for (int64_t i = 0; i < ntasks; ++i) {
    const std::string name = ntasks > 1 ? who + " task " + std::to_string(i) : who;
    if (T == 0) {
      FM_RETURN_IF_ERROR(ValidateWeight(tasks[i].w, name));
      continue;
    }
    FM_RETURN_IF_ERROR(PrepareTask(tasks[i], T, norm, name, &p.task[i]));
    if (norm && tasks[i].w.cols != tasks[0].w.cols)
      return InvalidArgument(name + ": cols " + std::to_string(tasks[i].w.cols) +
                             " differ from task 0's " + std::to_string(tasks[0].w.cols) +
                             " (the norm weight has one length)");
    const int64_t block_rows = kGemvWarps / p.task[i].slices * (p.task[i].tc ? kTcRows : kWarpRows);
    blocks += (p.task[i].rows + block_rows - 1) / block_rows;
    p.block_end[i] = blocks;
  }
  if (T == 0) return Status::Ok();
  FM_RETURN_IF_ERROR(CheckNoOutputIsAnInput(p.task, static_cast<int>(ntasks), T, norm, who));
  if (blocks > 0x7FFFFFFF) return InvalidArgument(who + ": " + std::to_string(blocks) + " blocks");
  p.ntasks = static_cast<int>(ntasks);
  p.T = T;
  p.norm = norm;
  p.eps = eps;
  p.prefetch = launch_overlap.load(std::memory_order_relaxed);
  const unsigned grid = static_cast<unsigned>(blocks);
  int tc_tasks = 0;
  for (int i = 0; i < p.ntasks; ++i) tc_tasks += p.task[i].tc ? 1 : 0;
  // The router rides in the kRouteTile FMA instance (RouteAfterLastBlock), or launches after.
  const bool route_inside = route && tc_tasks == 0 && T <= kRouteMaxTokens;
  if (route_inside) p.route = *route, p.route_count = route_count;
  auto launch = [&]() -> Status {
    if (tc_tasks == p.ntasks)  // the tensor-core core serves 8 tokens a pass whatever T is
      return Launch("GemvTasksKernel", GemvTasksKernel<1, kTcTasks>, grid, kGemvThreads, 0, p);
    if (tc_tasks > 0) return LaunchWithTile<kMixedTasks>(TokenTile(T), grid, p);
    return LaunchWithTile<kFmaTasks>(route_inside ? kRouteTile : TokenTile(T), grid, p);
  };
  FM_RETURN_IF_ERROR(launch());
  if (!route || route_inside) return Status::Ok();
  const RouterParams& r = *route;
  return RouterTopK(p.task[0].y, r.bias, r.tid2eid, r.tokens, r.vocab, T, r.E, r.k,
                    r.routed_scale, r.ids, r.w);
}

}  // namespace

void SetWeightPath(WeightPath path) { g_weight_path.store(path); }
WeightPath GetWeightPath() { return g_weight_path.load(); }
void SetLaunchOverlap(bool on) { launch_overlap.store(on); }
bool GetLaunchOverlap() { return launch_overlap.load(); }

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

Status Gemm(const QWeight& w, const float* x, int64_t x_stride, float* y, int64_t y_stride,
            int64_t T) {
  const GemvTask task{w, x, x_stride, y, y_stride};
  return LaunchTasks(&task, 1, T, nullptr, 0.0f, "Gemm");
}

Status Gemv(const QWeight& w, const float* x, float* y) { return Gemm(w, x, 0, y, 0, 1); }

Status GemmMany(const GemvTask* tasks, int64_t n, int64_t T, const float* norm, float eps) {
  return LaunchTasks(tasks, n, T, norm, eps, "GemmMany");
}

Status GateRouterTopK(const QWeight& gate, const float* x, int64_t x_stride, int64_t T,
                      float* logits, const float* bias, const int64_t* tid2eid,
                      const int32_t* tokens, int64_t vocab, int64_t k, float routed_scale,
                      int32_t* ids, float* w, int32_t* counter) {
  const RouterParams r{bias, tid2eid, tokens, vocab, gate.rows, k, routed_scale, ids, w};
  FM_RETURN_IF_ERROR(CheckRouter("GateRouterTopK", T, r));
  if (!counter) return InvalidArgument("GateRouterTopK: null block counter");
  const GemvTask task{gate, x, x_stride, logits, gate.rows};
  return LaunchTasks(&task, 1, T, nullptr, 0.0f, "GateRouterTopK", &r, counter);
}

}  // namespace fm::cuda
