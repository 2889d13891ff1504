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
// Numbers: e4m3 and e2m1 are exact in f16; x enters as hi + lo f16 (two mmas, ~22 bits). FP8:
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
constexpr int kTcAhead = 2;    // steps whose weight loads a lane issues before the first mma
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

// The x a lane reads, for a tile of 8 tokens: token g's (its B column; null: an idle token,
// zeros) and, for an FP4 step on the FMA fallback, tokens 2t and 2t + 1 (its outputs); with a
// norm weight g, x = g * (x * inv). Plain fields: an array indexed by lane would live in local memory.
struct TcLaneX {
  const float* xg;
  float inv_g;
  const float* xo[2];
  float inv_o[2];
  const float* g;
};

// Columns c..c+3 of a token's x (zeros for a null x), normed with g.
__device__ __forceinline__ float4 TcX4(const float* x, const float* g, float inv, int64_t c) {
  if (!x) return float4{0.0f, 0.0f, 0.0f, 0.0f};
  float4 a = __ldg(reinterpret_cast<const float4*>(x + c));
  if (g) {
    const float4 gg = __ldg(reinterpret_cast<const float4*>(g + c));
    a.x = gg.x * (a.x * inv), a.y = gg.y * (a.y * inv);
    a.z = gg.z * (a.z * inv), a.w = gg.w * (a.w * inv);
  }
  return a;
}

// Stream i's exact sums of step st for the lane's tokens 2t, 2t + 1, on f32 FMAs (an FP4 group
// scale the f16 weights cannot hold).
template <WeightFormat F>
__device__ void TcRowFallback(const TcRows& rows, int i, int64_t cols, int64_t st,
                              const TcLaneX& lx, float (&d)[4]) {
  const int64_t c0 = st * 4 * VecElems(F), c1 = c0 + 4 * VecElems(F) < cols ? c0 + 4 * VecElems(F) : cols;
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

// Step st of the lane's two rows (q: its vectors 4 st + t, zero past the row's end) into d.
template <WeightFormat F>
__device__ __forceinline__ void TcStep(const uint4 (&q)[2], const TcRows& rows,
                                       const uint8_t* const (&sr)[2], int64_t st, int64_t nvec,
                                       int64_t cols, const TcLaneX& lx, int g, int t,
                                       float (&d)[4]) {
  const int64_t v = 4 * st + t;
  const bool live = v < nvec;
  const float* xv = live ? lx.xg : nullptr;
  const float inv = lx.inv_g;
  if constexpr (F == WeightFormat::kFP8Block) {
    float c[4] = {0.0f, 0.0f, 0.0f, 0.0f};
#pragma unroll
    for (int j = 0; j < 4; ++j) {
      const float4 xa = TcX4(xv, lx.g, inv, v * 16 + 4 * j);
      uint32_t bh[2], bl[2];
      SplitF16x2(xa.x, xa.y, bh[0], bl[0]);
      SplitF16x2(xa.z, xa.w, bh[1], bl[1]);
      const uint32_t w0 = Word(q[0], j), w1 = Word(q[1], j);
      const uint32_t a[4] = {E4m3x2ToF16x2(w0), E4m3x2ToF16x2(w1), E4m3x2ToF16x2(w0 >> 16),
                             E4m3x2ToF16x2(w1 >> 16)};
      MmaF16(a, bh, c);
      MmaF16(a, bl, c);
    }
    if (4 * st < nvec) {  // the whole warp: the step's 64 columns lie in 128-block st / 2
      const float s0 = E8m0Decode(sr[0][st / 2]), s1 = E8m0Decode(sr[1][st / 2]);
      d[0] = fmaf(c[0], s0, d[0]), d[1] = fmaf(c[1], s0, d[1]);
      d[2] = fmaf(c[2], s1, d[2]), d[3] = fmaf(c[3], s1, d[3]);
    }
  } else {
    // Each lane's vector is one 32-group of each row: its scale, as an f16x2 factor
    // 2^(s - 113) on e2m1 * 2^-14; a row with any group of the step out of range takes the step
    // on FMAs (its four lanes agree through the ballot).
    uint32_t f[2];
    bool bad[2];
#pragma unroll
    for (int i = 0; i < 2; ++i) {
      const uint32_t s = live ? sr[i][v] : 127u;
      const bool ok = s >= kTcFp4ScaleMin && s <= kTcFp4ScaleMax;
      const unsigned votes = __ballot_sync(0xffffffffu, !ok);
      bad[i] = ((votes >> (4 * g)) & 0xFu) != 0;
      f[i] = bad[i] || !live ? 0u : ((s - 98u) << 10) * 0x10001u;
    }
#pragma unroll 2
    for (int j = 0; j < 8; ++j) {
      const float4 xa = TcX4(xv, lx.g, inv, v * 32 + 4 * j);
      uint32_t bh[2], bl[2];
      SplitF16x2(xa.x, xa.y, bh[0], bl[0]);
      SplitF16x2(xa.z, xa.w, bh[1], bl[1]);
      uint32_t h0[2], h1[2];
      E2m1x4ToF16x2(Word(q[0], j / 2) >> (16 * (j % 2)), h0);
      E2m1x4ToF16x2(Word(q[1], j / 2) >> (16 * (j % 2)), h1);
      const uint32_t a[4] = {MulF16x2(h0[0], f[0]), MulF16x2(h1[0], f[1]), MulF16x2(h0[1], f[0]),
                             MulF16x2(h1[1], f[1])};
      MmaF16(a, bh, d);
      MmaF16(a, bl, d);
    }
#pragma unroll
    for (int i = 0; i < 2; ++i)
      if (bad[i]) TcRowFallback<F>(rows, i, cols, st, lx, d);
  }
}

// The lane's share d of the warp's tile over steps slice, slice + slices, ...: d[0], d[1] =
// stream 0 x tokens 2t, 2t + 1; d[2], d[3] = stream 1. Every warp of the block makes the same
// trips (the emulated mma is block-wide); dead steps load nothing and add zero.
template <WeightFormat F>
__device__ void StreamTileTc(const TcRows& rows, int64_t cols, const TcLaneX& lx, int lane,
                             int slice, int slices, float (&d)[4]) {
  const int g = lane >> 2, t = lane & 3;
  d[0] = d[1] = d[2] = d[3] = 0.0f;
  const int64_t nvec = cols / VecElems(F), nsteps = (nvec + 3) / 4;
  const int64_t per = (nsteps + slices - 1) / slices;
  const int64_t trips = (per + kTcAhead - 1) / kTcAhead * kTcAhead;
  const uint4* wr[2];
  const uint8_t* sr[2];
#pragma unroll
  for (int i = 0; i < 2; ++i) {
    wr[i] = RowVectors<F>(rows.data[i], rows.row[i], cols);
    sr[i] = RowScales<F>(rows.scale[i], rows.row[i], cols);
  }
#pragma unroll 1
  for (int64_t it = 0; it < trips; it += kTcAhead) {
    uint4 q[kTcAhead][2];
#pragma unroll
    for (int u = 0; u < kTcAhead; ++u) {
      const int64_t v = 4 * (slice + (it + u) * slices) + t;
#pragma unroll
      for (int i = 0; i < 2; ++i) q[u][i] = v < nvec ? __ldg(wr[i] + v) : uint4{0u, 0u, 0u, 0u};
    }
#pragma unroll
    for (int u = 0; u < kTcAhead; ++u)
      TcStep<F>(q[u], rows, sr, slice + (it + u) * slices, nvec, cols, lx, g, t, d);
  }
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
