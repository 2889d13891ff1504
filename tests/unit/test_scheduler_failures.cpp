// The Scheduler's failure paths against a fake cluster (scheduler_fake_workers.h): failure
// attribution, lost sequences, the reset barrier, step deadlines, stray and freed sequences.
#include <gtest/gtest.h>

#include "tests/unit/scheduler_fake_workers.h"

namespace fm {
namespace {

using namespace std::chrono_literals;
using namespace scheduler_test;

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

// A step that ran out of time while this coordinator was paused blames the coordinator: the
// request fails with that reason, no node is marked down (even beside a plain time-out, which
// the pause explains), every worker is reset, and the next request runs.
TEST(Scheduler, AStepThatRanOutOfTimeWhileTheCoordinatorWasPausedMarksNoNodeDown) {
  FakeWorkers w(3);
  Scheduler s(&w, nullptr, {});
  const std::string paused = "this coordinator did not run for 6000 ms (paused, or starved of CPU) "
                             "around the deadline of its call to node w2 (fake:2) which may have "
                             "answered in time";
  w.SetStepFault([&](int worker, const flashmesh::v1::StepBatchRequest&) -> RpcResult {
    if (worker == 1) return {Unavailable("node w1 (fake:1) did not answer in time"), RpcFault::kTimedOut};
    if (worker == 2) return {Unavailable(paused), RpcFault::kCoordinatorStalled};
    return {};
  });
  auto a = s.Submit(Params({5}, 4));
  ASSERT_TRUE(a.ok());
  const Outcome o = Collect(a->get());
  EXPECT_EQ(o.error.code(), Code::kUnavailable);
  EXPECT_EQ(o.error.message(), paused);
  EXPECT_TRUE(w.marked_down().empty());
  ASSERT_TRUE(WaitFor([&] {
    auto l = w.log();
    return std::count(l.begin(), l.end(), "reset w0") == 1 && std::count(l.begin(), l.end(), "reset w1") == 1 &&
           std::count(l.begin(), l.end(), "reset w2") == 1;
  }));
  w.SetStepFault(nullptr);
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
    if (worker == 1) return {Unavailable("node w1 (fake:1) did not answer in time"), RpcFault::kTimedOut};
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

// A worker's message that names the step already is not prefixed with it again; one that names
// another step (whose id starts with the same digits) is.
TEST(Scheduler, AWorkerErrorThatNamesItsStepIsNotPrefixedWithItAgain) {
  FakeWorkers w(2);
  Scheduler s(&w, nullptr, {});
  const std::string step = "step " + std::to_string((w.term_ << 20) + 1);
  w.SetStepFault([&](int worker, const flashmesh::v1::StepBatchRequest&) -> RpcResult {
    if (worker == 1) return {Internal("node w1: " + step + " aborted: the cluster was reset"), RpcFault::kWorker};
    return {};
  });
  auto a = s.Submit(Params({5}, 4));
  ASSERT_TRUE(a.ok());
  EXPECT_EQ(Collect(a->get()).error.message(), "node w1: " + step + " aborted: the cluster was reset");
  std::string other;   // "step <this step's id>0": another step
  w.SetStepFault([&](int worker, const flashmesh::v1::StepBatchRequest& req) -> RpcResult {
    other = "step " + std::to_string(req.step_id()) + "0";
    if (worker == 1) return {Internal("node w1: " + other + " is unknown"), RpcFault::kWorker};
    return {};
  });
  ASSERT_TRUE(WaitFor([&] { return s.Health().ok(); }));
  auto b = s.Submit(Params({5}, 4));
  ASSERT_TRUE(b.ok());
  const std::string m = Collect(b->get()).error.message();
  EXPECT_EQ(m, other.substr(0, other.size() - 1) + ": node w1: " + other + " is unknown");
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

// A sequence whose row the head could not sample (its logits held a NaN: SampledToken.error)
// ends alone, naming the node and the reason, and is freed; the other sequence of the same
// steps keeps its tokens and finishes, and no worker is reset or marked down.
TEST(Scheduler, ARowThatCouldNotBeSampledEndsOnlyItsRequest) {
  FakeWorkers w(1);
  Scheduler s(&w, nullptr, {});
  // b's third token (100 -> 101, 102, 103) is the row that fails.
  w.SetTokenRewrite([](flashmesh::v1::StepBatchResponse* resp) {
    for (auto& t : *resp->mutable_tokens())
      if (t.id() == 103) {
        t.set_id(-1);
        t.set_error("logits[7] is NaN");
      }
  });
  w.Hold("step");   // both requests in every step
  auto a = s.Submit(Params({5}, 6));
  auto b = s.Submit(Params({100}, 6));
  ASSERT_TRUE(a.ok() && b.ok());
  ASSERT_TRUE(WaitFor([&] { return w.HeldCalls("step") == 1; }));
  ASSERT_TRUE(WaitFor([&] { return w.held(0) == 2; }));
  w.Release("step");
  Outcome ob = Collect(b->get()), oa = Collect(a->get());
  EXPECT_EQ(ob.ids, (std::vector<int32_t>{101, 102}));
  EXPECT_EQ(ob.error.code(), Code::kInternal) << ob.error.ToString();
  EXPECT_NE(ob.error.message().find("could not be sampled: node w0: logits[7] is NaN"), std::string::npos)
      << ob.error.ToString();
  EXPECT_TRUE(oa.finished) << oa.error.ToString();
  EXPECT_EQ(oa.ids, (std::vector<int32_t>{6, 7, 8, 9, 10, 11}));
  size_t both = 0;
  for (const auto& step : w.steps()) both += step.req.items_size() == 2;
  EXPECT_GE(both, 2u) << "the failing row shared its steps with the other request";
  EXPECT_TRUE(WaitFor([&] { return w.held(0) == 0; })) << "b's sequence is freed";
  EXPECT_TRUE(w.marked_down().empty());
  for (const auto& line : w.log()) EXPECT_EQ(line.find("reset"), std::string::npos) << line;
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

// A step's time from launch covers the steps in flight before it. On a 10-stage pipeline of 10
// decoding streams, 10 one-row steps are in flight and end one after another, one every 20 ms,
// as a pipeline's last stage ends them: a step launched behind k others takes ~(k + 1) x 20 ms.
// Measured against those rows, its deadline is the floor + 8 x ~200 ms (~1.7 s). Measured
// against its own row alone, a 1-row step took up to 200 ms a row and a step of 10 rows in
// flight got 8 x 10 x 200 ms (~16 s): a pipeline's deadlines grew with the square of its stages
// (a review measured 52 s for 0.73 s steps on pp8).
TEST(Scheduler, APipelinesStepDeadlineCountsTheStepsInFlightOnce) {
  constexpr int kStages = 10;
  FakeWorkers w(kStages);
  SchedulerLimits limits;
  limits.step_floor = 100ms;
  Scheduler s(&w, nullptr, limits);
  w.Hold("step");
  std::atomic<bool> stop{false};
  std::thread answer([&] {   // the oldest step's calls (one a worker) every 20 ms
    while (!stop) {
      std::this_thread::sleep_for(20ms);
      w.ReleaseOldest("step", kStages);
    }
  });
  // All submitted first (they decode together), then read; asserted once the answering thread
  // is joined.
  std::vector<std::shared_ptr<RequestStream>> streams;
  bool all_finished = true;
  for (int i = 0; i < kStages; ++i) {
    auto st = s.Submit(Params({i + 1}, 12));
    all_finished = all_finished && st.ok();
    if (st.ok()) streams.push_back(std::move(st).value());
  }
  for (auto& st : streams) all_finished = Collect(st.get()).finished && all_finished;
  stop = true;
  answer.join();
  w.Release("step");
  ASSERT_TRUE(all_finished);
  const auto steps = w.steps();   // one entry a worker a step
  ASSERT_GE(steps.size(), 30u * kStages);
  // The last third, every stage busy with a decode step: ~1.7 s (~16 s when counted twice).
  for (size_t i = steps.size() - steps.size() / 3; i < steps.size(); ++i)
    EXPECT_LT(steps[i].budget, 5s) << "step call " << i << " of " << steps.size();
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

// A worker that does not answer a StartSequence by its deadline may only be paused (a swap
// storm, SIGSTOP): the new request fails naming it, but the node is not marked down, so the
// live request, whose step waits on that worker, goes on once it answers.
TEST(Scheduler, AStartThatTimesOutFailsItsRequestButNotTheLiveOnes) {
  FakeWorkers w(2);
  Scheduler s(&w, nullptr, {});
  w.Hold("step w1");
  auto live = s.Submit(Params({5}, 4));
  ASSERT_TRUE(live.ok());
  ASSERT_TRUE(WaitFor([&] { return w.HeldCalls("step w1") == 1; }));
  w.RefuseStarts(Unavailable("node w1 (fake:1) did not answer in time"), RpcFault::kTimedOut);
  auto late = s.Submit(Params({9}, 2));
  ASSERT_TRUE(late.ok());
  const Outcome refused = Collect(late->get());
  EXPECT_EQ(refused.error.code(), Code::kUnavailable);
  EXPECT_EQ(refused.error.message(), "node w1 (fake:1) did not answer in time");
  EXPECT_TRUE(w.marked_down().empty());
  w.RefuseStarts(Status::Ok());
  w.Release("step w1");
  const Outcome o = Collect(live->get());
  EXPECT_TRUE(o.finished) << o.error.ToString();
  EXPECT_EQ(o.ids, (std::vector<int32_t>{6, 7, 8, 9}));
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
