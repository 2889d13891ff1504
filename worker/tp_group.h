// CommTpGroup: the collective of a tensor-parallel stage (model/tp.h) over the group's
// Communicator (TCP on the data plane, or NCCL). Each all-gather is one all-to-all of the same
// f32 buffer to every member, as a TP_GATHER frame tagged with the step and the gather's index
// within the step, so members that fall out of step fail naming the peer instead of mixing
// pieces. Every wait lasts until the step's deadline (SetStep; `timeout` a gather without one);
// a dead member is Unavailable naming it.
#pragma once
#include <atomic>
#include <chrono>
#include <cstdint>
#include <optional>
#include <vector>

#include "model/tp.h"
#include "net/communicator.h"

namespace fm {

class CommTpGroup : public TpGroup {
 public:
  // expert_begin[r]..expert_begin[r+1]: member r's routed experts (size + 1 entries).
  CommTpGroup(net::Communicator* comm, std::vector<int64_t> expert_begin, net::Millis timeout);

  int rank() const override { return comm_->rank(); }
  int size() const override { return comm_->size(); }
  int ExpertOwner(int32_t e) const override;
  Result<std::vector<std::vector<float>>> AllGather(std::span<const float> mine) override;
  bool device_buffers() const override { return comm_->device_buffers(); }
  Status AllGatherInPlace(float* all, const std::vector<int64_t>& counts) override;

  // The step whose layers run next: tags its gathers, counted from 0; each gather waits until
  // the step's deadline (without one, `timeout` a gather).
  void SetStep(uint64_t step,
               std::optional<std::chrono::steady_clock::time_point> deadline = std::nullopt) {
    step_ = step;
    deadline_ = deadline;
    next_tag_ = 0;
  }
  // Ends the gathers of `step` promptly (Communicator::AbortStep); any thread.
  void AbortStep(uint64_t step) { comm_->AbortStep(step); }
  // Payload bytes this member sent to the others since the load.
  uint64_t bytes_sent() const { return bytes_sent_.load(); }

 private:
  net::Communicator* comm_;
  std::vector<int64_t> expert_begin_;
  net::Millis timeout_;
  uint64_t step_ = 0;
  std::optional<std::chrono::steady_clock::time_point> deadline_;   // SetStep
  net::Millis Wait() const { return deadline_ ? net::Until(*deadline_) : timeout_; }
  uint32_t next_tag_ = 0;
  std::atomic<uint64_t> bytes_sent_{0};
};

}  // namespace fm
