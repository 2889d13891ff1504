// Fused kernels of the device decode layer (kernels/cuda/fused.cu): each launch does the work of
// several ops.h kernels, so a decode layer is a short fixed launch sequence (docs/gpu.md
// "Launches of a decode layer"). Same conventions as ops.h: host launchers over device pointers
// on the current stream, InvalidArgument naming the bad argument, every reduction in a fixed
// order (no float atomics), results within float rounding of the CPU references.
#pragma once
#include <cstdint>

#include "common/status.h"
#include "kernels/cuda/ops.h"

namespace fm::cuda {

// hc_post of the previous sublayer fused with hc_pre and the RMSNorm of the next
// (kernels/cpu/hc.h), for T rows of X [T, n, H]:
//   with `out`: X'[t, k, h] = post[t, k] * out[t, h] + sum_j comb[t, j*n+k] * X[t, j, h] into
//   x_new; without: X' = x (x_new unused);
//   mix[t] = fn [(2+n)*n, n*H] . X'[t], rinv = 1/sqrt(mean(X'[t]^2) + rms_eps), then hc_pre's
//   pre/post/comb (Sinkhorn, iters >= 1) into post/comb and y[t] = RMSNorm(sum_i pre_i X'[t, i],
//   norm) (weight norm [H]).
// Each block takes 32 columns h of every stream and row: it writes its slice of X' and its
// partial dot products with fn's rows (and of the squares) to `partials`; the last block to finish
// (a device counter it resets to 0, so a graph replays) sums the partials in block order and does
// the rest. partials: HcFusedPartials(T, n, H) floats; counter: one int32, 0 before the first call.
// post/comb are read (the previous sublayer's) and then overwritten; x_new must not alias x.
int64_t HcFusedPartials(int64_t T, int64_t n, int64_t H);
Status HcPostPre(const float* x, const float* out, float* x_new, const float* fn,
                 const float* base, const float* scale, const float* norm, int64_t T, int64_t n,
                 int64_t H, int64_t iters, float hc_eps, float rms_eps, float* post, float* comb,
                 float* y, float* partials, int32_t* counter);

// The query/key preparation of attention for T rows after their products, one launch:
// q [T, nh, d]: each head RMSNorm'd (no weight) then RoPE'd at pos[t]; kv [T, d]: RMSNorm with
// kv_norm then RoPE'd; with the indexer (iq non-null): iq [T, ni, di] RoPE'd and iw [T, ni]
// scaled by iw_scale. RoPE as RopeInterleaved (the last rd channels, freqs [rd/2]).
struct AttnPrepArgs {
  float* q;
  int64_t nh, d;
  float* kv;
  const float* kv_norm;
  float* iq;  // null: no indexer
  float* iw;
  int64_t ni, di;
  float iw_scale;
  const int32_t* pos;  // [T]
  const float* freqs;
  int64_t rd;
  float eps;
};
Status AttnPrep(const AttnPrepArgs& a, int64_t T);

// One compressor of one token (model/compressor.h): its row into the pending rows and, when the
// token completes a window, the pooled, RMSNorm'd and RoPE'd entry into its row of `entries`.
struct CompressorRowArgs {
  const float* a;  // [width]: this token's kv and gate products
  const float* z;
  const float* ape;  // [r, width]
  const float* norm;  // [dim]
  float* pend_a;  // [2, r, width]
  float* pend_z;
  float* entries;  // [max_entries, dim]
  int64_t ratio, dim;
  bool overlap;  // width = 2 * dim, pooling the previous window's first half too
};
// The cache updates of one token, one launch: kv [d] into ring row *ring_row of keys [*, d]
// (when >= 0), and up to two compressors (comp; index_comp when non-null) at `step`, their
// entries RoPE'd at step->window_pos (freqs [rd/2], eps for the RMSNorm). dim <= 1024.
Status CacheRow(const float* kv, int64_t d, float* keys, const int32_t* ring_row,
                const CompressorRowArgs* comp, const CompressorRowArgs* index_comp,
                const CompressorStep* step, const float* freqs, int64_t rd, float eps);

// Decode attention of one token with its key index built in the kernel and the output's inverse
// RoPE as its epilogue (kernels/cpu/attention_core.h SinkAttentionHeads, then the inverse RoPE):
// the keys are the window ring rows (win = {win_start, nwin}: (win_start + i) % window, oldest
// first), then the entry rows window + (picks ? picks[j] : j) for j < *entries (entries null:
// none) of kv [*, d], at most max_keys and *count (when non-null) of them. For head h < nh:
// s_i = scale * q_h . k_i, p = softmax over (s, sink_h), sink in the denominator only,
// o_h = sum_i p_i k_i, then rotated by -pos * freqs (the last rd channels). One block per head,
// its warps over interleaved keys with an online softmax each, merged in warp order. d <= 512;
// no keys gives o = 0.
struct AttentionArgs {
  const float* q;  // [nh, d]
  int64_t nh, d;
  const float* kv;
  const int32_t* win;
  int64_t window;
  const int32_t* entries;
  const int32_t* picks;
  int64_t max_keys;
  const int32_t* count;
  const float* sink;
  float scale;
  const int32_t* pos;  // [1]
  const float* freqs;
  int64_t rd;
  float* o;  // [nh, d]
};
Status SinkAttentionRope(const AttentionArgs& a);

}  // namespace fm::cuda
