// The Scheduler against a fake cluster (a WorkerSet with scripted workers): step order,
// failure attribution, cancellation, backpressure, draining, the reset barrier, step deadlines.
#include <gtest/gtest.h>
#include <unistd.h>

#include <algorithm>
#include <functional>
#include <mutex>
#include <set>
#include <thread>

#include <filesystem>

#include "coordinator/scheduler.h"
#include "model/mkmodel.h"
#include "model/tokenizer.h"

namespace fm {
namespace {

using namespace std::chrono_literals;
using Clock = std::chrono::steady_clock;

// Workers w0.. (stage-major); the last stage "samples" each item's last token + 1. Every RPC
// answers at once unless its kind is held: then it waits for Release (or, a step, for its
// cancel). step_fault, when set, answers a step instead of the worker.
class FakeWorkers final : public WorkerSet {
 public:
  struct Step {
    int worker;
    flashmesh::v1::StepBatchRequest req;
    Clock::duration budget;   // deadline - the time it was sent
  };

  explicit FakeWorkers(int stages) : stages_(stages), down_(stages, false) {
    for (int i = 0; i < stages; ++i) {
      std::string name = "w", control = "fake:";
      name += std::to_string(i);
      control += std::to_string(i);
      infos_.push_back({name, control, 0, i == stages - 1});
    }
  }

