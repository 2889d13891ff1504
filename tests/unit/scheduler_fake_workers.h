// The scheduler tests' fake cluster (test_scheduler.cpp, test_scheduler_failures.cpp): a
// WorkerSet with scripted workers, and helpers that collect a request's events.
#pragma once
#include <algorithm>
#include <chrono>
#include <functional>
#include <map>
#include <mutex>
#include <set>
#include <string>
#include <thread>
#include <vector>

#include "coordinator/scheduler.h"

namespace fm::scheduler_test {

using namespace std::chrono_literals;
using Clock = std::chrono::steady_clock;

// Workers w0.. (stage-major); the last stage "samples" each item's last token + 1, and a fork
// whose source the worker does not hold fails the step. A sequence started with
// prompt_logprobs gets, until its first token, each prompt token after the first scored
// -position with one alternative (token + 100 at -0.5). Every RPC
// answers at once unless its kind is held: then it waits for Release (or, a step, for its
// cancel). step_fault, when set, answers a step instead of the worker.
class FakeWorkers final : public WorkerSet {
 public:
  struct Step {
    int worker;
    flashmesh::v1::StepBatchRequest req;
    Clock::duration budget;   // deadline - the time it was sent
  };

  // ep > 1: each stage is an EP group of ep workers (w(stage * ep + rank)).
  explicit FakeWorkers(int stages, int ep = 1) : stages_(stages), ep_(ep), down_(stages * ep, false) {
    for (int i = 0; i < stages * ep; ++i) {
      std::string name = "w", control = "fake:";
      name += std::to_string(i);
      control += std::to_string(i);
      infos_.push_back({name, control, i % ep, i / ep == stages - 1});
    }
  }

  int num_stages() const override { return stages_; }
  uint64_t term() const override { return term_; }
  uint64_t term_ = 1765000000000;   // a coordinator's start time in ms (2025-12-06)
  int expert_parallel() const override { return ep_; }
  const std::vector<WorkerInfo>& workers() const override { return infos_; }
  Status Ready() const override {
    FM_RETURN_IF_ERROR(Running());
    std::lock_guard<std::mutex> lock(mu_);
    if (draining_ >= 0) return Unavailable("node w" + std::to_string(draining_) + " is draining");
    return Status::Ok();
  }
  Status Running() const override {
    std::lock_guard<std::mutex> lock(mu_);
    if (!stepped_down_.empty()) return Unavailable(stepped_down_);
    for (int i = 0; i < static_cast<int>(down_.size()); ++i) {
      if (down_[i]) return Unavailable("node w" + std::to_string(i) + " is down");
      if (loading_.count(i)) return Unavailable("node w" + std::to_string(i) + " is loading");
    }
    return Status::Ok();
  }
  bool serving(int w) const override {
    std::lock_guard<std::mutex> lock(mu_);
    return !down_[w] && !loading_.count(w);
  }
  void MarkDown(int w, const std::string& why) override {
    {
      std::lock_guard<std::mutex> lock(mu_);
      if (!stepped_down_.empty()) return;   // as Cluster::MarkDown
      down_[w] = true;
      marked_down_.push_back(w);
    }
    Changed();
  }
  void OnChange(std::function<void()> fn) override { listener_ = std::move(fn); }
  void OnHeld(std::function<void(int, std::vector<uint64_t>, Deadline)> fn) override {
    held_listener_ = std::move(fn);
  }

