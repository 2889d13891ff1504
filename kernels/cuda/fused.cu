// Fused kernels of the device decode layer (kernels/cuda/fused_ops.h). Blocks of 256 threads
// (8 warps); block sums are warp butterflies then the warp sums in warp order, so every result
// depends only on the shapes, never on timing.
#include <cuda_runtime.h>

#include <string>

#include "kernels/cuda/check.cuh"
#include "kernels/cuda/fused_ops.h"

namespace fm::cuda {
namespace {

constexpr int kThreads = 256;
constexpr int kWarps = kThreads / 32;
constexpr int kHcCols = 32;  // columns h of every stream per HcPostPre block
constexpr int kHcMaxStreams = 16;
constexpr int kMaxEntryDim = 1024;
constexpr int kAttnMaxDim = 512;

__device__ float SigmoidF(float v) { return 1.0f / (1.0f + expf(-v)); }

__device__ float WarpSum(float v) {
  for (int off = 16; off > 0; off >>= 1) v += __shfl_xor_sync(0xffffffffu, v, off);
  return v;
}

// Sum over the block (warp butterflies, then the warp sums in warp order); all threads get it.
__device__ float BlockSum(float v) {
  __shared__ float warp_sums[kWarps];
  v = WarpSum(v);
  if (threadIdx.x % 32 == 0) warp_sums[threadIdx.x / 32] = v;
  __syncthreads();
  float total = 0.0f;
  for (int w = 0; w < kWarps; ++w) total += warp_sums[w];
  __syncthreads();
  return total;
}

// In place on the rd/2 pairs at the end of a row of width d: (a, b) rotated by pos * freqs[i]
// (negated when inverse), angle in f32 as RopeInterleaved. Block-strided over the pairs.
__device__ void RopeRow(float* row, int64_t d, int64_t rd, int32_t pos, const float* freqs,
                        bool inverse) {
  for (int64_t i = threadIdx.x; i < rd / 2; i += kThreads) {
    float s, c;
    sincosf(static_cast<float>(pos) * freqs[i], &s, &c);
    if (inverse) s = -s;
    float* p = row + (d - rd) + 2 * i;
    const float a = p[0], b = p[1];
    p[0] = a * c - b * s;
    p[1] = a * s + b * c;
  }
}

// comb[j*n+k]: softmax over k + eh, then columns / (sum + eh), then (iters-1) x (rows, columns);
// the order of kernels/cpu/hc.h.
__device__ void SinkhornComb(float* comb, int n, int iters, float eh) {
  for (int j = 0; j < n; ++j) {
    float* row = comb + j * n;
    float mx = row[0];
    for (int k = 1; k < n; ++k) mx = fmaxf(mx, row[k]);
    float sum = 0.0f;
    for (int k = 0; k < n; ++k) {
      row[k] = expf(row[k] - mx);
      sum += row[k];
    }
    for (int k = 0; k < n; ++k) row[k] = row[k] / sum + eh;
  }
  for (int it = 0; it < iters; ++it) {
    if (it > 0)
      for (int j = 0; j < n; ++j) {
        float s = 0.0f;
        for (int k = 0; k < n; ++k) s += comb[j * n + k];
        for (int k = 0; k < n; ++k) comb[j * n + k] /= s + eh;
      }
    for (int k = 0; k < n; ++k) {
      float s = 0.0f;
      for (int j = 0; j < n; ++j) s += comb[j * n + k];
      for (int j = 0; j < n; ++j) comb[j * n + k] /= s + eh;
    }
  }
}

struct HcArgs {
  const float* x;
  const float* out;
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
  int32_t* counter;
};

// Block b: columns [32b, 32b+32) of every stream; writes X' there, then warp w reduces rows
// m = w, w + 8, ... of fn (row M: the squares) over the slice; the last block finishes the rows.
__global__ void HcPostPreKernel(HcArgs a) {
  __shared__ float pre[kHcMaxStreams];
  __shared__ float comb_s[kHcMaxStreams * kHcMaxStreams];
  __shared__ bool last;
  const int n = a.n, M = (2 + n) * n, lane = threadIdx.x % 32, warp = threadIdx.x / 32;
  const int64_t H = a.H, h0 = static_cast<int64_t>(blockIdx.x) * kHcCols;
  const int cols = static_cast<int>(H - h0 < kHcCols ? H - h0 : kHcCols);
  const float* xs = a.out ? a.x_new : a.x;  // X'
  if (a.out) {
    for (int i = threadIdx.x; i < a.T * n * cols; i += kThreads) {
      const int t = i / (n * cols), k = (i / cols) % n, h = i % cols;
      const float* xt = a.x + static_cast<int64_t>(t) * n * H;
      const float* ct = a.comb + t * n * n;
      float acc = a.post[t * n + k] * a.out[t * H + h0 + h];
      for (int j = 0; j < n; ++j) acc += ct[j * n + k] * xt[j * H + h0 + h];
      a.x_new[(static_cast<int64_t>(t) * n + k) * H + h0 + h] = acc;
    }
    __syncthreads();
  }
  for (int t = 0; t < a.T; ++t) {
    const float* xt = xs + static_cast<int64_t>(t) * n * H;
    for (int m0 = 0; m0 <= M; m0 += kWarps) {
      const int m = m0 + warp;
      float v = 0.0f;
      if (m <= M)
        for (int i = lane; i < n * cols; i += 32) {
          const int64_t col = (i / cols) * H + h0 + i % cols;
          v += (m < M ? a.fn[m * n * H + col] : xt[col]) * xt[col];
        }
      v = WarpSum(v);
      if (m <= M && lane == 0) a.partials[(static_cast<int64_t>(blockIdx.x) * a.T + t) * (M + 1) + m] = v;
    }
  }
  __threadfence();
  __syncthreads();
  if (threadIdx.x == 0) last = atomicAdd(a.counter, 1) == static_cast<int>(gridDim.x) - 1;
  __syncthreads();
  if (!last) return;
  __threadfence();
  if (threadIdx.x == 0) *a.counter = 0;
  const volatile float* parts = a.partials;
  const volatile float* xv = xs;
  for (int t = 0; t < a.T; ++t) {
    if (threadIdx.x == 0) {
      float mix[(2 + kHcMaxStreams) * kHcMaxStreams + 1];
      for (int m = 0; m <= M; ++m) {
        float s = 0.0f;
        for (unsigned b = 0; b < gridDim.x; ++b) s += parts[(static_cast<int64_t>(b) * a.T + t) * (M + 1) + m];
        mix[m] = s;
      }
      const float rinv = 1.0f / sqrtf(mix[M] / static_cast<float>(n * H) + a.rms_eps);
      for (int i = 0; i < n; ++i) {
        pre[i] = SigmoidF(mix[i] * rinv * a.scale[0] + a.base[i]) + a.hc_eps;
        a.post[t * n + i] = 2.0f * SigmoidF(mix[n + i] * rinv * a.scale[1] + a.base[n + i]);
      }
      for (int c = 0; c < n * n; ++c)
        comb_s[c] = mix[2 * n + c] * rinv * a.scale[2] + a.base[2 * n + c];
      SinkhornComb(comb_s, n, a.iters, a.hc_eps);
      for (int c = 0; c < n * n; ++c) a.comb[t * n * n + c] = comb_s[c];
    }
    __syncthreads();
    float* yt = a.y + t * H;
    float ss = 0.0f;
    for (int64_t h = threadIdx.x; h < H; h += kThreads) {
      float acc = 0.0f;
      for (int i = 0; i < n; ++i) acc += pre[i] * xv[(static_cast<int64_t>(t) * n + i) * H + h];
      yt[h] = acc;
      ss += acc * acc;
    }
    const float inv = 1.0f / sqrtf(BlockSum(ss) / static_cast<float>(H) + a.rms_eps);
    for (int64_t h = threadIdx.x; h < H; h += kThreads) yt[h] = a.norm[h] * (yt[h] * inv);
    __syncthreads();
  }
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

// Blocks: T * nh query heads, then T kv rows, then T * ni indexer heads.
__global__ void AttnPrepKernel(AttnPrepArgs a, int T) {
  const int64_t b = blockIdx.x, nq = T * a.nh;
  if (b < nq) {
    NormRopeRow(a.q + b * a.d, a.d, nullptr, a.eps, a.rd, a.pos[b / a.nh], a.freqs);
  } else if (b < nq + T) {
    const int64_t t = b - nq;
    NormRopeRow(a.kv + t * a.d, a.d, a.kv_norm, a.eps, a.rd, a.pos[t], a.freqs);
  } else {
    const int64_t head = b - nq - T, t = head / a.ni;
    RopeRow(a.iq + head * a.di, a.di, a.rd, a.pos[t], a.freqs, false);
    if (threadIdx.x == 0) a.iw[head] *= a.iw_scale;
  }
}

// One compressor's token: store its row, and on the window's last token pool the gathered
// slots (CompressorGather's order), norm, RoPE and append the entry.
__device__ void CompressorRow(const CompressorRowArgs& c, const CompressorStep* st,
                              const float* freqs, int64_t rd, float eps) {
  __shared__ float ent[kMaxEntryDim];
  const int64_t r = c.ratio, d = c.dim, width = c.overlap ? 2 * d : d;
  const int64_t row = (st->parity * r + st->slot) * width;
  for (int64_t i = threadIdx.x; i < width; i += kThreads) {
    c.pend_a[row + i] = c.a[i];
    c.pend_z[row + i] = c.z[i] + c.ape[st->slot * width + i];
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
    float m = c.pend_z[src(0, ch)];
    for (int64_t j = 1; j < n; ++j) m = c.pend_z[src(j, ch)] > m ? c.pend_z[src(j, ch)] : m;
    float sum = 0.0f;
    for (int64_t j = 0; j < n; ++j) sum += expf(c.pend_z[src(j, ch)] - m);
    float acc = 0.0f;
    for (int64_t j = 0; j < n; ++j)
      acc += (expf(c.pend_z[src(j, ch)] - m) / sum) * c.pend_a[src(j, ch)];
    ent[ch] = acc;
    ss += acc * acc;
  }
  const float inv = 1.0f / sqrtf(BlockSum(ss) / static_cast<float>(d) + eps);
  for (int64_t ch = threadIdx.x; ch < d; ch += kThreads) ent[ch] = c.norm[ch] * (ent[ch] * inv);
  __syncthreads();
  RopeRow(ent, d, rd, st->window_pos, freqs, false);
  __syncthreads();
  float* out = c.entries + static_cast<int64_t>(st->entry) * d;
  for (int64_t ch = threadIdx.x; ch < d; ch += kThreads) out[ch] = ent[ch];
}

// Block 0: the ring store; block 1: comp; block 2: index_comp.
__global__ void CacheRowKernel(const float* kv, int64_t d, float* keys, const int32_t* ring_row,
                               CompressorRowArgs comp, CompressorRowArgs index_comp,
                               const CompressorStep* st, const float* freqs, int64_t rd,
                               float eps) {
  if (blockIdx.x == 0) {
    const int64_t r = ring_row[0];
    if (r >= 0)
      for (int64_t c = threadIdx.x; c < d; c += kThreads) keys[r * d + c] = kv[c];
  } else {
    CompressorRow(blockIdx.x == 1 ? comp : index_comp, st, freqs, rd, eps);
  }
}

// Key row i of the query (KeyIndex's order).
__device__ int64_t KeyRow(const AttentionArgs& a, int64_t i, int64_t nwin) {
  if (i < nwin) return (a.win[0] + i) % a.window;
  return a.window + (a.picks ? a.picks[i - nwin] : i - nwin);
}

// One block per head: warp w takes keys w, w + 8, ...; per key the lanes split the dot product,
// then the warp's online softmax (max m, sum l, acc [d]) moves on; the warps merge in order.
__global__ void SinkAttentionRopeKernel(AttentionArgs a) {
  __shared__ float acc[kWarps][kAttnMaxDim];
  __shared__ float wm[kWarps], wl[kWarps];
  __shared__ float o_s[kAttnMaxDim];
  const int64_t h = blockIdx.x, d = a.d;
  const int lane = threadIdx.x % 32, warp = threadIdx.x / 32;
  const int64_t nwin = a.win[1], ne = a.entries ? a.entries[0] : 0;
  int64_t n = nwin + ne < a.max_keys ? nwin + ne : a.max_keys;
  if (a.count && a.count[0] < n) n = a.count[0] < 0 ? 0 : a.count[0];
  const float* qh = a.q + h * d;
  for (int64_t c = lane; c < d; c += 32) acc[warp][c] = 0.0f;
  float m = -INFINITY, l = 0.0f;
  for (int64_t i0 = 0; i0 < n; i0 += kWarps) {  // the same trip count in every warp
    const int64_t i = i0 + warp;
    const float* k = i < n ? a.kv + KeyRow(a, i, nwin) * d : nullptr;
    float dot = 0.0f;
    if (k)
      for (int64_t c = lane; c < d; c += 32) dot += qh[c] * k[c];
    const float s = WarpSum(dot) * a.scale;
    if (!k) continue;
    if (s > m) {  // a new max rescales what came before (exp(-inf) = 0 on the first key)
      const float r = expf(m - s);
      for (int64_t c = lane; c < d; c += 32) acc[warp][c] = acc[warp][c] * r + k[c];
      l = l * r + 1.0f;
      m = s;
    } else {  // NaN scores land here and poison l and acc, as on the CPU
      const float p = expf(s - m);
      for (int64_t c = lane; c < d; c += 32) acc[warp][c] += p * k[c];
      l += p;
    }
  }
  if (lane == 0) {
    wm[warp] = m;
    wl[warp] = l;
  }
  __syncthreads();
  float mx = a.sink[h];
  for (int w = 0; w < kWarps; ++w) mx = wm[w] > mx ? wm[w] : mx;
  float den = expf(a.sink[h] - mx);
  for (int w = 0; w < kWarps; ++w) den += wl[w] * expf(wm[w] - mx);
  for (int64_t c = threadIdx.x; c < d; c += kThreads) {
    float v = 0.0f;
    for (int w = 0; w < kWarps; ++w) v += acc[w][c] * expf(wm[w] - mx);
    o_s[c] = v / den;
  }
  __syncthreads();
  RopeRow(o_s, d, a.rd, a.pos[0], a.freqs, true);
  __syncthreads();
  for (int64_t c = threadIdx.x; c < d; c += kThreads) a.o[h * d + c] = o_s[c];
}

Status CheckRope(const char* op, int64_t d, int64_t rd) {
  if (rd <= 0 || rd % 2 != 0 || rd > d)
    return InvalidArgument(std::string(op) + ": rope dims " + std::to_string(rd) +
                           " must be even, > 0 and <= the row width " + std::to_string(d));
  return Status::Ok();
}

}  // namespace

int64_t HcFusedPartials(int64_t T, int64_t n, int64_t H) {
  return (H + kHcCols - 1) / kHcCols * T * ((2 + n) * n + 1);
}

Status HcPostPre(const float* x, const float* out, float* x_new, const float* fn,
                 const float* base, const float* scale, const float* norm, int64_t T, int64_t n,
                 int64_t H, int64_t iters, float hc_eps, float rms_eps, float* post, float* comb,
                 float* y, float* partials, int32_t* counter) {
  if (T < 0 || n < 1 || n > kHcMaxStreams || H < 1 || iters < 1)
    return InvalidArgument("HcPostPre: tokens " + std::to_string(T) + ", hc streams " +
                           std::to_string(n) + ", hidden " + std::to_string(H) + ", sinkhorn iters " +
                           std::to_string(iters) + " (want tokens >= 0, streams in [1, " +
                           std::to_string(kHcMaxStreams) + "], hidden >= 1, iters >= 1)");
  if (T == 0) return Status::Ok();
  if (!x || !fn || !base || !scale || !norm || !post || !comb || !y || !partials || !counter ||
      (out && !x_new))
    return InvalidArgument("HcPostPre: null device pointer");
  if (out && x_new == x) return InvalidArgument("HcPostPre: x_new must not alias x");
  const HcArgs a{x, out, x_new, fn, base, scale, norm, static_cast<int>(T), static_cast<int>(n),
                 H, static_cast<int>(iters), hc_eps, rms_eps, post, comb, y, partials, counter};
  HcPostPreKernel<<<static_cast<unsigned>((H + kHcCols - 1) / kHcCols), kThreads, 0,
                    CurrentStream()>>>(a);
  return LaunchStatus("HcPostPreKernel");
}

Status AttnPrep(const AttnPrepArgs& a, int64_t T) {
  if (T < 0 || a.nh < 1 || a.d < 1 || (a.iq && (a.ni < 1 || a.di < 1)))
    return InvalidArgument("AttnPrep: tokens " + std::to_string(T) + ", heads " +
                           std::to_string(a.nh) + " x " + std::to_string(a.d) + ", indexer heads " +
                           std::to_string(a.ni) + " x " + std::to_string(a.di));
  FM_RETURN_IF_ERROR(CheckRope("AttnPrep", a.iq && a.di < a.d ? a.di : a.d, a.rd));
  if (T == 0) return Status::Ok();
  if (!a.q || !a.kv || !a.kv_norm || !a.pos || !a.freqs || (a.iq && !a.iw))
    return InvalidArgument("AttnPrep: null device pointer");
  const int64_t blocks = T * (a.nh + 1 + (a.iq ? a.ni : 0));
  AttnPrepKernel<<<static_cast<unsigned>(blocks), kThreads, 0, CurrentStream()>>>(
      a, static_cast<int>(T));
  return LaunchStatus("AttnPrepKernel");
}

Status CacheRow(const float* kv, int64_t d, float* keys, const int32_t* ring_row,
                const CompressorRowArgs* comp, const CompressorRowArgs* index_comp,
                const CompressorStep* step, const float* freqs, int64_t rd, float eps) {
  if (d < 1) return InvalidArgument("CacheRow: head_dim " + std::to_string(d) + " < 1");
  if (!kv || !keys || !ring_row) return InvalidArgument("CacheRow: null device pointer");
  if (index_comp && !comp) return InvalidArgument("CacheRow: index compressor without compressor");
  for (const CompressorRowArgs* c : {comp, index_comp}) {
    if (!c) continue;
    if (c->ratio < 1 || c->dim < 1 || c->dim > kMaxEntryDim)
      return InvalidArgument("CacheRow: compressor ratio " + std::to_string(c->ratio) + ", dim " +
                             std::to_string(c->dim) + " (want ratio >= 1, dim in [1, " +
                             std::to_string(kMaxEntryDim) + "])");
    FM_RETURN_IF_ERROR(CheckRope("CacheRow", c->dim, rd));
    if (!c->a || !c->z || !c->ape || !c->norm || !c->pend_a || !c->pend_z || !c->entries ||
        !step || !freqs)
      return InvalidArgument("CacheRow: null device pointer in a compressor");
  }
  const unsigned blocks = 1 + (comp ? 1 : 0) + (index_comp ? 1 : 0);
  const CompressorRowArgs none{};
  CacheRowKernel<<<blocks, kThreads, 0, CurrentStream()>>>(
      kv, d, keys, ring_row, comp ? *comp : none, index_comp ? *index_comp : none, step, freqs,
      rd, eps);
  return LaunchStatus("CacheRowKernel");
}

Status SinkAttentionRope(const AttentionArgs& a) {
  if (a.nh < 0 || a.d < 1 || a.d > kAttnMaxDim || a.window < 1 || a.max_keys < 0)
    return InvalidArgument("SinkAttentionRope: heads " + std::to_string(a.nh) + ", head_dim " +
                           std::to_string(a.d) + ", window " + std::to_string(a.window) +
                           ", max keys " + std::to_string(a.max_keys) + " (want head_dim in [1, " +
                           std::to_string(kAttnMaxDim) + "], window >= 1)");
  FM_RETURN_IF_ERROR(CheckRope("SinkAttentionRope", a.d, a.rd));
  if (a.nh == 0) return Status::Ok();
  if (!a.q || !a.kv || !a.win || !a.sink || !a.pos || !a.freqs || !a.o)
    return InvalidArgument("SinkAttentionRope: null device pointer");
  SinkAttentionRopeKernel<<<static_cast<unsigned>(a.nh), kThreads, 0, CurrentStream()>>>(a);
  return LaunchStatus("SinkAttentionRopeKernel");
}

}  // namespace fm::cuda
