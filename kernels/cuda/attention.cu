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
constexpr int kTopKLoads = 8;  // RowTopK: 16-byte score loads a thread has in flight
static_assert(kIndexKeys == 64 && kIndexHeads == 64 && kThreads == 256,
              "IndexerScoreKeys: 256 threads of 4 x 4 dots cover 64 heads x 64 keys");

// A score's rank as ordered bits: a larger key, a larger value; NaN ranks as -inf (lowest), and
// -0 as +0 (they compare equal, so their order is the index's).
__device__ uint32_t RankBits(float v) {
  if (v != v) v = -INFINITY;
  if (v == 0.0f) v = 0.0f;
  const uint32_t u = __float_as_uint(v);
  return (u & 0x80000000u) ? ~u : (u | 0x80000000u);
}

// Exclusive prefix sum of v over the block's threads in thread order (integers: exact); all
// threads call it.
__device__ int BlockExclusiveScan(int v) {
  __shared__ int vals[kThreads];
  __shared__ int warp_tot[kWarps];
  const int tid = threadIdx.x, w = tid / 32;
  vals[tid] = v;
  __syncthreads();
  if (tid % 32 == 0) {
    int s = 0;
    for (int i = 0; i < 32; ++i) s += vals[w * 32 + i];
    warp_tot[w] = s;
  }
  __syncthreads();
  int before = 0;
  for (int i = 0; i < w; ++i) before += warp_tot[i];
  for (int i = w * 32; i < tid; ++i) before += vals[i];
  __syncthreads();  // vals is rewritten by the next call
  return before;
}

// The ranks of score[e0, e0 + 4) (e0 % 4 == 0, score 16-byte aligned), read through L2: other
// blocks of the launch wrote them. Entries at n and past are not read (rank 0, never counted).
__device__ __forceinline__ uint4 RankBits4(const float* score, int e0, int n) {
  float4 v;
  if (e0 + 3 < n) {
    v = __ldcg(reinterpret_cast<const float4*>(score + e0));
  } else {
    v.x = e0 < n ? __ldcg(score + e0) : 0.0f;
    v.y = e0 + 1 < n ? __ldcg(score + e0 + 1) : 0.0f;
    v.z = e0 + 2 < n ? __ldcg(score + e0 + 2) : 0.0f;
    v.w = 0.0f;
  }
  return uint4{RankBits(v.x), RankBits(v.y), RankBits(v.z), RankBits(v.w)};
}

__device__ __forceinline__ uint32_t Lane4(const uint4& u, int c) {
  return c == 0 ? u.x : c == 1 ? u.y : c == 2 ? u.z : u.w;
}

// hist[bin] += 1 for every lane of the warp with that bin (kNoBin: none), one shared atomic per
// distinct bin: scores share their top bits (sign and exponent), so the lanes' bins mostly
// coincide, and per-lane atomics on one bin would queue 32 deep. All lanes call it.
constexpr uint32_t kNoBin = 256;
__device__ __forceinline__ void HistAdd(int* hist, uint32_t bin) {
  const unsigned peers = __match_any_sync(0xffffffffu, bin);
  if (bin != kNoBin && __ffs(static_cast<int>(peers)) - 1 == static_cast<int>(threadIdx.x % 32))
    atomicAdd(&hist[bin], __popc(peers));
}

