// Scheduler: continuous batching over the pipeline, on one scheduling thread that never waits
// on a worker. Requests wait in a bounded queue (a cancelled or expired one leaves it at once)
// and are admitted up to max_batch live sequences: StartSequence on every stage, async; a
// sequence steps once every stage holds it. Every live sequence that is not in flight joins
// the next micro-batch, and so does the next chunk of a prompt whose chunks are in flight; up
// to one micro-batch per stage is in flight, so every stage is busy. A
// micro-batch is one StepBatch to every worker with a deadline sized to the step; the last
// stage's answer carries one sampled id per sequence. Finished or cancelled sequences are
// freed on every worker. A failed step ends every live request with the error of the worker
// it belongs to (RpcFault, not error text) and resets every worker; nothing new starts until
// every reset is done. While a worker drains, the live requests finish and nothing new starts.
#pragma once
#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <deque>
#include <functional>
#include <map>
#include <set>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <thread>
#include <vector>

#include "common/status.h"
#include "coordinator/request_stream.h"
#include "coordinator/worker_set.h"
#include "flashmesh/v1/api.pb.h"
#include "model/tokenizer.h"

namespace fm {

struct GenerateParams {
  std::vector<int32_t> prompt;
  flashmesh::v1::Sampling sampling;   // resolved: seed set, greedy decided
  int64_t max_tokens = 0;
  std::vector<std::string> stop;
  std::vector<int32_t> stop_token_ids;
  int64_t min_tokens = 0;   // no stop of any kind before this many tokens
  bool ignore_eos = false;
  // The client's deadline: a request still queued then leaves the queue with DEADLINE_EXCEEDED.
  std::chrono::steady_clock::time_point deadline = std::chrono::steady_clock::time_point::max();
};

struct SchedulerLimits {
  int64_t max_batch = 16;
  int64_t max_queue = 64;
  int64_t max_context = 8192;
  // Rows of one micro-batch (vLLM's max_num_batched_tokens): a longer prompt goes in chunks of
  // this many tokens, one step each, and a step holds its decode rows plus prompt chunks up to
  // this (at least one chunk). Chunk edges depend on the prompt alone, never on other requests.
  int64_t max_step_tokens = 2048;
  // A step's deadline: step_floor + step_multiple x the estimated time of its rows and those of
  // the steps in flight before it (Scheduler::StepDeadline); before the first step has finished,
  // first_step for each 1024 rows or part.
  std::chrono::milliseconds step_floor{5000};
  double step_multiple = 8;
  std::chrono::milliseconds first_step{30000};
  std::chrono::milliseconds control_timeout{2000};   // StartSequence, FreeSequence, Reset
};

class Scheduler {
 public:
  // tokenizer may be null (no text pieces, no stop strings, no EOS detection).
  Scheduler(WorkerSet* workers, const Tokenizer* tokenizer, SchedulerLimits limits);
  ~Scheduler();

  // Queues a request; RESOURCE_EXHAUSTED when the queue is full, UNAVAILABLE when the
  // cluster cannot take new requests now.
  Result<std::shared_ptr<RequestStream>> Submit(GenerateParams params);
  // Queues every request or none (the n choices of one HTTP request: the queue must hold them
  // all at once, or they would be refused one by one as it fills). Requests of one prompt of 2
  // or more tokens share its prefill when the batch has room (docs/architecture.md "Shared
  // prompts"): a prefix sequence (one per EP member; not a request, but a batch slot while it
  // lives) runs all of the prompt but its last token once, and each request admitted while it
  // lives forks from it and runs that last token itself (StepItem.fork_from): on CPU shards the
  // tokens each would get alone, since a CPU prefill gives the same bits however it is chunked.
  Result<std::vector<std::shared_ptr<RequestStream>>> SubmitAll(std::vector<GenerateParams> params);
  int64_t max_queue() const { return limits_.max_queue; }
  int active() const { return active_count_; }
  int queued() const { return queued_count_; }
  // Ok, or why the scheduler is not healthy: a step overdue (running past half of its
  // deadline), workers being reset after a failure, or a worker still holding a sequence no
  // request owns at two heartbeats in a row.
  Status Health() const;
  // Called with each StepBatch round trip (node name, seconds) from the scheduling thread;
  // set it before the first Submit.
  void SetStepObserver(std::function<void(const std::string& node, double seconds)> fn) {
    step_observer_ = std::move(fn);
  }

