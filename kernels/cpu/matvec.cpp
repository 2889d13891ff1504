// Keep-quant Matmul (kernels/cpu/matvec.h). Weights are decoded 16 at a time into a vector
// register and used there; nothing is expanded in memory.
//
// Reduction order (the determinism contract): output (t, r) keeps 16 lane partial sums.
// Chunk j of a row (16 consecutive inputs; FP4: see below) is added lane-wise in increasing j
// with one fused multiply-add, acc[l] = fma(W[r, c_j(l)], x[t, c_j(l)], acc[l]) (one rounding;
// every build path uses a true FMA, so the bits do not depend on the ISA), then the lanes
// are summed by a fixed tree
// (l, l+8), (l, l+4), (l, l+2), (l, l+1). A partial last chunk adds +0 in its unused lanes.
// The order depends only on cols: tiles over rows and batch rows, threads, and the position
// of a row in the batch only change which independent accumulators run side by side.
//
// Decoding, exact (the decoded weight equals MatvecRef's float W_real bit for bit):
//  F32  as is;  BF16  u16 << 16;
//  FP8  e4m3 byte -> e4m3 * 2^-k exactly by placing its bits in an f32 (k = 120; e4m3
//       subnormals become f32 subnormals); one multiply by S * 2^k (S = the block's scale) gives
//       e4m3 * S with a single rounding, as the reference. The NaN codes 0x7F/0xFF would decode
//       as +-480 * S instead of NaN: the checkpoint loader refuses them (CheckE4m3Codes).
//       Fast variant: where x * S * 2^k and e4m3 * S both stay
//       normal for this call's x (XBounds), the tile multiplies x by S * 2^k once for its rows
//       (they share the 128-row block's scale) and takes e4m3 * 2^-k as the weight: both
//       products are then exact powers-of-two scalings, so each fma gives the same bits.
//  FP4  per 32-input block, the 16-entry table of e2m1 values times the block scale (one of
//       256 precomputed tables, exact products), indexed by the nibbles (a register
//       permute). The low nibbles of the block's 16 bytes are chunk
//       2k (inputs 32k + 2l), the high nibbles chunk 2k+1 (inputs 32k + 2l + 1); x is
//       de-interleaved the same way once per call.
#include "kernels/cpu/matvec.h"

#include <algorithm>
#include <bit>
#include <cmath>
#include <cstring>
#include <limits>
#include <type_traits>
#include <vector>

#include "common/log.h"
#include "common/numfmt.h"

#if defined(__AVX512F__)
#include <immintrin.h>
#endif