  std::function<void()> StartSequence(int w, const flashmesh::v1::StartSequenceRequest& req, Deadline,
                                      Done<flashmesh::v1::StartSequenceResponse> done) override {
    {
      std::lock_guard<std::mutex> lock(mu_);
      if (!start_refusal_.ok()) {
        const Status why = start_refusal_;
        done({why, start_refusal_fault_}, {});
        return [] {};
      }
    }
    return Cancellable<flashmesh::v1::StartSequenceResponse>(
        "start", w, [this, w, id = req.seq_id(), context = req.max_context(),
                     scores = req.sampling().has_prompt_logprobs()] {
          std::lock_guard<std::mutex> lock(mu_);
          held_[w].insert(id);
          started_context_[id] = context;
          if (scores) scored_.insert(id);
          max_live_ = std::max(max_live_, held_[w].size());
        }, done);
  }
  std::function<void()> FreeSequence(int w, const flashmesh::v1::FreeSequenceRequest& req,
                                     Deadline deadline,
                                     Done<flashmesh::v1::FreeSequenceResponse> done) override {
    {
      std::lock_guard<std::mutex> lock(mu_);
      free_budgets_.push_back(deadline - Clock::now());
    }
    return Cancellable<flashmesh::v1::FreeSequenceResponse>("free", w, [this, w, req] {
      std::lock_guard<std::mutex> lock(mu_);
      if (!frees_ignored_)
        for (uint64_t id : req.seq_ids()) held_[w].erase(id);
    }, done);
  }
  std::function<void()> Reset(int w, Deadline deadline, Done<flashmesh::v1::ResetResponse> done) override {
    {
      std::lock_guard<std::mutex> lock(mu_);
      reset_budgets_.push_back(deadline - Clock::now());
    }
    return Cancellable<flashmesh::v1::ResetResponse>("reset", w, [this, w] {
      std::lock_guard<std::mutex> lock(mu_);
      held_[w].clear();
    }, done);
  }
  std::function<void()> StepBatch(int w, const flashmesh::v1::StepBatchRequest& req, Deadline deadline,
                                  Done<flashmesh::v1::StepBatchResponse> done) override {
    auto once = std::make_shared<std::once_flag>();
    const flashmesh::v1::StepBatchResponse scores = infos_[w].head ? Scores(req) : flashmesh::v1::StepBatchResponse();
    auto answer = [this, w, req, done, once, scores] {
      std::call_once(*once, [&] {
        RpcResult r;
        {
          std::lock_guard<std::mutex> lock(mu_);
          if (step_fault_) r = step_fault_(w, req);
          // As a worker does (ShardRuntime::CheckSlices): a fork needs its source held, when the
          // step runs (here: when it is answered).
          for (const auto& item : req.items())
            if (r.ok() && item.fork_from() != 0 && !held_[w].count(item.fork_from()))
              r = {InvalidArgument("sequence " + std::to_string(item.fork_from()) + ", which sequence " +
                                   std::to_string(item.seq_id()) + " is forked from, is not held here"),
                   RpcFault::kWorker};
          // As Cluster does (cluster_rpc.cpp): a worker that follows a newer coordinator.
          if (r.fault == RpcFault::kSuperseded)
            stepped_down_ = "this coordinator stepped down: " + r.status.message();
        }
        flashmesh::v1::StepBatchResponse resp;
        if (r.ok()) resp = scores;
        if (r.ok() && infos_[w].head)
          for (const auto& item : req.items()) {
            if (item.prefill_continues()) continue;   // a prompt chunk: nothing sampled
            auto* t = resp.add_tokens();
            t->set_seq_id(item.seq_id());
            t->set_id(item.tokens(item.tokens_size() - 1) + 1);
          }
        if (r.ok() && infos_[w].head && token_rewrite_) {
          std::lock_guard<std::mutex> lock(mu_);
          token_rewrite_(&resp);
        }
        done(r, resp);
      });
    };
    {
      std::lock_guard<std::mutex> lock(mu_);
      steps_.push_back({w, req, deadline - Clock::now()});
    }
    Run("step", w, answer);
    return [once, done] {
      std::call_once(*once, [&] { done({Cancelled("cancelled"), RpcFault::kUnreachable}, {}); });
    };
  }

