// EpExpertExecutor: the routed experts of one MoE step across an expert-parallel group
// (docs/architecture.md). Every member holds the dense parts and a contiguous range of experts; each
// runs its own sequences (data-parallel attention) and, per MoE layer:
//   dispatch  (all-to-all-v): to each owner, the rows that route to its experts [n, H] f32
//             and the (row, expert) pairs [p, 2] i32;
//   compute   every requested (row, expert), this member's and the others' in one call of its
//             ExpertRunner (the CPU kernels, or a device shard's GPU);
//   combine   (all-to-all-v): each pair's unweighted expert output [p, H] back to the row's
//             member, which sums the k contributions in k order (CombineRouted of model/moe.h).
// Returning unweighted outputs and summing at the row's owner in the local executor's order
// makes the result bit-identical to running every expert in one process (RunSlots hands the
// unweighted outputs to a device shard, which sums them as its own combine does). Every member
// must call RunRouted or RunSlots for the same layers of the same step, with T = 0 when it has
// no rows.
#pragma once
#include <cstdint>
#include <mutex>
#include <vector>

#include "model/moe.h"
#include "net/communicator.h"

namespace fm {

struct EpStats {
  uint64_t dispatch_bytes = 0, combine_bytes = 0;  // payload bytes this member sent
  std::vector<uint64_t> tokens_per_expert;         // rows routed to each expert (by any member)
};

class EpExpertExecutor : public ExpertExecutor {
 public:
  // runner: this member's experts (outliving the executor); expert_begin[r]..expert_begin[r+1]:
  // rank r's experts (size+1 entries, last = n_routed_experts).
  EpExpertExecutor(const ModelConfig& cfg, ExpertRunner* runner, net::Communicator* comm,
                   std::vector<int64_t> expert_begin, net::Millis timeout);

  // The step whose layers run next (tags every frame so members cannot mix steps).
  void SetStep(uint64_t step) { step_ = step; }
  // Ends the exchanges of `step` promptly (Communicator::AbortStep); any thread.
  void AbortStep(uint64_t step) { comm_->AbortStep(step); }
  Status RunRouted(int64_t layer, const float* x, int64_t T, const int32_t* expert_ids,
                   const float* weights, float* routed) override;
  Status RunSlots(int64_t layer, const float* x, int64_t T, const int32_t* expert_ids,
                  float* slots) override;
  // The largest round count of the group this step (one all-to-all of a count).
  Result<int64_t> AgreeRounds(int64_t rounds) override;
  EpStats stats() const {   // a copy: the Stats RPC reads while steps run
    std::lock_guard<std::mutex> lock(stats_mu_);
    return stats_;
  }

 private:
  int Owner(int32_t expert) const;

  const ModelConfig& cfg_;
  ExpertRunner* runner_;
  net::Communicator* comm_;
  std::vector<int64_t> expert_begin_;
  net::Millis timeout_;
  uint64_t step_ = 0;
  mutable std::mutex stats_mu_;
  EpStats stats_;
};

}  // namespace fm