namespace fm {
namespace {

typedef float f32x16 __attribute__((vector_size(64)));
typedef uint32_t u32x16 __attribute__((vector_size(64)));
typedef int32_t i32x16 __attribute__((vector_size(64)));
typedef int16_t i16x16 __attribute__((vector_size(32)));
typedef int8_t i8x16 __attribute__((vector_size(16)));
typedef uint8_t u8x16 __attribute__((vector_size(16)));
typedef uint16_t u16x16 __attribute__((vector_size(32)));

constexpr int64_t kLanes = 16;

// Reinterprets the bits of one vector type as another of the same size.
template <class To, class From>
inline To BitCast(From v) {
  static_assert(sizeof(To) == sizeof(From));
  To t;
  std::memcpy(&t, &v, sizeof(t));
  return t;
}

inline f32x16 LoadF32x16(const float* p) {
  f32x16 v;
  std::memcpy(&v, p, sizeof(v));
  return v;
}

// The first n floats of p, zero-padded to 16 lanes.
inline f32x16 LoadF32Partial(const float* p, int64_t n) {
  float tmp[kLanes] = {};
  std::memcpy(tmp, p, static_cast<size_t>(n) * sizeof(float));
  return LoadF32x16(tmp);
}

// a * b + c per lane with a single rounding.
inline f32x16 Fma16(f32x16 a, f32x16 b, f32x16 c) {
#if defined(__AVX512F__)
  return BitCast<f32x16>(_mm512_fmadd_ps(BitCast<__m512>(a), BitCast<__m512>(b), BitCast<__m512>(c)));
#else
  for (int l = 0; l < kLanes; ++l) c[l] = std::fma(a[l], b[l], c[l]);
  return c;
#endif
}

// Makes the compiler treat v as computed here, so it stays in one register. Without it GCC
// folds a tile's shared x load into each row's FMA as a memory operand (RB loads of the same
// 64 bytes per chunk), which made the FP4 decode tile ~1.5x slower (bench_matvec).
inline void KeepInRegister(f32x16& v) {
#if defined(__AVX512F__)
  asm("" : "+v"(v));
#else
  (void)v;
#endif
}

// Fixed tree over the 16 lanes.
inline float SumLanes(f32x16 v) {
  float s[kLanes];
  std::memcpy(s, &v, sizeof(s));
  for (int w = kLanes / 2; w > 0; w /= 2)
    for (int l = 0; l < w; ++l) s[l] = s[l] + s[l + w];
  return s[0];
}

// ---- widening loads --------------------------------------------------------------------
// 16 narrow integers -> 16 x 32 bit. GCC 12 scalarizes __builtin_convertvector for these
// widths, so AVX-512 uses its one-instruction extensions; elsewhere the generic code.
#if defined(__AVX512F__)
inline u32x16 WidenU8(const uint8_t* p) {
  return BitCast<u32x16>(_mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))));
}
inline u32x16 WidenU16(const uint16_t* p) {
  return BitCast<u32x16>(
      _mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p))));
}
#else
inline u32x16 WidenU8(const uint8_t* p) {
  u8x16 v;
  std::memcpy(&v, p, sizeof(v));
  return __builtin_convertvector(v, u32x16);
}
inline u32x16 WidenU16(const uint16_t* p) {
  u16x16 v;
  std::memcpy(&v, p, sizeof(v));
  return __builtin_convertvector(v, u32x16);
}
#endif

// 16 e4m3 bytes -> f32 values times 2^-kE4m3Exp, exact: the f32 bit pattern
// (b & 0x80) << 24 | (b & 0x7F) << 20 is e4m3(b) * 2^-120 (the e4m3 subnormals become f32
// subnormals, which the FMA takes at full speed on the machines measured here). Three integer
// instructions per 16 weights with AVX-512 (sign-extending widen, shift, mask).
constexpr int kE4m3Exp = 120;
#if defined(__AVX512F__)
inline f32x16 E4m3Scaled(const uint8_t* p) {
  const __m512i s = _mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
  // Sign-extended byte << 20: sign in bits 31..27; keep bit 31 and bits 26..20.
  return BitCast<f32x16>(
      _mm512_and_si512(_mm512_slli_epi32(s, 20), _mm512_set1_epi32(static_cast<int>(0x87F00000u))));
}
#else
inline f32x16 E4m3Scaled(const uint8_t* p) {
  i8x16 b;
  std::memcpy(&b, p, sizeof(b));
  // Sign-extended byte << 20: sign in bits 31..27; keep bit 31 and bits 26..20.
  const u32x16 bits = (BitCast<u32x16>(__builtin_convertvector(b, i32x16)) << 20) & 0x87F00000u;
  return BitCast<f32x16>(bits);
}
#endif

inline float Pow2(int e) {  // 2^e for -126 <= e <= 127
  return std::bit_cast<float>(static_cast<uint32_t>(e + 127) << 23);
}

// E8m0ToF32 for every byte as a constant table (no libm call per block): 2^(b-127), the
// subnormal 2^-127 for b = 0, NaN for 255.
struct E8m0Table {
  float v[256];
  constexpr E8m0Table() : v() {
    for (uint32_t b = 0; b < 256; ++b)
      v[b] = std::bit_cast<float>(b == 0 ? 0x00400000u : b == 255 ? 0x7FC00000u : b << 23);
  }
};
constexpr E8m0Table kE8m0;