  // Test controls.
  // A heartbeat of worker w: what it holds now, in increasing order or (`descending`) not.
  void Heartbeat(int w, bool descending = false) {
    const auto asked = Clock::now();
    std::vector<uint64_t> ids;
    {
      std::lock_guard<std::mutex> lock(mu_);
      ids.assign(held_[w].begin(), held_[w].end());
    }
    if (descending) std::reverse(ids.begin(), ids.end());
    held_listener_(w, ids, asked);
  }
  void AddHeld(int w, uint64_t id) {
    std::lock_guard<std::mutex> lock(mu_);
    held_[w].insert(id);
  }
  void DropHeld(int w, uint64_t id) {
    std::lock_guard<std::mutex> lock(mu_);
    held_[w].erase(id);
  }
  void Hold(const std::string& kind) {
    std::lock_guard<std::mutex> lock(mu_);
    holding_.insert(kind);
  }
  // Stops holding `kind` and answers every held call of it.
  void Release(const std::string& kind) {
    std::vector<std::function<void()>> calls;
    {
      std::lock_guard<std::mutex> lock(mu_);
      holding_.erase(kind);
      calls.swap(held_calls_[kind]);
    }
    for (auto& c : calls) c();
  }
  // Answers the n oldest held calls of `kind` (a step's calls, one a worker, go together) and
  // keeps holding it: steps served one after another, as a pipeline's last stage ends them.
  void ReleaseOldest(const std::string& kind, size_t n) {
    std::vector<std::function<void()>> calls;
    {
      std::lock_guard<std::mutex> lock(mu_);
      auto& held = held_calls_[kind];
      const size_t k = std::min(n, held.size());
      calls.assign(std::make_move_iterator(held.begin()), std::make_move_iterator(held.begin() + k));
      held.erase(held.begin(), held.begin() + static_cast<std::ptrdiff_t>(k));
    }
    for (auto& c : calls) c();
  }
  // Answers the n newest held calls of `kind` (a later step's before an earlier one's).
  void ReleaseNewest(const std::string& kind, size_t n) {
    std::vector<std::function<void()>> calls;
    {
      std::lock_guard<std::mutex> lock(mu_);
      auto& held = held_calls_[kind];
      const size_t k = std::min(n, held.size());
      calls.assign(std::make_move_iterator(held.end() - static_cast<std::ptrdiff_t>(k)),
                   std::make_move_iterator(held.end()));
      held.erase(held.end() - static_cast<std::ptrdiff_t>(k), held.end());
    }
    for (auto& c : calls) c();
  }
  size_t HeldCalls(const std::string& kind) {
    std::lock_guard<std::mutex> lock(mu_);
    return held_calls_[kind].size();
  }
  void SetStepFault(std::function<RpcResult(int, const flashmesh::v1::StepBatchRequest&)> f) {
    std::lock_guard<std::mutex> lock(mu_);
    step_fault_ = std::move(f);
  }
  // Rewrites the head's answers (a worker that sends wrong sampled tokens).
  void SetTokenRewrite(std::function<void(flashmesh::v1::StepBatchResponse*)> f) {
    std::lock_guard<std::mutex> lock(mu_);
    token_rewrite_ = std::move(f);
  }
  // Every StartSequence is refused with `why` (a worker's KV budget, a drain), Ok: none;
  // `fault` says whose error it is (kTimedOut: no answer by the deadline).
  void RefuseStarts(Status why, RpcFault fault = RpcFault::kWorker) {
    std::lock_guard<std::mutex> lock(mu_);
    start_refusal_ = std::move(why);
    start_refusal_fault_ = fault;
  }
  // Frees answer OK but free nothing (a worker that keeps what it was told to drop).
  void IgnoreFrees(bool ignore) {
    std::lock_guard<std::mutex> lock(mu_);
    frees_ignored_ = ignore;
  }
  void SetDown(int w, bool down) {
    {
      std::lock_guard<std::mutex> lock(mu_);
      down_[w] = down;
    }
    Changed();
  }
  // Each started sequence's max_context, by sequence id.
  std::vector<int32_t> started_contexts() const {
    std::lock_guard<std::mutex> lock(mu_);
    std::vector<int32_t> v;
    for (const auto& [id, c] : started_context_) v.push_back(c);
    return v;
  }
  void SetLoading(int w, bool loading) {
    {
      std::lock_guard<std::mutex> lock(mu_);
      if (loading) loading_.insert(w);
      else loading_.erase(w);
    }
    Changed();
  }
  void SetDraining(int w) {
    {
      std::lock_guard<std::mutex> lock(mu_);
      draining_ = w;
    }
    Changed();
  }
  std::vector<Step> steps() {
    std::lock_guard<std::mutex> lock(mu_);
    return steps_;
  }
  std::vector<std::string> log() {
    std::lock_guard<std::mutex> lock(mu_);
    return log_;
  }
  size_t held(int w) {
    std::lock_guard<std::mutex> lock(mu_);
    return held_[w].size();
  }
  size_t max_live() {
    std::lock_guard<std::mutex> lock(mu_);
    return max_live_;
  }
  std::vector<Clock::duration> reset_budgets() {   // deadline - the time sent, per reset
    std::lock_guard<std::mutex> lock(mu_);
    return reset_budgets_;
  }
  std::vector<Clock::duration> free_budgets() {   // deadline - the time sent, per free
    std::lock_guard<std::mutex> lock(mu_);
    return free_budgets_;
  }
  std::vector<int> marked_down() {
    std::lock_guard<std::mutex> lock(mu_);
    return marked_down_;
  }

