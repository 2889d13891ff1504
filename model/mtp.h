// The multi-token-prediction block mtp.0 (MODEL.md "MTP"; DeepSeek-V4 official inference and
// antirez/ds4: HF transformers does not implement it). From the main model's final manifold
// X_t (before hc_head) and the next token tok_{t+1}:
//   e = e_proj . RMSNorm(embed[tok_{t+1}]; enorm),  X^m_t[k] = e + h_proj . RMSNorm(X_t[k]; hnorm)
// then one score-routed block (its own cache, same positions), and
//   logits^m_t = head . RMSNorm(hc_head(X^m_t; mtp.0.hc_head_*); mtp.0.norm), predicting t+2.
#pragma once
#include <cstdint>
#include <memory>
#include <span>
#include <vector>

#include "model/layer.h"

namespace fm {

struct MtpWeights {
  QWeight e_proj, h_proj;                // [H, H]
  std::vector<float> enorm, hnorm, norm; // [H]
  HcWeights hc_head;                     // mtp.0.hc_head_{fn,base,scale}
  std::unique_ptr<LayerWeights> block;   // mtp.0.* as a layer, index num_hidden_layers
};

Result<std::unique_ptr<MtpWeights>> BindMtp(const Checkpoint& ckpt);

// emb [T, H]: embed rows of the next tokens; x_main [T, hc, H]; tokens [T] (the next tokens);
// seqs: each sequence's rows with its MTP attention cache; head: the shared head.weight.
// logits [T, V].
Status MtpForward(const ModelConfig& cfg, const MtpWeights& w, std::span<const AttentionSeq> seqs,
                  const float* emb, const float* x_main, const int32_t* tokens, int64_t T,
                  ExpertExecutor* exec, const QWeight& head, float* logits, ThreadPool* pool);

}  // namespace fm
