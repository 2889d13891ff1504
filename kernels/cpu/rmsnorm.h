// RMSNorm over rows (MODEL.md "RMSNorm"; HF DeepseekV4RMSNorm / DeepseekV4UnweightedRMSNorm).
#pragma once
#include <cstdint>

namespace fm {

// y[r, :] = g * (x[r, :] / sqrt(mean(x[r, :]^2) + eps)); g == nullptr: unweighted (g = 1).
// Squares summed in double in index order; x and y may alias.
void RmsNormRows_rd(const float* x, const float* g, int64_t rows, int64_t dim, float eps, float* y);

}  // namespace fm