  int num_stages() const override { return stages_; }
  uint64_t term() const override { return term_; }
  uint64_t term_ = 1765000000000;   // a coordinator's start time in ms (2025-12-06)
  int expert_parallel() const override { return 1; }
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
    for (int i = 0; i < stages_; ++i) {
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
        done({why, RpcFault::kWorker}, {});
        return [] {};
      }
    }
    return Cancellable<flashmesh::v1::StartSequenceResponse>(
        "start", w, [this, w, id = req.seq_id(), context = req.max_context()] {
          std::lock_guard<std::mutex> lock(mu_);
          held_[w].insert(id);
          started_context_[id] = context;
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
    auto answer = [this, w, req, done, once] {
      std::call_once(*once, [&] {
        RpcResult r;
        {
          std::lock_guard<std::mutex> lock(mu_);
          if (step_fault_) r = step_fault_(w, req);
          // As Cluster does (cluster_rpc.cpp): a worker that follows a newer coordinator.
          if (r.fault == RpcFault::kSuperseded)
            stepped_down_ = "this coordinator stepped down: " + r.status.message();
        }
        flashmesh::v1::StepBatchResponse resp;
        if (r.ok() && infos_[w].head)
          for (const auto& item : req.items()) {
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
  // Every StartSequence is refused with `why` (a worker's KV budget, a drain), Ok: none.
  void RefuseStarts(Status why) {
    std::lock_guard<std::mutex> lock(mu_);
    start_refusal_ = std::move(why);
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

  int stages_;
  std::vector<WorkerInfo> infos_;
  mutable std::mutex mu_;
  std::vector<bool> down_;
  int draining_ = -1;
  std::set<int> loading_;
  bool frees_ignored_ = false;
  Status start_refusal_;
  std::string stepped_down_;   // why, once a worker answered kSuperseded
  std::map<int, std::set<uint64_t>> held_;   // sequences each worker holds
  std::map<uint64_t, int32_t> started_context_;   // each sequence's StartSequence max_context
  size_t max_live_ = 0;
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

GenerateParams Params(std::vector<int32_t> prompt, int64_t max_tokens) {
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
Outcome Collect(RequestStream* s, std::chrono::milliseconds timeout = 5000ms) {
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

bool WaitFor(const std::function<bool()>& pred, std::chrono::milliseconds timeout = 5000ms) {
  const auto until = Clock::now() + timeout;
  while (Clock::now() < until) {
    if (pred()) return true;
    std::this_thread::sleep_for(2ms);
  }
  return pred();
}

// A sequence starts with the context its request can reach (prompt + max_tokens), capped at
// the cluster's: workers size and charge its KV by it.
TEST(Scheduler, ASequenceStartsWithItsRequestsReachNotTheClustersContext) {
  FakeWorkers w(2);
  SchedulerLimits limits;
  limits.max_context = 100;
  Scheduler s(&w, nullptr, limits);
  auto a = s.Submit(Params({5, 6, 7}, 4));
  ASSERT_TRUE(a.ok());
  EXPECT_EQ(Collect(a->get()).ids.size(), 4u);
  auto b = s.Submit(Params(std::vector<int32_t>(90, 3), 50));
  ASSERT_TRUE(b.ok());
  Outcome ob = Collect(b->get());
  EXPECT_EQ(ob.ids.size(), 10u);   // the cluster's max_context ends it
  EXPECT_EQ(ob.reason, flashmesh::v1::FINISH_REASON_LENGTH);
  EXPECT_EQ(w.started_contexts(), (std::vector<int32_t>{7, 100}));
}

TEST(Scheduler, EveryRequestGetsItsTokensAndEveryWorkerRunsStepsInOrder) {
  FakeWorkers w(3);
  Scheduler s(&w, nullptr, {});
  auto a = s.Submit(Params({5}, 4));
  auto b = s.Submit(Params({100, 7}, 3));
  ASSERT_TRUE(a.ok() && b.ok());
  Outcome oa = Collect(a->get()), ob = Collect(b->get());
  EXPECT_EQ(oa.ids, (std::vector<int32_t>{6, 7, 8, 9}));
  EXPECT_EQ(oa.reason, flashmesh::v1::FINISH_REASON_LENGTH);
  EXPECT_EQ(ob.ids, (std::vector<int32_t>{8, 9, 10}));
  // Each worker: increasing step ids, each naming the step sent before it (or 0).
  std::map<int, uint64_t> last;
  for (const auto& st : w.steps()) {
    EXPECT_GT(st.req.step_id(), last[st.worker]);
    EXPECT_TRUE(st.req.prev_step_id() == 0 || st.req.prev_step_id() == last[st.worker])
        << "step " << st.req.step_id() << " prev " << st.req.prev_step_id();
    last[st.worker] = st.req.step_id();
  }
  EXPECT_EQ(w.steps().front().req.prev_step_id(), 0u);
  ASSERT_TRUE(WaitFor([&] { return w.held(0) + w.held(1) + w.held(2) == 0; }));
  EXPECT_TRUE(s.Health().ok());
}

TEST(Scheduler, AWorkerThatDoesNotAnswerIsBlamedNotThePeerWaitingForIt) {
  FakeWorkers w(3);
  Scheduler s(&w, nullptr, {});
  w.SetStepFault([](int worker, const flashmesh::v1::StepBatchRequest&) -> RpcResult {
    if (worker == 1) return {Unavailable("node w1 (fake:1) is unavailable: connection refused"), RpcFault::kUnreachable};
    if (worker == 2) return {DeadlineExceeded("node w2: step waited too long for its input"), RpcFault::kWorker};
    return {};
  });
  auto a = s.Submit(Params({5}, 4));
  ASSERT_TRUE(a.ok());
  Outcome o = Collect(a->get());
  EXPECT_EQ(o.error.code(), Code::kUnavailable);
  EXPECT_NE(o.error.message().find("node w1"), std::string::npos) << o.error.message();
  EXPECT_EQ(w.marked_down(), std::vector<int>{1});
  // The others are reset at once; the down one once it is back. Then requests run again.
  ASSERT_TRUE(WaitFor([&] {
    auto l = w.log();
    return std::count(l.begin(), l.end(), "reset w0") == 1 && std::count(l.begin(), l.end(), "reset w2") == 1;
  }));
  EXPECT_FALSE(s.Health().ok());
  w.SetStepFault(nullptr);
  w.SetDown(1, false);
  ASSERT_TRUE(WaitFor([&] { auto l = w.log(); return std::count(l.begin(), l.end(), "reset w1") == 1; }));
  ASSERT_TRUE(WaitFor([&] { return s.Health().ok(); }));
  auto b = s.Submit(Params({20}, 2));
  ASSERT_TRUE(b.ok());
  EXPECT_EQ(Collect(b->get()).ids, (std::vector<int32_t>{21, 22}));
}

TEST(Scheduler, AWorkerThatLostTheSequencesEndsTheRequestsUnavailableWithItsReason) {
  FakeWorkers w(2);
  Scheduler s(&w, nullptr, {});
  w.SetStepFault([](int worker, const flashmesh::v1::StepBatchRequest&) -> RpcResult {
    if (worker == 0) return {NotFound("node w0 does not hold sequence 1 of step 1"), RpcFault::kLostSequences};
    return {};
  });
  auto a = s.Submit(Params({5}, 4));
  ASSERT_TRUE(a.ok());
  const auto t0 = Clock::now();
  Outcome o = Collect(a->get());
  EXPECT_LT(Clock::now() - t0, 2s);
  EXPECT_EQ(o.error.code(), Code::kUnavailable);
  EXPECT_NE(o.error.message().find("does not hold sequence 1"), std::string::npos) << o.error.message();
  EXPECT_TRUE(w.marked_down().empty());
}

// A stage that froze answers nothing; the stage after it gives up waiting for its input at 9/10
// of the step's deadline and says so. The blame goes to the frozen stage once its own RPC ends
// (at the deadline), not to the peer that answered first.
TEST(Scheduler, APeerThatGaveUpWaitingIsNotBlamedForTheStageThatFroze) {
  FakeWorkers w(3);
  SchedulerLimits limits;
  limits.first_step = 2s;
  Scheduler s(&w, nullptr, limits);
  w.Hold("step w1");
  w.SetStepFault([](int worker, const flashmesh::v1::StepBatchRequest&) -> RpcResult {
    if (worker == 2) return {DeadlineExceeded("step waited too long for its input"), RpcFault::kWorker};
    if (worker == 1) return {Unavailable("node w1 (fake:1) did not answer in time"), RpcFault::kUnreachable};
    return {};
  });
  auto a = s.Submit(Params({5}, 4));
  ASSERT_TRUE(a.ok());
  ASSERT_TRUE(WaitFor([&] { return w.HeldCalls("step w1") == 1; }));
  std::this_thread::sleep_for(1s);   // past the 300 ms grace, before the step's deadline
  w.Release("step w1");              // its RPC ends: no answer in time
  Outcome o = Collect(a->get());
  EXPECT_EQ(o.error.code(), Code::kUnavailable) << o.error.ToString();
  EXPECT_NE(o.error.message().find("node w1"), std::string::npos) << o.error.ToString();
  EXPECT_EQ(w.marked_down(), std::vector<int>{1});
}

TEST(Scheduler, AWorkerErrorEndsTheRequestsWithItsCodeAndText) {
  FakeWorkers w(2);
  Scheduler s(&w, nullptr, {});
  w.SetStepFault([](int worker, const flashmesh::v1::StepBatchRequest&) -> RpcResult {
    if (worker == 1) return {Internal("node w1: sampler exploded"), RpcFault::kWorker};
    return {};
  });
  auto a = s.Submit(Params({5}, 4));
  ASSERT_TRUE(a.ok());
  Outcome o = Collect(a->get());
  EXPECT_EQ(o.error.code(), Code::kInternal);
  EXPECT_EQ(o.error.message(), "step " + std::to_string((w.term_ << 20) + 1) + ": node w1: sampler exploded");
  EXPECT_TRUE(w.marked_down().empty());
}

// A head that answers a token for a sequence not in the step (or a second token for one) fails
// the step naming the node, instead of leaving the step's own sequence in flight for good: its
// request ends, and the next request runs.
TEST(Scheduler, ATokenForASequenceNotInTheStepFailsTheStepNamingTheNode) {
  FakeWorkers w(2);
  SchedulerLimits limits;
  limits.max_batch = 1;
  Scheduler s(&w, nullptr, limits);
  w.SetTokenRewrite([](flashmesh::v1::StepBatchResponse* resp) { resp->mutable_tokens(0)->set_seq_id(999999); });
  auto a = s.Submit(Params({5}, 4));
  ASSERT_TRUE(a.ok());
  Outcome o = Collect(a->get());
  EXPECT_EQ(o.error.code(), Code::kInternal) << o.error.ToString();
  EXPECT_NE(o.error.message().find("node w1 (fake:1) returned a token for sequence 999999"),
            std::string::npos) << o.error.ToString();

  // Two tokens for the one sequence of the step: the second is refused the same way.
  w.SetTokenRewrite([](flashmesh::v1::StepBatchResponse* resp) { *resp->add_tokens() = resp->tokens(0); });
  auto b = s.Submit(Params({7}, 4));
  ASSERT_TRUE(b.ok());
  Outcome ob = Collect(b->get());
  EXPECT_EQ(ob.error.code(), Code::kInternal) << ob.error.ToString();
  EXPECT_NE(ob.error.message().find("not an unanswered sequence"), std::string::npos) << ob.error.ToString();

  w.SetTokenRewrite(nullptr);
  auto c = s.Submit(Params({20}, 2));
  ASSERT_TRUE(c.ok());
  EXPECT_EQ(Collect(c->get()).ids, (std::vector<int32_t>{21, 22}));
}

// A worker that follows a newer coordinator answered: it is not a dead node (the coordinator
// steps down, cluster_rpc.cpp), so nothing is marked DOWN and the request ends UNAVAILABLE,
// saying so.
TEST(Scheduler, AWorkerThatFollowsANewerCoordinatorIsNotMarkedDown) {
  FakeWorkers w(2);
  Scheduler s(&w, nullptr, {});
  w.SetStepFault([](int, const flashmesh::v1::StepBatchRequest&) -> RpcResult {
    return {FailedPrecondition("StepBatch refused: stale coordinator term 1; this worker follows term 2"),
            RpcFault::kSuperseded};
  });
  auto a = s.Submit(Params({5}, 4));
  ASSERT_TRUE(a.ok());
  Outcome o = Collect(a->get());
  EXPECT_EQ(o.error.code(), Code::kUnavailable) << o.error.ToString();
  EXPECT_NE(o.error.message().find("stepped down: StepBatch refused: stale coordinator term 1"),
            std::string::npos) << o.error.ToString();
  EXPECT_TRUE(w.marked_down().empty());
}

TEST(Scheduler, CancelledQueuedRequestsLeaveTheQueueAtOnce) {
  FakeWorkers w(2);
  SchedulerLimits limits;
  limits.max_batch = 1;
  limits.max_queue = 2;
  Scheduler s(&w, nullptr, limits);
  w.Hold("start");
  auto first = s.Submit(Params({1}, 2));   // admitted, starting
  ASSERT_TRUE(WaitFor([&] { return w.HeldCalls("start") == 2; }));
  auto q1 = s.Submit(Params({2}, 2));
  auto q2 = s.Submit(Params({3}, 2));
  ASSERT_TRUE(q1.ok() && q2.ok());
  EXPECT_EQ(s.queued(), 2);
  EXPECT_EQ(s.Submit(Params({4}, 2)).status().code(), Code::kResourceExhausted);
  (*q1)->Cancel();
  (*q2)->Cancel();
  EXPECT_EQ(Collect(q1->get()).error.code(), Code::kCancelled);
  auto q3 = s.Submit(Params({5}, 2));
  EXPECT_TRUE(q3.ok()) << q3.status().ToString();
  w.Release("start");
  EXPECT_EQ(Collect(first->get()).ids, (std::vector<int32_t>{2, 3}));
  EXPECT_EQ(Collect(q3->get()).ids, (std::vector<int32_t>{6, 7}));
}

TEST(Scheduler, SixtyFourExpiredQueuedRequestsDoNotBlockANewOne) {
  FakeWorkers w(2);
  SchedulerLimits limits;
  limits.max_batch = 1;
  limits.max_queue = 64;
  Scheduler s(&w, nullptr, limits);
  w.Hold("start");
  auto first = s.Submit(Params({1}, 1));
  ASSERT_TRUE(WaitFor([&] { return w.HeldCalls("start") == 2; }));
  std::vector<std::shared_ptr<RequestStream>> expired;
  for (int i = 0; i < 64; ++i) {
    GenerateParams p = Params({10}, 1);
    p.deadline = Clock::now() + 50ms;
    auto r = s.Submit(std::move(p));
    ASSERT_TRUE(r.ok());
    expired.push_back(*r);
  }
  // They leave at their deadline, not when a slot frees up.
  EXPECT_EQ(Collect(expired.back().get(), 2000ms).error.code(), Code::kDeadlineExceeded);
  EXPECT_TRUE(WaitFor([&] { return s.queued() == 0; }));
  auto fresh = s.Submit(Params({30}, 1));
  ASSERT_TRUE(fresh.ok()) << fresh.status().ToString();
  w.Release("start");
  EXPECT_EQ(Collect(fresh->get()).ids, std::vector<int32_t>{31});
  expired.pop_back();   // collected above
  for (auto& e : expired) EXPECT_EQ(Collect(e.get(), 100ms).error.code(), Code::kDeadlineExceeded);
}

TEST(Scheduler, AtMostMaxBatchSequencesLiveAndEveryRequestCompletes) {
  FakeWorkers w(3);
  SchedulerLimits limits;
  limits.max_batch = 2;
  Scheduler s(&w, nullptr, limits);
  // Starts wait until all six are queued: else a loaded machine can run the first request to its
  // end before the second arrives, and two are never live together.
  w.Hold("start");
  std::vector<std::shared_ptr<RequestStream>> streams;
  for (int i = 0; i < 6; ++i) streams.push_back(*s.Submit(Params({i * 100}, 5)));
  // Two admitted together (2 sequences x 3 workers), the other four queued behind them.
  ASSERT_TRUE(WaitFor([&] { return w.HeldCalls("start") == 6; }));
  EXPECT_EQ(s.queued(), 4);
  std::this_thread::sleep_for(50ms);
  EXPECT_EQ(w.HeldCalls("start"), 6u) << "a third sequence started while two were live";
  w.Release("start");
  for (int i = 0; i < 6; ++i) {
    Outcome o = Collect(streams[i].get());
    ASSERT_TRUE(o.finished) << i << ": " << o.error.ToString();
    EXPECT_EQ(o.ids, (std::vector<int32_t>{i * 100 + 1, i * 100 + 2, i * 100 + 3, i * 100 + 4, i * 100 + 5}));
  }
  // Never more than two at a time on any worker. (Not exactly two: once released, the first
  // request can run to its end and be freed before the test thread delivers the second's
  // held start answers.)
  EXPECT_LE(w.max_live(), 2u);
  EXPECT_GE(w.max_live(), 1u);
}

TEST(Scheduler, AnUnfinishedCharacterAtTheEndComesOutAsTheReplacementCharacter) {
  const std::string dir = ::testing::TempDir() + "scheduler_tokenizer_" + std::to_string(getpid());
  ASSERT_TRUE(WriteTestTokenizer(dir, 300).ok());
  auto tok = Tokenizer::Load(dir);
  std::filesystem::remove_all(dir);
  ASSERT_TRUE(tok.ok()) << tok.status().ToString();
  auto euro = tok->Encode("\xE2\x82\xAC");   // three byte tokens at 300 ids
  ASSERT_TRUE(euro.ok() && euro->size() == 3u);
  FakeWorkers w(2);
  Scheduler s(&w, &*tok, {});
  // The fake samples the last token + 1: the one new token is the character's first byte alone.
  auto r = s.Submit(Params({(*euro)[0] - 1}, 1));
  ASSERT_TRUE(r.ok());
  Outcome o = Collect(r->get());
  ASSERT_TRUE(o.finished) << o.error.ToString();
  EXPECT_EQ(o.reason, flashmesh::v1::FINISH_REASON_LENGTH);
  EXPECT_EQ(o.ids, std::vector<int32_t>{(*euro)[0]});
  EXPECT_EQ(o.text, "\xEF\xBF\xBD");   // U+FFFD, as generate --model prints it; was ""
}

// A coordinator that takes over (a later term) numbers its steps above every step of the one
// before, even one that ran a million steps: the frames an old step left in a worker's queues
// are then older than every new step and skipped, never taken for a new step's.
TEST(Scheduler, StepIdsRiseAcrossCoordinators) {
  uint64_t last_old = 0;
  {
    FakeWorkers w(2);
    Scheduler s(&w, nullptr, {});
    auto r = s.Submit(Params({1}, 3));
    ASSERT_TRUE(r.ok());
    ASSERT_TRUE(Collect(r->get()).finished);
    for (const auto& st : w.steps()) last_old = std::max(last_old, st.req.step_id());
    EXPECT_EQ(w.steps().front().req.step_id(), (w.term_ << 20) + 1);
  }
  last_old += 1000000;   // as if it had run a million more
  FakeWorkers w(2);
  w.term_ += 1;          // started a millisecond later
  Scheduler s(&w, nullptr, {});
  auto r = s.Submit(Params({1}, 1));
  ASSERT_TRUE(r.ok());
  ASSERT_TRUE(Collect(r->get()).finished);
  EXPECT_GT(w.steps().front().req.step_id(), last_old);
}

TEST(Scheduler, CancellingALiveRequestFreesItOnEveryWorker) {
  FakeWorkers w(3);
  Scheduler s(&w, nullptr, {});
  w.Hold("step");
  auto a = s.Submit(Params({1}, 100));
  ASSERT_TRUE(WaitFor([&] { return w.HeldCalls("step") == 3; }));
  (*a)->Cancel();
  w.Release("step");
  Outcome o = Collect(a->get());
  EXPECT_EQ(o.reason, flashmesh::v1::FINISH_REASON_CANCELLED);
  EXPECT_TRUE(WaitFor([&] { return w.held(0) + w.held(1) + w.held(2) == 0; }));
  EXPECT_EQ(s.active(), 0);
}

TEST(Scheduler, DrainingFinishesWhatRunsAndTakesNothingNew) {
  FakeWorkers w(2);
  Scheduler s(&w, nullptr, {});
  w.Hold("step");
  auto live = s.Submit(Params({1}, 3));
  ASSERT_TRUE(WaitFor([&] { return w.HeldCalls("step") == 2; }));
  w.SetDraining(0);
  auto refused = s.Submit(Params({2}, 3));
  EXPECT_EQ(refused.status().code(), Code::kUnavailable);
  EXPECT_NE(refused.status().message().find("draining"), std::string::npos);
  w.Release("step");
  Outcome o = Collect(live->get());
  EXPECT_TRUE(o.finished) << o.error.ToString();
  EXPECT_EQ(o.ids, (std::vector<int32_t>{2, 3, 4}));
}

TEST(Scheduler, AHeldStartSequenceDoesNotStallTheStepsOfOthers) {
  FakeWorkers w(2);
  Scheduler s(&w, nullptr, {});
  auto a = s.Submit(Params({1}, 50));
  ASSERT_TRUE(WaitFor([&] { return !w.steps().empty(); }));
  w.Hold("start");
  auto b = s.Submit(Params({500}, 2));
  ASSERT_TRUE(WaitFor([&] { return w.HeldCalls("start") == 2; }));
  Outcome oa = Collect(a->get());   // all 50 tokens while b's StartSequence is unanswered
  EXPECT_EQ(oa.ids.size(), 50u);
  EXPECT_EQ(oa.ids.back(), 51);
  w.Release("start");
  EXPECT_EQ(Collect(b->get()).ids, (std::vector<int32_t>{501, 502}));
}

TEST(Scheduler, NothingStartsUntilEveryWorkerIsReset) {
  FakeWorkers w(2);
  Scheduler s(&w, nullptr, {});
  w.SetStepFault([](int worker, const flashmesh::v1::StepBatchRequest&) -> RpcResult {
    return {Internal("node w" + std::to_string(worker) + ": broken"), RpcFault::kWorker};
  });
  w.Hold("reset");
  auto a = s.Submit(Params({1}, 2));
  EXPECT_EQ(Collect(a->get()).error.code(), Code::kInternal);
  ASSERT_TRUE(WaitFor([&] { return w.HeldCalls("reset") == 2; }));
  w.SetStepFault(nullptr);
  auto b = s.Submit(Params({7}, 1));
  ASSERT_TRUE(b.ok());
  std::this_thread::sleep_for(100ms);
  auto log = w.log();
  EXPECT_EQ(std::count(log.begin(), log.end(), "start w0"), 1) << "started before the resets";
  EXPECT_NE(s.Health().message().find("resetting"), std::string::npos);
  w.Release("reset");
  EXPECT_EQ(Collect(b->get()).ids, std::vector<int32_t>{8});
  EXPECT_TRUE(WaitFor([&] { return s.Health().ok(); }));
}

// A worker that reloads (a restart, an NCCL group) fails what runs; the others are reset at once,
// it once it serves again: a Reset sent during its load would wait behind it, time out and mark
// a loading node down.
TEST(Scheduler, ALoadingWorkerIsResetOnceItServesNotDuringItsLoad) {
  FakeWorkers w(2);
  Scheduler s(&w, nullptr, {});
  w.Hold("step");
  auto a = s.Submit(Params({1}, 3));
  ASSERT_TRUE(WaitFor([&] { return w.HeldCalls("step") == 2; }));
  w.SetLoading(1, true);
  EXPECT_EQ(Collect(a->get()).error.code(), Code::kUnavailable);
  auto resets = [&](int worker) {
    auto log = w.log();
    return std::count(log.begin(), log.end(), "reset w" + std::to_string(worker));
  };
  ASSERT_TRUE(WaitFor([&] { return resets(0) == 1; }));
  std::this_thread::sleep_for(50ms);
  EXPECT_EQ(resets(1), 0);
  w.SetLoading(1, false);
  ASSERT_TRUE(WaitFor([&] { return resets(1) == 1; }));
  EXPECT_TRUE(w.marked_down().empty());
  w.Release("step");
  auto b = s.Submit(Params({7}, 1));
  ASSERT_TRUE(b.ok());
  EXPECT_EQ(Collect(b->get()).ids, std::vector<int32_t>{8});
}

TEST(Scheduler, StepDeadlinesFollowRecentStepTimesAndAnOverdueStepDegradesHealth) {
  FakeWorkers w(2);
  SchedulerLimits limits;
  limits.step_floor = 400ms;
  limits.first_step = 3000ms;
  Scheduler s(&w, nullptr, limits);
  auto a = s.Submit(Params({1}, 5));
  ASSERT_TRUE(Collect(a->get()).finished);
  auto steps = w.steps();
  ASSERT_GE(steps.size(), 4u);
  EXPECT_GT(steps.front().budget, 2900ms);   // no recent steps yet: first_step
  EXPECT_LT(steps.back().budget, 600ms);     // floor + 8 x (instant steps)
  EXPECT_GT(steps.back().budget, 300ms);
  w.Hold("step");
  auto b = s.Submit(Params({1}, 5));
  ASSERT_TRUE(WaitFor([&] { return w.HeldCalls("step") == 2; }));
  EXPECT_TRUE(s.Health().ok());
  ASSERT_TRUE(WaitFor([&] { return !s.Health().ok(); }, 1000ms));   // past half of ~400 ms
  EXPECT_NE(s.Health().message().find("overdue"), std::string::npos);
  w.Release("step");
  EXPECT_TRUE(Collect(b->get()).finished);
  EXPECT_TRUE(s.Health().ok());
}

// A prefill's deadline follows the prefills measured, not the decode steps: a 1-row step is
// mostly fixed cost, and its time per row x 1000 rows put a deadline tens of minutes out (a
// stuck stage hidden that long).
TEST(Scheduler, APrefillsDeadlineScalesFromTheLastPrefillNotFromADecodeStep) {
  FakeWorkers w(1);
  SchedulerLimits limits;
  limits.step_floor = 100ms;
  Scheduler s(&w, nullptr, limits);
  // Each step answered 50 ms after it was sent.
  w.Hold("step");
  std::atomic<bool> stop{false};
  std::thread answer([&] {
    while (!stop) {
      std::this_thread::sleep_for(50ms);
      w.Release("step");
      w.Hold("step");
    }
  });
  auto a = s.Submit(Params(std::vector<int32_t>(300, 1), 4));   // a 300-row step, then 1-row ones
  const bool finished = Collect(a->get()).finished;
  auto b = s.Submit(Params(std::vector<int32_t>(1000, 1), 1));
  const bool b_finished = Collect(b->get()).finished;
  stop = true;
  answer.join();
  w.Release("step");
  ASSERT_TRUE(finished);
  ASSERT_TRUE(b_finished);
  auto steps = w.steps();
  ASSERT_EQ(steps.size(), 5u);
  // ~50-100 ms for 300 rows bounds 1000 rows by ~0.33 ms x 1000: 8 x that + the floor ~ 3 s.
  // From a decode step (~50-100 ms a row) it was 8 x 1000 x that: over 400 s.
  EXPECT_LT(steps[4].budget, 10s);
  EXPECT_GT(steps[4].budget, 100ms);
  // A decode step after the prefills: bounded by the decode steps' own times.
  EXPECT_LT(steps[3].budget, 2s);
}

TEST(Scheduler, ASequenceNoRequestOwnsIsFreedAndDegradesHealthUntilItIsGone) {
  FakeWorkers w(2);
  Scheduler s(&w, nullptr, {});
  w.AddHeld(1, 999);   // left behind by someone else
  w.Heartbeat(1);
  ASSERT_TRUE(WaitFor([&] { return w.held(1) == 0; }));
  EXPECT_TRUE(s.Health().ok());
  // A free that does not take: unowned at two beats in a row, with no free on its way, is stray.
  w.IgnoreFrees(true);
  w.AddHeld(1, 998);
  w.Heartbeat(1);
  ASSERT_TRUE(WaitFor([&] { return w.free_budgets().size() == 2; }));
  EXPECT_TRUE(s.Health().ok());
  std::this_thread::sleep_for(50ms);   // the free's answer reaches the scheduler
  w.Heartbeat(1);
  ASSERT_TRUE(WaitFor([&] { return !s.Health().ok(); }));
  EXPECT_EQ(s.Health().message(), "node w1 holds 1 sequence(s) no request owns (freeing them)");
  w.IgnoreFrees(false);
  w.Heartbeat(1);   // still held: freed again
  ASSERT_TRUE(WaitFor([&] { return w.held(1) == 0; }));
  std::this_thread::sleep_for(50ms);
  w.Heartbeat(1);
  EXPECT_TRUE(WaitFor([&] { return s.Health().ok(); }));
}

// A refused start ends its request with the worker's reason, whole: End read the reason from
// the request it had just freed (the client got 16 bytes of freed heap before the text).
TEST(Scheduler, ARefusedStartEndsTheRequestWithTheWorkersReason) {
  FakeWorkers w(2);
  Scheduler s(&w, nullptr, {});
  w.RefuseStarts(ResourceExhausted("node w0: the KV budget holds no more sequences of this size"));
  for (int i = 0; i < 3; ++i) {
    auto a = s.Submit(Params({1}, 2));
    ASSERT_TRUE(a.ok());
    const Outcome o = Collect(a->get());
    EXPECT_EQ(o.error.code(), Code::kResourceExhausted);
    EXPECT_EQ(o.error.message(),
              "starting the sequence: node w0: the KV budget holds no more sequences of this size");
  }
}

// Shutdown cancels the control calls on their way: a free queued behind a long step (or on a
// stuck worker) held it until the free's deadline, the step's plus its own time.
TEST(Scheduler, ShutdownCancelsTheCallsOnTheirWay) {
  FakeWorkers w(2);
  auto s = std::make_unique<Scheduler>(&w, nullptr, SchedulerLimits{});
  w.Hold("free");
  auto a = s->Submit(Params({1}, 2));
  ASSERT_TRUE(Collect((*a).get()).finished);
  ASSERT_TRUE(WaitFor([&] { return w.HeldCalls("free") == 2; }));
  const auto start = Clock::now();
  s.reset();
  EXPECT_LT(Clock::now() - start, 1s);
  w.Release("free");   // late answers of cancelled calls reach nobody
}

// A worker frees between steps: behind a long step (a prefill) it still lists a sequence whose
// free is on its way. That is neither stray (health stays ok) nor freed again at every beat.
TEST(Scheduler, ASequenceWhoseFreeIsOnItsWayIsNotStrayNorFreedAgain) {
  FakeWorkers w(2);
  Scheduler s(&w, nullptr, {});
  w.Hold("free");
  auto a = s.Submit(Params({1}, 2));
  ASSERT_TRUE(Collect(a->get()).finished);
  ASSERT_TRUE(WaitFor([&] { return w.HeldCalls("free") == 2; }));   // one a worker
  for (int beat = 0; beat < 3; ++beat) {
    w.Heartbeat(0);
    w.Heartbeat(1);
  }
  std::this_thread::sleep_for(50ms);
  EXPECT_TRUE(s.Health().ok()) << s.Health().ToString();
  EXPECT_EQ(w.HeldCalls("free"), 2u);
  w.Release("free");
  EXPECT_EQ(w.held(0) + w.held(1), 0u);
  w.Heartbeat(0);
  EXPECT_TRUE(WaitFor([&] { return s.Health().ok(); }));
}

// A worker frees between steps, so a free sent while a step runs (a long prefill) waits for it:
// its deadline covers the step's, or a busy worker would be marked DOWN and the cluster reset.
TEST(Scheduler, AFreeBehindAStepInFlightHasTheStepsTimeToo) {
  FakeWorkers w(1);
  Scheduler s(&w, nullptr, {});
  w.Hold("step");
  auto a = s.Submit(Params({1}, 3));
  ASSERT_TRUE(WaitFor([&] { return w.HeldCalls("step") == 1; }));
  w.AddHeld(0, 999);   // a stray sequence: freed at the next beat, while a's step runs
  w.Heartbeat(0);
  ASSERT_TRUE(WaitFor([&] { return !w.free_budgets().empty(); }));
  const auto step_budget = w.steps().front().budget;
  EXPECT_GT(w.free_budgets().front(), step_budget) << "the free's deadline ends before the step's";
  EXPECT_GE(step_budget, 29s) << "the first step's deadline is first_step (30 s)";
  w.Release("step");
  EXPECT_TRUE(Collect(a->get()).finished);
}

// A worker takes its Reset only once the step it computes ends (compute is not cut short): when
// one stage fails while another runs a long step, that stage's Reset has until the step's
// deadline, or a busy healthy worker would be marked DOWN 2 s after the failure.
TEST(Scheduler, AResetBehindAStepStillComputingHasTheStepsTimeToo) {
  FakeWorkers w(2);
  Scheduler s(&w, nullptr, {});
  w.Hold("step w0");
  w.SetStepFault([](int worker, const flashmesh::v1::StepBatchRequest&) -> RpcResult {
    if (worker == 1) return {Internal("node w1: broken"), RpcFault::kWorker};
    return {};
  });
  auto a = s.Submit(Params({1}, 3));
  ASSERT_TRUE(WaitFor([&] { return w.HeldCalls("step w0") == 1; }));
  EXPECT_EQ(Collect(a->get()).error.code(), Code::kInternal);
  ASSERT_TRUE(WaitFor([&] { return w.reset_budgets().size() == 2; }));
  const auto step_budget = w.steps().front().budget;
  EXPECT_GE(step_budget, 29s) << "the first step's deadline is first_step (30 s)";
  for (const auto b : w.reset_budgets())
    EXPECT_GT(b, step_budget - 1s) << "a reset's deadline ends before the cancelled step's";
  w.Release("step w0");
  EXPECT_TRUE(WaitFor([&] { return s.Health().ok(); }));
  EXPECT_TRUE(w.marked_down().empty());
  // A later failure's Resets have that failure's steps' time, not the first one's 30 s.
  w.SetStepFault(nullptr);
  EXPECT_TRUE(Collect(s.Submit(Params({2}, 3))->get()).finished);   // quick steps: ~5 s deadlines
  w.SetStepFault([](int worker, const flashmesh::v1::StepBatchRequest&) -> RpcResult {
    if (worker == 1) return {Internal("node w1: broken again"), RpcFault::kWorker};
    return {};
  });
  EXPECT_EQ(Collect(s.Submit(Params({3}, 3))->get()).error.code(), Code::kInternal);
  ASSERT_TRUE(WaitFor([&] { return w.reset_budgets().size() == 4; }));
  for (size_t i = 2; i < 4; ++i) EXPECT_LT(w.reset_budgets()[i], 10s) << "reset " << i;
}

// A heartbeat that no longer lists a live request's sequence ends it; one that lists it, in any
// order (the worker's own), does not.
TEST(Scheduler, ARequestWhoseSequenceAWorkerLostBetweenStepsEndsUnavailable) {
  FakeWorkers w(1);
  Scheduler s(&w, nullptr, {});
  w.Hold("step");
  auto a = s.Submit(Params({1}, 3));   // in flight (held)
  ASSERT_TRUE(WaitFor([&] { return w.HeldCalls("step") == 1; }));
  auto b = s.Submit(Params({2}, 3));   // started, waiting for the one pipeline slot
  ASSERT_TRUE(WaitFor([&] { return w.held(0) == 2; }));
  // b's start is recorded when the scheduler thread runs its answer, which may come after a
  // heartbeat taken now (one older than b's start does not count), so heartbeats go on a while.
  Outcome early;
  for (int i = 0; i < 10 && early.error.ok(); ++i) {
    w.Heartbeat(0, /*descending=*/true);
    early = Collect(b->get(), 20ms);
  }
  EXPECT_TRUE(early.error.ok() && early.ids.empty() && !early.finished) << early.error.ToString();
  w.DropHeld(0, 2);   // an out-of-band reset took b's sequence
  Outcome ob;
  for (int i = 0; i < 100 && ob.error.ok() && !ob.finished; ++i) {
    w.Heartbeat(0);
    ob = Collect(b->get(), 50ms);
  }
  EXPECT_EQ(ob.error.code(), Code::kUnavailable);
  EXPECT_EQ(ob.error.message(), "node w0 lost sequence 2 (the worker was reset or restarted)");
  w.Release("step");
  EXPECT_EQ(Collect(a->get()).ids, (std::vector<int32_t>{2, 3, 4}));
}

}  // namespace
}  // namespace fm
