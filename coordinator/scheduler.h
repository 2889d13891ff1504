// Scheduler: continuous batching over the pipeline. Requests wait in a bounded queue, are
// admitted up to max_batch live sequences (StartSequence on every stage), and every live
// sequence that is not in flight joins the next micro-batch; up to one micro-batch per stage
// is in flight, so every stage is busy. A micro-batch is one StepBatch to every stage; the
// last stage's answer carries one sampled id per sequence. Finished or cancelled sequences
// are freed on every worker. A worker failure ends every live request with UNAVAILABLE
// naming the node and resets the other workers.
#pragma once
#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <deque>
#include <functional>
#include <map>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <thread>
#include <vector>

#include "common/status.h"
#include "coordinator/cluster.h"
#include "flashmesh/v1/api.pb.h"
#include "model/tokenizer.h"

namespace fm {

struct GenerateParams {
  std::vector<int32_t> prompt;
  flashmesh::v1::Sampling sampling;   // resolved: seed set, greedy decided
  int64_t max_tokens = 0;
  std::vector<std::string> stop;
  bool ignore_eos = false;
};

// One request's stream of events, filled by the scheduler, drained by the API handler.
class RequestStream {
 public:
  struct Event {
    enum Kind { kToken, kFinish, kError } kind = kToken;
    flashmesh::v1::TokenEvent token;
    flashmesh::v1::Finish finish;
    Status error;
  };
  // Waits up to `timeout` for the next event.
  bool Pop(Event* ev, std::chrono::milliseconds timeout);
  void Push(Event ev);
  void Cancel() { cancelled_ = true; }
  bool cancelled() const { return cancelled_; }

 private:
  std::mutex mu_;
  std::condition_variable cv_;
  std::deque<Event> events_;
  std::atomic<bool> cancelled_{false};
};

struct SchedulerLimits {
  int64_t max_batch = 16;
  int64_t max_queue = 64;
  int64_t max_context = 8192;
};

class Scheduler {
 public:
  // tokenizer may be null (no text pieces, no stop strings, no EOS detection).
  Scheduler(Cluster* cluster, const Tokenizer* tokenizer, SchedulerLimits limits);
  ~Scheduler();

  // Queues a request; RESOURCE_EXHAUSTED when the queue is full, UNAVAILABLE when the
  // cluster cannot generate now.
  Result<std::shared_ptr<RequestStream>> Submit(GenerateParams params);
  int active() const { return active_count_; }
  int queued() const { return queued_count_; }
  // Called with each StepBatch round trip (node name, seconds) from gRPC's callback threads;
  // set it before the first Submit.
  void SetStepObserver(std::function<void(const std::string& node, double seconds)> fn) {
    step_observer_ = std::move(fn);
  }

 private:
  struct Request {
    uint64_t id = 0;
    GenerateParams params;
    std::shared_ptr<RequestStream> stream;
    std::optional<StreamDecoder> decoder;
    std::string text;              // decoded so far (for stop strings)
    int64_t generated = 0;
    std::vector<int32_t> next;     // tokens of its next step
    bool in_flight = false;
    int member = 0;                // EP rank whose workers hold its KV (0 without EP)
  };
  struct StepCall;   // one micro-batch's RPCs to every stage

  void Loop();
  void Admit();
  void Launch();
  void Complete(StepCall* call);
  void ApplyToken(Request* r, int32_t id, float logprob);
  void Finish(Request* r, flashmesh::v1::FinishReason reason, const std::string& stop_string);
  void FailAll(const Status& why);
  void FreeOnWorkers(const std::vector<uint64_t>& ids);
  Status Attribute(const StepCall& call) const;
  int num_in_flight() const { return static_cast<int>(in_flight_.size()); }

  Cluster* cluster_;
  const Tokenizer* tokenizer_;
  SchedulerLimits limits_;

  std::mutex mu_;                     // guards incoming_, done_calls_, wake_
  std::condition_variable cv_;
  std::deque<std::unique_ptr<Request>> incoming_;
  std::vector<StepCall*> done_calls_;
  bool stop_ = false;

  // Owned by the scheduler thread.
  std::map<uint64_t, std::unique_ptr<Request>> live_;
  std::map<uint64_t, std::shared_ptr<StepCall>> in_flight_;
  uint64_t next_request_id_ = 1, next_step_id_ = 1;
  uint64_t last_step_id_ = 0;         // the step launched last; 0 after a reset
  std::atomic<int> active_count_{0}, queued_count_{0};
  std::atomic<int> outstanding_rpcs_{0};
  std::function<void(const std::string&, double)> step_observer_;
  std::thread thread_;
};

}  // namespace fm
