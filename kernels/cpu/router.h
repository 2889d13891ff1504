// MoE routing of one token (MODEL.md "MoE"; HF DeepseekV4TopKRouter / DeepseekV4HashRouter):
// scores s = sqrt(softplus(gate . x)); expert ids from top-k of s + bias (noaux_tc) or from the
// token's tid2eid row (hash layers); weights = s[id] / (sum s[id] + 1e-20) * routed_scale.
#pragma once
#include <cstdint>

namespace fm {

// s[e] = sqrt(softplus(l[e])), softplus(v) = log1p(exp(v)) (v for v > 20, as torch).
void RouterSqrtSoftplus_E(const float* logits, int64_t E, float* scores);

// ids[k] = the k largest scores + bias, descending (ties to the lower index);
// w[j] = scores[ids[j]] / (sum_j scores[ids[j]] + 1e-20) * routed_scale, sum in j order.
void RouterTopkBias_E(const float* scores, const float* bias, int64_t E, int64_t k,
                      float routed_scale, int32_t* ids, float* w);

// ids[j] = eids[j] (the token's tid2eid row); w as above.
void RouterHash_k(const float* scores, const int64_t* eids, int64_t k, float routed_scale,
                  int32_t* ids, float* w);

// Plain reference of top-k + weights: full stable sort in double.
void RouterTopkBiasRef(const float* scores, const float* bias, int64_t E, int64_t k,
                       double routed_scale, int32_t* ids, float* w);

}  // namespace fm
