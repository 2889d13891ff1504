// Fused kernels of the device decode layer (kernels/cuda/fused_ops.h): hc_post + hc_pre, the
// query/key preparation with the cache updates (the indexer and the attention core:
// attention.cu). Conventions in fused_common.cuh.
#include <cuda_runtime.h>

#include <string>

#include "kernels/cuda/check.cuh"
#include "kernels/cuda/launch.cuh"
#include "kernels/cuda/fused_common.cuh"
#include "kernels/cuda/fused_ops.h"
#include "kernels/cuda/moe_combine.cuh"

namespace fm::cuda {
namespace {

using namespace fused;

constexpr int kHcCols = 32;  // columns h of every stream per HcPostPre block
constexpr int kHcMaxStreams = 5;  // HcPostPre: a token's n x n comb fits a warp's lanes
constexpr int kHcMaxMix = (2 + kHcMaxStreams) * kHcMaxStreams + 1;  // mix rows + the squares
constexpr int kHcYPer = 16;  // columns of y a thread of that block holds: H = 4096 in one pass
constexpr int kMaxEntryDim = 1024;

struct HcArgs {
  const float* x;
  HcPostInput out;
  float* x_new;
  const float* fn;
  const float* base;
  const float* scale;
  const float* norm;
  int T, n;
  int64_t H;
  int iters;
  float hc_eps, rms_eps;
  float* post;
  float* comb;
  float* y;
  float* partials;  // [blocks, T, M + 1]
  int32_t* counters;  // [T]
  bool prefetch;  // launch overlap (launch.cuh): the block's fn columns into L2 before the wait
};

// A warp's trips over the mix rows m = warp, warp + 8, ... (M + 1 <= kHcMaxMix rows).
constexpr int kHcTrips = (kHcMaxMix + kWarps - 1) / kWarps;
// X' elements of a block's slice a lane holds (n * kHcCols <= 160: lanes l, l + 32, ...).
constexpr int kHcLaneElems = (kHcMaxStreams * kHcCols + 31) / 32;
// Partials a lane loads at once per mix row in the finish (blocks l, l + 32, ...: 128 blocks =
// H 4096 in one round).
constexpr int kHcFinishLoads = 4;

// v[q] = c of lane base + q * stride, q < kHcMaxStreams (lanes past the last wrap): every
// shuffle is issued before any use, so a Sinkhorn sum waits for one round trip, not n.
__device__ __forceinline__ void LanesOf(float c, int base, int stride, float (&v)[kHcMaxStreams]) {
#pragma unroll
  for (int q = 0; q < kHcMaxStreams; ++q) v[q] = __shfl_sync(0xffffffffu, c, base + q * stride);
}

// sum over q < n of c at lane base + q * stride, added in q order (kernels/cpu/hc.h's order).
__device__ __forceinline__ float LaneSum(float c, int base, int stride, int n) {
  float v[kHcMaxStreams], s = 0.0f;
  LanesOf(c, base, stride, v);
#pragma unroll
  for (int q = 0; q < kHcMaxStreams; ++q)
    if (q < n) s += v[q];
  return s;
}

// The last of token t's HcPostPre blocks: mix[m] = the blocks' partials summed (warp w takes
// rows m = w, w + 8, ...; lane l blocks l, l + 32, ... in order, then a butterfly; every load of
// a round is issued before the first add); warp 0 then takes the token's pre/post and Sinkhorn
// comb, entry (j, k) in lane j n + k (each row and column sum gathered by shuffles in
// kernels/cpu/hc.h's order: the bits of one thread, without a block barrier an iteration); then
// y = RMSNorm(sum_i pre[i] X'_i) over the whole block, kHcYPer columns a thread with their loads
// in flight (H <= kThreads * kHcYPer: y stays in registers until it is normed).
// Every warp runs every shuffle (the others on dummy values): the emulation's shuffles are
// block-wide.
__device__ void HcFinishToken(const HcArgs& a, const float* xs, int t, int M) {
  __shared__ float mix[kHcMaxMix];
  __shared__ float pre[kHcMaxStreams];
  const int n = a.n, lane = threadIdx.x % 32, warp = threadIdx.x / 32;
  const int trips = (M + 1 + kWarps - 1) / kWarps;  // the same in every warp
  float v[kHcTrips] = {};
  for (unsigned b0 = lane; b0 < gridDim.x; b0 += 32 * kHcFinishLoads)
#pragma unroll
    for (int r = 0; r < kHcTrips; ++r) {
      const int m = warp + kWarps * r;
      if (r < trips && m <= M)
#pragma unroll
        for (int j = 0; j < kHcFinishLoads; ++j) {
          const unsigned b = b0 + 32 * j;
          if (b < gridDim.x)
            v[r] += __ldcg(a.partials + (static_cast<int64_t>(b) * a.T + t) * (M + 1) + m);
        }
    }
#pragma unroll
  for (int r = 0; r < kHcTrips; ++r) {
    if (r >= trips) break;
    const int m = warp + kWarps * r;
    const float s = WarpSum(v[r]);
    if (lane == 0 && m <= M) mix[m] = s;
  }
  __syncthreads();
  const bool live = warp == 0;
  const float rinv = 1.0f / sqrtf(mix[M] / static_cast<float>(n * a.H) + a.rms_eps);
  if (live && lane < n) {
    pre[lane] = SigmoidF(mix[lane] * rinv * a.scale[0] + a.base[lane]) + a.hc_eps;
    a.post[t * n + lane] = 2.0f * SigmoidF(mix[n + lane] * rinv * a.scale[1] + a.base[n + lane]);
  }
  const bool entry = lane < n * n;
  const int j = entry ? lane / n : 0, k = entry ? lane % n : 0;
  float c = entry ? mix[2 * n + lane] * rinv * a.scale[2] + a.base[2 * n + lane] : 0.0f;
  float top = -INFINITY, row[kHcMaxStreams];
  LanesOf(c, j * n, 1, row);  // row j
#pragma unroll
  for (int q = 0; q < kHcMaxStreams; ++q)
    if (q < n) top = fmaxf(top, row[q]);
  c = expf(c - top);
  c = c / LaneSum(c, j * n, 1, n) + a.hc_eps;
  for (int it = 0; it < a.iters; ++it) {
    if (it > 0) c /= LaneSum(c, j * n, 1, n) + a.hc_eps;  // row j
    c /= LaneSum(c, k, n, n) + a.hc_eps;                  // column k
  }
  if (live && entry) a.comb[t * n * n + lane] = c;
  __syncthreads();  // pre
  float* yt = a.y + static_cast<int64_t>(t) * a.H;
  const bool one_pass = a.H <= static_cast<int64_t>(kThreads) * kHcYPer;
  float ss = 0.0f, acc[kHcYPer];
  for (int64_t h0 = threadIdx.x; h0 < a.H; h0 += kThreads * kHcYPer) {
#pragma unroll
    for (int q = 0; q < kHcYPer; ++q) acc[q] = 0.0f;
    for (int i0 = 0; i0 < n; i0 += 2) {  // 2 streams' loads in flight, summed in stream order (hc.h)
      float xv[2][kHcYPer];
#pragma unroll
      for (int u = 0; u < 2; ++u) {
        const float* xi = xs + (static_cast<int64_t>(t) * n + i0 + u) * a.H;
#pragma unroll
        for (int q = 0; q < kHcYPer; ++q)
          xv[u][q] = i0 + u < n && h0 + q * kThreads < a.H ? __ldcg(xi + h0 + q * kThreads) : 0.0f;
      }
#pragma unroll
      for (int u = 0; u < 2; ++u)
#pragma unroll
        for (int q = 0; q < kHcYPer; ++q)
          if (i0 + u < n && h0 + q * kThreads < a.H) acc[q] += pre[i0 + u] * xv[u][q];
    }
#pragma unroll
    for (int q = 0; q < kHcYPer; ++q)
      if (h0 + q * kThreads < a.H) {
        if (!one_pass) yt[h0 + q * kThreads] = acc[q];
        ss += acc[q] * acc[q];
      }
  }
  const float inv = 1.0f / sqrtf(BlockSum(ss) / static_cast<float>(a.H) + a.rms_eps);
  for (int64_t h0 = threadIdx.x; h0 < a.H; h0 += kThreads * kHcYPer) {
#pragma unroll
    for (int q = 0; q < kHcYPer; ++q) {
      const int64_t h = h0 + q * kThreads;
      if (h < a.H) yt[h] = a.norm[h] * ((one_pass ? acc[q] : yt[h]) * inv);
    }
  }
}

// Block (b, t): columns [32b, 32b+32) of every stream of token t; writes X' there (and keeps the
// slice in shared memory), then warp w reduces rows m = w, w + 8, ... of fn (row M: the squares)
// over the slice, every row's loads issued before its first add and each row summed over the
// lane's elements in ascending order; the last of token t's blocks (its counter) finishes the
// token. So the tokens of a step finish on T blocks at once, not one after another on one.
// 4 blocks an SM (64 registers, no spills; 5 would spill): the T = 8 grid is 1024 blocks. On
// sm_12x (GB10) 64 registers spilled 20 bytes, so 3 there (80 registers; its 48 SMs still hold
// the T = 1 grid's 128 blocks at once).
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 1200
constexpr int kHcBlocksPerSm = 3;
#else
constexpr int kHcBlocksPerSm = 4;
#endif
__global__ void __launch_bounds__(kThreads, kHcBlocksPerSm) HcPostPreKernel(HcArgs a) {
  __shared__ bool last;
  __shared__ float xs_sh[kHcMaxStreams * kHcCols];  // X' of the slice: i = stream * cols + h
  const int n = a.n, M = (2 + n) * n, lane = threadIdx.x % 32, warp = threadIdx.x / 32;
  const int t = static_cast<int>(blockIdx.y);
  const int64_t H = a.H, h0 = static_cast<int64_t>(blockIdx.x) * kHcCols;
  const int cols = static_cast<int>(H - h0 < kHcCols ? H - h0 : kHcCols);
  AllowDependents();
  if (a.prefetch && t == 0)  // fn's rows m, streams i: 128 bytes each at column h0
    for (int i = threadIdx.x; i < M * n; i += kThreads)
      PrefetchL2(a.fn + (static_cast<int64_t>(i / n) * n + i % n) * H + h0, cols * 4);
  WaitPredecessors();
  const bool with_post = a.out.out || a.out.contrib;
  const float* xs = with_post ? a.x_new : a.x;  // X'
  const float* xt = a.x + static_cast<int64_t>(t) * n * H;
  for (int i = threadIdx.x; i < n * cols; i += kThreads) {
    const int k = i / cols, h = i % cols;
    float acc;
    if (with_post) {
      const float* ct = a.comb + t * n * n;
      float cv[kHcMaxStreams], xv[kHcMaxStreams];  // every load issued before the first add
#pragma unroll
      for (int j = 0; j < kHcMaxStreams; ++j) {
        cv[j] = j < n ? ct[j * n + k] : 0.0f;
        xv[j] = j < n ? xt[j * H + h0 + h] : 0.0f;
      }
      acc = a.post[t * n + k] * HcPostInputAt(a.out, t, H, h0 + h);
#pragma unroll
      for (int j = 0; j < kHcMaxStreams; ++j)
        if (j < n) acc += cv[j] * xv[j];
      a.x_new[(static_cast<int64_t>(t) * n + k) * H + h0 + h] = acc;
    } else {
      acc = xt[k * H + h0 + h];
    }
    xs_sh[i] = acc;
  }
  __syncthreads();
  const int trips = (M + 1 + kWarps - 1) / kWarps;  // the same in every warp
  int off[kHcLaneElems];  // element i's column in a row of fn, past h0 (n * H < 2^31)
#pragma unroll
  for (int q = 0; q < kHcLaneElems; ++q) {
    const int i = lane + 32 * q;
    off[q] = i < n * cols ? (i / cols) * static_cast<int>(H) + i % cols : -1;
  }
  float v[kHcTrips];
#pragma unroll
  for (int r = 0; r < kHcTrips; ++r) {
    const int m = warp + kWarps * r;
    const float* fr = a.fn + static_cast<int64_t>(m) * n * H + h0;
    v[r] = 0.0f;
    if (r < trips && m <= M)
#pragma unroll
      for (int q = 0; q < kHcLaneElems; ++q)
        if (off[q] >= 0) {
          const float x = xs_sh[lane + 32 * q];
          v[r] += (m < M ? fr[off[q]] : x) * x;
        }
  }
#pragma unroll
  for (int r = 0; r < kHcTrips; ++r) {
    if (r >= trips) break;
    const int m = warp + kWarps * r;
    const float s = WarpSum(v[r]);
    if (m <= M && lane == 0)
      a.partials[(static_cast<int64_t>(blockIdx.x) * a.T + t) * (M + 1) + m] = s;
  }
  // Every block of the grid reaches this add (no return before it), else the counter never
  // comes back to 0 and every later step finishes early. The last block overwrites this token's
  // post and comb, which the others read above: their loads were used before their adds.
  __threadfence();
  __syncthreads();
  if (threadIdx.x == 0) last = atomicAdd(a.counters + t, 1) == static_cast<int>(gridDim.x) - 1;
  __syncthreads();
  if (!last) return;
  __threadfence();
  if (threadIdx.x == 0) a.counters[t] = 0;
  HcFinishToken(a, xs, t, M);
}

// row[0..d) = g * row / sqrt(mean(row^2) + eps) (g = weight, or 1 when null), then RoPE.
__device__ void NormRopeRow(float* row, int64_t d, const float* weight, float eps, int64_t rd,
                            int32_t pos, const float* freqs) {
  float ss = 0.0f;
  for (int64_t c = threadIdx.x; c < d; c += kThreads) ss += row[c] * row[c];
  const float inv = 1.0f / sqrtf(BlockSum(ss) / static_cast<float>(d) + eps);
  for (int64_t c = threadIdx.x; c < d; c += kThreads) {
    const float v = row[c] * inv;
    row[c] = weight ? weight[c] * v : v;
  }
  __syncthreads();
  RopeRow(row, d, rd, pos, freqs, false);
}

// One compressor's token: store its row, and on the window's last token pool the gathered
// slots (previous window's first half, then this window's), norm, RoPE and append the entry.
__device__ void CompressorRow(const CompressorRowArgs& c, int64_t t, float* pend_a, float* pend_z,
                              float* entries, const CompressorStep* st, const float* freqs,
                              int64_t rd, float eps) {
  __shared__ float ent[kMaxEntryDim];
  const int64_t r = c.ratio, d = c.dim, width = c.overlap ? 2 * d : d;
  const int64_t row = (st->parity * r + st->slot) * width;
  for (int64_t i = threadIdx.x; i < width; i += kThreads) {
    pend_a[row + i] = c.a[t * width + i];
    pend_z[row + i] = c.z[t * width + i] + c.ape[st->slot * width + i];
  }
  __syncthreads();
  if (!st->emit) return;
  const bool prev = c.overlap && st->has_prev;
  const int64_t n = prev ? 2 * r : r;
  auto src = [&](int64_t j, int64_t ch) {  // slot j of the gathered window, channel ch
    if (prev && j < r) return ((st->parity ^ 1) * r + j) * width + ch;
    return (st->parity * r + (prev ? j - r : j)) * width + (c.overlap ? d : 0) + ch;
  };
  float ss = 0.0f;
  for (int64_t ch = threadIdx.x; ch < d; ch += kThreads) {
    float m = pend_z[src(0, ch)];
    for (int64_t j = 1; j < n; ++j) m = pend_z[src(j, ch)] > m ? pend_z[src(j, ch)] : m;
    float sum = 0.0f;
    for (int64_t j = 0; j < n; ++j) sum += expf(pend_z[src(j, ch)] - m);
    float acc = 0.0f;
    for (int64_t j = 0; j < n; ++j) acc += (expf(pend_z[src(j, ch)] - m) / sum) * pend_a[src(j, ch)];
    ent[ch] = acc;
    ss += acc * acc;
  }
  const float inv = 1.0f / sqrtf(BlockSum(ss) / static_cast<float>(d) + eps);
  for (int64_t ch = threadIdx.x; ch < d; ch += kThreads) ent[ch] = c.norm[ch] * (ent[ch] * inv);
  __syncthreads();
  RopeRow(ent, d, rd, st->window_pos, freqs, false);
  __syncthreads();
  float* out = entries + static_cast<int64_t>(st->entry) * d;
  for (int64_t ch = threadIdx.x; ch < d; ch += kThreads) out[ch] = ent[ch];
}

// CacheRowsArgs as the kernels take it: the compressors by value, ncomp of them (0, 1 or 2).
struct CacheKernelArgs {
  const RowCache* table;  // null: AttnPrep without the cache rows
  int64_t window;
  RowSteps steps;
  CompressorRowArgs comp, index_comp;
  int ncomp;
};

// Row t's kv [d] (kv_row) into its ring row of table[t].keys (none when ring_row < 0).
__device__ void RingStoreRow(const CacheKernelArgs& c, int64_t t, const float* kv_row, int64_t d) {
  const int64_t r = *RowField(c.steps.ring_row, c.steps.stride, t);
  float* keys = c.table[t].keys;
  if (r >= 0)
    for (int64_t ch = threadIdx.x; ch < d; ch += kThreads) keys[r * d + ch] = kv_row[ch];
}

// Row t's compressor `which` (0: the layer's, its entries after the ring of d-wide keys; 1: the
// indexer's, into ikeys).
__device__ void CacheCompressorRow(const CacheKernelArgs& c, int64_t t, int which, int64_t d,
                                   const float* freqs, int64_t rd, float eps) {
  const RowCache rc = c.table[t];
  const CompressorStep* st = RowField(c.steps.comp, c.steps.stride, t);
  if (which == 0)
    CompressorRow(c.comp, t, rc.pend_a, rc.pend_z, rc.keys + c.window * d, st, freqs, rd, eps);
  else
    CompressorRow(c.index_comp, t, rc.ipend_a, rc.ipend_z, rc.ikeys, st, freqs, rd, eps);
}

// Block (0, y): row0 + y's ring store; (1, y): its compressor; (2, y): the indexer's.
__global__ void CacheRowsKernel(CacheKernelArgs c, int64_t row0, const float* kv, int64_t d,
                                const float* freqs, int64_t rd, float eps) {
  KernelPrologue();
  const int64_t t = row0 + blockIdx.y;
  if (blockIdx.x == 0) return RingStoreRow(c, t, kv + t * d, d);
  CacheCompressorRow(c, t, static_cast<int>(blockIdx.x) - 1, d, freqs, rd, eps);
}

// Blocks: T * nh query heads, then T kv rows, then T * ni indexer heads, then (with the cache
// rows, c.table set) T * c.ncomp compressor rows; a kv row's block stores it into its ring row
// once it is normed and RoPE'd.
__global__ void AttnPrepKernel(AttnPrepArgs a, int T, CacheKernelArgs c) {
  KernelPrologue();
  const int64_t b = blockIdx.x, nq = T * a.nh, ni = a.iq ? T * a.ni : 0;
  if (b < nq) {
    NormRopeRow(a.q + b * a.d, a.d, nullptr, a.eps, a.rd, a.pos[b / a.nh], a.freqs);
  } else if (b < nq + T) {
    const int64_t t = b - nq;
    NormRopeRow(a.kv + t * a.d, a.d, a.kv_norm, a.eps, a.rd, a.pos[t], a.freqs);
    if (c.table) {
      __syncthreads();  // the RoPE's pairs were written by other threads
      RingStoreRow(c, t, a.kv + t * a.d, a.d);
    }
  } else if (b < nq + T + ni) {
    const int64_t head = b - nq - T, t = head / a.ni;
    RopeRow(a.iq + head * a.di, a.di, a.rd, a.pos[t], a.freqs, false);
    if (threadIdx.x == 0) a.iw[head] *= a.iw_scale;
  } else {
    const int64_t i = b - nq - T - ni;
    CacheCompressorRow(c, i / c.ncomp, static_cast<int>(i % c.ncomp), a.d, a.freqs, a.rd, a.eps);
  }
}

}  // namespace

namespace fused {

Status CheckRope(const char* op, int64_t d, int64_t rd) {
  if (rd <= 0 || rd % 2 != 0 || rd > d)
    return InvalidArgument(std::string(op) + ": rope dims " + std::to_string(rd) +
                           " must be even, > 0 and <= the row width " + std::to_string(d));
  return Status::Ok();
}

Status CheckRows(const char* op, const RowCache* table, int64_t row0, int64_t rows) {
  if (row0 < 0 || rows < 0 || rows > 65535)
    return InvalidArgument(std::string(op) + ": rows [" + std::to_string(row0) + ", +" +
                           std::to_string(rows) + ") (want row0 >= 0, 0 <= rows <= 65535)");
  if (rows > 0 && !table) return InvalidArgument(std::string(op) + ": null row table");
  return Status::Ok();
}

}  // namespace fused

int64_t HcFusedPartials(int64_t T, int64_t n, int64_t H) {
  return (H + kHcCols - 1) / kHcCols * T * ((2 + n) * n + 1);
}

Status HcPostPre(const float* x, const HcPostInput& out, float* x_new, const float* fn,
                 const float* base, const float* scale, const float* norm, int64_t T, int64_t n,
                 int64_t H, int64_t iters, float hc_eps, float rms_eps, float* post, float* comb,
                 float* y, float* partials, int32_t* counters) {
  if (T < 0 || T > 65535 || n < 1 || n > kHcMaxStreams || H < 1 || n * H > 0x7FFFFFFF ||
      iters < 1)
    return InvalidArgument("HcPostPre: tokens " + std::to_string(T) + ", hc streams " +
                           std::to_string(n) + ", hidden " + std::to_string(H) + ", sinkhorn iters " +
                           std::to_string(iters) + " (want tokens in [0, 65535], streams in [1, " +
                           std::to_string(kHcMaxStreams) + "], hidden >= 1 with streams * hidden " +
                           "< 2^31, iters >= 1)");
  FM_RETURN_IF_ERROR(CheckHcPostInput("HcPostPre", out));
  if (T == 0) return Status::Ok();
  if (!x || !fn || !base || !scale || !norm || !post || !comb || !y || !partials || !counters ||
      (out.present() && !x_new))
    return InvalidArgument("HcPostPre: null device pointer");
  if (out.present() && x_new == x) return InvalidArgument("HcPostPre: x_new must not alias x");
  const HcArgs a{x, out, x_new, fn, base, scale, norm, static_cast<int>(T), static_cast<int>(n),
                 H, static_cast<int>(iters), hc_eps, rms_eps, post, comb, y, partials, counters,
                 launch_overlap.load(std::memory_order_relaxed)};
  const dim3 grid(static_cast<unsigned>((H + kHcCols - 1) / kHcCols), static_cast<unsigned>(T));
  return Launch("HcPostPreKernel", HcPostPreKernel, grid, kThreads, 0, a);
}

namespace {

// CacheRows' checks of rows [row0, row0 + rows) (op names the caller), then the kernels' view.
Result<CacheKernelArgs> CheckCacheRows(const char* op, const CacheRowsArgs& c, int64_t row0,
                                       int64_t rows, const float* kv, int64_t d,
                                       const float* freqs, int64_t rd) {
  const std::string who(op);
  FM_RETURN_IF_ERROR(CheckRows(op, c.table, row0, rows));
  if (d < 1 || c.window < 1)
    return InvalidArgument(who + ": head_dim " + std::to_string(d) + ", window " +
                           std::to_string(c.window) + " (want both >= 1)");
  if (c.index_comp && !c.comp) return InvalidArgument(who + ": index compressor without compressor");
  if (!kv || !c.steps.ring_row) return InvalidArgument(who + ": null device pointer");
  for (const CompressorRowArgs* k : {c.comp, c.index_comp}) {
    if (!k) continue;
    if (k->ratio < 1 || k->dim < 1 || k->dim > kMaxEntryDim)
      return InvalidArgument(who + ": compressor ratio " + std::to_string(k->ratio) + ", dim " +
                             std::to_string(k->dim) + " (want ratio >= 1, dim in [1, " +
                             std::to_string(kMaxEntryDim) + "])");
    FM_RETURN_IF_ERROR(CheckRope(op, k->dim, rd));
    if (!k->a || !k->z || !k->ape || !k->norm || !c.steps.comp || !freqs)
      return InvalidArgument(who + ": null device pointer in a compressor");
  }
  if (c.comp && c.comp->dim != d)
    return InvalidArgument(who + ": compressor dim " + std::to_string(c.comp->dim) +
                           " != head_dim " + std::to_string(d));
  const CompressorRowArgs none{};
  return CacheKernelArgs{c.table, c.window, c.steps, c.comp ? *c.comp : none,
                         c.index_comp ? *c.index_comp : none,
                         (c.comp ? 1 : 0) + (c.index_comp ? 1 : 0)};
}

}  // namespace

Status CacheRows(const CacheRowsArgs& c, int64_t row0, int64_t rows, const float* kv, int64_t d,
                 const float* freqs, int64_t rd, float eps) {
  FM_ASSIGN_OR_RETURN(const CacheKernelArgs k,
                      CheckCacheRows("CacheRows", c, row0, rows, kv, d, freqs, rd));
  if (rows == 0) return Status::Ok();
  const dim3 grid(1 + k.ncomp, static_cast<unsigned>(rows));
  return Launch("CacheRowsKernel", CacheRowsKernel, grid, kThreads, 0, k, row0, kv, d, freqs, rd,
                eps);
}

Status AttnPrep(const AttnPrepArgs& a, int64_t T, const CacheRowsArgs* cache) {
  if (T < 0 || a.nh < 1 || a.d < 1 || (a.iq && (a.ni < 1 || a.di < 1)))
    return InvalidArgument("AttnPrep: tokens " + std::to_string(T) + ", heads " +
                           std::to_string(a.nh) + " x " + std::to_string(a.d) + ", indexer heads " +
                           std::to_string(a.ni) + " x " + std::to_string(a.di));
  FM_RETURN_IF_ERROR(CheckRope("AttnPrep", a.iq && a.di < a.d ? a.di : a.d, a.rd));
  CacheKernelArgs c{};
  if (cache) {
    FM_ASSIGN_OR_RETURN(c, CheckCacheRows("AttnPrep", *cache, 0, T, a.kv, a.d, a.freqs, a.rd));
    // Its entries go to ikeys rows of the indexer's head dim: a wider one would write past them.
    if (cache->index_comp && cache->index_comp->dim != a.di)
      return InvalidArgument("AttnPrep: index compressor dim " + std::to_string(cache->index_comp->dim) +
                             " != the indexer's head_dim " + std::to_string(a.di));
  }
  if (T == 0) return Status::Ok();
  if (!a.q || !a.kv || !a.kv_norm || !a.pos || !a.freqs || (a.iq && !a.iw))
    return InvalidArgument("AttnPrep: null device pointer");
  const int64_t blocks = T * (a.nh + 1 + (a.iq ? a.ni : 0) + c.ncomp);
  return Launch("AttnPrepKernel", AttnPrepKernel, static_cast<unsigned>(blocks), kThreads, 0, a,
                static_cast<int>(T), c);
}

}  // namespace fm::cuda
