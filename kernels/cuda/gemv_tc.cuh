// The tensor-core weight-streaming core for FP8 (e4m3, e8m0 per 128x128) and FP4 (e2m1, e8m0
// per 32), the alternative to gemv_core.cuh's f32 FMAs (ops.h SetWeightPath picks). A warp
// streams a tile of 16 weight rows x 8 tokens: lane l = 4 g + t loads 16-byte vectors of two
// rows (the mma's rows g and g + 8, "streams" 0 and 1: a product's rows r and r + 8, or an
// expert's W1 and W3 row) and token g's x for the same columns, and each decoded weight element
// meets all 8 tokens in the tensor cores (mma.sync m16n8k16, f16 operands, f32 sums). So T = 8
// costs the weight decode of T = 1, where the FMA core pays 16 (FP8) to 32 (FP4) FMAs a vector
// for every token.
// Columns: a step is 4 consecutive vectors, lane t taking vector 4 step + t; mma j of a step
// takes elements 4j..4j+3 of every lane's vector, for the weights and x alike (a permutation
// of the columns, which the sum does not see).
// x: when a pass's tokens fit kTcStageBytes, the block splits x once into shared memory in the
// order the lanes read it (TcStageX), so a lane's B operands of an mma are one 16-byte shared
// load; otherwise each lane loads and splits its token's columns at every step (at T = 1 that
// split was over half of an FP8 step's instructions). The same split either way: the same bits.
// Numbers: e4m3 and e2m1 are exact in f16; x enters as hi = f16(x) and lo = f16((x - hi) 2^11)
// (two mmas, two sums; ~22 bits for |x| >= 2^-13, absolute error < 2^-36 below). FP8:
// a step's sums are scaled in f32 by their 128-block's scale. FP4: the group scale is folded
// into the f16 weight (e2m1 * 2^(s-127) is exact in f16 for s in [104, 128], weights of
// magnitude 2^-24..12); a row whose group is outside takes that step on f32 FMAs (row-local:
// no other row changes). Bits: an mma output column depends on its own B column only and a
// warp's steps on the shape only, so a token's bits depend on neither T nor the other tokens.
#pragma once
#include "kernels/cuda/gemv_core.cuh"
#include "kernels/cuda/mma.cuh"

