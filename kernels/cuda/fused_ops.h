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
//   with `out` present (a dense output or the MoE's slots, ops.h HcPostInput): X'[t, k, h] =
//   post[t, k] * out[t, h] + sum_j comb[t, j*n+k] * X[t, j, h] into x_new; without: X' = x
//   (x_new unused);
//   mix[t] = fn [(2+n)*n, n*H] . X'[t], rinv = 1/sqrt(mean(X'[t]^2) + rms_eps), then hc_pre's
//   pre/post/comb (Sinkhorn, iters >= 1) into post/comb and y[t] = RMSNorm(sum_i pre_i X'[t, i],
//   norm) (weight norm [H]).
// Block (b, t) takes 32 columns h of every stream of row t: it writes its slice of X' and its
// partial dot products with fn's rows (and of the squares) to `partials`; the last of row t's
// blocks to finish (counters[t], which it resets to 0, so a graph replays) sums the row's
// partials in block order and does the rest, so the rows finish in parallel. partials:
// HcFusedPartials(T, n, H) floats; counters: T int32, 0 before the first call. T <= 65535,
// n * H < 2^31.
// post/comb are read (the previous sublayer's) and then overwritten; x_new must not alias x.
int64_t HcFusedPartials(int64_t T, int64_t n, int64_t H);
Status HcPostPre(const float* x, const HcPostInput& out, float* x_new, const float* fn,
                 const float* base, const float* scale, const float* norm, int64_t T, int64_t n,
                 int64_t H, int64_t iters, float hc_eps, float rms_eps, float* post, float* comb,
                 float* y, float* partials, int32_t* counters);

// The query/key preparation of attention for T rows after their products, one launch:
// q [T, nh, d]: each head RMSNorm'd (no weight) then RoPE'd at pos[t]; kv [T, d]: RMSNorm with
// kv_norm then RoPE'd; with the indexer (iq non-null): iq [T, ni, di] RoPE'd and iw [T, ni]
// scaled by iw_scale. RoPE: the pairs of the last rd channels rotate by pos * freqs[i], freqs
// [rd/2], as kernels/cpu/rope.h.
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

// One sequence's caches of one layer as the attention-side kernels of a step read them: row t of
// a step reads table[t] (device memory written by the host before the step), so one launch
// serves rows of different sequences and a captured step replays over a new table.
struct RowCache {
  float* keys;    // [window + max_entries, d]: ring row s % window, then entry e at window + e
  float* ikeys;   // [max_entries, di]: the indexer's entries (ratio 4; 16-byte aligned)
  float* score;   // [max_entries]: the indexer's scores (16-byte aligned: read as float4s)
  float* pend_a;  // [2, r, width] each: the compressor's pending rows
  float* pend_z;
  float* ipend_a;  // the indexer compressor's
  float* ipend_z;
  int32_t max_entries;
  int32_t unused;
};

// Where row t's position scalars are (model/cuda/step_inputs.h RowScalars): each pointer is row
// 0's field, row t's lies `stride` bytes further per row.
struct RowSteps {
  const int32_t* ring_row;  // the ring row of this token's kv (< 0: none)
  const int32_t* win;       // {win_start, nwin}
  const int32_t* visible;   // compressed entries that exist
  const int32_t* entries;   // entries attended
  const int32_t* keys;      // nwin + entries (or nwin on layers without entries)
  const CompressorStep* comp;
  int64_t stride;
};

