// Expert FFN pieces (MODEL.md "MoE"; HF DeepseekV4Experts._apply_gate / DeepseekV4MLP).
#pragma once
#include <cstdint>

namespace fm {

// out[i] = silu(min(gate[i], L)) * clip(up[i], -L, L); limit <= 0 means no clamp.
void SwigluClamp_n(const float* gate, const float* up, int64_t n, float limit, float* out);

// y[H] = sum_j w[j] * contrib[j][H], j ascending (a row's routed experts in k order).
void MoeCombine_kH(const float* contrib, const float* w, int64_t k, int64_t H, float* y);

// Plain references in double.
void SwigluClampRef(const float* gate, const float* up, int64_t n, double limit, float* out);
void MoeCombineRef(const float* contrib, const float* w, int64_t k, int64_t H, float* y);

}  // namespace fm
