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
#include <chrono>
#include <cstdint>
#include <mutex>
#include <optional>
#include <string>
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
  // rank r's experts (size+1 entries, last = n_routed_experts); max_rows: the most rows a member
  // runs in one round (a step's), so a peer announcing more than max_rows x k pairs is refused
  // before anything is sized by it.
  EpExpertExecutor(const ModelConfig& cfg, ExpertRunner* runner, net::Communicator* comm,
                   std::vector<int64_t> expert_begin, net::Millis timeout, int64_t max_rows);

  // The step whose layers run next (tags every frame so members cannot mix steps), and its
  // deadline: each exchange of the step waits until then (members' loads differ by design:
  // one may wait out another's long prefill); without one, `timeout` an exchange.
  void SetStep(uint64_t step,
               std::optional<std::chrono::steady_clock::time_point> deadline = std::nullopt) {
    step_ = step;
    deadline_ = deadline;
  }
  // Ends the exchanges of `step` promptly (Communicator::AbortStep); any thread.
  void AbortStep(uint64_t step) { comm_->AbortStep(step); }
  Status RunRouted(int64_t layer, const float* x, int64_t T, const int32_t* expert_ids,
                   const float* weights, float* routed) override;
  Status RunSlots(int64_t layer, const float* x, int64_t T, const int32_t* expert_ids,
                  float* slots) override;
  // x and slots in the device memory of the runner's DeviceRows: rows and outputs go GPU to GPU
  // on a communicator that takes device memory (NCCL), through one host copy each way otherwise.
  Status RunSlotsOnDevice(int64_t layer, const float* x, int64_t T, const int32_t* expert_ids,
                          float* slots) override;
  // The largest round count of the group this step (one all-to-all of a count).
  Result<int64_t> AgreeRounds(int64_t rounds) override;
  EpStats stats() const {   // a copy: the Stats RPC reads while steps run
    std::lock_guard<std::mutex> lock(stats_mu_);
    return stats_;
  }

 private:
  // Per destination rank: the distinct rows it needs (local row ids, ascending) and the pairs.
  struct Outgoing {
    std::vector<int32_t> row_ids;   // local rows sent, in order
    std::vector<int32_t> pairs;     // [p, 2]: (index into row_ids, expert)
    std::vector<int64_t> slots;     // [p]: row * k + j of the pair in the requester's layout
  };

  int Owner(int32_t expert) const;
  // Each row's k experts by owner (and counted in stats_).
  Result<std::vector<Outgoing>> Route(int64_t layer, int64_t T, const int32_t* expert_ids);
  // The dispatch's first exchange: the pairs each owner runs; returns every rank's (checked [p, 2]).
  Result<std::vector<net::Frame>> SendPairs(int64_t layer, const std::vector<Outgoing>& out);
  // Rank r's dispatch rows [n, H] f32, n <= its pairs.
  Status CheckRows(int64_t layer, int r, const net::FrameHeader& h, int64_t pairs) const;
  // Rank r's p pairs (over its n rows) appended as (row0 + row, expert), each checked to be a
  // row it sent and an expert of this member.
  Status AppendPairs(int64_t layer, int r, const int32_t* in, int64_t p, int64_t n, int64_t row0,
                     std::vector<int32_t>* pairs) const;
  // Rank r's combine: `pairs` outputs [pairs, H] f32.
  Status CheckCombine(int64_t layer, int r, const net::FrameHeader& h, size_t pairs) const;
  // Layer `layer`'s exchange `part` of payloads in device memory into device targets: as they
  // are when the communicator takes device memory, else through host copies by `dev`.
  Result<std::vector<net::FrameHeader>> ExchangeOnDevice(DeviceRows* dev, net::FrameKind kind,
                                                         int64_t layer, uint32_t part,
                                                         const std::vector<net::CommBuffer>& send,
                                                         const std::vector<net::RecvTarget>& into);
  void CountBytes(uint64_t dispatch, uint64_t combine) {
    std::lock_guard<std::mutex> lock(stats_mu_);
    stats_.dispatch_bytes += dispatch;
    stats_.combine_bytes += combine;
  }
  std::string What(int64_t layer) const {
    return "EP layer " + std::to_string(layer) + " step " + std::to_string(step_);
  }
  std::string Who(int r) const { return "rank " + std::to_string(r) + " (" + comm_->name(r) + ")"; }

  const ModelConfig& cfg_;
  ExpertRunner* runner_;
  net::Communicator* comm_;
  std::vector<int64_t> expert_begin_;
  net::Millis timeout_;
  int64_t max_pairs_;   // a peer's pairs in one round: max_rows x k
  uint64_t step_ = 0;
  std::optional<std::chrono::steady_clock::time_point> deadline_;   // SetStep
  net::Millis Wait() const { return deadline_ ? net::Until(*deadline_) : timeout_; }
  mutable std::mutex stats_mu_;
  EpStats stats_;
};

}  // namespace fm