// v[i] = table[idx[i] mod 16]: one register permute (vpermps and __builtin_shuffle ignore the
// higher index bits). __builtin_shuffle with a runtime
// index is GCC-only; clang (the fuzz build) takes the intrinsic or the plain loop.
inline f32x16 Lookup16(f32x16 table, u32x16 idx) {
#if defined(__AVX512F__)
  return BitCast<f32x16>(_mm512_permutexvar_ps(BitCast<__m512i>(idx), BitCast<__m512>(table)));
#elif defined(__clang__)
  f32x16 v;
  for (int i = 0; i < kLanes; ++i) v[i] = table[idx[i] & 15u];
  return v;
#else
  return __builtin_shuffle(table, idx);
#endif
}

// The factors S * 2^kE4m3Exp for which FP8's fast decode is exact with this call's x: x * f
// and e4m3 * 2^-kE4m3Exp * f both stay normal f32 (f is a power of two, so both products are
// exact and fma(e, x * f, acc) == fma(e * f, x, acc) bit for bit).
struct XBounds {
  float fp8_lo = 0.0f, fp8_hi = -1.0f;   // empty: always the plain decode
};

XBounds BoundsOf(const float* x, int64_t n) {
  float lo = std::numeric_limits<float>::infinity(), hi = 0.0f;
  for (int64_t i = 0; i < n; ++i) {
    const float a = std::fabs(x[i]);
    if (a > 0.0f && a < lo) lo = a;
    if (a > hi) hi = a;   // NaN compares false: NaN * f is NaN either way
  }
  XBounds b;
  if (hi == std::numeric_limits<float>::infinity()) return b;
  // One binade of margin on each side; e4m3's smallest nonzero is 2^-9, times 2^-kE4m3Exp.
  const float x_lo = lo == std::numeric_limits<float>::infinity() ? 0.0f : Pow2(-125) / lo;
  b.fp8_lo = std::max(Pow2(-125 + 9 + kE4m3Exp), x_lo);
  b.fp8_hi = hi > 0.0f ? std::min(Pow2(125), Pow2(126) / hi) : Pow2(125);
  return b;
}

// ---- per-format row decoders -----------------------------------------------------------
// Init(w, r) binds row r; SetBlock(b) prepares block b (kBlockChunks chunks) and says whether
// its chunks need the rare slow decode (kSlow); Chunk<kSlow>(j) is the decoded chunk j (inside
// the current block), Tail<kSlow>(j, n) the partial chunk j of n < 16 inputs. Chunk<true> of a
// row whose SetBlock said false gives the same bits as Chunk<false>.

struct RowF32 {
  // The fast decode's input scaling (none for this format) and whether two rows share it.
  static f32x16 ScaleX(f32x16 x) { return x; }
  static bool SameXScale(const RowF32&, const RowF32&) { return true; }
  static constexpr int64_t kBlockChunks = 8;
  static constexpr int64_t kChunkBytes = 64;
  const float* p;
  const void* bytes_at(int64_t off) const { return reinterpret_cast<const uint8_t*>(p) + off; }
  void Init(const QWeight& w, int64_t r, const XBounds&) { p = static_cast<const float*>(w.data) + r * w.cols; }
  bool SetBlock(int64_t) { return false; }
  template <bool kSlow>
  f32x16 Chunk(int64_t j) const { return LoadF32x16(p + j * kLanes); }
  template <bool kSlow>
  f32x16 Tail(int64_t j, int64_t n) const { return LoadF32Partial(p + j * kLanes, n); }
};

struct RowBF16 {
  // The fast decode's input scaling (none for this format) and whether two rows share it.
  static f32x16 ScaleX(f32x16 x) { return x; }
  static bool SameXScale(const RowBF16&, const RowBF16&) { return true; }
  static constexpr int64_t kBlockChunks = 8;
  static constexpr int64_t kChunkBytes = 32;
  const uint16_t* p;
  const void* bytes_at(int64_t off) const { return reinterpret_cast<const uint8_t*>(p) + off; }
  void Init(const QWeight& w, int64_t r, const XBounds&) {
    p = static_cast<const uint16_t*>(w.data) + r * w.cols;
  }
  bool SetBlock(int64_t) { return false; }
  template <bool kSlow>
  f32x16 Chunk(int64_t j) const { return BitCast<f32x16>(WidenU16(p + j * kLanes) << 16); }
  template <bool kSlow>
  f32x16 Tail(int64_t j, int64_t n) const {
    uint16_t tmp[kLanes] = {};
    std::memcpy(tmp, p + j * kLanes, static_cast<size_t>(n) * sizeof(uint16_t));
    return BitCast<f32x16>(WidenU16(tmp) << 16);
  }
};

