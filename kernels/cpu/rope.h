// Interleaved partial RoPE of DeepSeek-V4 (MODEL.md "RoPE"; HF DeepseekV4RotaryEmbedding,
// apply_rotary_pos_emb, and _compute_yarn_parameters in modeling_rope_utils).
// Two thetas: window-only layers use rope_theta plain; layers with a compressor (and their
// compressor and indexer) use compress_rope_theta with the YaRN frequency ramp, no mscale.
#pragma once
#include <cstdint>
#include <vector>

namespace fm {

// Largest rotary width the kernels take (cos/sin tables live on the stack).
constexpr int64_t kRopeMaxDim = 512;

// f_i = theta^(-2i/rd), i < rd/2 (f32, as HF computes the table).
std::vector<float> RopeInvFreqDefault(double theta, int64_t rd);

// YaRN: corr(b) = rd*ln(L0/(2*pi*b)) / (2*ln theta); lo = max(floor(corr(beta_fast)), 0),
// hi = min(ceil(corr(beta_slow)), rd-1) (+0.001 if equal); ramp_i = clip((i-lo)/(hi-lo), 0, 1);
// f_i = f_i*(1-ramp_i) + (f_i/factor)*ramp_i.
std::vector<float> RopeInvFreqYarn(double theta, int64_t rd, double factor, double beta_fast,
                                   double beta_slow, int64_t original_max_pos);

// For each of n rows of width dim: rotate the last rd channels as pairs (x[2i], x[2i+1]) of that
// slice by angle pos*f_i: (a, b) -> (a*cos - b*sin, b*cos + a*sin). inverse: angle -> -angle.
void RopeRows_nd(float* x, int64_t n, int64_t dim, int64_t rd, int64_t pos, const float* inv_freq,
                 bool inverse);

}  // namespace fm
