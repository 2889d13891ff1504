// A block's top k of a row of floats, for the Lightning indexer (attention.cu IndexerTopK) and the
// sampler's candidates (sample.cu). A radix select finds the k-th largest score's rank bits (4
// passes of 8 bits, counted in shared memory, so the order of the counts does not matter). Then
// thread i takes the contiguous entries [i per, (i + 1) per), and block scans of its counts give
// every chosen entry its slot in index order: every score above the k-th, and the first `need`
// equal to it. One pass counts both, a last pass emits: 6 passes over the scores, linear in n.
// Every pass reads the scores as 16-byte vectors (where the row is 16-byte aligned), kTopKLoads
// of them in flight a thread, through L2 (__ldcg: the indexer's scores come from other blocks of
// the same launch); a pass of 64K entries waits 8 round trips to L2, where one key a thread at a
// time waited 256.
#pragma once
#include <cuda_runtime.h>

#include <cstdint>

#include "kernels/cuda/bits.cuh"

namespace fm::cuda {

constexpr int kTopKThreads = 256;  // the block size of every caller
constexpr int kTopKLoads = 8;      // 16-byte score loads a thread has in flight

// Exclusive prefix sum of v over the block's threads in thread order (integers: exact); all
// threads call it.
__device__ inline int BlockExclusiveScan(int v) {
  __shared__ int vals[kTopKThreads];
  __shared__ int warp_tot[kTopKThreads / 32];
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

// The ranks of score[e0, e0 + 4) (e0 % 4 == 0); one 16-byte load when vec (score 16-byte
// aligned) and all four are below n. Entries at n and past are not read (rank 0).
__device__ __forceinline__ uint4 RankBits4(const float* score, int64_t e0, int64_t n, bool vec) {
  float4 v;
  if (vec && e0 + 3 < n) {
    v = __ldcg(reinterpret_cast<const float4*>(score + e0));
  } else {
    v.x = e0 < n ? __ldcg(score + e0) : 0.0f;
    v.y = e0 + 1 < n ? __ldcg(score + e0 + 1) : 0.0f;
    v.z = e0 + 2 < n ? __ldcg(score + e0 + 2) : 0.0f;
    v.w = e0 + 3 < n ? __ldcg(score + e0 + 3) : 0.0f;
  }
  return uint4{RankBits(v.x), RankBits(v.y), RankBits(v.z), RankBits(v.w)};
}

// f(e, rank, e < n) for the 4 entries of each of the kTopKLoads vectors v0, v0 + step, ... of
// score[0, n), every load issued before the first f. Entries past n are visited too (rank 0),
// so that a caller can keep whole warps in step.
template <class F>
__device__ __forceinline__ void VisitRanks(const float* score, int64_t n, bool vec, int64_t v0,
                                           int64_t step, F&& f) {
  uint4 u[kTopKLoads];
#pragma unroll
  for (int j = 0; j < kTopKLoads; ++j) u[j] = RankBits4(score, 4 * (v0 + j * step), n, vec);
#pragma unroll
  for (int j = 0; j < kTopKLoads; ++j)
#pragma unroll
    for (int c = 0; c < 4; ++c) {
      const int64_t e = 4 * (v0 + j * step) + c;
      f(e, Word(u[j], c), e < n);
    }
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

// The k-th largest rank of score[0, n) (1 <= k <= n), and how many entries of that rank, the
// lowest indices first, complete the k.
struct KthRank {
  uint32_t rank;
  int need;
};
__device__ inline KthRank KthLargestRank(const float* score, int64_t n, int k, bool vec) {
  __shared__ int hist[256];
  __shared__ uint32_t digit_prefix;
  __shared__ int digit_need;
  uint32_t prefix = 0, mask = 0;
  int need = k;
  for (int shift = 24; shift >= 0; shift -= 8) {
    for (int i = threadIdx.x; i < 256; i += kTopKThreads) hist[i] = 0;
    __syncthreads();
    // The same trip count in every thread (HistAdd takes whole warps).
    for (int64_t base = 0; 4 * base < n; base += kTopKThreads * kTopKLoads)
      VisitRanks(score, n, vec, base + threadIdx.x, kTopKThreads, [&](int64_t, uint32_t b, bool in) {
        HistAdd(hist, in && (b & mask) == prefix ? (b >> shift) & 0xFFu : kNoBin);
      });
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
  return {prefix, need};
}

// emit(slot, e, rank) for each of the top k entries of score[0, n) (1 <= k <= n; score larger
// first, index lower first among equal ranks), slot in [0, k) ascending with e. Every thread of
// the block calls it.
template <class Emit>
__device__ inline void BlockTopK(const float* score, int64_t n, int k, Emit&& emit) {
  const bool vec = (reinterpret_cast<uintptr_t>(score) & 15u) == 0;
  const KthRank kth = KthLargestRank(score, n, k, vec);
  // A thread's entries: [lo, hi), lo a multiple of 4.
  const int64_t per = ((n + kTopKThreads - 1) / kTopKThreads + 3) / 4 * 4;
  const int64_t start = static_cast<int64_t>(threadIdx.x) * per;
  const int64_t lo = start < n ? start : n, hi = lo + per < n ? lo + per : n;
  // f(e, rank) for the thread's entries in ascending order.
  auto each = [&](auto&& f) {
    for (int64_t e0 = lo; e0 < hi; e0 += 4 * kTopKLoads)
      VisitRanks(score, hi, vec, e0 / 4, 1, [&](int64_t e, uint32_t u, bool in) {
        if (in) f(e, u);
      });
  };
  // One pass counts the thread's entries above the k-th and equal to it; the ties taken are the
  // first `need` in index order, so the thread takes min(max(need - tie0, 0), ties) of its own.
  int ties = 0, above = 0;
  each([&](int64_t, uint32_t u) {
    ties += u == kth.rank ? 1 : 0;
    above += u > kth.rank ? 1 : 0;
  });
  const int tie0 = BlockExclusiveScan(ties);  // ties before this thread's entries
  int at = BlockExclusiveScan(above + min(max(kth.need - tie0, 0), ties));
  int tie = tie0;
  each([&](int64_t e, uint32_t u) {
    if (u > kth.rank || (u == kth.rank && tie++ < kth.need)) emit(at++, e, u);
  });
}

}  // namespace fm::cuda
