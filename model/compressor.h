// The compressor of DeepSeek-V4 attention and its decode state (MODEL.md "Attention" steps 4-6,
// "Decode state"; HF DeepseekV4HCACompressor, DeepseekV4CSACompressor, DeepseekV4Indexer and the
// buffer / overlap / entry state of DeepseekV4HCACache / DeepseekV4CSACache).
// Tokens are pushed one at a time in position order; a window of `ratio` tokens, once complete,
// becomes one entry, so prefill and decode run the very same steps.
#pragma once
#include <cstddef>
#include <cstdint>
#include <string>
#include <vector>

#include "common/status.h"
#include "common/tensor.h"
#include "model/checkpoint.h"

namespace fm {

// Weights of one compressor (the attention's, width D, or the indexer's, width dI).
struct CompressorWeights {
  int64_t ratio = 0;        // r: tokens per entry
  int64_t dim = 0;          // d: width of an entry
  bool overlap = false;     // ratio 4: projections are 2d wide, windows overlap by r
  QWeight wkv, wgate;       // [c*d, H], c = overlap ? 2 : 1
  std::vector<float> ape;   // [r, c*d], added to the gate logits by slot (position mod r)
  std::vector<float> norm;  // [d], the RMSNorm weight of a pooled entry
  int64_t width() const { return overlap ? 2 * dim : dim; }
};

// prefix: "layers.N.attn.compressor." or "layers.N.attn.indexer.compressor."; checks every shape.
Result<CompressorWeights> BindCompressor(const Checkpoint& ckpt, const std::string& prefix,
                                         int64_t ratio, int64_t dim, int64_t hidden);
// Shape checks of in-memory weights (BindCompressor runs them too); errors name `what`.
Status ValidateCompressor(const CompressorWeights& w, int64_t hidden, const std::string& what);

// One sequence's state of one compressor: pending rows of the open window, the previous
// window's rows (overlap), and the entries emitted so far (already normed and roped).
class CompressorState {
 public:
  CompressorState(int64_t ratio, int64_t dim, bool overlap);

  // Token at position `pos` (== tokens pushed so far) with projections a = Wkv x, gate = Wgate x
  // (each width() floats). When its window completes, emits entry w = pos / r:
  // e_w = rope(RMSNorm(pool(window); norm), w*r) with the compress rope (inv_freq, rd).
  void Push(const CompressorWeights& w, const float* a, const float* gate, int64_t pos,
            const float* inv_freq, int64_t rd, float eps);

  int64_t num_entries() const { return static_cast<int64_t>(entries_.size()) / dim_; }
  const float* entries() const { return entries_.data(); }  // [num_entries, dim]
  size_t bytes() const;

 private:
  int64_t ratio_, dim_;
  bool overlap_;
  std::vector<float> pend_a_, pend_z_;  // [r, width]: the open window, slot = pos mod r
  std::vector<float> prev_a_, prev_z_;  // [r, width]: the last complete window (overlap only)
  bool has_prev_ = false;
  std::vector<float> entries_;
};

// The entries a ratio-4 query attends (MODEL.md "Attention" step 6, HF DeepseekV4Indexer): all of
// [0, visible) when visible <= topk, else the topk highest indexer scores (ties to the lower
// index), ascending. q [nI, dI]: roped indexer query; proj [nI]: weights_proj . x (unscaled);
// keys [>= visible, dI]: the indexer's entries.
void IndexerSelect(const float* q, const float* proj, int64_t nI, int64_t dI, const float* keys,
                   int64_t visible, int64_t topk, std::vector<int32_t>* picks);

}  // namespace fm
