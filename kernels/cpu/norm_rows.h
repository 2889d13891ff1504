// Weighted RMSNorm over the rows of a residual-side tensor (attn_norm, ffn_norm, norm, MTP
// enorm/hnorm): y = g * (x / sqrt(mean(x^2) + eps)), HF DeepseekV4RMSNorm.
#pragma once
#include <cstdint>

namespace fm {

// x [H] -> y [H] (may alias x); squares summed in double in index order.
void RmsNormWeighted_H(const float* x, const float* g, int64_t H, float eps, float* y);

// Plain reference in double.
void RmsNormWeightedRef(const float* x, const float* g, int64_t H, double eps, float* y);

}  // namespace fm