// One compressor of a layer (model/compressor.h) for the step's rows: row t's token stores its
// a, z into the pending rows and, when it completes a window, the pooled, RMSNorm'd and RoPE'd
// entry is appended (at keys + window * dim, or ikeys for the indexer's compressor).
struct CompressorRowArgs {
  const float* a;  // [T, width]: the step's kv and gate products
  const float* z;
  const float* ape;   // [r, width]
  const float* norm;  // [dim]
  int64_t ratio, dim;
  bool overlap;  // width = 2 * dim, pooling the previous window's first half too
};
// The cache updates of rows [row0, row0 + rows), one launch: kv [T, d] row t into ring row
// ring_row(t) of table[t].keys, and the layer's compressors (comp; index_comp when non-null,
// which must then have dim == the indexer's di) at step comp(t), their entries RoPE'd at the
// step's window_pos (freqs [rd/2], eps for the RMSNorm). dim <= 1024. Rows of one sequence
// must go one launch each, in order (a later row's ring store overwrites what an earlier row
// reads; the compressor's pending rows chain from token to token).
struct CacheRowsArgs {
  const RowCache* table;
  int64_t window;
  RowSteps steps;
  const CompressorRowArgs* comp;        // null: no compressor
  const CompressorRowArgs* index_comp;  // null: no indexer compressor
};
Status CacheRows(const CacheRowsArgs& c, int64_t row0, int64_t rows, const float* kv, int64_t d,
                 const float* freqs, int64_t rd, float eps);

// The query/key preparation (above: AttnPrepArgs).
// With `cache` (rows [0, T) of distinct sequences, the decode step's way), the same launch also
// makes CacheRows' updates of those rows (a.kv, a.freqs, a.rd, a.eps as its kv and RoPE): the
// block that norms and RoPEs row t's kv then stores it into its ring row, and blocks of their
// own run the compressors; the bits of AttnPrep followed by CacheRows, one launch fewer.
Status AttnPrep(const AttnPrepArgs& a, int64_t T, const CacheRowsArgs* cache = nullptr);

// The Lightning indexer for rows [row0, row0 + rows) whose table[t].max_entries > k (the others
// attend every entry and are skipped): score[e] = sum_h (relu(q_h . k_e) * scale) * w[h] over
// the first visible(t) keys of table[t].ikeys, q = iq [T, nh, di] row t, w = iw [T, nh] row t;
// then picks[t, :] = the k best (ties to the lower index, NaN lowest) in ascending index order.
// A row of no more than k visible entries picks them all, in order, and is not scored.
// A row's keys are scored in tiles of 64 keys x 64 heads (dot products as register tiles over
// columns staged in shared memory), the tiles spread over max_entries / 64 blocks a row (at most
// 256 / rows, at least 1; max_entries: the largest table[t].max_entries, which only sizes the
// grid); the last of a row's blocks (counters[t], reset by it) ranks them by a radix select,
// linear in the entries.
// Until 2026-12-05 a thread scored a key alone over 16 blocks a row. counters [T] start at 0.
Status IndexerTopK(const RowCache* table, int64_t row0, int64_t rows, const float* iq,
                   const float* iw, int64_t nh, int64_t di, float scale, const RowSteps& steps,
                   int64_t max_entries, int64_t k, int32_t* picks, int32_t* counters);

// Decode attention of rows [row0, row0 + rows) with the key index built in the kernel and the
// output's inverse RoPE as its epilogue (kernels/cpu/attention_core.h SinkAttentionHeads, then
// the inverse RoPE): row t's keys are table[t].keys's window ring rows (win(t) = {win_start,
// nwin}: (win_start + i) % window, oldest first), then with entries the entry rows window + e
// for e = picks[t, j] (indexer rows: max_entries > topk) or e = j, j < entries(t); at most
// keys(t). For head h < nh: s_i = scale * q_h . k_i, p = softmax over (s, sink_h), sink in the
// denominator only, o_h = sum_i p_i k_i, then rotated by -pos[t] * freqs (the last rd
// channels). One block per (head, row), its warps over interleaved keys with an online softmax
// each, merged in warp order. d <= 512; no keys gives o = 0.
struct AttentionArgs {
  const float* q;  // [T, nh, d]
  int64_t nh, d;
  const RowCache* table;
  int64_t window;
  bool entries;   // the layer has compressed entries
  int64_t topk;   // > 0: the indexer's k (picks [T, topk]); 0: no indexer
  const int32_t* picks;
  RowSteps steps;
  const float* sink;
  float scale;
  const int32_t* pos;  // [T]
  const float* freqs;
  int64_t rd;
  float* o;  // [T, nh, d]
};
Status SinkAttentionRows(const AttentionArgs& a, int64_t row0, int64_t rows);

}  // namespace fm::cuda
