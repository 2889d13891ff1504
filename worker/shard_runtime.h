// ShardRuntime: what one worker holds resident: its slice of the checkpoint (Checkpoint::Open
// with only its shard), the ShardModel bound to it, and one decode state per live sequence
// (plus, on the last stage, that sequence's sampler). Thread-safe; the StageExecutor is its
// only caller of Forward*, the control service calls the rest.
#pragma once
#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstdint>
#include <map>
#include <memory>
#include <mutex>
#include <span>
#include <string>
#include <vector>

#include "common/status.h"
#include "common/thread_pool.h"
#include "model/checkpoint.h"
#include "model/forward.h"
#include "model/sampler.h"
#include "net/communicator.h"
#include "worker/ep_expert_executor.h"
#include "worker/tp_group.h"

namespace fm {

class SequenceCache;

struct ShardPlacement {
  std::string model_dir;
  int stage = 0, num_stages = 1;
  int64_t layer_begin = 0, layer_end = -1;   // exclusive; -1 = all
  bool embed = true, head = true;
  std::vector<int64_t> experts;              // empty = all
  int64_t max_context = 0;                   // 0 = the model's max_position_embeddings or 8192
  int64_t max_step_rows = 0;                 // the rows of the plan's largest step; 0 = max_context
                                             // (placement() has both resolved)
  uint64_t kv_cache_bytes = 0;               // 0 = unlimited
  int cuda_device = -1;                      // run on GPU N (model/cuda/shard_model.h); -1 = CPU
  // Expert parallelism (empty = off): member r holds experts [ep_expert_begin[r],
  // ep_expert_begin[r+1]); `experts` is this member's range.
  int ep_rank = 0;
  std::vector<int64_t> ep_expert_begin;
  // Tensor parallelism (model/tp.h): > 1 = the group above splits every layer's heads, each
  // member holds every sequence, and member 0 of the last stage samples.
  int tensor_parallel = 1;
  bool expert_parallel() const { return ep_expert_begin.size() > 2 && tensor_parallel == 1; }
  bool samples() const { return head && (tensor_parallel == 1 || ep_rank == 0); }
  // Largest-step frames this stage may have to hold unread (its inbox, its data plane's unread
  // bytes per peer): the coordinator keeps a step per stage in flight, and a slow stage may find
  // all of them queued by the stage before it; one spare, and at least 4 (EP/TP exchanges).
  int64_t max_waiting_steps() const { return std::max<int64_t>(4, int64_t{num_stages} + 1); }
  // max_waiting_steps frames of frame_bytes each, saturating far beyond any memory (2^60).
  uint64_t max_waiting_bytes(uint64_t frame_bytes) const {
    const uint64_t cap = uint64_t{1} << 60, waiting = static_cast<uint64_t>(max_waiting_steps());
    return frame_bytes > cap / waiting ? cap : waiting * frame_bytes;
  }
};

// One step's slice for one sequence.
struct StepSlice {
  uint64_t seq_id = 0;
  std::vector<int32_t> tokens;
  bool sample = true;   // false: a prompt chunk with more to come; no token is drawn for it
  uint64_t fork_from = 0;   // nonzero: first take this sequence's state (StepItem.fork_from)
  int32_t next_token = -1;  // the prompt's token after this chunk, when scored (StepItem.next_token)
};

// A prompt slice's scores (SamplerConfig.prompt_logprobs): tokens[i] is the token at position
// first + i, scored by the row before it (ScoreToken).
struct PromptScores {
  uint64_t seq_id = 0;
  int64_t first = 0;
  std::vector<SampledToken> tokens;
  // Why a row's logits could not be scored (NaN, +inf): tokens are then empty, and the
  // coordinator ends that request alone, as for a row that could not be sampled.
  Status error;
};

struct SampledId {
  uint64_t seq_id = 0;
  int32_t id = 0;
  float logprob = 0.f;
  std::vector<TokenLogprob> top;   // the sequence's top_logprobs alternatives (SampledToken)
  Status error;                    // this sequence's row could not be sampled (SampledToken)
};

// A device shard's host<->device copies of its steps (common/device_transfers.h; the one-time
// weight upload is not in them) and the rows it ran through its layers since the process
// started: what the bytes cover. Zeros on a CPU shard.
struct DeviceStepTraffic {
  uint64_t host_to_device = 0, device_to_host = 0, tokens = 0;
};

class ShardRuntime {
 public:
  explicit ShardRuntime(int threads);
  ~ShardRuntime();

  // Opens the shard and binds the model; replaces what was loaded (all sequences dropped). A
  // device shard drops the old one first (its GPU memory), so a failed load leaves none.
  // With expert or tensor parallelism, `ep_group` (outliving the load) carries the MoE
  // all-to-all or the tensor-parallel all-gathers.
  Status Load(const ShardPlacement& placement, net::Communicator* ep_group = nullptr);
  bool loaded() const;
  // Drops the shard and every sequence: loaded() is false until the next Load.
  void Unload();
  // After a failed step: a device shard whose device a fault left unusable for this process
  // (CudaDeviceHealth) is marked lost: loaded() is false, so that Health says unloaded and the
  // coordinator takes the node out (its next LoadShard fails naming the device error) instead
  // of sending it steps that all fail. True when it marked it. Not concurrently with a step.
  bool MarkIfDeviceLost();
  // Sequences whose free is queued (StageExecutor::Free) give their KV budget back at once:
  // the coordinator starts the next sequence as soon as it has sent the free.
  void Uncharge(const std::vector<uint64_t>& seq_ids);
  // A copy: LoadShard replaces it while the data plane and the RPCs read it.
  ShardPlacement placement() const;
  // Loaded, as stage 0 (whose steps need no input): the executor asks on every wake.
  bool first_stage() const;
  const ModelConfig& config() const;   // needs loaded()
  uint64_t weight_bytes() const;

