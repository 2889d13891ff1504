// The attention core of DeepSeek-V4 (MODEL.md "Attention" step 7; HF eager_attention_forward with
// sinks): one query head against a list of key rows, shared-KV (key = value), with a learned sink
// logit that only enters the softmax denominator.
#pragma once
#include <cstdint>

namespace fm {

// a . b over n floats: 8 interleaved f32 partial sums (lane i takes elements i, i+8, ...), then
// a fixed pairwise combine. The order depends only on n.
float DotF32_n(const float* a, const float* b, int64_t n);

// s_i = scale * q.k_i; m = max(max_i s_i, sink); p_i = exp(s_i - m) / (sum_j exp(s_j - m) +
// exp(sink - m)); o = sum_i p_i * k_i, i ascending. keys: n row pointers of width d.
// scratch: n floats. n == 0 gives o = 0.
void SinkAttentionHead_d(const float* q, const float* const* keys, int64_t n, int64_t d,
                         float sink, float scale, float* scratch, float* o);

}  // namespace fm
