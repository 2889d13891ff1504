// The attention core of DeepSeek-V4 (MODEL.md "Attention" step 7; HF eager_attention_forward with
// sinks): one query head against a list of key rows, shared-KV (key = value), with a learned sink
// logit that only enters the softmax denominator.
#pragma once
#include <cstdint>

namespace fm {

// a . b over n floats: 8 interleaved f32 partial sums (lane i takes elements i, i+8, ...), then
// a fixed pairwise combine. The order depends only on n.
float DotF32_n(const float* a, const float* b, int64_t n);

// For each head h < nh: s_hi = scale * q_h.k_i; m = max(max_i s_hi, sink_h);
// p_hi = exp(s_hi - m) / (sum_j exp(s_hj - m) + exp(sink_h - m)); o_h = sum_i p_hi * k_i,
// i ascending. q [nh, d], sink [nh], o [nh, d]; keys: n row pointers of width d shared by all
// heads (one kv head). scratch: nh*n floats. n == 0 gives o = 0. Results per head do not depend
// on nh (a head computed alone gives the same bits).
void SinkAttentionHeads_hd(const float* q, int64_t nh, const float* const* keys, int64_t n,
                           int64_t d, const float* sink, float scale, float* scratch, float* o);

}  // namespace fm