  Status StartSequence(uint64_t seq_id, int64_t max_context, const SamplerConfig& sampling);
  void FreeSequence(uint64_t seq_id);
  bool HasSequence(uint64_t seq_id) const;
  std::vector<uint64_t> sequence_ids() const;   // ascending
  void FreeAll();
  uint64_t kv_bytes() const;
  int active_sequences() const;

  // The step's manifold buffer, in the shard's memory (model/activations.h: on the device for a
  // device shard), made by Load; the executor keeps X in it from the embedding (or the receive)
  // through the layers to the head or the send. Needs loaded().
  Activations& activations() { return *x_; }

  // Every slice names a started sequence and brings 1.. tokens that fit its context, and a fork
  // names a held sequence that is not itself forked in the step into one with no position yet:
  // checked before X is sized for a step (a step's row count comes from the network).
  Status CheckSlices(std::span<const StepSlice> slices);
  // Every slice with fork_from takes its source's decode state (and, on the last stage, the
  // prompt its sampler saw), all before any row runs. After CheckSlices; a failure leaves the
  // forked sequences half copied (the step fails, and the coordinator resets the workers).
  Status Fork(std::span<const StepSlice> slices);
  // Stage 0: tokens of every slice -> X [T, hc, H] (x resized to T rows). Needs the embedding.
  Status Embed(std::span<const StepSlice> slices, Activations* x) const;
  // X [T, hc, H] (a pointer into activations()) through this shard's layers; each slice's
  // cache advances. An EP member with no slices still takes part in every layer's all-to-all
  // (with no rows). `step` tags them; they wait until `deadline` (the step's). The slices passed
  // CheckSlices (StageExecutor::Execute, before X was sized by them).
  Status Forward(uint64_t step, std::chrono::steady_clock::time_point deadline,
                 std::span<const StepSlice> slices, float* x);
  // Makes `step`'s EP exchanges return Cancelled promptly (0 = none): a reset must not wait
  // out the deadline of a step blocked on a member that will never answer. Any thread, but
  // not concurrently with Load.
  void AbortStep(uint64_t step);
  // Last stage: for every slice with `sample`, the logits of its last row of x -> one sampled
  // id + logprob (a prompt chunk with more to come gets none).
  Result<std::vector<SampledId>> Sample(std::span<const StepSlice> slices, const Activations& x);
  // Last stage, before Sample: the prompt slices of sequences started with prompt_logprobs
  // (nothing sampled yet) -> each row's score of the token after it: the slice's next token,
  // and for a chunk with more to come its next_token (required then), by ShardModel::ScoreNext
  // (on a device shard, where the logits are). A row whose logits ScoreToken refuses gives that
  // slice an error instead.
  Result<std::vector<PromptScores>> ScorePrompts(std::span<const StepSlice> slices, const Activations& x);

  int64_t row_floats() const;   // hc * H
  // EP: rows routed to each expert by this member's rows, and dispatch + combine bytes sent;
  // TP: the all-gather payload bytes sent (as dispatch_bytes). Since the process started,
  // over every shard it loaded.
  EpStats ep_stats() const;
  DeviceStepTraffic device_traffic() const;

 private:
  struct Sequence {
    std::unique_ptr<SequenceCache> cache;
    std::unique_ptr<Sampler> sampler;
    int64_t max_context = 0;
    int64_t position = 0;
    bool generated = false;   // a token was sampled: the tokens it is fed from then on are its own
    // What it charges the KV budget: its bytes at max_context (a CPU cache grows with its
    // positions, a device cache is allocated whole at the start).
    uint64_t kv_charge = 0;
    // cache->bytes() after its last change, written under mu_: the executor thread grows the
    // cache without mu_, so kv_bytes() (a Stats call's thread) must not read the cache itself.
    uint64_t cache_bytes = 0;
  };
  std::string device_lost_;   // MarkIfDeviceLost's error; empty while the device works
  Result<Sequence*> Find(uint64_t seq_id);
  void PublishCacheBytes(Sequence* seq);   // on the executor thread, after seq's cache changed
  // Under mu_: adds ep_'s or tp_'s counters to *to; RetireGroupStats keeps them before a load
  // or unload replaces the group, so ep_stats() counts from the process's start, as the
  // data-plane counters do (a coordinator's failover reloads every worker).
  void AddGroupStats(EpStats* to) const;
  void RetireGroupStats();
  EpStats retired_group_stats_;

  ThreadPool pool_;
  ShardPlacement placement_;
  std::unique_ptr<Checkpoint> ckpt_;
  std::unique_ptr<ShardModel> model_;
  std::unique_ptr<Activations> x_;          // activations(), in model_'s memory
  std::unique_ptr<Activations> last_rows_;  // Sample: each slice's last row, when not all of x
  std::unique_ptr<EpExpertExecutor> ep_;   // swapped under mu_ and groups_mu_
  std::unique_ptr<CommTpGroup> tp_;        // likewise
  // Held only while ep_/tp_ are swapped or aborted: AbortStep must not wait on mu_, which a
  // StartSequence holds while it allocates (a cudaFree there waits for a stuck NCCL kernel that
  // only the abort would end).
  std::mutex groups_mu_;
  mutable std::mutex mu_;   // guards seqs_ (the map, not the caches: one executor thread)
  std::map<uint64_t, Sequence> seqs_;
  std::atomic<uint64_t> device_tokens_{0};   // rows Forward ran on a device shard
};

}  // namespace fm