struct RowFP8 {
  // Fast decode: x * factor instead of every weight * factor; the rows of a tile must agree.
  f32x16 ScaleX(f32x16 x) const { return x * factor; }
  static bool SameXScale(const RowFP8& a, const RowFP8& b) { return a.factor == b.factor; }
  static constexpr int64_t kBlockChunks = 128 / kLanes;
  static constexpr int64_t kChunkBytes = 16;
  const uint8_t* p;
  const void* bytes_at(int64_t off) const { return p + off; }
  const uint8_t* scale_row;  // e8m0 scales of this row's 128-row block
  float factor, late_scale;  // weight = decoded * factor [* late_scale: the slow decode]
  float fast_lo, fast_hi;    // XBounds
  void Init(const QWeight& w, int64_t r, const XBounds& xb) {
    p = static_cast<const uint8_t*>(w.data) + r * w.cols;
    scale_row = w.scale + (r / 128) * ((w.cols + 127) / 128);
    fast_lo = xb.fp8_lo;
    fast_hi = xb.fp8_hi;
  }
  // Slow unless the fast decode is exact for this block's factor.
  bool SetBlock(int64_t b) {
    const int e = scale_row[b];
    // factor = S * 2^kE4m3Exp, one rounding of e4m3 * S; when that is not a finite f32 (or S
    // is NaN) multiply by 2^kE4m3Exp and then by S: exact first step, the same bits.
    const bool big = e - 127 + kE4m3Exp > 127;
    factor = big ? Pow2(kE4m3Exp) : Pow2(e - 127 + kE4m3Exp);
    late_scale = big ? kE8m0.v[e] : 1.0f;
    return big || !(factor >= fast_lo && factor <= fast_hi);
  }
  // kSlow: the weight itself (as the reference); fast: e4m3 * 2^-kE4m3Exp, x scaled instead.
  template <bool kSlow>
  f32x16 Decode(const uint8_t* q) const {
    if constexpr (kSlow) return E4m3Scaled(q) * factor * late_scale;
    return E4m3Scaled(q);
  }
  template <bool kSlow>
  f32x16 Chunk(int64_t j) const { return Decode<kSlow>(p + j * kLanes); }
  template <bool kSlow>
  f32x16 Tail(int64_t j, int64_t n) const {
    uint8_t tmp[kLanes] = {};
    std::memcpy(tmp, p + j * kLanes, static_cast<size_t>(n));
    return Decode<kSlow>(tmp);
  }
};

// kFp4Tables.v[b] = the 16 e2m1 values times E8m0ToF32(b), filled at start-up (the largest
// scales overflow to inf, which a constant expression may not): exact products where finite.
struct Fp4Tables {
  alignas(64) float v[256][16];
  Fp4Tables() {
    const float kE2m1[16] = {0.0f,  0.5f,  1.0f,  1.5f,  2.0f,  3.0f,  4.0f,  6.0f,
                             -0.0f, -0.5f, -1.0f, -1.5f, -2.0f, -3.0f, -4.0f, -6.0f};
    for (int b = 0; b < 256; ++b)
      for (int i = 0; i < 16; ++i) v[b][i] = kE2m1[i] * kE8m0.v[b];
  }
};
const Fp4Tables kFp4Tables;