 private:
  using Clock = std::chrono::steady_clock;
  // The prompt the requests of one SubmitAll share; each of them holds it, so it expires with
  // the last of them.
  struct SharedPrompt {
    GenerateParams prefix;    // the prefix sequence's: the prompt but its last token
    // Per EP member (0 without EP; a fork lives where its prefix does): the prefix sequence
    // while it lives, and the members where one was started or could not be (no slot).
    std::map<int, uint64_t> seq_by_member;
    std::set<int> tried;
    // Alive while one of its requests is still queued (each queued one holds it: the queue
    // drops requests on other threads too).
    std::weak_ptr<const void> queued;
  };
  struct Request {
    uint64_t id = 0;
    GenerateParams params;
    std::shared_ptr<RequestStream> stream;
    std::optional<StreamDecoder> decoder;
    std::string text;              // decoded so far (for stop strings)
    int64_t generated = 0;
    std::vector<int32_t> next;     // tokens of its next step
    // Steps holding it: one, or several chunks of its prompt (a pipeline runs them one stage
    // apart, in step order, so each stage has the chunk before in its KV).
    int in_flight = 0;
    int member = 0;                // EP rank whose workers hold its KV (0 without EP)
    int starting = 0;              // StartSequence calls not answered yet
    std::vector<int> started;      // workers that hold it
    Clock::time_point started_at;  // when the last StartSequence answered
    Status start_error;            // the first failed StartSequence
    // A request of a shared prompt (whether it waits to fork: ForkSource).
    std::shared_ptr<SharedPrompt> shared;
    std::shared_ptr<const void> queued_mark;   // SharedPrompt.queued, until it is admitted
    // The prefix sequence of a shared prompt (no client reads its stream): the requests that
    // wait to fork from it, the steps in flight that do, and who still shares it at all.
    bool prefix = false;
    std::set<uint64_t> waiting;
    int forks_in_flight = 0;
    std::weak_ptr<SharedPrompt> sharers;
    // prompt_logprobs: the scores of prompt positions 1.. as the chunks' steps bring them (in
    // any order; each position is due in one step only), how many are in, and the first token
    // when its step completes before all of them.
    std::vector<flashmesh::v1::PromptToken> prompt_scores;
    size_t scored = 0;
    bool prompt_sent = false;
    std::optional<flashmesh::v1::SampledToken> held;
    // A chunk's rows could not be scored: no more chunks are sent, and the request ends with
    // this once its steps in flight are back (its KV is freed only then).
    Status score_error;
    bool ScoresPrompt() const { return params.sampling.has_prompt_logprobs(); }
  };
  // One micro-batch's RPCs to every worker.
  struct StepCall {
    uint64_t step_id = 0;
    std::vector<uint64_t> seq_ids;    // every sequence of the step
    std::vector<uint64_t> chunk_ids;  // those sent a prompt chunk with more to come: no token
    std::vector<uint64_t> fork_sources;   // the prefix sequence of each fork in the step
    // prompt_logprobs: per sequence, the prompt positions [first, first + count) it must score.
    std::map<uint64_t, std::pair<int64_t, int64_t>> scores_due;
    size_t rows = 0;
    // Its rows and those of the steps in flight before it at its launch: what its time from
    // launch to completion covers, so what it is measured against (StepDeadline).
    size_t rows_to_run = 0;
    Clock::time_point launched, deadline;
    std::vector<RpcResult> results;                        // per worker
    std::vector<flashmesh::v1::StepBatchResponse> responses;
    std::vector<char> done;
    std::vector<std::function<void()>> cancels;   // dropped once done: they may hold this call
    int remaining = 0;
    bool failed = false;
    Clock::time_point settle_by;   // failed: when to complete it without the missing answers
    // Cancels what still runs and drops the handles.
    void Cancel() {
      for (const auto& c : cancels) c();
      cancels.clear();
    }
  };

