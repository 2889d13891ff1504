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

#include "common/status.h"
#include "common/thread_pool.h"
#include "model/checkpoint.h"
#include "model/config.h"

namespace fm {

struct AttentionWeights;  // bound views for one layer (defined at the end of this file)

// prefix: "layers.N.attn." or "mtp.0.attn."; ratio = compress_ratios[layer].
Result<std::unique_ptr<AttentionWeights>> BindAttention(const Checkpoint& ckpt,
                                                        const std::string& prefix, int64_t ratio);

class AttentionCache {  // one sequence, one layer (MODEL.md "Decode state")
 public:
  virtual ~AttentionCache() = default;
  virtual int64_t next_pos() const = 0;  // positions consumed so far
  virtual size_t bytes() const = 0;      // bytes currently held (KV use for status)
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
Status AttentionForward(const ModelConfig& cfg, const AttentionWeights& w,
                        std::span<const AttentionSeq> seqs, const float* x, float* out,
                        ThreadPool* pool);

}  // namespace fm
