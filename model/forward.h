// ShardModel: the DeepSeek-V4 forward over the part of the model one process holds
// (a layer range, optionally the embedding and the head), on CPU, for a batch of sequences.
// Single-process mode holds everything; a pipeline stage holds [layer_begin, layer_end).
// The residual stream between layers (and between stages) is the manifold X [T, hc, H], f32.
#pragma once
#include <cstdint>
#include <memory>
#include <span>
#include <string>
#include <vector>

#include "common/status.h"
#include "common/thread_pool.h"
#include "model/activations.h"
#include "model/checkpoint.h"
#include "model/config.h"
#include "model/sampler.h"

namespace fm {

class SequenceCache;  // model/kv_cache.h: one sequence's per-layer decode state on this shard
class TpGroup;        // model/tp.h: a tensor-parallel group's collective

// One sequence's slice of a batch: its tokens are consecutive rows of X.
struct BatchItem {
  SequenceCache* cache = nullptr;     // advanced by tokens.size() on success
  std::span<const int32_t> tokens;    // token ids of these rows (hash routing needs them)
};

// The routed-expert part of one MoE step, pluggable so expert parallelism can run experts on
// other workers. Input: x [T, H] (the normed MoE input), for each row its top-k expert ids and
// weights (row-major [T, k]). Output: routed [T, H] = sum over k, in k order, of
// weight * expert(x). The shared expert is added by the caller.
class ExpertExecutor {
 public:
  virtual ~ExpertExecutor() = default;
  virtual Status RunRouted(int64_t layer, const float* x, int64_t T, const int32_t* expert_ids,
                           const float* weights, float* routed) = 0;
  // The same experts' outputs before the sum: slots [T, k, H], slot (t, j) = expert
  // expert_ids[t k + j] of row t, unweighted (RunRouted = CombineRouted of these). A device
  // shard sums them on the device, in the order of its own combine.
  virtual Status RunSlots(int64_t layer, const float* x, int64_t T, const int32_t* expert_ids,
                          float* slots) = 0;
  // RunSlots with x and slots in the device memory of this member's experts (a device shard
  // under expert parallelism: the rows never cross the host); expert_ids on the host. Only an
  // executor whose runner has DeviceRows takes them; the default refuses.
  virtual Status RunSlotsOnDevice(int64_t layer, const float* x, int64_t T,
                                  const int32_t* expert_ids, float* slots) {
    (void)x, (void)T, (void)expert_ids, (void)slots;
    return InvalidArgument("MoE layer " + std::to_string(layer) +
                           ": this expert executor takes rows in host memory only");
  }
  // Every member of an expert-parallel group runs the same number of rounds a step (a round:
  // one RunRouted or RunSlots a layer of its shard). A shard that runs its rows in `rounds`
  // passes (a device shard: steps of 32 rows) gets the group's largest and runs the rounds it
  // lacks with no rows (RunExpertRounds). In one process: its own count.
  virtual Result<int64_t> AgreeRounds(int64_t rounds) { return rounds; }
};

// Rounds [from, to) with no rows for layers [layer_begin, layer_end): this member serves the
// others' requests for its experts (AgreeRounds).
Status RunEmptyRounds(ExpertExecutor* exec, int64_t from, int64_t to, int64_t layer_begin,
                      int64_t layer_end);

class DeviceRows;

// The routed experts a shard holds, run for an expert-parallel executor on behalf of any
// member: out [p, H] = the unweighted output of expert pairs[2i + 1] on row pairs[2i] of rows
// [n, H], host memory. Errors name a pair whose expert is not held here.
class ExpertRunner {
 public:
  virtual ~ExpertRunner() = default;
  virtual Status RunPairs(int64_t layer, const float* rows, int64_t n, const int32_t* pairs,
                          int64_t p, float* out) = 0;
  // The device side of a runner whose experts live in a GPU's memory; null for the CPU's.
  virtual DeviceRows* device_rows() { return nullptr; }
};

// What the EP executor needs to keep a layer's rows and the experts' outputs in the memory of
// a GPU that holds this member's experts (RunSlotsOnDevice): two buffers that persist from call
// to call, a row gather, counted host copies (for a communicator that only takes host memory)
// and RunPairs on device rows. Work is queued in order on the runner's own stream; Wait returns
// once it is done (before a communicator or the shard's stream reads what it wrote). One caller
// at a time (the member's step thread).
class DeviceRows {
 public:
  virtual ~DeviceRows() = default;
  // Buffer `which` (0 or 1) with room for `floats` f32; a larger request reallocates it (what it
  // held is lost), so pointers are good until the next Buffer call of the same `which`.
  virtual Result<float*> Buffer(int which, int64_t floats) = 0;
  // dst [n, H] row i = src row idx[i]; idx on the host, each in [0, src_rows); device memory.
  virtual Status GatherRows(const float* src, int64_t src_rows, const int32_t* idx, int64_t n,
                            float* dst) = 0;
  // Blocking copies of `bytes` between host memory and one of the two buffers.
  virtual Status ToHost(const void* src, void* dst, size_t bytes) = 0;
  virtual Status FromHost(const void* src, void* dst, size_t bytes) = 0;
  // RunPairs with rows [n, H] and out [p, H] in device memory (pairs on the host).
  virtual Status RunPairsOnDevice(int64_t layer, const float* rows, int64_t n,
                                  const int32_t* pairs, int64_t p, float* out) = 0;
  virtual Status Wait() = 0;
};

// embed.weight checked against config.json: BF16 or F32 [vocab, hidden].
Result<TensorView> BindEmbed(const Checkpoint& ckpt);
// head.weight as a matvec weight, checked to be [vocab, hidden].
Result<QWeight> BindHeadWeight(const Checkpoint& ckpt);
// row [H] = embed[token] in f32 (token already checked against the vocabulary).
void EmbedRow(const TensorView& embed, int32_t token, int64_t H, float* row);
// X [T, n, H]: every one of the n streams of row t = embed[tokens[t]].
void EmbedManifold(const TensorView& embed, std::span<const int32_t> tokens, int64_t n, int64_t H,
                   float* x);

// Token ids against the vocabulary (non-empty); errors name `what` and the position.
Status CheckTokenIds(const ModelConfig& cfg, std::span<const int32_t> tokens,
                     const std::string& what);
// A batch for a shard of layers [layer_begin, layer_end), checked before anything runs: caches
// present, distinct and made for this shard (with an MTP cache when mtp), tokens in the vocab,
// context within max_context. Returns the items' tokens concatenated.
Result<std::vector<int32_t>> CheckBatchItems(const ModelConfig& cfg, int64_t layer_begin,
                                             int64_t layer_end, std::span<const BatchItem> items,
                                             bool mtp);

class ShardModel {
 public:
  // Binds the checkpoint's selected tensors (no copies of big weights). pool: kernel threads.
  static Result<std::unique_ptr<ShardModel>> Create(const Checkpoint& ckpt, ThreadPool* pool);
  virtual ~ShardModel() = default;