// The row's top k of score[0, n) into picks ascending (score descending, index ascending; n > k):
// the k-th largest key's bits by a radix select (4 passes of 8 bits, counted in shared memory,
// so the order of the counts does not matter), then every key above it and the first `need`
// equal to it in index order; thread i takes the contiguous keys [i per, (i + 1) per), so block
// scans of its counts (one pass counts both) give each chosen key its place, and a last pass
// writes them: 6 passes over the scores. Linear in n; no bound on n. Every pass
// reads the scores as 16-byte vectors, kTopKLoads of them in flight a thread (a pass of 64K
// entries: 8 round trips to L2, where one key a thread at a time took 256); the counts are
// added a warp's bin at a time (HistAdd).
__device__ void RowTopK(const float* score, int n, int k, int32_t* picks) {
  __shared__ int hist[256];
  __shared__ uint32_t digit_prefix;
  __shared__ int digit_need;
  uint32_t prefix = 0, mask = 0;
  int need = k;
  for (int shift = 24; shift >= 0; shift -= 8) {
    for (int i = threadIdx.x; i < 256; i += kThreads) hist[i] = 0;
    __syncthreads();
    // The same trip count in every thread (the match below takes whole warps).
    for (int base = 0; 4 * base < n; base += kThreads * kTopKLoads) {
      const int v0 = base + static_cast<int>(threadIdx.x);
      uint4 u[kTopKLoads];
#pragma unroll
      for (int j = 0; j < kTopKLoads; ++j) u[j] = RankBits4(score, 4 * (v0 + j * kThreads), n);
#pragma unroll
      for (int j = 0; j < kTopKLoads; ++j)
#pragma unroll
        for (int c = 0; c < 4; ++c) {
          const uint32_t b = Lane4(u[j], c);
          const bool cand = 4 * (v0 + j * kThreads) + c < n && (b & mask) == prefix;
          HistAdd(hist, cand ? (b >> shift) & 0xFFu : kNoBin);
        }
    }
    __syncthreads();
    if (threadIdx.x == 0) {  // the digit of the need-th largest among the candidates
      int d = 255;
      while (hist[d] < need) need -= hist[d--];
      digit_prefix = prefix | (static_cast<uint32_t>(d) << shift);
      digit_need = need;
    }
    __syncthreads();
    prefix = digit_prefix;
    need = digit_need;
    mask |= 0xFFu << shift;
    __syncthreads();  // hist and the digit are rewritten by the next pass
  }
  // A thread's keys: [lo, hi), lo a multiple of 4.
  const int per = ((n + kThreads - 1) / kThreads + 3) / 4 * 4;
  const int lo = min(n, static_cast<int>(threadIdx.x) * per), hi = min(n, lo + per);
  // f(e, rank) for the thread's keys in ascending order, kTopKLoads vectors in flight.
  auto each = [&](auto&& f) {
    for (int e0 = lo; e0 < hi; e0 += 4 * kTopKLoads) {
      uint4 u[kTopKLoads];
#pragma unroll
      for (int j = 0; j < kTopKLoads; ++j) u[j] = RankBits4(score, e0 + 4 * j, hi);
#pragma unroll
      for (int j = 0; j < kTopKLoads; ++j)
#pragma unroll
        for (int c = 0; c < 4; ++c)
          if (e0 + 4 * j + c < hi) f(e0 + 4 * j + c, Lane4(u[j], c));
    }
  };
  // One pass counts the thread's keys above the k-th and equal to it; the ties taken are the
  // first `need` in index order, so the thread takes min(max(need - tie0, 0), ties) of its own.
  int ties = 0, above = 0;
  each([&](int, uint32_t u) {
    ties += u == prefix ? 1 : 0;
    above += u > prefix ? 1 : 0;
  });
  const int tie0 = BlockExclusiveScan(ties);  // ties before this thread's keys
  int at = BlockExclusiveScan(above + min(max(need - tie0, 0), ties));
  int tie = tie0;
  each([&](int e, uint32_t u) {  // the thread's keys in ascending order from lo
    if (u > prefix || (u == prefix && tie++ < need)) picks[at++] = e;
  });
}

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
// the row's last block picks its top k (RowTopK), written ascending. A row of no more than k
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
  __threadfence();
  __syncthreads();
  if (threadIdx.x == 0) last = atomicAdd(counters + t, 1) == static_cast<int>(gridDim.x) - 1;
  __syncthreads();
  if (!last) return;
  __threadfence();
  if (threadIdx.x == 0) counters[t] = 0;
  RowTopK(rc.score, n, k, picks + t * k);
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

// The block's warps' softmax states (wm, wl, acc_s rows) merged in warp order with the head's
// sink, the inverse RoPE of the result, and o[t, h] written. Call after a barrier.
__device__ void AttnMergeStore(const AttentionArgs& a, int64_t h, int64_t t,
                               const float (*acc_s)[kAttnMaxDim], const float* wm, const float* wl) {
  __shared__ float o_s[kAttnMaxDim];
  const int64_t d = a.d;
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
  __shared__ float wm[kWarps], wl[kWarps];
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
  if (lane == 0) wm[warp] = m, wl[warp] = l;
  __syncthreads();
  AttnMergeStore(a, h, t, acc, wm, wl);
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
  __shared__ float wm[kWarps], wl[kWarps];
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
  if (lane == 0) wm[warp] = m, wl[warp] = l;
  __syncthreads();
  AttnMergeStore(a, h, t, acc_s, wm, wl);
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
