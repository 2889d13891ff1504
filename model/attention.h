// The DeepSeek-V4 attention block on CPU (MODEL.md "Attention", HF DeepseekV4Attention) with its
// per-sequence decode state (MODEL.md "Decode state", HF DeepseekV4HCACache / CSACache).
// Three layer kinds by compress ratio: 0 = sliding window only; 4 = compressed-sparse
// (overlapping compressor windows + Lightning indexer top-k); any other ratio > 1 =
// heavily-compressed (non-overlapping windows, every visible entry attended).
#pragma once
#include <cstddef>
#include <cstdint>
#include <memory>
#include <span>
#include <string>
#include <vector>

#include "common/status.h"
#include "common/thread_pool.h"
#include "model/checkpoint.h"
#include "model/compressor.h"
#include "model/config.h"

namespace fm {

struct AttentionWeights;  // bound views for one layer (defined at the end of this file)
class TpGroup;            // model/tp.h

// prefix: "layers.N.attn." or "mtp.0.attn."; ratio = compress_ratios[layer].
Result<std::unique_ptr<AttentionWeights>> BindAttention(const Checkpoint& ckpt,
                                                        const std::string& prefix, int64_t ratio);

class AttentionCache {  // one sequence, one layer (MODEL.md "Decode state")
 public:
  virtual ~AttentionCache() = default;
  virtual int64_t next_pos() const = 0;  // positions consumed so far
  virtual size_t bytes() const = 0;      // bytes currently held (KV use for status)
  // This cache takes src's state: the same layer of another sequence on the same shard, whose
  // positions fit this one's max_context (a sequence forked from a shared prompt prefix,
  // StepItem.fork_from). Errors: a cache of another kind or ratio, src beyond max_context.
  virtual Status CopyFrom(const AttentionCache& src) = 0;
};

std::unique_ptr<AttentionCache> NewAttentionCache(const ModelConfig& cfg, int64_t ratio,
                                                  int64_t max_context);

struct AttentionSeq {  // consecutive rows of x, in order
  AttentionCache* cache;
  int64_t rows;
};

// x [sum rows, H]: RMSNorm'ed attention inputs; out [sum rows, H]. Each sequence's rows are its
// next positions cache->next_pos() ...; caches advance. Projections batch all rows (Matmul is
// row-independent: bit-identical); attention itself per sequence.
// Errors: context beyond max_context, a cache of another ratio than the weights.
// tp (tensor parallelism, model/tp.h): this member computes its heads and groups and gathers
// the rest; out is the full [sum rows, H] on every member, the same bits. null = all heads.
Status AttentionForward(const ModelConfig& cfg, const AttentionWeights& w,
                        std::span<const AttentionSeq> seqs, const float* x, float* out,
                        ThreadPool* pool, TpGroup* tp = nullptr);

// The bound weights of one attention layer: views into the checkpoint (QWeight) and f32 copies of
// the small tensors. Tests may fill one in memory and check it with ValidateAttention.
struct AttentionWeights {
  int64_t ratio = 0;                  // compress_ratios[layer]
  QWeight wq_a;                       // [q_lora, H]
  std::vector<float> q_norm;          // [q_lora]
  QWeight wq_b;                       // [nH*D, q_lora]
  QWeight wkv;                        // [D, H]
  std::vector<float> kv_norm;         // [D]
  QWeight wo_a;                       // [G*R, nH*D/G]
  QWeight wo_b;                       // [H, G*R]
  std::vector<float> attn_sink;       // [nH]
  std::vector<float> rope_inv_freq;   // [rd/2]: rope_theta plain (ratio 0) or compress + YaRN
  CompressorWeights compressor;       // ratio > 0
  CompressorWeights index_compressor; // ratio 4: keys of the indexer, width dI
  QWeight index_wq_b;                 // ratio 4: [nI*dI, q_lora]
  QWeight index_weights_proj;         // ratio 4: [nI, H]
};

// The rope frequencies of a layer of this ratio (MODEL.md "RoPE").
std::vector<float> AttentionRopeInvFreq(const ModelConfig& cfg, int64_t ratio);
// Every shape of w against cfg; errors name the tensor under `prefix`.
Status ValidateAttention(const ModelConfig& cfg, const AttentionWeights& w,
                         const std::string& prefix);

}  // namespace fm