 private:
  // The prompt scores of a step's items, in the order the steps are sent (a pipeline's last
  // stage runs them so, whichever answer comes back first).
  flashmesh::v1::StepBatchResponse Scores(const flashmesh::v1::StepBatchRequest& req) {
    std::lock_guard<std::mutex> lock(mu_);
    flashmesh::v1::StepBatchResponse resp;
    for (const auto& item : req.items()) {
      int64_t& position = positions_[item.seq_id()];
      if (scored_.count(item.seq_id())) {
        std::vector<int32_t> next(item.tokens().begin() + 1, item.tokens().end());
        if (item.has_next_token()) next.push_back(item.next_token());
        if (!next.empty()) {
          auto* p = resp.add_prompt_scores();
          p->set_seq_id(item.seq_id());
          p->set_first(position + 1);
          for (size_t k = 0; k < next.size(); ++k) {
            auto* t = p->add_tokens();
            t->set_id(next[k]);
            t->set_logprob(-static_cast<float>(position + 1 + static_cast<int64_t>(k)));
            auto* alt = t->add_top();
            alt->set_id(next[k] + 100);
            alt->set_logprob(-0.5f);
          }
        }
      }
      position += item.tokens_size();
      if (!item.prefill_continues()) scored_.erase(item.seq_id());
    }
    return resp;
  }
  // Held when its kind is ("step"), or the kind of this worker ("step w1").
  void Run(const std::string& kind, int w, std::function<void()> answer) {
    {
      std::lock_guard<std::mutex> lock(mu_);
      log_.push_back(kind + " w" + std::to_string(w));
      for (const std::string& k : {kind, kind + " w" + std::to_string(w)})
        if (holding_.count(k)) {
          held_calls_[k].push_back(std::move(answer));
          return;
        }
    }
    answer();
  }
  // A call whose answer (its `effect` on the workers, then Ok) runs now or when its kind is
  // released; the canceller it returns answers Cancelled instead, if it comes first.
  template <typename Resp>
  std::function<void()> Cancellable(const std::string& kind, int w, std::function<void()> effect,
                                    Done<Resp> done) {
    auto once = std::make_shared<std::once_flag>();
    Run(kind, w, [once, effect, done] {
      std::call_once(*once, [&] {
        effect();
        done({}, {});
      });
    });
    return [once, done] {
      std::call_once(*once, [&] { done({Cancelled("cancelled"), RpcFault::kUnreachable}, {}); });
    };
  }
  void Changed() {
    if (listener_) listener_();
  }

  int stages_, ep_;
  std::vector<WorkerInfo> infos_;
  mutable std::mutex mu_;
  std::vector<bool> down_;
  int draining_ = -1;
  std::set<int> loading_;
  bool frees_ignored_ = false;
  Status start_refusal_;
  RpcFault start_refusal_fault_ = RpcFault::kWorker;
  std::string stepped_down_;   // why, once a worker answered kSuperseded
  std::map<int, std::set<uint64_t>> held_;   // sequences each worker holds
  std::map<uint64_t, int32_t> started_context_;   // each sequence's StartSequence max_context
  size_t max_live_ = 0;
  std::set<uint64_t> scored_;                  // sequences whose prompt the head scores
  std::map<uint64_t, int64_t> positions_;      // tokens the head ran per sequence
  std::set<std::string> holding_;
  std::map<std::string, std::vector<std::function<void()>>> held_calls_;
  std::function<RpcResult(int, const flashmesh::v1::StepBatchRequest&)> step_fault_;
  std::function<void(flashmesh::v1::StepBatchResponse*)> token_rewrite_;
  std::vector<Step> steps_;
  std::vector<Clock::duration> free_budgets_, reset_budgets_;
  std::vector<std::string> log_;
  std::vector<int> marked_down_;
  std::function<void()> listener_;
  std::function<void(int, std::vector<uint64_t>, Deadline)> held_listener_;
};

// Limits that prefill a prompt in chunks of 4 tokens.
inline SchedulerLimits ChunksOf4() {
  SchedulerLimits limits;
  limits.max_step_tokens = 4;
  return limits;
}

inline GenerateParams Params(std::vector<int32_t> prompt, int64_t max_tokens) {
  GenerateParams p;
  p.prompt = std::move(prompt);
  p.max_tokens = max_tokens;
  p.sampling.set_greedy(true);
  return p;
}

struct Outcome {
  std::vector<int32_t> ids;
  std::string text;   // the tokens' pieces
  bool finished = false;
  flashmesh::v1::FinishReason reason = flashmesh::v1::FINISH_REASON_UNSPECIFIED;
  Status error;
};

// Every event until the finish or the error (or `timeout`: neither).
inline Outcome Collect(RequestStream* s, std::chrono::milliseconds timeout = 5000ms) {
  Outcome o;
  const auto until = Clock::now() + timeout;
  RequestStream::Event ev;
  while (Clock::now() < until) {
    if (!s->Pop(&ev, 20ms)) continue;
    if (ev.kind == RequestStream::Event::kToken) {
      o.ids.push_back(ev.token.id());
      o.text += ev.token.text();
    } else if (ev.kind == RequestStream::Event::kFinish) {
      o.finished = true;
      o.reason = ev.finish.reason();
      return o;
    } else {
      o.error = ev.error;
      return o;
    }
  }
  return o;
}

inline bool WaitFor(const std::function<bool()>& pred, std::chrono::milliseconds timeout = 5000ms) {
  const auto until = Clock::now() + timeout;
  while (Clock::now() < until) {
    if (pred()) return true;
    std::this_thread::sleep_for(2ms);
  }
  return pred();
}

}  // namespace fm::scheduler_test
