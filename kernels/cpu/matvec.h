// Keep-quant matrix-vector / matrix-matrix products: Y[t, r] = sum_c W[r, c] * X[t, c].
// W stays in its checkpoint format (F32, BF16, FP8 e4m3 with 128x128 e8m0 block scales,
// FP4 e2m1 with per-32 e8m0 scales) and is decoded inside the loop.
#pragma once
#include <cstdint>
#include <span>

#include "common/tensor.h"
#include "common/thread_pool.h"

namespace fm {

// Plain reference: dequantize element by element, accumulate in double, one output at a time.
// Slow; the ground truth every optimized kernel is tested against.
void MatvecRef(const QWeight& w, const float* x, float* y);

// Optimized product for T input rows X[T, cols] -> Y[T, rows] (row-major, f32).
// Each output element is reduced in a fixed order that depends only on `cols`, so the result
// is bit-identical for any pool size, any T, and any position of a row inside the batch.
// pool may be null (single-threaded).
void Matmul(const QWeight& w, const float* x, int64_t T, float* y, ThreadPool* pool);

// Several independent products Y_i = W_i X_i in one parallel pass (one thread wake-up for all;
// the MoE runs every routed expert's W1 and W3 this way). Same bits as Matmul on each.
struct MatmulJob {
  const QWeight* w;
  const float* x;  // [T, w->cols]
  int64_t T;
  float* y;        // [T, w->rows]
};
void MatmulMany(std::span<const MatmulJob> jobs, ThreadPool* pool);

}  // namespace fm
