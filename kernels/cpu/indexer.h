// Lightning indexer (MODEL.md "Attention" step 6; HF DeepseekV4IndexerScorer and the top-k of
// DeepseekV4Indexer): scores of one query against compressed indexer keys, then top-k.
#pragma once
#include <cstdint>

namespace fm {

// score[e] = sum_h (relu(q_h . k_e) * scale) * w[h], h ascending. q [nh, d], w [nh] (already
// times nh^-1/2), keys [n, d] contiguous, scale = d^-1/2.
void IndexerScores_hd(const float* q, const float* w, int64_t nh, int64_t d, const float* keys,
                      int64_t n, float scale, float* score);

// The k highest of score[0..n) (ties to the lower index; NaN ranks lowest), written to out[k]
// in ascending index order. Requires k <= n.
void TopKAscending_n(const float* score, int64_t n, int64_t k, int32_t* out);

}  // namespace fm
