// The attention side of the device decode layer (kernels/cuda/fused_ops.h): the Lightning
// indexer's top-k and the decode attention with its sink and inverse RoPE, every row of a step
// in one launch each. Conventions in fused_common.cuh.
#include <cuda_runtime.h>

#include <algorithm>
#include <string>

#include "kernels/cuda/check.cuh"
#include "kernels/cuda/fused_common.cuh"
#include "kernels/cuda/fused_ops.h"
#include "kernels/cuda/launch.cuh"
#include "kernels/cuda/top_k.cuh"

namespace fm::cuda {
namespace {

using namespace fused;

constexpr int kAttnMaxDim = 512;
constexpr int kAttnPerLane = kAttnMaxDim / 32;  // a key's elements a lane holds
constexpr int kAttnBatch = 4;  // keys a warp of SinkAttentionRows scores at once
// IndexerTopK: a block scores kIndexKeys keys x kIndexHeads heads at a time, kIndexSlab
// columns staged at once; a step's rows share up to kIndexMaxBlocks blocks (at least one a row).
constexpr int kIndexKeys = 64, kIndexHeads = 64, kIndexSlab = 32;
constexpr int kIndexPad = kIndexKeys + 4;  // a staged row's floats
constexpr int64_t kIndexMaxBlocks = 256;
static_assert(kIndexKeys == 64 && kIndexHeads == 64 && kThreads == 256,
              "IndexerScoreKeys: 256 threads of 4 x 4 dots cover 64 heads x 64 keys");
static_assert(kThreads == kTopKThreads, "IndexerTopK's last block ranks with BlockTopK");

// Row t's scores of keys [e0, e0 + kIndexKeys) into score (those below n): the block's
// [kIndexHeads, kIndexKeys] dot products a head pass at a time, thread (hy, kx) holding heads
// 4 hy.. x keys 4 kx.. in registers, over columns staged kIndexSlab at a time in shared memory;
// each dot a single chain over c ascending (as one thread's loop: the same bits), then thread
// e sums key e's terms over h ascending: sum_h (relu(dot) * scale) * w[h].
__device__ void IndexerScoreKeys(const float* q, const float* w, int nh, int di, float scale,
                                 const float* ikeys, int64_t e0, int n, float* score) {
  // q_s[j][h] = q[h0 + h][c0 + j], k_s[j][e] = key e0 + e's column c0 + j: rows padded to
  // kIndexPad floats (16-byte aligned for the float4 reads, 4-way store conflicts at most).
  alignas(16) __shared__ float q_s[kIndexSlab][kIndexPad];
  alignas(16) __shared__ float k_s[kIndexSlab][kIndexPad];
  alignas(16) __shared__ float dots[kIndexHeads][kIndexKeys];
  const int tid = threadIdx.x, kx = tid % 16, hy = tid / 16;
  float acc = 0.0f;  // key e0 + tid's score (tid < kIndexKeys)
  for (int h0 = 0; h0 < nh; h0 += kIndexHeads) {
    float d[4][4] = {};
    for (int c0 = 0; c0 < di; c0 += kIndexSlab) {
      const int cw = min(kIndexSlab, di - c0);  // a multiple of 4 (di is)
      __syncthreads();  // the previous slab (or pass's dots) is read
      // 16-byte loads along a row (8 lanes read a row's 128-byte slab), stored transposed.
      for (int i = tid; i < kIndexSlab / 4 * kIndexKeys; i += kThreads) {
        const int col = i / (kIndexSlab / 4), j = 4 * (i % (kIndexSlab / 4));
        const bool in = j < cw;
        float4 qv{0.0f, 0.0f, 0.0f, 0.0f}, kv{0.0f, 0.0f, 0.0f, 0.0f};
        if (in && h0 + col < nh)
          qv = *reinterpret_cast<const float4*>(q + static_cast<int64_t>(h0 + col) * di + c0 + j);
        if (in && e0 + col < n)
          kv = *reinterpret_cast<const float4*>(ikeys + (e0 + col) * di + c0 + j);
        q_s[j][col] = qv.x, q_s[j + 1][col] = qv.y, q_s[j + 2][col] = qv.z, q_s[j + 3][col] = qv.w;
        k_s[j][col] = kv.x, k_s[j + 1][col] = kv.y, k_s[j + 2][col] = kv.z, k_s[j + 3][col] = kv.w;
      }
      __syncthreads();
      for (int j = 0; j < cw; ++j) {
        const float4 qv = *reinterpret_cast<const float4*>(&q_s[j][4 * hy]);
        const float4 kv = *reinterpret_cast<const float4*>(&k_s[j][4 * kx]);
        const float qa[4] = {qv.x, qv.y, qv.z, qv.w}, ka[4] = {kv.x, kv.y, kv.z, kv.w};
#pragma unroll
        for (int a = 0; a < 4; ++a)
#pragma unroll
          for (int b = 0; b < 4; ++b) d[a][b] += qa[a] * ka[b];
      }
    }
#pragma unroll
    for (int a = 0; a < 4; ++a)
      *reinterpret_cast<float4*>(&dots[4 * hy + a][4 * kx]) =
          float4{d[a][0], d[a][1], d[a][2], d[a][3]};
    __syncthreads();
    if (tid < kIndexKeys)
      for (int h = 0; h < min(kIndexHeads, nh - h0); ++h) {
        const float dot = dots[h][tid];
        acc += ((dot > 0.0f ? dot : 0.0f) * scale) * w[h0 + h];
      }
  }
  if (tid < kIndexKeys && e0 + tid < n) score[e0 + tid] = acc;
}

// Blocks (b, y) of row row0 + y score the key tiles b, b + gridDim.x, ... (IndexerScoreKeys);
// the row's last block picks its top k (top_k.cuh BlockTopK), written ascending. A row of no more than k
// visible entries picks them all, in order, without scores.
__global__ void IndexerTopKKernel(const RowCache* table, int64_t row0, const float* iq,
                                  const float* iw, int nh, int di, float scale, RowSteps steps,
                                  int k, int32_t* picks, int32_t* counters) {
  KernelPrologue();
  __shared__ bool last;
  const int64_t t = row0 + blockIdx.y;
  const RowCache rc = table[t];
  if (rc.max_entries <= k) return;  // this sequence attends every entry
  const int visible = *RowField(steps.visible, steps.stride, t);
  const int n = max(0, min(visible, rc.max_entries));
  if (n <= k) {  // every visible entry, in order
    if (blockIdx.x == 0)
      for (int e = threadIdx.x; e < n; e += kThreads) picks[t * k + e] = e;
    return;
  }
  for (int64_t e0 = static_cast<int64_t>(blockIdx.x) * kIndexKeys; e0 < n;
       e0 += static_cast<int64_t>(gridDim.x) * kIndexKeys)
    IndexerScoreKeys(iq + t * nh * di, iw + t * nh, nh, di, scale, rc.ikeys, e0, n, rc.score);
  // The returns above depend on the row only, so a row's blocks all skip this add or all make
  // it: a counter left off 0 would finish every later step of the row early.
  __threadfence();
  __syncthreads();
  if (threadIdx.x == 0) last = atomicAdd(counters + t, 1) == static_cast<int>(gridDim.x) - 1;
  __syncthreads();
  if (!last) return;
  __threadfence();
  if (threadIdx.x == 0) counters[t] = 0;
  int32_t* row_picks = picks + t * k;
  BlockTopK(rc.score, n, k,
            [&](int slot, int64_t e, uint32_t) { row_picks[slot] = static_cast<int32_t>(e); });
}

// Row t's keys for the decode attention: n of them, the window's ring rows (oldest first), then
// the entries (all, or the indexer's picks), key i's row of table[t].keys from Key(i).
struct AttnKeys {
  const float* keys;
  const int32_t* win;    // {win_start, nwin}
  const int32_t* picks;  // null: entries in order
  int64_t nwin, n, window, d;
  __device__ const float* Key(int64_t i) const {
    const int64_t row = i < nwin ? (win[0] + i) % window
                                 : window + (picks ? picks[i - nwin] : i - nwin);
    return keys + row * d;
  }
};

__device__ AttnKeys AttnKeysOf(const AttentionArgs& a, int64_t t) {
  const RowCache rc = a.table[t];
  const int32_t* win = RowField(a.steps.win, a.steps.stride, t);
  const int64_t nwin = win[1], ne = a.entries ? *RowField(a.steps.entries, a.steps.stride, t) : 0;
  const bool indexed = a.topk > 0 && rc.max_entries > a.topk;
  const int64_t max_keys = a.window + (!a.entries ? 0 : indexed ? a.topk : rc.max_entries);
  const int64_t counted = *RowField(a.steps.keys, a.steps.stride, t);
  int64_t n = nwin + ne < max_keys ? nwin + ne : max_keys;
  n = counted < n ? (counted < 0 ? 0 : counted) : n;
  return AttnKeys{rc.keys, win, indexed ? a.picks + t * a.topk : nullptr, nwin, n, a.window, a.d};
}

// One key's step of a warp's online softmax (max m, sum l) at score s; the caller then updates
// acc with the coefficient cf: true, a new max: acc = acc * cf + key (exp(-inf) = 0 rescales
// nothing on the first key); false: acc += cf * key (NaN scores land here and poison l and acc,
// as on the CPU).
__device__ __forceinline__ bool SoftmaxStep(float s, float& m, float& l, float& cf) {
  if (s > m) {
    cf = expf(m - s);
    l = l * cf + 1.0f;
    m = s;
    return true;
  }
  cf = expf(s - m);
  l += cf;
  return false;
}

// The block's warps' softmax states (each warp's m and l, acc_s row warp) merged in warp order
// with the head's sink, the inverse RoPE of the result, and o[t, h] written. Every thread calls
// it once its warp's acc_s row is written.
__device__ void AttnMergeStore(const AttentionArgs& a, int64_t h, int64_t t,
                               const float (*acc_s)[kAttnMaxDim], float m, float l) {
  __shared__ float wm[kWarps], wl[kWarps];
  __shared__ float o_s[kAttnMaxDim];
  const int64_t d = a.d;
  if (threadIdx.x % 32 == 0) wm[threadIdx.x / 32] = m, wl[threadIdx.x / 32] = l;
  __syncthreads();
  float mx = a.sink[h];
  for (int w = 0; w < kWarps; ++w) mx = wm[w] > mx ? wm[w] : mx;
  float den = expf(a.sink[h] - mx);
  for (int w = 0; w < kWarps; ++w) den += wl[w] * expf(wm[w] - mx);
  for (int64_t c = threadIdx.x; c < d; c += kThreads) {
    float v = 0.0f;
    for (int w = 0; w < kWarps; ++w) v += acc_s[w][c] * expf(wm[w] - mx);
    o_s[c] = v / den;
  }
  __syncthreads();
  RopeRow(o_s, d, a.rd, a.pos[t], a.freqs, true);
  __syncthreads();
  for (int64_t c = threadIdx.x; c < d; c += kThreads) a.o[(t * a.nh + h) * d + c] = o_s[c];
}

// One block per (head h, row row0 + y), for steps of many rows (blocks to fill every SM many
// times over: 32 registers, 8 blocks an SM): warp w takes keys w, w + 8, ... one at a time; per
// key the lanes split the dot product, then the warp's online softmax (acc in shared memory)
// moves on; the warps merge in order.
__global__ void SinkAttentionRowsKernel(AttentionArgs a, int64_t row0) {
  KernelPrologue();
  __shared__ float acc[kWarps][kAttnMaxDim];
  const int64_t h = blockIdx.x, t = row0 + blockIdx.y, d = a.d;
  const int lane = threadIdx.x % 32, warp = threadIdx.x / 32;
  const AttnKeys ks = AttnKeysOf(a, t);
  const float* qh = a.q + (t * a.nh + h) * d;
  for (int64_t c = lane; c < d; c += 32) acc[warp][c] = 0.0f;
  float m = -INFINITY, l = 0.0f;
  for (int64_t i0 = 0; i0 < ks.n; i0 += kWarps) {  // the same trip count in every warp
    const int64_t i = i0 + warp;
    const float* k = i < ks.n ? ks.Key(i) : nullptr;
    float dot = 0.0f;
    if (k)
      for (int64_t c = lane; c < d; c += 32) dot += qh[c] * k[c];
    const float s = WarpSum(dot) * a.scale;
    if (!k) continue;
    float cf;
    if (SoftmaxStep(s, m, l, cf))
      for (int64_t c = lane; c < d; c += 32) acc[warp][c] = acc[warp][c] * cf + k[c];
    else
      for (int64_t c = lane; c < d; c += 32) acc[warp][c] += cf * k[c];
  }
  AttnMergeStore(a, h, t, acc, m, l);
}

// The same for a one-row step (the single-stream decode: a block per head, fewer than the
// SMs, so latency rather than occupancy decides): a warp scores kAttnBatch of its keys at once
// (their loads and butterflies in flight together, q and the warp's acc in registers, lane l
// holding elements l, l + 32, ...), then updates its softmax with them one by one in key order.
// So the bits are SinkAttentionRowsKernel's (the test compares the two bit for bit), and a warp
// waits one round trip per kAttnBatch keys, not per key. 164 registers (sm_90): one block an SM.
__global__ void SinkAttentionRowBatchedKernel(AttentionArgs a, int64_t row0) {
  KernelPrologue();
  __shared__ float acc_s[kWarps][kAttnMaxDim];
  const int64_t h = blockIdx.x, t = row0 + blockIdx.y, d = a.d;
  const int lane = threadIdx.x % 32, warp = threadIdx.x / 32;
  const AttnKeys ks = AttnKeysOf(a, t);
  const float* qh = a.q + (t * a.nh + h) * d;
  float qv[kAttnPerLane], acc[kAttnPerLane];
#pragma unroll
  for (int j = 0; j < kAttnPerLane; ++j) {
    const int64_t c = lane + 32 * j;
    qv[j] = c < d ? qh[c] : 0.0f;
    acc[j] = 0.0f;
  }
  float m = -INFINITY, l = 0.0f;
  for (int64_t i0 = 0; i0 < ks.n; i0 += kWarps * kAttnBatch) {  // the same trips in every warp
    const float* k[kAttnBatch];
    float kv[kAttnBatch][kAttnPerLane], dot[kAttnBatch];
#pragma unroll
    for (int b = 0; b < kAttnBatch; ++b) {
      const int64_t i = i0 + b * kWarps + warp;
      k[b] = i < ks.n ? ks.Key(i) : nullptr;
    }
#pragma unroll
    for (int b = 0; b < kAttnBatch; ++b)
#pragma unroll
      for (int j = 0; j < kAttnPerLane; ++j) {
        const int64_t c = lane + 32 * j;
        kv[b][j] = k[b] && c < d ? k[b][c] : 0.0f;
      }
#pragma unroll
    for (int b = 0; b < kAttnBatch; ++b) {
      dot[b] = 0.0f;
#pragma unroll
      for (int j = 0; j < kAttnPerLane; ++j)
        if (k[b] && lane + 32 * j < d) dot[b] += qv[j] * kv[b][j];
    }
    for (int off = 16; off > 0; off >>= 1)  // kAttnBatch butterflies side by side (WarpSum's)
#pragma unroll
      for (int b = 0; b < kAttnBatch; ++b) dot[b] += __shfl_xor_sync(0xffffffffu, dot[b], off);
#pragma unroll
    for (int b = 0; b < kAttnBatch; ++b) {
      if (!k[b]) break;  // the batch's keys are in order, the missing ones last
      const float s = dot[b] * a.scale;
      float cf;
      const bool rescale = SoftmaxStep(s, m, l, cf);
#pragma unroll
      for (int j = 0; j < kAttnPerLane; ++j)
        if (lane + 32 * j < d) acc[j] = rescale ? acc[j] * cf + kv[b][j] : acc[j] + cf * kv[b][j];
    }
  }
#pragma unroll
  for (int j = 0; j < kAttnPerLane; ++j)
    if (lane + 32 * j < d) acc_s[warp][lane + 32 * j] = acc[j];
  AttnMergeStore(a, h, t, acc_s, m, l);
}

}  // namespace

Status IndexerTopK(const RowCache* table, int64_t row0, int64_t rows, const float* iq,
                   const float* iw, int64_t nh, int64_t di, float scale, const RowSteps& steps,
                   int64_t max_entries, int64_t k, int32_t* picks, int32_t* counters) {
  FM_RETURN_IF_ERROR(CheckRows("IndexerTopK", table, row0, rows));
  if (nh < 1 || di < 1 || di % 4 != 0 || k < 1 || max_entries < 0 ||
      nh * di > (int64_t{1} << 24) || max_entries > (int64_t{1} << 30))
    return InvalidArgument("IndexerTopK: heads " + std::to_string(nh) + ", head_dim " +
                           std::to_string(di) + ", k " + std::to_string(k) + ", max_entries " +
                           std::to_string(max_entries) +
                           " (want heads, k >= 1, head_dim a positive multiple of 4, "
                           "heads x head_dim <= 2^24, max_entries in [0, 2^30])");
  if (rows == 0) return Status::Ok();
  if (!iq || !iw || !steps.visible || !picks || !counters)
    return InvalidArgument("IndexerTopK: null device pointer");
  // Blocks a row: its tiles, at most kIndexMaxBlocks over the step's rows (rows of short
  // sequences leave their blocks at once, and at 32 rows x 256 blocks that alone took waves).
  const int64_t tiles = (max_entries + kIndexKeys - 1) / kIndexKeys;
  const int64_t cap = std::max<int64_t>(1, kIndexMaxBlocks / rows);
  const unsigned blocks = static_cast<unsigned>(std::clamp<int64_t>(tiles, 1, cap));
  return Launch("IndexerTopKKernel", IndexerTopKKernel,
                dim3(blocks, static_cast<unsigned>(rows)), kThreads, 0, table, row0, iq, iw,
                static_cast<int>(nh), static_cast<int>(di), scale, steps, static_cast<int>(k),
                picks, counters);
}

Status SinkAttentionRows(const AttentionArgs& a, int64_t row0, int64_t rows) {
  FM_RETURN_IF_ERROR(CheckRows("SinkAttentionRows", a.table, row0, rows));
  if (a.nh < 0 || a.d < 1 || a.d > kAttnMaxDim || a.window < 1 || a.topk < 0)
    return InvalidArgument("SinkAttentionRows: heads " + std::to_string(a.nh) + ", head_dim " +
                           std::to_string(a.d) + ", window " + std::to_string(a.window) +
                           ", topk " + std::to_string(a.topk) + " (want head_dim in [1, " +
                           std::to_string(kAttnMaxDim) + "], window >= 1, topk >= 0)");
  FM_RETURN_IF_ERROR(CheckRope("SinkAttentionRows", a.d, a.rd));
  if (a.nh == 0 || rows == 0) return Status::Ok();
  if (!a.q || !a.steps.win || !a.steps.keys || (a.entries && !a.steps.entries) ||
      (a.topk > 0 && !a.picks) || !a.sink || !a.pos || !a.freqs || !a.o)
    return InvalidArgument("SinkAttentionRows: null device pointer");
  const dim3 grid(static_cast<unsigned>(a.nh), static_cast<unsigned>(rows));
  if (rows == 1)
    return Launch("SinkAttentionRowBatchedKernel", SinkAttentionRowBatchedKernel, grid, kThreads,
                  0, a, row0);
  return Launch("SinkAttentionRowsKernel", SinkAttentionRowsKernel, grid, kThreads, 0, a, row0);
}

}  // namespace fm::cuda