struct RowFP4 {
  // The fast decode's input scaling (none for this format) and whether two rows share it.
  static f32x16 ScaleX(f32x16 x) { return x; }
  static bool SameXScale(const RowFP4&, const RowFP4&) { return true; }
  static constexpr int64_t kBlockChunks = 2;
  static constexpr int64_t kChunkBytes = 8;
  const uint8_t* p;
  const uint8_t* scales;
  const void* bytes_at(int64_t off) const { return p + off; }
  f32x16 table;  // e2m1 values times the current block's scale
  u32x16 bytes;  // the current block's 16 packed bytes, one per lane
  void Init(const QWeight& w, int64_t r, const XBounds&) {
    p = static_cast<const uint8_t*>(w.data) + r * (w.cols / 2);
    scales = w.scale + r * (w.cols / 32);
  }
  bool SetBlock(int64_t b) {
    table = LoadF32x16(kFp4Tables.v[scales[b]]);
    bytes = WidenU8(p + b * 16);
    return false;
  }
  template <bool kSlow>
  f32x16 Chunk(int64_t j) const {
    return Lookup16(table, (j & 1) ? (bytes >> 4) : bytes);
  }
  template <bool kSlow>
  f32x16 Tail(int64_t, int64_t) const { return f32x16{}; }  // cols % 32 == 0: never called
};

// ---- tiles -----------------------------------------------------------------------------
constexpr int64_t kPrefetchBytes = 512;
// RB consecutive weight rows x TB consecutive batch rows, one pass over cols; every decoded
// chunk is used TB times from a register. x rows have stride cols; y is [T, rows].
template <class Row, int RB, int TB>
void Tile(const QWeight& w, int64_t r0, const float* x, const XBounds& xb, int64_t t0, float* y) {
  const int64_t cols = w.cols;
  Row row[RB];
  for (int i = 0; i < RB; ++i) row[i].Init(w, r0 + i, xb);
  const float* xt[TB];
  for (int t = 0; t < TB; ++t) xt[t] = x + (t0 + t) * cols;
  f32x16 acc[RB][TB] = {};
  // The tile's rows are one contiguous region read at RB fronts; rows of 1-8 KiB are too
  // short for the hardware prefetcher (which stops at 4 KiB pages) to pick up, so each front
  // prefetches the same place in the next tile's rows (the next region), a little ahead.
  // bench_matvec, 2 threads: the BF16 head's 4 KiB rows 36-45 -> 50-55 GB/s with it.
  const int64_t ahead = RB * cols / kLanes * Row::kChunkBytes + kPrefetchBytes;
  // kSlow: std::true_type / std::false_type, the decode variant of this block.
  auto step = [&](int64_t j, auto kSlow) {
    if ((j * Row::kChunkBytes) % 64 == 0)  // one per cache line of each front
      for (int i = 0; i < RB; ++i) __builtin_prefetch(row[i].bytes_at(j * Row::kChunkBytes + ahead));
    f32x16 wv[RB];
    for (int i = 0; i < RB; ++i) wv[i] = row[i].template Chunk<kSlow()>(j);
    for (int t = 0; t < TB; ++t) {
      f32x16 xv = LoadF32x16(xt[t] + j * kLanes);
      if constexpr (!kSlow()) xv = row[0].ScaleX(xv);   // exact (XBounds)
      KeepInRegister(xv);
      for (int i = 0; i < RB; ++i) acc[i][t] = Fma16(wv[i], xv, acc[i][t]);
    }
  };
  auto set_block = [&](int64_t b) {
    bool slow = false;
    for (int i = 0; i < RB; ++i) slow |= row[i].SetBlock(b);
    for (int i = 1; i < RB; ++i) slow |= !Row::SameXScale(row[i], row[0]);   // x scaled once
    return slow;
  };
  constexpr int64_t kBC = Row::kBlockChunks;
  const int64_t full_chunks = cols / kLanes, tail = cols % kLanes;
  const int64_t full_blocks = full_chunks / kBC;
  for (int64_t b = 0; b < full_blocks; ++b) {
    if (__builtin_expect(set_block(b), 0)) {
      for (int64_t jj = 0; jj < kBC; ++jj) step(b * kBC + jj, std::true_type());
    } else {
      for (int64_t jj = 0; jj < kBC; ++jj) step(b * kBC + jj, std::false_type());
    }
  }
  if (full_blocks * kBC < full_chunks || tail) {
    // The last, partial block: rare, always the slow decode (same bits).
    set_block(full_blocks);
    for (int64_t j = full_blocks * kBC; j < full_chunks; ++j) step(j, std::true_type());
    if (tail) {
      f32x16 wv[RB];
      for (int i = 0; i < RB; ++i) wv[i] = row[i].template Tail<true>(full_chunks, tail);
      for (int t = 0; t < TB; ++t) {
        const f32x16 xv = LoadF32Partial(xt[t] + full_chunks * kLanes, tail);
        for (int i = 0; i < RB; ++i) acc[i][t] = Fma16(wv[i], xv, acc[i][t]);
      }
    }
  }
  for (int t = 0; t < TB; ++t)
    for (int i = 0; i < RB; ++i) y[(t0 + t) * w.rows + r0 + i] = SumLanes(acc[i][t]);
}

