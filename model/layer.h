// One DeepSeek-V4 block over the hyper-connection manifold (MODEL.md "Layer", "Head"; HF
// DeepseekV4DecoderLayer, DeepseekV4HyperHead): the bound weights of a layer and the row-wise
// compositions the forward, the MTP block and the head share. X is [T, hc, H] f32, row-major.
#pragma once
#include <cstdint>
#include <memory>
#include <span>
#include <string>
#include <vector>

#include "common/status.h"
#include "common/tensor.h"
#include "common/thread_pool.h"
#include "model/attention.h"
#include "model/checkpoint.h"
#include "model/config.h"
#include "model/forward.h"
#include "model/moe.h"

namespace fm {

// hc_{attn,ffn}_{fn,base,scale} or hc_head_{fn,base,scale}: f32 copies; fn as a matvec weight.
struct HcWeights {
  std::vector<float> fn, base, scale;
  QWeight fn_weight() const;  // F32 [fn.size() / (hc*H), hc*H]
};
// prefix + "fn" / "base" / "scale"; checks [mix_rows, hc*H], [mix_rows], [scale_len].
Result<HcWeights> BindHc(const Checkpoint& ckpt, const std::string& prefix, int64_t mix_rows,
                         int64_t scale_len);

struct LayerWeights {
  int64_t layer = 0;  // absolute: N, or num_hidden_layers for mtp.0
  int64_t ratio = 0;
  HcWeights hc_attn, hc_ffn;
  std::vector<float> attn_norm, ffn_norm;
  std::unique_ptr<AttentionWeights> attn;
  MoeWeights moe;
};
// prefix "layers.N." or "mtp.0.".
Result<std::unique_ptr<LayerWeights>> BindLayer(const Checkpoint& ckpt, const std::string& prefix,
                                                int64_t layer);

// X [T, hc, H] through one block in place: hc_pre -> RMSNorm -> attention -> hc_post, then
// hc_pre -> RMSNorm -> MoE (routed through exec + shared expert) -> hc_post.
// seqs: the rows of each sequence with that sequence's cache of this layer; tokens [T].
// tp: a tensor-parallel member's share (model/tp.h; exec unused), the same bits; null = all.
Status RunLayer(const ModelConfig& cfg, const LayerWeights& w, std::span<const AttentionSeq> seqs,
                const int32_t* tokens, int64_t T, ExpertExecutor* exec, float* x,
                ThreadPool* pool, TpGroup* tp = nullptr);

// X [rows, hc, H] -> logits [rows, V] = head . RMSNorm(hc_head(X); norm).
void HeadLogits(const ModelConfig& cfg, const HcWeights& hc_head, const std::vector<float>& norm,
                const QWeight& head, const float* x, int64_t rows, float* logits,
                ThreadPool* pool);

// f32 copy of a [len] vector tensor, checked for its length; errors name the tensor.
Result<std::vector<float>> GetVector(const Checkpoint& ckpt, const std::string& name, int64_t len);

}  // namespace fm
