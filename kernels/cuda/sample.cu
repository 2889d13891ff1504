// Sampling on the device (sample_ops.h): the twin of model/sampler.cpp's Sampler::Sample.
// Launch 1 (SampleChunkKernel): the vocabulary in chunks, one block each, per row: the chunk's
// max and argmax, first NaN and +inf, and its softmax sums relative to the chunk max. Launch 2
// (SampleFinishKernel): one block per row merges the chunks in order and picks: greedy directly;
// untruncated by a cumulative walk in id order (chunk sums, then sub-range sums, then elements);
// top-k / top-p on the sorted candidates of a radix select. A row's top_n alternatives: each
// chunk block also keeps its chunk's top_n ids (a radix select over 2048 logits), and the row's
// block ranks those nchunks * top_n candidates, so no block walks the whole vocabulary for them.
#include <cuda_runtime.h>

#include <cmath>
#include <string>

#include "kernels/cuda/check.cuh"
#include "kernels/cuda/launch.cuh"
#include "kernels/cuda/sample_ops.h"
#include "kernels/cuda/top_k.cuh"

namespace fm::cuda {
namespace {

constexpr int kSampleThreads = 256;
static_assert(kSampleThreads == kTopKThreads, "TopCandidates ranks with BlockTopK");
constexpr int64_t kSampleChunk = 2048;  // logits per chunk block (more when the vocab needs it)
constexpr int kSampleMaxChunks = 256;

struct ChunkStats {
  float max;      // the chunk's largest logit other than -inf (-inf when none)
  int32_t arg;    // its lowest id, -1 when none
  int32_t nan;    // the chunk's first NaN id, -1 when none
  int32_t inf;    // the chunk's first +inf id, -1 when none
  int32_t ge;     // score rows: the chunk's ids whose logit is >= the scored id's
  double sum_g;   // sum exp(l - max): log_softmax's denominator, relative to max
  double sum_w;   // sum exp(l / T - max / T): the sampling weights, relative to max / T
};

int64_t ChunkSize(int64_t vocab) {
  const int64_t need = (vocab + kSampleMaxChunks - 1) / kSampleMaxChunks;
  return need > kSampleChunk ? need : kSampleChunk;
}
int64_t NumChunks(int64_t vocab) {
  const int64_t c = ChunkSize(vocab);
  return (vocab + c - 1) / c;
}

// The scratch: ChunkStats [rows, nchunks], then per row its chunks' top_n candidates, chunk c's
// at [c * top_n, (c + 1) * top_n) of the row's nchunks * kSampleMaxTop: logits, then ids (-1
// pads a chunk shorter than top_n).
struct Scratch {
  ChunkStats* stats;
  float* cand_l;
  int32_t* cand_id;
};
Scratch ScratchOf(void* p, int64_t rows, int nchunks) {
  auto* stats = static_cast<ChunkStats*>(p);
  auto* cand_l = reinterpret_cast<float*>(stats + rows * nchunks);
  auto* cand_id = reinterpret_cast<int32_t*>(cand_l + rows * nchunks * kSampleMaxTop);
  return {stats, cand_l, cand_id};
}

// Score rows are greedy whatever `greedy` says (their logprob is log_softmax's).
__device__ bool IsGreedy(const SampleParams& p) { return p.greedy || p.score_id >= 0; }
__device__ int TopN(const SampleParams& p) {
  return p.top_n < 0 ? 0 : (p.top_n > kSampleMaxTop ? kSampleMaxTop : p.top_n);
}

// Whether logit v at id i beats (bv, bi): larger, ties to the lower id; i < 0 is "none".
__device__ bool Beats(float v, int i, float bv, int bi) {
  if (i < 0) return false;
  if (bi < 0) return true;
  return v > bv || (v == bv && i < bi);
}

__device__ int MinId(int a, int b) { return a < 0 ? b : (b < 0 ? a : (a < b ? a : b)); }

// Sum of v over the block's threads in a fixed tree; every thread gets the same value.
__device__ double BlockSum(double v, double* sh) {
  const int tid = threadIdx.x;
  sh[tid] = v;
  __syncthreads();
  for (int s = kSampleThreads / 2; s > 0; s >>= 1) {
    if (tid < s) sh[tid] += sh[tid + s];
    __syncthreads();
  }
  const double r = sh[0];
  __syncthreads();
  return r;
}

// Grid (chunks, rows). Chunk c of row r: ids [c * chunk, min((c + 1) * chunk, vocab)).
__global__ void SampleChunkKernel(const float* logits, int64_t vocab, int64_t chunk, int nchunks,
                                  const SampleParams* params, Scratch scratch) {
  KernelPrologue();
  __shared__ float best_v[kSampleThreads];
  __shared__ int best_i[kSampleThreads], nan_i[kSampleThreads], inf_i[kSampleThreads];
  __shared__ double sums[kSampleThreads];
  __shared__ int ge_sum;
  const int tid = threadIdx.x;
  const int64_t row = blockIdx.y, lo = blockIdx.x * chunk;
  const int64_t hi = lo + chunk < vocab ? lo + chunk : vocab;
  const float* l = logits + row * vocab;
  float bv = 0.0f;
  int bi = -1, ni = -1, ii = -1;
  for (int64_t i = lo + tid; i < hi; i += kSampleThreads) {
    const float v = l[i];
    if (v != v) ni = MinId(ni, static_cast<int>(i));
    else if (v != -INFINITY && Beats(v, static_cast<int>(i), bv, bi)) bv = v, bi = static_cast<int>(i);
    if (v == INFINITY) ii = MinId(ii, static_cast<int>(i));
  }
  best_v[tid] = bv, best_i[tid] = bi, nan_i[tid] = ni, inf_i[tid] = ii;
  __syncthreads();
  for (int s = kSampleThreads / 2; s > 0; s >>= 1) {
    if (tid < s) {
      if (Beats(best_v[tid + s], best_i[tid + s], best_v[tid], best_i[tid]))
        best_v[tid] = best_v[tid + s], best_i[tid] = best_i[tid + s];
      nan_i[tid] = MinId(nan_i[tid], nan_i[tid + s]);
      inf_i[tid] = MinId(inf_i[tid], inf_i[tid + s]);
    }
    __syncthreads();
  }
  const float m = best_i[0] < 0 ? -INFINITY : best_v[0];
  const SampleParams p = params[row];
  const bool greedy = IsGreedy(p);
  const double inv_t = greedy ? 1.0 : 1.0 / static_cast<double>(p.temperature);
  const double top = static_cast<double>(m) * inv_t;
  double g = 0.0, w = 0.0;
  if (m != -INFINITY) {
    for (int64_t i = lo + tid; i < hi; i += kSampleThreads) {
      const double v = l[i];
      g += exp(v - static_cast<double>(m));
      if (!greedy) w += exp(v * inv_t - top);
    }
  }
  g = BlockSum(g, sums);
  w = BlockSum(w, sums);
  if (p.score_id >= 0 && p.score_id < vocab) {  // the rank's count (integers: any order)
    const float target = l[p.score_id];
    int ge = 0;
    for (int64_t i = lo + tid; i < hi; i += kSampleThreads) ge += l[i] >= target ? 1 : 0;
    if (tid == 0) ge_sum = 0;
    __syncthreads();
    atomicAdd(&ge_sum, ge);
  }
  __syncthreads();
  if (tid == 0)
    scratch.stats[row * nchunks + blockIdx.x] =
        ChunkStats{m, best_i[0], nan_i[0], inf_i[0], p.score_id >= 0 ? ge_sum : 0, g, w};
  const int top_n = TopN(p);
  if (top_n > 0) {  // the chunk's top_n by (logit desc, id asc), in id order; -1 pads
    float* cl = scratch.cand_l + row * nchunks * kSampleMaxTop + blockIdx.x * top_n;
    int32_t* cid = scratch.cand_id + row * nchunks * kSampleMaxTop + blockIdx.x * top_n;
    const int k = hi - lo < top_n ? static_cast<int>(hi - lo) : top_n;
    BlockTopK(l + lo, hi - lo, k, [&](int slot, int64_t e, uint32_t) {
      cl[slot] = l[lo + e];
      cid[slot] = static_cast<int32_t>(lo + e);
    });
    for (int j = k + tid; j < top_n; j += kSampleThreads) cl[j] = -INFINITY, cid[j] = -1;
  }
}

// Where a cumulative sum passes a target.
struct Crossing {
  int64_t index;  // the first element whose cumulative passes (the last one when none does)
  double cum;     // the cumulative up to and including it
  bool found;
};

// The weights a walk reads: exp(l * inv_t - top) of ids lo + j (ids == null) or of the sorted
// candidates ids[j] (low 32 bits: 0xFFFFFFFF - id).
struct Weights {
  const float* logits;
  const unsigned long long* cand;
  int64_t lo;
  double inv_t, top;
  __device__ int64_t Id(int64_t j) const {
    return cand ? static_cast<int64_t>(0xFFFFFFFFu - static_cast<unsigned>(cand[j])) : lo + j;
  }
  __device__ double At(int64_t j) const {
    return exp(static_cast<double>(logits[Id(j)]) * inv_t - top);
  }
};

__device__ bool Passes(double cum, double target, bool inclusive) {
  return inclusive ? cum >= target : target < cum;
}

// Walks items [0, n) of `w` from `base`: the first j whose cumulative passes `target`. Sub-range
// sums per thread (contiguous, in order), thread 0 finds the sub-range, then steps element by
// element from it (on past it if rounding made the sub-range sum pass but not its elements).
__device__ Crossing FirstCrossing(const Weights& w, int64_t n, double base, double target,
                                  bool inclusive, double* sh) {
  __shared__ Crossing result;
  const int tid = threadIdx.x;
  const int64_t per = (n + kSampleThreads - 1) / kSampleThreads;
  double s = 0.0;
  for (int64_t j = tid * per; j < (tid + 1) * per && j < n; ++j) s += w.At(j);
  sh[tid] = s;
  __syncthreads();
  if (tid == 0) {
    double cum = base;
    int t = 0;
    while (t < kSampleThreads - 1 && !Passes(cum + sh[t], target, inclusive)) cum += sh[t++];
    Crossing c{n - 1, cum, false};
    for (int64_t j = t * per; j < n; ++j) {
      c.cum += w.At(j);
      c.index = j;
      if (Passes(c.cum, target, inclusive)) {
        c.found = true;
        break;
      }
    }
    result = c;
  }
  __syncthreads();
  const Crossing c = result;
  __syncthreads();
  return c;
}

// cand[0, m) = the m best ids of l[0, n) by (logit desc, id asc), sorted so, as
// RankBits(logit) << 32 | (0xFFFFFFFF - id) (unique: the ids differ); cand holds mpad (a power of
// two >= m) entries. The set is top_k.cuh's BlockTopK (the CPU's order: -0 ties +0).
__device__ void TopCandidates(const float* l, int64_t n, int m, int mpad, unsigned long long* cand) {
  const int tid = threadIdx.x;
  BlockTopK(l, n, m, [&](int slot, int64_t id, uint32_t rank) {
    cand[slot] = (static_cast<unsigned long long>(rank) << 32) |
                 (0xFFFFFFFFu - static_cast<unsigned>(id));
  });
  for (int j = m + tid; j < mpad; j += kSampleThreads) cand[j] = 0;
  __syncthreads();
  // Bitonic sort, descending.
  for (int size = 2; size <= mpad; size <<= 1) {
    for (int stride = size / 2; stride > 0; stride >>= 1) {
      for (int j = tid; j < mpad; j += kSampleThreads) {
        const int partner = j ^ stride;
        if (partner > j) {
          const bool desc = (j & size) == 0;
          const unsigned long long a = cand[j], b = cand[partner];
          if (desc ? a < b : a > b) cand[j] = b, cand[partner] = a;
        }
      }
      __syncthreads();
    }
  }
}

// The logprob of a reported id: log_softmax (greedy and score rows: LogSoftmax::At of
// model/sampler.cpp, the argmax's -log(sum)) or log(w / total) under the pick's distribution;
// false for an id of probability 0 (left out of the alternatives, as on the CPU).
struct AltLogprob {
  const float* l;
  bool greedy;
  int best;
  float best_v;
  double log_sum;           // greedy
  double inv_t, top, total;  // sampling
  __device__ bool At(int64_t id, float* lp) const {
    if (greedy) {
      if (l[id] == -INFINITY) return false;
      *lp = id == best ? static_cast<float>(-log_sum)
                       : static_cast<float>((static_cast<double>(l[id]) - best_v) - log_sum);
      return true;
    }
    const double w = exp(static_cast<double>(l[id]) * inv_t - top);
    if (!(w > 0.0)) return false;
    *lp = static_cast<float>(log(w / total));
    return true;
  }
};

// res's alternatives: the best m ids of the row's n chunk candidates (cl, cid) by (logit desc,
// id asc), each with f's logprob. The candidates hold every chunk's best top_n >= m, so they
// hold the row's best m; ties keep id order, as the candidates lie in id order. All threads.
__device__ void TopFromChunks(const float* cl, const int32_t* cid, int n, int m,
                              const AltLogprob& f, unsigned long long* cand, SampleResult* res,
                              SampleTop* top) {
  int mpad = 1;
  while (mpad < m) mpad <<= 1;
  TopCandidates(cl, n, m, mpad, cand);
  if (threadIdx.x == 0) {
    int k = 0;
    for (int j = 0; j < m; ++j) {
      const int32_t id = cid[0xFFFFFFFFu - static_cast<unsigned>(cand[j])];
      float lp;
      if (id >= 0 && f.At(id, &lp)) top->id[k] = id, top->logprob[k++] = lp;
    }
    res->top_count = k;
  }
}

__device__ void SetResult(SampleResult* res, int32_t id, float logprob, int32_t status) {
  res->id = id, res->logprob = logprob, res->status = status;
}

// One block per row: merges the row's chunk stats in order and draws its token (or scores
// score_id), then its top_n alternatives.
__global__ void SampleFinishKernel(const float* logits, int64_t vocab, int64_t chunk,
                                   int nchunks, const SampleParams* params, Scratch scratch,
                                   SampleResult* out, SampleTop* tops) {
  KernelPrologue();
  __shared__ unsigned long long cand[kSampleMaxCandidates];
  __shared__ double sh[kSampleThreads];
  __shared__ float M;
  __shared__ int best, state;  // state: 0 sample, 1 done, 2 greedy alternatives
  __shared__ double log_sum;
  const int tid = threadIdx.x;
  const int64_t row = blockIdx.x;
  const float* l = logits + row * vocab;
  const ChunkStats* cs = scratch.stats + row * nchunks;
  const float* cl = scratch.cand_l + row * nchunks * kSampleMaxTop;
  const int32_t* cid = scratch.cand_id + row * nchunks * kSampleMaxTop;
  const SampleParams p = params[row];
  const int top_n = TopN(p);
  const int m_top = vocab < top_n ? static_cast<int>(vocab) : top_n;
  SampleResult* res = out + row;
  SampleTop* alts = tops + row;
  if (tid == 0) {
    float bv = 0.0f;
    int bi = -1, ni = -1, ii = -1;
    int64_t ge = 0;
    for (int c = 0; c < nchunks; ++c) {
      if (Beats(cs[c].max, cs[c].arg, bv, bi)) bv = cs[c].max, bi = cs[c].arg;
      ni = MinId(ni, cs[c].nan);
      ii = MinId(ii, cs[c].inf);
      ge += cs[c].ge;
    }
    M = bv, best = bi, state = 1;
    res->top_count = 0, res->rank = 0;
    if (p.score_id >= vocab) SetResult(res, p.score_id, 0.0f, kSampleBadId);
    else if (ni >= 0) SetResult(res, ni, 0.0f, kSampleNaN);
    else if (bi < 0) SetResult(res, -1, 0.0f, kSampleNoFinite);
    else if (ii >= 0) SetResult(res, ii, 0.0f, kSamplePosInf);
    else if (IsGreedy(p)) {
      double sum = 0.0;
      for (int c = 0; c < nchunks; ++c)
        if (cs[c].arg >= 0) sum += cs[c].sum_g * exp(static_cast<double>(cs[c].max) - bv);
      log_sum = log(sum);
      const int id = p.score_id >= 0 ? p.score_id : bi;
      const AltLogprob f{l, true, bi, bv, log_sum, 0.0, 0.0, 0.0};
      float lp = -INFINITY;  // a scored -inf logit: log_softmax's -inf
      f.At(id, &lp);
      SetResult(res, id, lp, kSampleOk);
      if (p.score_id >= 0) res->rank = ge;
      state = top_n > 0 ? 2 : 1;
    } else {
      state = 0;
    }
  }
  __syncthreads();
  if (state == 1) return;
  if (state == 2) {
    const AltLogprob f{l, true, best, M, log_sum, 0.0, 0.0, 0.0};
    TopFromChunks(cl, cid, nchunks * top_n, m_top, f, cand, res, alts);
    return;
  }
  const double inv_t = 1.0 / static_cast<double>(p.temperature);
  const double top = static_cast<double>(M) * inv_t;
  double all = 0.0;  // every id's weight: the chunk sums moved from max / T to M / T, in order
  for (int c = 0; c < nchunks; ++c)
    if (cs[c].arg >= 0) all += cs[c].sum_w * exp(static_cast<double>(cs[c].max) * inv_t - top);
  const bool top_k = p.top_k > 0 && p.top_k < vocab;
  if (!top_k && p.top_p >= 1.0f) {
    // Untruncated: the first id whose cumulative weight in id order exceeds u * total.
    const double target = p.u * all;
    double base = 0.0;
    int c = 0;
    for (; c < nchunks - 1; ++c) {
      const double wc =
          cs[c].arg >= 0 ? cs[c].sum_w * exp(static_cast<double>(cs[c].max) * inv_t - top) : 0.0;
      if (target < base + wc) break;
      base += wc;
    }
    // From chunk c on to the end of the vocabulary (a walk past c only if rounding asks).
    const Weights w{l, nullptr, c * chunk, inv_t, top};
    const Crossing x = FirstCrossing(w, vocab - c * chunk, base, target, false, sh);
    if (tid == 0)
      SetResult(res, static_cast<int32_t>(w.Id(x.index)),
                static_cast<float>(log(w.At(x.index) / all)), kSampleOk);
    if (top_n > 0) {
      const AltLogprob f{l, false, best, M, 0.0, inv_t, top, all};
      TopFromChunks(cl, cid, nchunks * top_n, m_top, f, cand, res, alts);
    }
    return;
  }
  if (top_k && p.top_k > kSampleMaxCandidates) {
    if (tid == 0) SetResult(res, -1, 0.0f, kSampleNeedsHost);
    return;
  }
  const int m = top_k ? p.top_k : static_cast<int>(vocab < kSampleMaxCandidates ? vocab : kSampleMaxCandidates);
  int mpad = 1;
  while (mpad < m) mpad <<= 1;
  TopCandidates(l, vocab, m, mpad, cand);
  const Weights w{l, cand, 0, inv_t, top};
  int64_t keep = m;
  double total = all;
  if (top_k) {  // the candidates' weights in sorted order
    const Crossing x = FirstCrossing(w, m, 0.0, INFINITY, true, sh);
    total = x.cum;
  }
  if (p.top_p < 1.0f) {  // the shortest sorted prefix whose weight reaches top_p * total
    const Crossing x = FirstCrossing(w, m, 0.0, static_cast<double>(p.top_p) * total, true, sh);
    if (!x.found && !top_k && m < vocab) {  // the prefix is longer than the candidates
      if (tid == 0) SetResult(res, -1, 0.0f, kSampleNeedsHost);
      return;
    }
    keep = x.index + 1;
    total = x.cum;
  }
  const Crossing x = FirstCrossing(w, keep, 0.0, p.u * total, false, sh);
  if (tid == 0) {
    SetResult(res, static_cast<int32_t>(w.Id(x.index)),
              static_cast<float>(log(w.At(x.index) / total)), kSampleOk);
    // The alternatives: the kept set's first top_n (it is sorted), probability 0 left out.
    const AltLogprob f{l, false, best, M, 0.0, inv_t, top, total};
    int k = 0;
    for (int64_t j = 0; j < keep && j < top_n; ++j) {
      float lp;
      if (f.At(w.Id(j), &lp)) alts->id[k] = static_cast<int32_t>(w.Id(j)), alts->logprob[k++] = lp;
    }
    res->top_count = k;
  }
}

}  // namespace

size_t SampleScratchBytes(int64_t rows, int64_t vocab) {
  const size_t row_chunks = static_cast<size_t>(rows > 0 ? rows : 1) * NumChunks(vocab > 0 ? vocab : 1);
  return row_chunks * (sizeof(ChunkStats) + kSampleMaxTop * (sizeof(float) + sizeof(int32_t)));
}

Status SampleRows(const float* logits, int64_t rows, int64_t vocab, const SampleParams* params,
                  void* scratch, SampleResult* out, SampleTop* top) {
  if (!logits || !params || !scratch || !out || !top)
    return InvalidArgument("SampleRows: null logits, params, scratch, out or top");
  if (rows <= 0 || rows > 65535)
    return InvalidArgument("SampleRows: rows " + std::to_string(rows) + " outside [1, 65535]");
  if (vocab <= 0 || vocab > (int64_t{1} << 31) - 1)
    return InvalidArgument("SampleRows: vocab " + std::to_string(vocab) + " outside [1, 2^31)");
  const int64_t chunk = ChunkSize(vocab);
  const int nchunks = static_cast<int>(NumChunks(vocab));
  const Scratch parts = ScratchOf(scratch, rows, nchunks);
  FM_RETURN_IF_ERROR(Launch("SampleChunkKernel", SampleChunkKernel,
                            dim3(nchunks, static_cast<unsigned>(rows)), kSampleThreads, 0, logits,
                            vocab, chunk, nchunks, params, parts));
  return Launch("SampleFinishKernel", SampleFinishKernel, static_cast<unsigned>(rows),
                kSampleThreads, 0, logits, vocab, chunk, nchunks, params, parts, out, top);
}

}  // namespace fm::cuda