  // The scheduling thread's wake-up and its inbox of work from other threads, shared with the
  // streams' cancel hooks and the cluster's listeners (which may outlive the scheduler); `mu`
  // also guards incoming_.
  struct Signal {
    std::mutex mu;
    std::condition_variable cv;
    bool wake = false, stop = false;
    std::vector<std::function<void()>> posted;   // run on the scheduling thread
    void Post(std::function<void()> fn);
  };

  void Loop();
  // Runs `fn` on the scheduling thread (from an RPC callback).
  void Post(std::function<void()> fn);
  // An RPC whose callback touches this scheduler is on its way: its id for Untrack and Keep.
  uint64_t Track();
  void Untrack(uint64_t call);   // its callback is done with it
  // The canceller of a call still on its way (none once answered): the destructor cancels them,
  // or a FreeSequence queued behind a long step would hold the shutdown until its deadline.
  void Keep(uint64_t call, std::function<void()> cancel);
  Clock::time_point NextWake();
  void Tick();
  // Under signal_->mu: cancelled and expired requests leave the queue, each told why.
  void DropDeadQueuedLocked(Clock::time_point now);
  void FailQueued(const Status& why);
  void SendResets();
  void Admit();
  // The requests of one SubmitAll with one prompt (2 or more tokens) and one repetition penalty
  // share it: each holds the same SharedPrompt.
  void SharePrompt(const std::vector<std::unique_ptr<Request>>& requests);
  // Makes `owned` live and starts its sequence on its member's workers (every stage).
  Request* StartRequest(std::unique_ptr<Request> owned, int member);
  // The live prefix sequence on `member` that a shared prompt's request at admission forks
  // from, or null. The first of them placed on a member starts one there when the batch has
  // slots for the prefix and two requests, the prefix and r fit the member's share of the batch
  // and another still queued would be placed there too in this pass (`load`: the live sequences
  // per member, before r).
  Request* PrefixFor(const Request& r, int member, std::vector<int> load);
  // The live prefix sequence of `shared` on `member`, or null.
  Request* LivePrefix(const SharedPrompt& shared, int member);
  // The prefix sequence r waits to fork from (its `waiting` lists r), or null: r prefills alone.
  Request* ForkSource(const Request& r);
  void CountActive();   // active(): the live sequences of requests (prefix sequences are not)
  // Frees every prefix sequence that no step in flight uses and no request waits for, once its
  // prompt is sent and none of its requests is still queued (or every one of them is gone).
  void FreeIdlePrefixes();
  // Bookkeeping of a request leaving live_: a fork it waited for, or, for a prefix sequence,
  // its member's entry (its waiting requests prefill alone now).
  void Leave(Request* r);
  void OnStarted(uint64_t id, int worker, const RpcResult& r);
  void Launch();
  Clock::time_point StepDeadline(Clock::time_point now, size_t rows) const;
  void OnStepDone(const std::shared_ptr<StepCall>& call, int worker, RpcResult r,
                  flashmesh::v1::StepBatchResponse resp, double seconds);
  void Complete(StepCall* call);
  Status Attribute(const StepCall& call);
  void ApplyToken(Request* r, const flashmesh::v1::SampledToken& t);
  // A worker's alternatives of `t` (at most `asked`), each with its bytes, into `out`.
  void AddAlternatives(const flashmesh::v1::SampledToken& t, int asked,
                       google::protobuf::RepeatedPtrField<flashmesh::v1::TopLogprob>* out) const;
  // The last stage's prompt scores of `call`, checked against what it was due; false when the
  // step failed for them (FailAll done).
  bool TakePromptScores(StepCall* call);
  // Applies r's held first token once every score of its prompt is here, after them (the
  // PromptLogprobs event).
  void ReleaseFirstToken(Request* r);
  // r's prompt could not be scored: ends it (freed) once no step of it is in flight; true
  // when r is failed that way (ended or waiting to be).
  bool EndIfScoringFailed(Request* r);
  // stop_offset: where stop_string starts in the request's text.
  void Finish(Request* r, flashmesh::v1::FinishReason reason, const std::string& stop_string = "",
              int64_t stop_offset = 0);
  void End(Request* r, Status why);   // by value: `why` is often r's own start_error
  // Ends every live request with `why` and resets every worker; failed_step_deadline: the
  // deadline of the step whose failure this is (the workers may still compute it).
  void FailAll(const Status& why, Clock::time_point failed_step_deadline = {});
  void FreeOnWorkers(const std::vector<int>& workers, const std::vector<uint64_t>& ids);
  // A worker's heartbeat: frees what it holds that no request owns, ends the requests whose
  // sequence it lost.
  void Reconcile(int worker, std::vector<uint64_t> held, Clock::time_point asked);
  int num_in_flight() const { return static_cast<int>(in_flight_.size()); }

