// Manifold-constrained hyper-connections (MODEL.md "hc_pre", "hc_post", "Head"; HF
// DeepseekV4HyperConnection / DeepseekV4HyperHead). The residual of a token is n streams X[n, H];
// a block reads one collapsed row and writes back through post/comb.
// The mix m = fn . flatten(X) is a plain Matmul by the caller (fn F32 [(2+n)*n, n*H], or [n, n*H]
// for the head); these kernels take it unnormalised together with rinv = 1/rms(flatten(X)).
#pragma once
#include <cstdint>

namespace fm {

// 1 / sqrt(mean(x[0..len)^2) + eps), squares summed in double in index order.
float RmsInv(const float* x, int64_t len, float eps);

// hc_pre weights of one row from mix[(2+n)*n] (fn . f, not yet scaled by rinv):
// pre_i = sigmoid(scale0*m_i + base_i) + eh; post_i = 2*sigmoid(scale1*m_{n+i} + base_{n+i});
// comb = softmax_k(scale2*m_{2n+j*n+k} + base) + eh, columns / (sum + eh), then (iters-1) x
// (rows / (sum + eh), columns / (sum + eh)).  m = mix * rinv.
void HcPreWeights_n(const float* mix, float rinv, const float* base, const float* scale, int64_t n,
                    int64_t iters, float hc_eps, float* pre, float* post, float* comb);

// y[H] = sum_i pre[i] * X[i][H], i ascending.
void HcCollapse_nH(const float* x, const float* pre, int64_t n, int64_t H, float* y);

// X'[k][H] = post[k] * out[H] + sum_j comb[j*n+k] * X[j][H], j ascending. x_new must not alias x.
void HcPost_nH(const float* x, const float* out, const float* post, const float* comb, int64_t n,
               int64_t H, float* x_new);

// hc_head weights: pre_i = sigmoid(scale * m_i + base_i) + eh, m = mix * rinv (mix = fn . f).
void HcHeadWeights_n(const float* mix, float rinv, const float* base, float scale, int64_t n,
                     float hc_eps, float* pre);

// Plain references (double everywhere, fn applied to the normalised f as HF does), one row.
// x [n, H], fn [(2+n)*n, n*H] -> y [H], post [n], comb [n*n].
void HcPreRef(const float* x, const float* fn, const float* base, const float* scale, int64_t n,
              int64_t H, int64_t iters, double hc_eps, double rms_eps, float* y, float* post,
              float* comb);
void HcPostRef(const float* x, const float* out, const float* post, const float* comb, int64_t n,
               int64_t H, float* x_new);
// x [n, H], fn [n, n*H] -> y [H] (the collapsed row before the final norm).
void HcHeadRef(const float* x, const float* fn, const float* base, double scale, int64_t n,
               int64_t H, double hc_eps, double rms_eps, float* y);

}  // namespace fm
