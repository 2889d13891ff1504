// Compressor pooling (MODEL.md "Attention" step 4; HF DeepseekV4HCACompressor /
// DeepseekV4CSACompressor): a window of slots (a_j, z_j) becomes one entry by a per-channel
// softmax over the slots. z already holds gate + ape[slot].
#pragma once
#include <cstdint>

namespace fm {

// pooled[c] = sum_j softmax_j(z_j[c]) * a_j[c] over n slots, j ascending (probabilities first,
// as HF). a[j], z[j]: row pointers of width d (callers offset them to a channel half).
void CompressorPool_nd(const float* const* a, const float* const* z, int64_t n, int64_t d,
                       float* pooled);

// One window of r tokens whose projections are rows of width c*d (a then z, row stride c*d).
// Ratio != 4 (c = 1): the r slots over channels [0, d).
// Ratio 4 (c = 2, overlap): 2r slots: the previous window's rows on channels [0, d) (prev_a ==
// nullptr at the first window: those slots have logit -inf, i.e. weight 0), then the current
// window's rows on channels [d, 2d).
void CompressorPoolWindow_rd(const float* cur_a, const float* cur_z, const float* prev_a,
                             const float* prev_z, int64_t r, int64_t d, bool overlap,
                             float* pooled);

}  // namespace fm