  WorkerSet* workers_;
  const Tokenizer* tokenizer_;
  SchedulerLimits limits_;

  std::shared_ptr<Signal> signal_;
  std::deque<std::unique_ptr<Request>> incoming_;

  // Owned by the scheduling thread.
  std::map<uint64_t, std::unique_ptr<Request>> live_;
  std::map<uint64_t, std::shared_ptr<StepCall>> in_flight_;
  uint64_t next_request_id_ = 1, next_step_id_ = 1;
  uint64_t last_step_id_ = 0;          // the step launched last; 0 once none is in flight
  int starts_outstanding_ = 0;         // StartSequence calls not answered, live or abandoned
  // The latest deadline of the steps the last FailAll cancelled: a worker may still compute them
  // (compute is not cut short) and takes its Reset after, so the Resets have until then too.
  // Cleared once every worker acknowledged its Reset.
  Clock::time_point busy_until_{};
  std::vector<char> needs_reset_;      // per worker: holds sequences of a failed schedule
  std::vector<char> resetting_;        // per worker: its Reset is in flight
  struct StepTime {
    size_t rows = 0;
    double seconds = 0;
  };
  std::deque<StepTime> recent_steps_;       // the last steps, newest last
  std::map<int, StepTime> latest_by_size_;  // the latest step of each size class [2^k, 2^(k+1))
  std::vector<std::vector<uint64_t>> unowned_;   // per worker: held, owned by no request, last beat
  // Per worker: the sequences a FreeSequence in flight frees (with how many such calls). A worker
  // frees between steps, so behind a long step it still lists them: neither stray nor freed again.
  std::vector<std::map<uint64_t, int>> freeing_;

  mutable std::mutex health_mu_;       // guards the three below (read by Health())
  std::map<uint64_t, std::pair<Clock::time_point, Clock::time_point>> step_times_;  // launch, overdue at
  bool resetting_any_ = false;
  std::vector<std::string> stray_;     // per worker: why it holds sequences a free did not remove

  std::atomic<int> active_count_{0}, queued_count_{0};
  std::mutex rpc_mu_;                  // guards the three below
  std::condition_variable rpc_cv_;
  uint64_t last_rpc_ = 0;
  std::set<uint64_t> outstanding_rpcs_;
  std::map<uint64_t, std::function<void()>> cancels_;   // start, free and reset calls
  std::function<void(const std::string&, double)> step_observer_;
  std::thread thread_;
};

}  // namespace fm
