// The device ShardModel's class (model/cuda/shard_model.h is its public entry point): its
// per-sequence device caches, the step's scratch and the CudaShardModel, whose member functions
// live in shard_model.cpp (weights, caches, the layer step) and shard_head.cpp (the head and
// sampling). Internal to fm_model_cuda.
#pragma once
#include <cstddef>
#include <cstdint>
#include <functional>
#include <memory>
#include <mutex>
#include <span>
#include <vector>

#include "kernels/cuda/device.h"
#include "kernels/cuda/fused_ops.h"
#include "kernels/cuda/sample_ops.h"
#include "model/cuda/device_activations.h"
#include "model/cuda/device_weights.h"
#include "model/cuda/ep_experts.h"
#include "model/cuda/shard_model.h"
#include "model/cuda/step_inputs.h"
#include "model/kv_cache.h"

namespace fm {


// One compressor's state of one sequence on the device (model/compressor.h CompressorState):
// the pending rows of the window being filled and of the one before it, [2, r, width]
// (CompressorStep.parity says which is which).
struct DevCompressorState {
  cuda::DeviceBuffer pend_a, pend_z;
};

// One sequence's attention state of one layer on the device (the CPU AttentionCacheImpl's).
class DeviceAttentionCache final : public AttentionCache {
 public:
  int64_t next_pos() const override { return pos; }
  size_t bytes() const override { return bytes_held; }
  // Queued on the current stream (CudaShardModel::CopySequence's): the ring, the entries written
  // so far and the compressors' pending rows.
  Status CopyFrom(const AttentionCache& src) override;

  int64_t ratio = 0, pos = 0, max_entries = 0;
  int64_t window = 0, dim = 0, index_dim = 0;   // W, D, dI of the model
  cuda::DeviceBuffer keys;    // [W + max_entries, D]: ring row s % W, then compressed entry e at W + e
  cuda::DeviceBuffer ikeys;   // [max_entries, dI]: the indexer's entries (ratio 4)
  cuda::DeviceBuffer score;   // [max_entries]: indexer scores of the current query
  DevCompressorState comp, index_comp;
  size_t bytes_held = 0;
};

// The decode state of one compressor: both pending halves, their bytes added to *bytes.
Result<DevCompressorState> NewCompressorState(int64_t ratio, int64_t width, size_t* bytes);

// The logit edits (model/cuda/logit_edits.h) one row takes on the device, at most: a row whose
// edits do not fit is drawn on the host from its raw logits (a sequence with a repetition
// penalty past 16,384 distinct ids seen; the APIs allow 1,024 logit_bias entries). The step's
// buffers hold kMaxStepRows rows of each: 12.6 MB.
constexpr size_t kMaxRowEdits = 16384, kMaxRowBiases = 1024;

// Scratch of one step of up to kMaxStepRows rows, sized once for the model.
struct DeviceStepScratch {
  cuda::DeviceBuffer inputs;  // StepInputs of a step (the graphs read it: rewritten before each replay)
  cuda::DeviceBuffer embed_ids;  // int32 [kMaxStepRows]: the token ids of an Embed chunk
  cuda::DeviceBuffer table;   // cuda::RowCache [layers, rows] of a step (the graphs' too)
  cuda::DeviceBuffer index_count;  // int32 [kMaxStepRows]: IndexerTopK's block counters
  cuda::DeviceBuffer route_count;  // int32: GateRouterTopK's block counter
  cuda::DeviceBuffer x, x_new, mix, y, post, comb, out;
  cuda::DeviceBuffer hc_part, hc_count;  // HcPostPre's per-block partials, int32 [kMaxStepRows] block counters
  cuda::DeviceBuffer cq, q, kv, ca, cz, ia, iz, iq, iw, picks, o, u;
  cuda::DeviceBuffer gl, ids, rw, h, contrib, routed;  // h, contrib: [T, k + 1 (shared), .]
  cuda::DeviceBuffer head_y, logits;  // [kMaxStepRows, H], [kMaxStepRows, vocab]
  cuda::DeviceBuffer sample_params, sample_out, sample_top, sample_scratch;  // SampleRows' (kMaxStepRows rows)
  cuda::DeviceBuffer adjust_rows, adjust_edits, adjust_biases;   // AdjustLogits' (kMaxRowEdits...)
  cuda::DeviceBuffer tp_all, tp_rows;  // a tp member's gathered pieces (f32), row indices (int32)
};

class CudaShardModel final : public ShardModel {
 public:
  CudaShardModel(const ModelConfig& cfg, int device, CudaStepMode mode)
      : cfg_(cfg), device_(device), mode_(mode) {}
  Status Bind(const Checkpoint& ckpt);

  const ModelConfig& config() const override { return cfg_; }
  int64_t layer_begin() const override { return begin_; }
  int64_t layer_end() const override { return end_; }
  bool has_embed() const override { return sel_embed_; }
  bool has_head() const override { return has_head_; }

  Result<std::unique_ptr<SequenceCache>> NewSequence(int64_t max_context) const override;
  Status CopySequence(const SequenceCache& src, SequenceCache* dst) const override;
  Result<std::unique_ptr<Activations>> NewActivations() const override {
    return NewDeviceActivations(device_, cfg_.hc_mult * cfg_.hidden_size);
  }
  Status Embed(std::span<const int32_t> tokens, float* x) const override;
  Status ForwardLayers(std::span<const BatchItem> items, float* x) const override;
  Status Logits(const float* x, int64_t rows, float* logits) const override;
  Result<std::vector<SampledToken>> SampleNext(const float* x, int64_t rows,
                                               std::span<Sampler* const> samplers) const override;
  Result<std::vector<SampledToken>> ScoreNext(const float* x, std::span<const int32_t> targets,
                                              int32_t top) const override;
  void SetExpertExecutor(ExpertExecutor* exec) override { exec_ = exec; }
  Status SetTensorParallel(TpGroup* tp) override;
  ExpertRunner* LocalExperts() override { return experts_.get(); }

