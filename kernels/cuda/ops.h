// CUDA twins of the CPU ops. Host launchers over device pointers, queued on this thread's
// current stream (device.h StreamScope; the default stream otherwise), asynchronous:
// DeviceBuffer::CopyToHost or Stream::Synchronize waits. What changes from step to step (token
// ids, positions: RouterTopK's tokens, CompressorStep, fused_ops.h's row scalars) is read from
// device memory, so a step captured once as a CUDA graph (device.h Graph) replays at any position.
// Launchers check their arguments and return InvalidArgument naming the bad one before touching
// the device, and turn launch errors into a Status. Every reduction runs in a fixed order, so
// results are deterministic run to run; they match the CPU references within float rounding, not
// bit-exactly. No CUDA types here, so plain C++ code can include it.
#pragma once
#include <cstdint>

#include "common/status.h"
#include "common/tensor.h"
#include "kernels/cuda/device.h"

namespace fm::cuda {

// A quantized weight copied to the device in its checkpoint layout (common/tensor.h QWeight).
struct DeviceWeight {
  WeightFormat format = WeightFormat::kF32;
  int64_t rows = 0, cols = 0;
  DeviceBuffer data, scale;
  // A QWeight whose data/scale are device pointers, as Gemv takes it.
  QWeight view() const;
};
// Checks the shape against the format (FP4: cols % 32 == 0) and copies weights and scales.
Result<DeviceWeight> UploadWeight(const QWeight& host);

// y[rows] = W[rows, cols] x[cols], W dequantized on the fly exactly as MatvecRef does (FP8 e4m3
// with e8m0 128x128 block scales incl. partial edge blocks, FP4 e2m1 with e8m0 per-32 scales,
// BF16, F32). w.data/w.scale, x and y are device pointers. Four rows a warp (gemv.cu; FP8/FP4
// on the tensor-core core: 16, see SetWeightPath below).
Status Gemv(const QWeight& w, const float* x, float* y);
// T products with the same weight: y[t * y_stride + r] = W x_t with x_t = x + t * x_stride, each
// bit-identical to Gemv(w, x_t, ...) whatever T is (when x and x_stride keep every x_t 16-byte
// aligned, or none). Each weight element is decoded once per 8 tokens.
Status Gemm(const QWeight& w, const float* x, int64_t x_stride, float* y, int64_t y_stride,
            int64_t T);

// One product of GemmMany: rows [row0, row0 + rows) of w (rows 0: to the end) times the T rows
// x + t * x_stride into y + t * y_stride (y[.., 0] is row row0). row0 may start anywhere, also
// inside an FP8 128-row scale block (the grouped wo_a: one task per group). A row's bits depend
// on the product's row count (it picks how many warps share a row); plan_rows > 0 computes the
// rows as in a product of plan_rows rows, so a tensor-parallel member's share of a weight gives
// the bits of those rows of the whole product.
struct GemvTask {
  QWeight w;
  const float* x = nullptr;
  int64_t x_stride = 0;
  float* y = nullptr;
  int64_t y_stride = 0;
  int64_t row0 = 0, rows = 0;
  int64_t plan_rows = 0;
};
constexpr int kMaxGemvTasks = 8;
// One launch: for every task i and t < T, y_i[t] = W_i xn_i[t] with xn = x, or with norm (device
// [cols], every task then has the same cols) xn = norm * (x / sqrt(mean(x^2) + eps)), rms in
// RmsNorm's order (so RmsNorm then Gemm gives the same bits). Without norm each task's output is
// bit-identical to Gemm of that task alone. At most kMaxGemvTasks tasks; the table is passed by
// value, so a captured graph bakes it. (A pointer and a count: the .cu files build as C++17.)
Status GemmMany(const GemvTask* tasks, int64_t n, int64_t T, const float* norm = nullptr,
                float eps = 0.0f);

// Which core streams FP8 and FP4 weights in Gemv/Gemm/GemmMany and the experts (BF16 and F32
// always take the FMA one), for the whole process, read at each launch (a captured graph keeps
// the core it was captured with):
// - kFma (default): f32 FMAs, 4 rows a warp (gemv_core.cuh), the core measured on the H200.
// - kTensorCore: mma.sync with f16 operands, 16 rows x 8 tokens a warp (gemv_tc.cuh): the
//   weight decode is paid once for 8 tokens. x enters as two f16 parts (~22 bits), so |x| must
//   stay below 65504 (larger gives inf/NaN). Not yet measured on a GPU (docs/gpu-kernels.md).
// Each core keeps a token's bits independent of T and the other tokens; the two cores' results
// differ in the last bits. Every worker of a cluster must use the same one.
enum class WeightPath { kFma, kTensorCore };
void SetWeightPath(WeightPath path);
WeightPath GetWeightPath();

// Launch overlap (programmatic dependent launch, kernels/cuda/launch.cuh), for the whole
// process, read at each launch (a captured graph keeps what it was captured with): every kernel
// may start its blocks while the one before it in the stream finishes, waits for it before it
// touches any buffer, and the weight-streaming kernels (Gemm, GemmMany, the shared expert) first
// ask L2 for their block's weight rows, so a product's DRAM reads overlap the tail of the kernel
// before it. Results are bit-identical either way. Default off: not yet measured on a GPU
// (docs/gpu-kernels.md "Launch overlap").
void SetLaunchOverlap(bool on);
bool GetLaunchOverlap();

// y[r, :] = g * x[r, :] / sqrt(mean(x[r, :]^2) + eps) for r < rows; g = weight[dim], or 1 when
// weight is null. y may equal x. One block per row.
Status RmsNorm(const float* x, const float* weight, float* y, int64_t rows, int64_t dim,
               float eps);

// The MoE router for T tokens (kernels/cpu/router.h): s = sqrt(softplus(logits[t, :E])); ids[t]
// = the top_k experts by s + bias (descending, ties to the lower index), or, on hash layers,
// the token's row tid2eid[tokens[t], :k] (tid2eid [vocab, k], entries checked by the loader to be
// in [0, E); tokens[T] int32 on the device; a token outside [0, vocab) gives ids -1 and NaN
// weights); w[t, j] = s[ids[t, j]] / (sum_j s[ids[t, j]] + 1e-20) * routed_scale. bias (score
// layers) and tid2eid (hash layers) are exclusive; both null = plain top-k of s. E <= 1024. One
// warp per token.
Status RouterTopK(const float* logits, const float* bias, const int64_t* tid2eid,
                  const int32_t* tokens, int64_t vocab, int64_t T, int64_t E, int64_t k,
                  float routed_scale, int32_t* ids, float* w);
// The MoE gate and router in one launch: logits [T, E] = Gemm(gate [E, cols], x rows x_stride
// apart), then RouterTopK's ids and weights from them (its arguments); the last of the product's
// blocks to finish (counter: an int32 in device memory, 0 before the first call, reset by the
// call) routes every token. The bits of Gemm and then RouterTopK, one launch fewer; a gate on the
// tensor-core core (ops.h SetWeightPath, FP8/FP4) or more than 32 tokens (a prefill chunk, which
// one block would route slowly) take the two launches.
Status GateRouterTopK(const QWeight& gate, const float* x, int64_t x_stride, int64_t T,
                      float* logits, const float* bias, const int64_t* tid2eid,
                      const int32_t* tokens, int64_t vocab, int64_t k, float routed_scale,
                      int32_t* ids, float* w, int32_t* counter);

// hc_head for T tokens (kernels/cpu/hc.h): x [T, n, H], mix [T, n] = fn . flatten(x) (a Gemm by
// the caller, not yet scaled by 1/rms), base [n] -> y [T, H] (before the final norm). n <= 16.
Status HcHead(const float* x, const float* mix, const float* base, float scale, int64_t T,
              int64_t n, int64_t H, float hc_eps, float rms_eps, float* y);
// What hc_post adds to the streams: a sublayer's output `out` [T, H], or the MoE's expert slots
// combined on the fly (Slots: contrib [T, k + 1, H] as ExpertsDown writes them with the shared
// expert, w [T, k]; the bits of MoeCombine(add_shared) into an `out`), so the MoE needs no
// combine launch. Neither set: no hc_post.
struct HcPostInput {
  const float* out = nullptr;
  const float* contrib = nullptr;
  const float* w = nullptr;
  int64_t k = 0;
  HcPostInput() = default;
  HcPostInput(const float* dense) : out(dense) {}  // NOLINT: a plain output converts
  static HcPostInput Slots(const float* contrib, const float* w, int64_t k) {
    HcPostInput in;
    in.contrib = contrib, in.w = w, in.k = k;
    return in;
  }
  bool present() const { return out || contrib; }
};
// The launchers' check of a present input: slots need w and 1 <= k <= 1024.
Status CheckHcPostInput(const char* op, const HcPostInput& in);

// hc_post: x_new [T, n, H] = post[k] * out[T, H] + sum_j comb[j*n+k] * x[j]; no aliasing.
Status HcPost(const float* x, const HcPostInput& out, const float* post, const float* comb,
              int64_t T, int64_t n, int64_t H, float* x_new);
// y [T, H] = sum_j w[T, j] * contrib[T, j, H], j ascending (the routed experts' outputs). With
// add_shared, contrib is [T, k + 1, H] (ExpertsDown's slots) and the shared row j == k is added
// last with weight 1.
Status MoeCombine(const float* contrib, const float* w, int64_t T, int64_t k, int64_t H, float* y,
                  bool add_shared = false);

// y[i] = a[i] + b[i]; y may equal a or b.
Status AddVectors(const float* a, const float* b, float* y, int64_t n);

// For i < n, c < width: dst[dst_row[i] * dst_stride + c] = src[src_row[i] * src_stride + c]
// (row indices in device memory; null: i). Column slices, joins of side-by-side pieces,
// gathers and scatters of row-major f32 (the device tensor-parallel gathers); a column offset
// is folded into src or dst. Rows must not overlap between src and dst.
Status CopyRowPieces(const float* src, int64_t src_stride, const int32_t* src_row, float* dst,
                     int64_t dst_stride, const int32_t* dst_row, int64_t n, int64_t width);

// The embedding lookup (model/forward.h EmbedManifold): x [T, n, H], every one of the n streams
// of row t = table[ids[t]] as f32. table [vocab, H] is BF16 (bf16 true) or F32; ids [T] int32 on
// the device, checked against the vocabulary by the caller before (an id outside [0, vocab)
// gives NaN rows, never a read outside the table).
Status EmbedRows(const void* table, bool bf16, int64_t vocab, int64_t H, const int32_t* ids,
                 int64_t T, int64_t n, float* x);

// Where one token stands in its compressor's window of r positions (device memory, written by
// the host before each step): CacheRows (fused_ops.h) reads it instead of the position.
struct CompressorStep {
  int32_t slot;        // pos % r: the pending row this token fills
  int32_t parity;      // (pos / r) % 2: which of the two pending buffers holds this window
  int32_t has_prev;    // pos >= r: a previous window exists (overlapping compressors)
  int32_t emit;        // slot == r - 1: this token completes the window
  int32_t entry;       // emit ? pos / r : -1, the entry row it appends
  int32_t window_pos;  // pos + 1 - r: the entry's RoPE position
};

// Routed experts of one shape on the device: E weights [rows, cols] of one format; datas/scales
// are device arrays of E device pointers (DeviceWeight buffers, 256-byte aligned).
struct DevExperts {
  WeightFormat format = WeightFormat::kF32;
  int64_t rows = 0, cols = 0, E = 0;
  const void* const* datas = nullptr;
  const uint8_t* const* scales = nullptr;
};
// The shared expert's weights (device QWeights): w1, w3 [Is, H], w2 [H, Is].
struct SharedExpert {
  QWeight w1, w3, w2;
};
// Slot s = t * S + j of a step, S = k (+1 with a shared expert): token t's j-th routed expert
// e = ids[t * k + j] for j < k, the shared expert for j == k. Both launches below group the slots
// by expert (the block of an expert's first slot serves all its slots, up to 8 per pass over the
// weight), so each expert's weight is read about once per step, and a slot's result does not
// depend on T or on the other slots. It is bit-identical to Gemm of its expert alone only where
// that Gemm streams each row in one slice (small matrices): the experts always do, while Gemm
// splits the rows of a big one over slices (at the real w2 [4096, 2048] FP4: 2, tc: 8), another
// order of the row's sums. Every path (shard, EP, TP) runs the experts here, so they agree.
//
// h[s, :I] = silu(min(W1_e x_t, limit)) * clip(W3_e x_t, -limit, limit) for every slot (rows of
// h_stride >= max(I, Is) floats; x_t = x + t * x_stride); an id outside [0, E) gives a NaN row.
// W1 and W3 in one pass, SwiGLU in the epilogue, one launch. k may be 0 with a shared expert
// (only the shared slots; w1/w3 and ids unused). limit: > 0, +inf for no clamp.
Status ExpertsUpGate(const DevExperts& w1, const DevExperts& w3, const int32_t* ids, int64_t T,
                     int64_t k, const float* x, int64_t x_stride, float limit,
                     const SharedExpert* shared, float* h, int64_t h_stride);
// contrib[s, :H] = W2_e h[s, :] for every slot (the shared expert's w2 at its slots; rows of H
// floats); an id outside [0, E) gives a NaN row. One launch.
Status ExpertsDown(const DevExperts& w2, const int32_t* ids, int64_t T, int64_t k, const float* h,
                   int64_t h_stride, const SharedExpert* shared, float* contrib);

// Read bandwidth of the current device in GB/s: `passes` reads of a `bytes` buffer (>= 1 MiB;
// take several times the L2 size), timed with events after one warm-up pass.
Result<double> MeasureReadBandwidth(size_t bytes, int passes);

}  // namespace fm::cuda