constexpr int kDecodeRows = 4;   // T == 1: rows per tile (independent add chains)
constexpr int kBatchRows = 2;    // T > 1: rows per tile ...
constexpr int kBatchCols = 4;    // ... times batch rows per tile
constexpr int64_t kMinWorkPerPart = 1 << 16;    // weight elements x T per thread chunk
constexpr int64_t kBatchXBytes = 256 << 10;     // x rows kept hot while a row range streams

template <class Row, int RB>
void TileBatch(const QWeight& w, int64_t r0, const float* x, const XBounds& xb, int64_t t0,
               int64_t tb, float* y) {
  switch (tb) {
    case 1: Tile<Row, RB, 1>(w, r0, x, xb, t0, y); break;
    case 2: Tile<Row, RB, 2>(w, r0, x, xb, t0, y); break;
    case 3: Tile<Row, RB, 3>(w, r0, x, xb, t0, y); break;
    default: Tile<Row, RB, kBatchCols>(w, r0, x, xb, t0, y); break;
  }
}

int64_t RowsPerTile(int64_t T) { return T == 1 ? kDecodeRows : kBatchRows; }
int64_t TileCount(const MatmulJob& j) {
  const int64_t rb = RowsPerTile(j.T);
  return (j.w->rows + rb - 1) / rb;
}

// Tiles [tile_begin, tile_end) of one product (x already in the format's input order).
template <class Row>
void RunTiles(const QWeight& w, const float* x, const XBounds& xb, int64_t T, float* y,
              int64_t tile_begin, int64_t tile_end) {
  const int64_t rb = RowsPerTile(T);
  if (T == 1) {
    for (int64_t tile = tile_begin; tile < tile_end; ++tile) {
      const int64_t r0 = tile * rb;
      if (r0 + rb <= w.rows) Tile<Row, kDecodeRows, 1>(w, r0, x, xb, 0, y);
      else for (int64_t r = r0; r < w.rows; ++r) Tile<Row, 1, 1>(w, r, x, xb, 0, y);
    }
    return;
  }
  // x rows per pass over the row range: enough to stay in L2 while its weights stream.
  const int64_t t_group = std::max<int64_t>(
      kBatchCols, kBatchXBytes / (w.cols * 4) / kBatchCols * kBatchCols);
  for (int64_t ts = 0; ts < T; ts += t_group) {
    const int64_t te = std::min(T, ts + t_group);
    for (int64_t tile = tile_begin; tile < tile_end; ++tile) {
      const int64_t r0 = tile * rb;
      for (int64_t t0 = ts; t0 < te; t0 += kBatchCols) {
        const int64_t tb = std::min<int64_t>(kBatchCols, te - t0);
        if (r0 + rb <= w.rows) TileBatch<Row, kBatchRows>(w, r0, x, xb, t0, tb, y);
        else for (int64_t r = r0; r < w.rows; ++r) TileBatch<Row, 1>(w, r, x, xb, t0, tb, y);
      }
    }
  }
}

void RunJobTiles(const MatmulJob& j, const float* x, const XBounds& xb, int64_t tile_begin,
                 int64_t tile_end) {
  switch (j.w->format) {
    case WeightFormat::kF32: RunTiles<RowF32>(*j.w, x, xb, j.T, j.y, tile_begin, tile_end); return;
    case WeightFormat::kBF16: RunTiles<RowBF16>(*j.w, x, xb, j.T, j.y, tile_begin, tile_end); return;
    case WeightFormat::kFP8Block: RunTiles<RowFP8>(*j.w, x, xb, j.T, j.y, tile_begin, tile_end); return;
    case WeightFormat::kFP4Block32: RunTiles<RowFP4>(*j.w, x, xb, j.T, j.y, tile_begin, tile_end); return;
  }
}