  virtual const ModelConfig& config() const = 0;
  virtual int64_t layer_begin() const = 0;
  virtual int64_t layer_end() const = 0;
  virtual bool has_embed() const = 0;
  virtual bool has_head() const = 0;

  // Empty decode state for this shard's layers, able to hold max_context positions. Errors:
  // ResourceExhausted when a device shard's memory cannot hold it.
  virtual Result<std::unique_ptr<SequenceCache>> NewSequence(int64_t max_context) const = 0;
  // dst (from NewSequence, not stepping) takes src's decode state: a fork of a sequence at its
  // position, e.g. n choices sharing one prefill of their prompt. No step may run meanwhile.
  virtual Status CopySequence(const SequenceCache& src, SequenceCache* dst) const;

  // An empty manifold buffer [0, hc*H] in this shard's activation memory: host memory on the
  // CPU shard (the default), device memory on a device shard. Every `x` below points into such
  // memory (a device pointer on a device shard); `logits` are always host memory.
  virtual Result<std::unique_ptr<Activations>> NewActivations() const {
    return NewHostActivations(config().hc_mult * config().hidden_size);
  }

  // tokens [T] -> X [T, hc, H] (every stream = the embedding row). Needs has_embed().
  virtual Status Embed(std::span<const int32_t> tokens, float* x) const = 0;
  // X [T, hc, H] through layers [layer_begin, layer_end), T = sum of items' token counts.
  // Rows of different items never mix (results are bit-identical to running each alone).
  virtual Status ForwardLayers(std::span<const BatchItem> items, float* x) const = 0;
  // X [rows, hc, H] (state after the last layer) -> logits [rows, vocab]. Needs has_head().
  virtual Status Logits(const float* x, int64_t rows, float* logits) const = 0;

