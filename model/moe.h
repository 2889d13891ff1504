// The MoE block of one layer (MODEL.md "MoE"; HF DeepseekV4SparseMoeBlock): route every row
// (hash table or sqrtsoftplus + bias top-k), run the routed experts through an ExpertExecutor,
// add the shared expert. The local executor groups rows per expert so each expert's weights are
// read once per chunk of rows, and sums each row's k contributions in k order, so a row's result
// does not depend on what else is in the batch.
#pragma once
#include <cstdint>
#include <string>
#include <vector>

#include "common/status.h"
#include "common/tensor.h"
#include "common/thread_pool.h"
#include "model/checkpoint.h"
#include "model/config.h"
#include "model/forward.h"

namespace fm {

// expert(x) = W2 . swiglu_clamped(W1 . x, W3 . x)
struct ExpertWeights {
  QWeight w1, w2, w3;
  bool loaded = false;
};

struct MoeWeights {
  int64_t layer = 0;
  bool hash = false;
  QWeight gate;                    // [E, H]
  std::vector<float> bias;         // [E], score layers
  std::vector<int64_t> tid2eid;    // [V, k], hash layers
  std::vector<ExpertWeights> experts;  // [E]; loaded = in this shard's selection
  ExpertWeights shared;
};

// prefix "layers.N.ffn." or "mtp.0.ffn."; layer = N (or num_hidden_layers for mtp.0).
// Binds the routed experts of ckpt.selection().experts (all when empty).
Result<MoeWeights> BindMoe(const Checkpoint& ckpt, const std::string& prefix, int64_t layer);

// x [T, H] (normed MoE input), tokens [T] -> ids [T, k], weights [T, k].
Status RouteMoe(const ModelConfig& cfg, const MoeWeights& w, const float* x,
                const int32_t* tokens, int64_t T, int32_t* ids, float* weights, ThreadPool* pool);

// y [T, H] = expert(x [T, H]) for every row.
void RunExpertFfn(const ExpertWeights& e, float swiglu_limit, const float* x, int64_t T, float* y,
                  ThreadPool* pool);

// One (source row, destination row) pair of a routed expert: out[dst] = expert(in[src]).
struct ExpertRowPair {
  int64_t src, dst;
};

// For every expert e with pairs, out[dst] = expert_e(in[src]) over by_expert[e] (rows of H
// floats). All experts' W1 and W3 products run in one parallel pass, then all W2 products:
// three thread rendezvous per call instead of three per expert. Each row's bits do not depend
// on the other pairs (Matmul per row is fixed-order).
// Calls of RunExpertGroups in this process so far: a device shard under expert parallelism
// runs none (its experts are on the GPU), which the tests check.
int64_t CpuExpertGroupRuns();
void RunExpertGroups(const MoeWeights& w, float swiglu_limit,
                     const std::vector<std::vector<ExpertRowPair>>& by_expert, int64_t H,
                     const float* in, float* out, ThreadPool* pool);

// The MoE weights of absolute `layer` in `layers` (null where this shard has none);
// InvalidArgument naming the layer when it is not on this shard.
Result<const MoeWeights*> RoutedLayer(const std::vector<const MoeWeights*>& layers, int64_t layer);

// routed[t] = sum over j of weights[t, j] * contrib[t, j] for T rows ([T, k, H] contributions),
// in k order: the one combine every expert executor ends with, so that a row's bits do not
// depend on where its experts ran.
void CombineRouted(const float* contrib, const float* weights, int64_t T, int64_t k, int64_t H,
                   float* routed);

// Runs the experts this process holds; layer -> weights through `layers` (indexed by absolute
// layer, main then MTP; null where this shard has no such layer).
class LocalExpertExecutor : public ExpertExecutor {
 public:
  LocalExpertExecutor(const ModelConfig& cfg, std::vector<const MoeWeights*> layers,
                      ThreadPool* pool)
      : cfg_(cfg), layers_(std::move(layers)), pool_(pool) {}
  Status RunRouted(int64_t layer, const float* x, int64_t T, const int32_t* expert_ids,
                   const float* weights, float* routed) override;
  Status RunSlots(int64_t layer, const float* x, int64_t T, const int32_t* expert_ids,
                  float* slots) override;

 private:
  // Checks the ids, then the slots of rows [r0, r0 + rows) into slots [rows, k, H].
  Status Slots(const MoeWeights& w, const float* x, int64_t r0, int64_t rows,
               const int32_t* expert_ids, float* slots);

  const ModelConfig& cfg_;
  std::vector<const MoeWeights*> layers_;
  ThreadPool* pool_;
};

// The experts of `layers` (bound from the checkpoint, the loaded ones) on the CPU, for an
// expert-parallel executor (ExpertRunner).
class CpuExpertRunner : public ExpertRunner {
 public:
  CpuExpertRunner(const ModelConfig& cfg, std::vector<const MoeWeights*> layers,
                  ThreadPool* pool)
      : cfg_(cfg), layers_(std::move(layers)), pool_(pool) {}
  Status RunPairs(int64_t layer, const float* rows, int64_t n, const int32_t* pairs, int64_t p,
                  float* out) override;

 private:
  const ModelConfig& cfg_;
  std::vector<const MoeWeights*> layers_;
  ThreadPool* pool_;
};

}  // namespace fm