// x [T, cols] with every 32-input block reordered as (even inputs, odd inputs), the order in
// which RowFP4 yields its chunks.
void DeinterleaveFp4Inputs(const float* x, int64_t T, int64_t cols, float* out) {
  for (int64_t t = 0; t < T; ++t)
    for (int64_t b = 0; b < cols; b += 32)
      for (int64_t l = 0; l < 16; ++l) {
        out[t * cols + b + l] = x[t * cols + b + 2 * l];
        out[t * cols + b + 16 + l] = x[t * cols + b + 2 * l + 1];
      }
}

}  // namespace

void Matmul(const QWeight& w, const float* x, int64_t T, float* y, ThreadPool* pool) {
  const MatmulJob job{&w, x, T, y};
  MatmulMany(std::span<const MatmulJob>(&job, 1), pool);
}

void MatmulMany(std::span<const MatmulJob> jobs, ThreadPool* pool) {
  // The products that need tiles, each with its input in the order its decoder yields.
  thread_local std::vector<std::vector<float>> fp4_inputs;
  std::vector<MatmulJob> run;
  std::vector<const float*> xs;
  std::vector<XBounds> bounds;
  for (const MatmulJob& j : jobs) {
    const QWeight& w = *j.w;
    if (j.T <= 0 || w.rows <= 0) continue;
    if (w.cols <= 0) {
      std::fill(j.y, j.y + j.T * w.rows, 0.0f);
      continue;
    }
    const float* x = j.x;
    if (w.format == WeightFormat::kFP4Block32) {
      if (w.cols % 32 != 0) {
        FM_LOG(kError, "matvec") << "FP4 weight with " << w.cols
                                 << " inputs: not a multiple of 32; output set to NaN";
        std::fill(j.y, j.y + j.T * w.rows, std::numeric_limits<float>::quiet_NaN());
        continue;
      }
      const size_t slot = xs.size();
      if (fp4_inputs.size() <= slot) fp4_inputs.resize(slot + 1);
      fp4_inputs[slot].resize(static_cast<size_t>(j.T * w.cols));
      DeinterleaveFp4Inputs(j.x, j.T, w.cols, fp4_inputs[slot].data());
      x = fp4_inputs[slot].data();
    }
    run.push_back(j);
    xs.push_back(x);
    bounds.push_back(w.format == WeightFormat::kFP8Block ? BoundsOf(j.x, j.T * w.cols) : XBounds{});
  }
  if (run.empty()) return;
  // One ParallelFor over the tiles of all products, in job order: one wake-up per call
  // instead of one per product, and the split balances the whole batch.
  std::vector<int64_t> first(run.size() + 1, 0);
  int64_t work = 0;
  for (size_t i = 0; i < run.size(); ++i) {
    first[i + 1] = first[i] + TileCount(run[i]);
    work += run[i].w->rows * run[i].w->cols * run[i].T;
  }
  const int64_t tiles = first.back();
  auto body = [&](size_t tb, size_t te) {
    for (size_t i = 0; i < run.size(); ++i) {
      const int64_t b = std::max<int64_t>(static_cast<int64_t>(tb), first[i]);
      const int64_t e = std::min<int64_t>(static_cast<int64_t>(te), first[i + 1]);
      if (b < e) RunJobTiles(run[i], xs[i], bounds[i], b - first[i], e - first[i]);
    }
  };
  const int64_t parts = std::clamp<int64_t>(work / kMinWorkPerPart, 1, pool ? pool->size() : 1);
  if (pool && parts > 1) pool->ParallelFor(static_cast<size_t>(tiles),
                                           static_cast<size_t>((tiles + parts - 1) / parts), body);
  else body(0, static_cast<size_t>(tiles));
}

}  // namespace fm