  // The head and each row's sampler: X [rows, hc, H] -> the token samplers[r] draws for row r
  // (rows == samplers.size()), each sampler's RNG advanced as by Sampler::Sample. The CPU shard
  // computes the logits and calls Sample; a device shard samples where the logits are, so only
  // (id, logprob) per row reach the host. Needs has_head(); errors as Logits. A row whose
  // logits Sample refuses (NaN, +inf, nothing finite) has that error in its SampledToken's
  // `error`, and the other rows are drawn as they would be without it.
  virtual Result<std::vector<SampledToken>> SampleNext(const float* x, int64_t rows,
                                                       std::span<Sampler* const> samplers) const;
  // The head and each row's known next token scored: X [rows, hc, H] -> row r's ScoreToken of
  // targets[r] with `top` alternatives (log_softmax of the raw logits, rank), rows ==
  // targets.size(). The CPU shard scores the logits on its pool, a block of rows at a time; a
  // device shard where the logits are, so only the scores reach the host. Needs has_head() and
  // top in [0, kMaxTopLogprobs] (CheckScoreNext); errors as Logits. A row ScoreToken refuses
  // (NaN, +inf or no finite logit, a target outside the vocabulary) has that error in its
  // SampledToken's `error`.
  virtual Result<std::vector<SampledToken>> ScoreNext(const float* x,
                                                      std::span<const int32_t> targets,
                                                      int32_t top) const = 0;

  // Routed experts run through `exec` instead of locally (expert parallelism); null = local.
  virtual void SetExpertExecutor(ExpertExecutor* exec) = 0;
  // The routed experts of this shard's selection as an ExpertRunner, for an expert-parallel
  // executor serving every member's pairs: the CPU shard's on its pool (CpuExpertRunner,
  // model/moe.h), a device shard's on its GPU. Lives as long as the shard.
  virtual ExpertRunner* LocalExperts() = 0;
  // Tensor parallelism (model/tp.h): ForwardLayers computes member tp->rank()'s share of every
  // layer and gathers the rest over `tp` (outliving its use), with the same bits; null = off.
  // Errors when the model's shapes do not divide by tp->size() or the shard cannot split.
  virtual Status SetTensorParallel(TpGroup* tp) {
    if (!tp) return Status::Ok();
    return InvalidArgument("tensor_parallel: this shard kind runs whole layers only (the CPU "
                           "shard splits heads)");
  }

  // Whether this shard holds the MTP block (mtp.0, with the embedding and the head it needs).
  virtual bool has_mtp() const { return false; }
  // MTP draft logits (MODEL.md "MTP"). x [T, hc, H]: the main model's final state (after the last
  // layer, before hc_head) of the items' rows; items[i].tokens: for each row t the token at t+1
  // (for a sequence's last row, the main model's choice). Runs mtp.0 on each cache's own MTP
  // cache (it advances by the row count) and writes logits [T, vocab] predicting token t+2.
  virtual Status MtpLogits(std::span<const BatchItem> items, const float* x,
                           float* logits) const {
    return InvalidArgument("MtpLogits: this shard holds no MTP block");
  }

 protected:
  // ScoreNext's refusals, the same for every shard kind: no head, a top past kMaxTopLogprobs.
  Status CheckScoreNext(int32_t top) const;
};

}  // namespace fm