 private:
  Status AllocScratch();
  Result<std::unique_ptr<AttentionCache>> NewCache(int64_t ratio, int64_t max_context) const;
  int RatioIndex(int64_t ratio) const;  // where `ratio`'s values are in RowScalars.ratio
  // The rows of a step: rows[t] is the sequence of token t (a sequence's tokens in order).
  using Rows = std::span<const SequenceCache* const>;
  // T tokens through every layer of the shard; s.x holds their X [T, hc, H] and is updated.
  // Position-dependent values come from `in` and the caches from `table` (cuda::RowCache
  // [layers, T], RowTable) only, so a step can be captured once and replayed over other rows.
  // distinct: every row is another sequence's (the attention side takes all rows in one launch).
  Status Step(int64_t T, bool distinct, const DevStepInputs& in,
              const cuda::RowCache* table) const;
  std::vector<cuda::RowCache> RowTable(Rows rows) const;
  // `next`: the layer after l in this shard (its hc_pre fuses with l's last hc_post), or null.
  Status LayerStep(const DevLayer& l, const DevLayer* next, int64_t T, bool distinct,
                   const DevStepInputs& in, const cuda::RowCache* table) const;
  // s.x -> s.y, post, comb for T rows; with `post` present: s.x <- hc_post(s.x, post) first.
  Status HcPreNorm(const DevHc& hc, const cuda::DeviceBuffer& norm, int64_t T,
                   const cuda::HcPostInput& post) const;
  Status HcPostUpdate(int64_t T, const cuda::HcPostInput& post) const;  // s.x <- hc_post(s.x, post)
  // table: the layer's cuda::RowCache [T].
  Status Attention(const DevLayer& l, int64_t T, bool distinct, const DevStepInputs& in,
                   const cuda::RowCache* table) const;
  // s.y -> the FFN's output: s.out, or (every expert on this device) the slots in s.contrib
  // with the weights in s.rw, which the hc_post after it combines (no combine launch).
  Result<cuda::HcPostInput> Moe(const DevLayer& l, int64_t T, const DevStepInputs& in) const;
  // X [T, hc, H] (device) -> s.logits [T, vocab]: hc_head, the final norm and the head.
  Status Head(const float* x, int64_t T) const;
  // step(r0, T) for the rows [0, rows) in steps of up to kMaxStepRows, on this shard's device
  // and stream, under mu_: SampleNext's and ScoreNext's walk over their rows.
  Status ForHeadSteps(int64_t rows, const std::function<Status(int64_t r0, int64_t T)>& step) const;
  // SampleRows over the head's T rows of logits (s_.logits):
  // res[0, T) and, when a row asks for alternatives, top[0, T) on the host.
  Status SampleHeadRows(const cuda::SampleParams* params, int64_t T, cuda::SampleResult* res,
                        cuda::SampleTop* top) const;

  ModelConfig cfg_;
  int device_;
  CudaStepMode mode_;
  cuda::Stream stream_;     // every launch and copy of this model
  std::vector<int64_t> ratios_;  // the distinct compress ratios > 1 of the shard's layers
  int64_t begin_ = 0, end_ = 0;
  bool sel_embed_ = false, has_head_ = false;
  cuda::DeviceBuffer embed_;  // embed.weight [vocab, H] as in the checkpoint (BF16 or F32)
  bool embed_bf16_ = false;
  std::vector<std::unique_ptr<DevLayer>> layers_;
  cuda::DeviceWeight head_;
  cuda::DeviceBuffer norm_;
  DevHc hc_head_;
  // Only sizes the indexer's grid (fixed, for graphs): blocks a row for this many positions'
  // entries. Sequences are not capped by it (their max_context is the worker's limit).
  int64_t index_grid_positions_ = 0;
  ExpertExecutor* exec_ = nullptr;  // null: routed experts on the device
  std::unique_ptr<DeviceExpertRunner> experts_;  // the uploaded experts, for an EP executor
  // Tensor parallelism: the member the weights were uploaded for (the checkpoint selection's
  // tp_rank of tp_size) and its group, set before the first step (tp_step.h).
  int tp_rank_ = 0, tp_size_ = 1;
  TpGroup* tp_ = nullptr;
  mutable std::mutex mu_;           // one step at a time: the scratch is shared
  // NewSequence's allocations (and frees on failure) never overlap a graph capture: a
  // synchronizing call from another thread may invalidate a capture even in thread-local mode.
  // (Sequences are freed between steps: the worker's executor serializes that.)
  mutable std::mutex capture_mu_;
  mutable DeviceStepScratch s_;
  // kGraph: the decode step graph of each bucket of kStepBuckets (empty until its first step),
  // and the caches of the buckets' padding rows (a sequence that never advances past 0).
  mutable cuda::Graph graphs_[std::size(kStepBuckets)];
  // Failed captures of each bucket: after kMaxCaptureFailures the bucket runs eagerly for good
  // (a device short of memory for good would otherwise record and fail a capture every step).
  static constexpr int kMaxCaptureFailures = 3;
  mutable int capture_failures_[std::size(kStepBuckets)] = {};
  std::unique_ptr<SequenceCache> pad_;
};

}  // namespace fm
