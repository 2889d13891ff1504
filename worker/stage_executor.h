// StageExecutor: runs this worker's stage for each micro-batch, one at a time, in exactly the
// order the coordinator sent them (each step names the step before it), so that the members
// of an expert-parallel group, whose MoE exchanges pair up step by step, never disagree. Stage 0 embeds the tokens; a later stage takes the
// previous stage's manifold X [T, hc, H] from its inbox (filled by the data plane). After the
// layers, a stage that is not the last sends X to the next stage; the last one samples.
// Several micro-batches can be in flight: while stage s runs step k, stage s-1 runs step k+1.
#pragma once
#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <deque>
#include <functional>
#include <map>
#include <memory>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

#include "common/status.h"
#include "model/activations.h"
#include "net/frame.h"
#include "worker/shard_runtime.h"

namespace fm {

// Sends one micro-batch's manifold to the next stage (the data plane, worker/data_plane.h).
class ActivationSink {
 public:
  using Clock = std::chrono::steady_clock;
  virtual ~ActivationSink() = default;
  // x: [x.rows(), hc*H], in host or device memory (x.device()), sent by `deadline` (the step's:
  // on a rendezvous link the send waits for the next stage to finish its current step).
  virtual Status Send(uint64_t step_id, Clock::time_point deadline, const Activations& x) = 0;
  // Ends a Send of step `step` that waits on the next stage (a reset); callable from any thread.
  virtual void AbortStep(uint64_t /*step*/) {}
};

// Where a stage pulls its input from when the previous stage's manifold is not pushed into the
// inbox (a rendezvous link such as NCCL's: the receiver posts the receive of its step).
class ActivationSource {
 public:
  using Clock = std::chrono::steady_clock;
  virtual ~ActivationSource() = default;
  // The previous stage's manifold of step_id into x (resized to `rows`), by `deadline`.
  virtual Status Receive(uint64_t step_id, int64_t rows, Clock::time_point deadline,
                         Activations* x) = 0;
  virtual void AbortStep(uint64_t /*step*/) {}
};

// An ACTIVATION frame's payload (f32: copied as it is; bf16: widened on the host first) into
// the first x->rows() rows of x; the frame is [x->rows(), x->row_floats()] (checked before).
Status CopyPayloadIn(const net::Frame& f, Activations* x);

class StageExecutor {
 public:
  using Clock = std::chrono::steady_clock;

  explicit StageExecutor(ShardRuntime* runtime);
  ~StageExecutor();

  // Where finished manifolds go; null on the last stage. Call with no step in flight.
  void SetNext(std::unique_ptr<ActivationSink> next);
  // Where a later stage pulls its input from; null (the default): from the inbox (Receive).
  void SetPrev(std::unique_ptr<ActivationSource> prev);

  // Runs one micro-batch through this stage once step `prev_step_id` (0: none since the last
  // reset) has run and the input is here; blocks until done or `deadline`. On the last stage
  // `sampled` gets one id per slice, in slice order, and `prompt` (when given) the scores of
  // the prompt slices that asked for them (ShardRuntime::ScorePrompts). `slices` may be empty
  // (EP member).
  Status RunStep(uint64_t step_id, uint64_t prev_step_id, std::vector<StepSlice> slices,
                 Clock::time_point deadline, std::vector<SampledId>* sampled,
                 std::vector<PromptScores>* prompt = nullptr);
  // The previous stage's ACTIVATION frame (header.step_id; [rows, hc*H] f32 or bf16), kept
  // as received until its step runs, then copied into the shard's activations once.
  Status Receive(net::Frame activation);
  // Step `step_id`'s input was refused (junk, or no room): the step fails now with `why` if it
  // waits, or as soon as RunStep queues it (its StepBatch can come after the frame), instead of
  // at its deadline. Later steps wait on it, until the coordinator's Reset.
  void FailWaitingStep(uint64_t step_id, const Status& why);

  // Frees sequences between steps (never under a running step): the executor's thread frees
  // them before it starts its next step, so a busy stage delays a free by one step at most.
  // Returns once they are freed (or the executor stops).
  void Free(const std::vector<uint64_t>& seq_ids);
  // Runs `swap` (LoadShard replacing or dropping the shard) with no step computing: a step
  // that becomes ready meanwhile starts after it. Drops the inbox (frames of the old shard).
  Status Exclusive(const std::function<Status()>& swap);
  // Fails every waiting step, aborts the running one's EP exchanges, waits for it to end,
  // then drops the inbox and every sequence.
  void Reset();
  // Reset, and every later RunStep fails at once (the worker is shutting down).
  void Stop();

  double tokens_per_second() const;
  uint64_t rows_processed() const;

 private:
  struct Step {
    uint64_t id = 0, prev = 0;
    Clock::time_point deadline;
    std::vector<StepSlice> slices;
    bool running = false, done = false;
    Status status;
    std::vector<SampledId> sampled;
    std::vector<PromptScores> prompt;
  };
  void Loop();
  void ApplyFreesLocked(std::unique_lock<std::mutex>& lock);
  Step* NextReadyLocked();
  void FailWaitingLocked();
  Status Execute(Step* step, const net::Frame* received);

  ShardRuntime* runtime_;
  std::unique_ptr<ActivationSink> next_;    // set under exec_mu_ and mu_
  std::unique_ptr<ActivationSource> prev_;  // likewise
  mutable std::mutex mu_;
  std::condition_variable cv_;        // new step, new activation, step done, frees, stop
  std::map<uint64_t, Step*> waiting_; // not yet started, by step id
  // At most kMaxInboxSteps manifolds wait (far more than the steps in flight), of at most
  // max_waiting_steps largest steps' bytes: bounds what a flooding previous stage can make this
  // one hold.
  static constexpr size_t kMaxInboxSteps = 64;
  std::map<uint64_t, net::Frame> inbox_;
  // Steps whose input was refused before RunStep queued them, and why (FailWaitingStep); the
  // newest kMaxInboxSteps, dropped by Reset and by a load.
  std::map<uint64_t, Status> refused_;
  std::mutex exec_mu_;                // held while a step computes
  std::deque<std::pair<Clock::time_point, int64_t>> recent_rows_;
  uint64_t rows_total_ = 0;
  uint64_t last_run_ = 0;             // id of the last step started; 0 after a reset
  // Free(): ids the loop frees before its next step; frees asked / done so far (tickets).
  std::vector<uint64_t> pending_frees_;
  uint64_t frees_asked_ = 0, frees_done_ = 0;
  bool stop_ = false;
  bool stopped_ = false;              // Stop(): no step runs any more
  std::thread thread_;
};

}  // namespace fm