namespace fm::cuda {

constexpr int kTcRows = 16;    // weight rows a warp streams (the mma's m)
constexpr int kTcTokens = 8;   // tokens a pass serves (the mma's n)
constexpr int kTcAhead = 3;    // steps whose weight loads a lane issues before the first mma
                               // (3: no spills under the 128-register cap; 4 spilled)
constexpr uint32_t kTcFp4ScaleMin = 104, kTcFp4ScaleMax = 128;

__host__ __device__ constexpr bool TcFormat(WeightFormat f) {
  return f == WeightFormat::kFP8Block || f == WeightFormat::kFP4Block32;
}

// The two weight rows of lanes 4 g .. 4 g + 3: stream i is the mma's row g + 8 i.
struct TcRows {
  const void* data[2];
  const uint8_t* scale[2];
  int64_t row[2];
};

// The x a lane reads, for a tile of 8 tokens: token g's (its B column) and, for an FP4 step on
// the FMA fallback, tokens 2t and 2t + 1 (its outputs; null: idle); with a norm weight g,
// x = g * (x * inv). xg is always a valid row (an idle token's lane reads a live token's and
// zeroes it), so its loads need no branch. stage: token g's staged fragments (TcStageX), or
// null: xg is loaded and split at every step. Plain fields: an array indexed by lane would live
// in local memory.
struct TcLaneX {
  const float* xg;
  bool live_g;
  float inv_g;
  const float* xo[2];
  float inv_o[2];
  const float* g;
  const uint4* stage;
};

// Shared memory for a pass's staged x (a static array of the tensor-core kernels: 2 blocks an
// SM take 72 KB of the H200's 228; a GB10 runs one a SM, 36 KB of its 100).
constexpr int kTcStageBytes = 36 << 10;

// A token's staged x, in 16-byte entries: entry (st J + j) 4 + t holds the B fragments of mma j
// of step st for lane quad t, {hi(c, c+1), hi(c+2, c+3), lo(c, c+1), lo(c+2, c+3)} of x's
// columns c = 4 j + VecElems (4 st + t) (J = VecElems / 4 mmas a step), zeros past the last
// vector; whole steps, then 4 entries (64 bytes) so that the two tokens a phase of 8 lanes reads
// fall on different banks.
__host__ __device__ constexpr int64_t TcStageStride(WeightFormat f, int64_t cols) {
  return (cols / VecElems(f) + 3) / 4 * VecElems(f) + 4;
}
__host__ __device__ constexpr bool TcStageFits(WeightFormat f, int64_t cols, int64_t tokens) {
  return tokens * TcStageStride(f, cols) * 16 <= kTcStageBytes;
}

// Every thread of the block (kGemvThreads): tokens 0..n-1 (x rows row_of(i), with a norm weight g: g * (x *
// inv[i])) into `stage` [n, TcStageStride], each element split as TcB splits it.
template <WeightFormat F, class RowOf>
__device__ void TcStageXOf(uint4* stage, int64_t cols, int n, RowOf row_of, const float* g,
                           const float* inv) {
  constexpr int J = VecElems(F) / 4;
  const int per = static_cast<int>(TcStageStride(F, cols)) - 4;
  const int nvec = static_cast<int>(cols / VecElems(F));
  for (int i = threadIdx.x; i < n * per; i += kGemvThreads) {
    const int tok = i / per, e = i % per, t = e % 4, j = (e / 4) % J, v = 4 * (e / (4 * J)) + t;
    float4 a = float4{0.0f, 0.0f, 0.0f, 0.0f};
    if (v < nvec) a = NormedX4(row_of(tok), g, g ? inv[tok] : 1.0f, v * VecElems(F) + 4 * j);
    uint4 f;
    SplitF16x2(a.x, a.y, f.x, f.z);
    SplitF16x2(a.z, a.w, f.y, f.w);
    stage[static_cast<int64_t>(tok) * (per + 4) + e] = f;
  }
}
template <class RowOf>
__device__ void TcStageX(WeightFormat format, uint4* stage, int64_t cols, int n, RowOf row_of,
                         const float* g, const float* inv) {
  if (format == WeightFormat::kFP8Block)
    TcStageXOf<WeightFormat::kFP8Block>(stage, cols, n, row_of, g, inv);
  else
    TcStageXOf<WeightFormat::kFP4Block32>(stage, cols, n, row_of, g, inv);
}

// x's lo part is scaled by 2^11 into the f16 range (mma.cuh SplitF16x2), its sums scaled back.
constexpr float kTcLoUnscale = 1.0f / 2048.0f;

// The B fragments (hi, lo) of 4 x columns; zeros where the token is idle or the step dead.
__device__ __forceinline__ void TcB(float4 a, bool keep, uint32_t (&bh)[2], uint32_t (&bl)[2]) {
  if (!keep) a = float4{0.0f, 0.0f, 0.0f, 0.0f};
  SplitF16x2(a.x, a.y, bh[0], bl[0]);
  SplitF16x2(a.z, a.w, bh[1], bl[1]);
}

// The B fragments (hi, lo) of mmas j0..j0+3 of step st for the lane: its staged entries (with
// kMayStage, when lx.stage is set), or its token's columns c0 + 4 j loaded and split here; zeros
// unless `keep`.
template <WeightFormat F, bool kMayStage>
__device__ __forceinline__ void TcB4(const TcLaneX& lx, int st, int j0, int t, bool keep, int c0,
                                     uint32_t (&bh)[4][2], uint32_t (&bl)[4][2]) {
  constexpr int J = VecElems(F) / 4;
  if (kMayStage && lx.stage) {
#pragma unroll
    for (int jj = 0; jj < 4; ++jj) {
      const uint4 f = keep ? lx.stage[(st * J + j0 + jj) * 4 + t] : uint4{0u, 0u, 0u, 0u};
      bh[jj][0] = f.x, bh[jj][1] = f.y, bl[jj][0] = f.z, bl[jj][1] = f.w;
    }
    return;
  }
  float4 xa[4];
#pragma unroll
  for (int jj = 0; jj < 4; ++jj) xa[jj] = NormedX4(lx.xg, lx.g, lx.inv_g, c0 + 4 * (j0 + jj));
#pragma unroll
  for (int jj = 0; jj < 4; ++jj) TcB(xa[jj], keep, bh[jj], bl[jj]);
}

// Stream i's exact sums of step st for the lane's tokens 2t, 2t + 1, on f32 FMAs (an FP4 group
// scale the f16 weights cannot hold).
template <WeightFormat F>
__device__ void TcRowFallback(const TcRows& rows, int i, int64_t cols, int st, const TcLaneX& lx,
                              float (&d)[4]) {
  const int64_t c0 = static_cast<int64_t>(st) * 4 * VecElems(F);
  const int64_t c1 = c0 + 4 * VecElems(F) < cols ? c0 + 4 * VecElems(F) : cols;
  for (int u = 0; u < 2; ++u) {
    const float* x = lx.xo[u];
    if (!x) continue;
    float s = 0.0f;
    for (int64_t c = c0; c < c1; ++c) {
      const float xv = lx.g ? lx.g[c] * (x[c] * lx.inv_o[u]) : x[c];
      s = fmaf(WeightAt(F, rows.data[i], rows.scale[i], rows.row[i], c, cols), xv, s);
    }
    d[2 * i + u] += s;
  }
}

// d += c_hi + c_lo 2^-11 (the step's sums of x's two parts), times a row's scale (FP8).
__device__ __forceinline__ void TcFold(const float (&ch)[4], const float (&cl)[4], float s0,
                                       float s1, float (&d)[4]) {
#pragma unroll
  for (int q = 0; q < 4; ++q) d[q] = fmaf(fmaf(cl[q], kTcLoUnscale, ch[q]), q < 2 ? s0 : s1, d[q]);
}

// Step st of the lane's two rows into d: q its vectors 4 st + t (zero past the row's end), sb
// their scale bytes (FP8: the step's 128-block; FP4: the vector's group). x's hi and lo parts
// go through separate mmas into separate sums (two chains, not one).
template <WeightFormat F, bool kMayStage>
__device__ __forceinline__ void TcStep(const uint4 (&q)[2], const uint32_t (&sb)[2],
                                       const TcRows& rows, int st, int nvec, int64_t cols,
                                       const TcLaneX& lx, int g, int t, float (&d)[4]) {
  constexpr int kElems = VecElems(F);
  const int v = 4 * st + t;
  const bool live = v < nvec, keep = live && lx.live_g;
  const int c0 = live ? v * kElems : 0;  // a dead step reads x's column 0 and zeroes it
  float ch[4] = {0.0f, 0.0f, 0.0f, 0.0f}, cl[4] = {0.0f, 0.0f, 0.0f, 0.0f};
  if constexpr (F == WeightFormat::kFP8Block) {
    uint32_t bh[4][2], bl[4][2];
    TcB4<F, kMayStage>(lx, st, 0, t, keep, c0, bh, bl);
#pragma unroll
    for (int j = 0; j < 4; ++j) {
      const uint32_t w0 = Word(q[0], j), w1 = Word(q[1], j);
      const uint32_t a[4] = {E4m3x2ToF16x2(w0), E4m3x2ToF16x2(w1), E4m3x2ToF16x2(w0 >> 16),
                             E4m3x2ToF16x2(w1 >> 16)};
      MmaF16(a, bh[j], ch);
      MmaF16(a, bl[j], cl);
    }
    // A dead step adds zero (its scale byte is a stand-in).
    TcFold(ch, cl, E8m0Decode(sb[0]), E8m0Decode(sb[1]), d);
  } else {
    // Each lane's vector is one 32-group of each row: its scale, as an f16x2 factor
    // 2^(s - 113) on e2m1 * 2^-14; a row with any group of the step out of range takes the step
    // on FMAs (its four lanes agree through the ballot).
    uint32_t f[2];
    bool bad[2];
#pragma unroll
    for (int i = 0; i < 2; ++i) {
      const bool ok = sb[i] >= kTcFp4ScaleMin && sb[i] <= kTcFp4ScaleMax;
      const unsigned votes = __ballot_sync(0xffffffffu, live && !ok);
      bad[i] = ((votes >> (4 * g)) & 0xFu) != 0;
      f[i] = bad[i] || !live ? 0u : ((sb[i] - 98u) << 10) * 0x10001u;
    }
#pragma unroll
    for (int half = 0; half < 2; ++half) {  // x's fragments in two sets of 4 mmas: registers
      uint32_t bh[4][2], bl[4][2];
      TcB4<F, kMayStage>(lx, st, 4 * half, t, keep, c0, bh, bl);
#pragma unroll
      for (int jj = 0; jj < 4; ++jj) {
        const int j = 4 * half + jj;
        uint32_t h0[2], h1[2];
        E2m1x4ToF16x2(Word(q[0], j / 2) >> (16 * (j % 2)), h0);
        E2m1x4ToF16x2(Word(q[1], j / 2) >> (16 * (j % 2)), h1);
        const uint32_t a[4] = {MulF16x2(h0[0], f[0]), MulF16x2(h1[0], f[1]),
                               MulF16x2(h0[1], f[0]), MulF16x2(h1[1], f[1])};
        MmaF16(a, bh[jj], ch);
        MmaF16(a, bl[jj], cl);
      }
    }
    TcFold(ch, cl, 1.0f, 1.0f, d);
#pragma unroll
    for (int i = 0; i < 2; ++i)
      if (bad[i]) TcRowFallback<F>(rows, i, cols, st, lx, d);
    __syncwarp();  // the fallback diverges; the next step's mma.sync.aligned needs the whole warp
  }
}

// Loads N steps' weights and scale bytes (from step index it of the slice) before their mmas.
template <WeightFormat F, int N, bool kMayStage>
__device__ __forceinline__ void TcSteps(const TcRows& rows, const uint4* const (&wr)[2],
                                        const uint8_t* const (&sr)[2], int it, int slice,
                                        int slices, int nvec, int64_t cols, const TcLaneX& lx,
                                        int g, int t, float (&d)[4]) {
  uint4 q[N][2];
  uint32_t sb[N];  // the two rows' scale bytes, row 1's at bits 8..15
#pragma unroll
  for (int u = 0; u < N; ++u) {
    const int st = slice + (it + u) * slices, v = 4 * st + t;
    sb[u] = 0;
#pragma unroll
    for (int i = 0; i < 2; ++i) {
      q[u][i] = v < nvec ? __ldg(wr[i] + v) : uint4{0u, 0u, 0u, 0u};
      uint32_t b;
      if constexpr (F == WeightFormat::kFP8Block)
        b = 4 * st < nvec ? __ldg(sr[i] + st / 2) : 127u;
      else
        b = v < nvec ? __ldg(sr[i] + v) : 127u;
      sb[u] |= b << (8 * i);
    }
  }
#pragma unroll
  for (int u = 0; u < N; ++u) {
    const uint32_t b[2] = {sb[u] & 0xFFu, sb[u] >> 8};
    TcStep<F, kMayStage>(q[u], b, rows, slice + (it + u) * slices, nvec, cols, lx, g, t, d);
  }
}

// The lane's share d of the warp's tile over steps slice, slice + slices, ...: d[0], d[1] =
// stream 0 x tokens 2t, 2t + 1; d[2], d[3] = stream 1. kTcAhead steps a trip, then the rest
// one at a time. Every warp of the block makes the same trips (the emulated mma is block-wide:
// a slice past the last step runs dead steps, which load nothing and add zero).
// cols < 2^31 (the launchers check). kMayStage: x may come from lx.stage (a kernel that never
// stages leaves it out: both ways in one loop do not fit the mixed Gemm kernel's 128 registers).
// kFp4Ahead: kTcAhead for FP4 rows, unless an instance spills with it.
template <WeightFormat F, bool kMayStage, int kFp4Ahead>
__device__ void StreamTileTcOf(const TcRows& rows, int64_t cols, const TcLaneX& lx, int lane,
                               int slice, int slices, float (&d)[4]) {
  const int g = lane >> 2, t = lane & 3;
  d[0] = d[1] = d[2] = d[3] = 0.0f;
  const int nvec = static_cast<int>(cols / VecElems(F)), nsteps = (nvec + 3) / 4;
  const int per = (nsteps + slices - 1) / slices;
  const uint4* wr[2];
  const uint8_t* sr[2];
#pragma unroll
  for (int i = 0; i < 2; ++i) {
    wr[i] = RowVectors<F>(rows.data[i], rows.row[i], cols);
    sr[i] = RowScales<F>(rows.scale[i], rows.row[i], cols);
  }
  constexpr int kAhead = F == WeightFormat::kFP4Block32 ? kFp4Ahead : kTcAhead;
  int it = 0;
#pragma unroll 1
  for (; it + kAhead <= per; it += kAhead)
    TcSteps<F, kAhead, kMayStage>(rows, wr, sr, it, slice, slices, nvec, cols, lx, g, t, d);
#pragma unroll 1
  for (; it < per; ++it)
    TcSteps<F, 1, kMayStage>(rows, wr, sr, it, slice, slices, nvec, cols, lx, g, t, d);
}

// StreamTileTcOf for the tensor-core format (FP8 or FP4) of the rows.
template <bool kMayStage, int kFp4Ahead = kTcAhead>
__device__ __forceinline__ void StreamTileTc(WeightFormat format, const TcRows& rows,
                                             int64_t cols, const TcLaneX& lx, int lane, int slice,
                                             int slices, float (&d)[4]) {
  if (format == WeightFormat::kFP8Block)
    StreamTileTcOf<WeightFormat::kFP8Block, kMayStage, kFp4Ahead>(rows, cols, lx, lane, slice,
                                                                  slices, d);
  else
    StreamTileTcOf<WeightFormat::kFP4Block32, kMayStage, kFp4Ahead>(rows, cols, lx, lane, slice,
                                                                    slices, d);
}

// Warps sharing each 16-row tile of a [rows, cols] product (the tensor-core twin of gemv.cu's
// RowSlices): doubled while the launch stays under kTargetWarps and each slice keeps 4 steps.
inline int TcSlices(int64_t rows, int64_t cols, WeightFormat format) {
  const int64_t tiles = (rows + kTcRows - 1) / kTcRows;
  const int64_t steps = (cols / VecElems(format) + 3) / 4;
  int s = 1;
  while (s < kGemvWarps && tiles * s < kTargetWarps && steps >= 4 * s) s *= 2;
  return s;
}

}  // namespace fm::cuda
