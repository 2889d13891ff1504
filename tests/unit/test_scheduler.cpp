// The Scheduler against a fake cluster (scheduler_fake_workers.h): step order, cancellation,
// backpressure, draining, streaming text. Its failure paths: test_scheduler_failures.cpp.
#include <gtest/gtest.h>
#include <unistd.h>

#include <filesystem>

#include "model/mkmodel.h"
#include "model/tokenizer.h"
#include "tests/unit/scheduler_fake_workers.h"

namespace fm {
namespace {

using namespace std::chrono_literals;
using namespace scheduler_test;

// A prompt of 3 chunks of ChunksOf4 (4, 4, 2).
std::vector<int32_t> TenTokensFrom100() {
  std::vector<int32_t> prompt;
  for (int32_t t = 100; t < 110; ++t) prompt.push_back(t);
  return prompt;
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

// A prompt longer than max_step_tokens goes in chunks, one a step, beside the decode rows of a
// stream already going; the chunks end at multiples of max_step_tokens from the prompt's start
// and only the last one is sampled.
TEST(Scheduler, ALongPromptGoesInChunksBesideAStreamThatKeepsDecoding) {
  FakeWorkers w(1);
  Scheduler s(&w, nullptr, ChunksOf4());
  // a's first step is held until b is queued: on a loaded machine a could otherwise finish its
  // 12 instant steps before b arrives (under TSan in CI it once did).
  w.Hold("step");
  auto a = s.Submit(Params({1}, 12));
  ASSERT_TRUE(a.ok());
  ASSERT_TRUE(WaitFor([&] { return w.HeldCalls("step") == 1; }));
  const std::vector<int32_t> prompt = TenTokensFrom100();
  auto b = s.Submit(Params(prompt, 2));
  w.Release("step");
  ASSERT_TRUE(b.ok());
  Outcome oa = Collect(a->get()), ob = Collect(b->get());
  std::vector<int32_t> want_a;
  for (int32_t t = 2; t <= 13; ++t) want_a.push_back(t);
  EXPECT_EQ(oa.ids, want_a);
  EXPECT_EQ(ob.ids, (std::vector<int32_t>{110, 111}));   // the prompt's last token + 1, then + 1
  // Each request's sequence id: the one its prompt's first step carried.
  uint64_t id_a = 0, id_b = 0;
  for (const auto& step : w.steps())
    for (const auto& item : step.req.items()) {
      if (item.tokens(0) == 1) id_a = item.seq_id();
      if (item.tokens(0) == 100) id_b = item.seq_id();
    }
  ASSERT_NE(id_a, id_b);
  std::vector<std::vector<int32_t>> chunks;
  std::vector<bool> continues;
  int beside_a = 0;
  for (const auto& step : w.steps()) {
    bool has_a = false, has_chunk = false;
    for (const auto& item : step.req.items()) {
      if (item.seq_id() == id_b && item.tokens_size() > 1) {
        chunks.emplace_back(item.tokens().begin(), item.tokens().end());
        continues.push_back(item.prefill_continues());
        has_chunk = true;
      }
      has_a = has_a || item.seq_id() == id_a;
    }
    beside_a += has_a && has_chunk;
  }
  ASSERT_EQ(chunks.size(), 3u);
  EXPECT_EQ(chunks[0], (std::vector<int32_t>{100, 101, 102, 103}));
  EXPECT_EQ(chunks[1], (std::vector<int32_t>{104, 105, 106, 107}));
  EXPECT_EQ(chunks[2], (std::vector<int32_t>{108, 109}));
  EXPECT_EQ(continues, (std::vector<bool>{true, true, false}));
  EXPECT_GE(beside_a, 2) << "the decoding stream waits for no more than one chunk";
}

// The chunks of one prompt do not wait for each other: on a 3-stage pipeline all three are in
// flight at once, one step each, in prompt order, and the last one's token comes back.
TEST(Scheduler, APromptsChunksFillThePipelineInStepOrder) {
  FakeWorkers w(3);
  Scheduler s(&w, nullptr, ChunksOf4());
  w.Hold("step");
  const std::vector<int32_t> prompt = TenTokensFrom100();
  auto r = s.Submit(Params(prompt, 2));
  ASSERT_TRUE(r.ok());
  ASSERT_TRUE(WaitFor([&] { return w.HeldCalls("step") == 9; })) << w.HeldCalls("step") << " held";
  std::vector<std::vector<int32_t>> chunks;
  uint64_t last_step = 0;
  for (const auto& step : w.steps()) {
    if (step.worker != 0) continue;
    ASSERT_EQ(step.req.items_size(), 1);
    EXPECT_GT(step.req.step_id(), last_step);
    last_step = step.req.step_id();
    chunks.emplace_back(step.req.items(0).tokens().begin(), step.req.items(0).tokens().end());
  }
  EXPECT_EQ(chunks, (std::vector<std::vector<int32_t>>{{100, 101, 102, 103}, {104, 105, 106, 107}, {108, 109}}));
  w.Release("step");
  Outcome o = Collect(r->get());
  EXPECT_EQ(o.ids, (std::vector<int32_t>{110, 111}));
  EXPECT_TRUE(WaitFor([&] { return w.held(0) + w.held(1) + w.held(2) == 0; }));
}

// A short prompt that arrives while a long one fills the pipeline takes the next free slot,
// ahead of the long one's next chunk (which would otherwise keep every slot to its last chunk).
TEST(Scheduler, AShortPromptBehindALongOneTakesTheNextFreeSlot) {
  FakeWorkers w(3);
  Scheduler s(&w, nullptr, ChunksOf4());
  w.Hold("step");
  auto a = s.Submit(Params(std::vector<int32_t>(20, 7), 1));   // 5 chunks
  ASSERT_TRUE(a.ok());
  ASSERT_TRUE(WaitFor([&] { return w.HeldCalls("step") == 9; }));
  // b's StartSequences are answered before a's first chunk comes back, so b is ready then.
  w.Hold("start");
  auto b = s.Submit(Params({500, 501}, 1));
  ASSERT_TRUE(b.ok());
  ASSERT_TRUE(WaitFor([&] { return w.HeldCalls("start") == 3; }));
  w.Release("start");
  w.ReleaseOldest("step", 3);   // a's first chunk is back
  ASSERT_TRUE(WaitFor([&] { return w.HeldCalls("step") == 9; }));
  const auto steps = w.steps();
  ASSERT_EQ(steps.size(), 12u);
  const auto& fourth = steps.back().req;
  ASSERT_EQ(fourth.items_size(), 1);
  EXPECT_EQ(std::vector<int32_t>(fourth.items(0).tokens().begin(), fourth.items(0).tokens().end()),
            (std::vector<int32_t>{500, 501}));
  w.Release("step");
  EXPECT_EQ(Collect(b->get()).ids, (std::vector<int32_t>{502}));
  EXPECT_EQ(Collect(a->get()).ids, (std::vector<int32_t>{8}));
}

// A request cancelled while several chunks of its prompt are in flight ends, and is freed,
// only once the last of those steps is back: a free ahead of them would make them fail.
TEST(Scheduler, ARequestCancelledWithChunksInFlightEndsAfterTheLastOfThem) {
  FakeWorkers w(3);
  Scheduler s(&w, nullptr, ChunksOf4());
  w.Hold("step");
  auto r = s.Submit(Params(std::vector<int32_t>(12, 7), 5));
  ASSERT_TRUE(r.ok());
  ASSERT_TRUE(WaitFor([&] { return w.HeldCalls("step") == 9; }));
  (*r)->Cancel();
  w.ReleaseOldest("step", 6);   // the first two chunks' steps
  std::this_thread::sleep_for(50ms);
  EXPECT_EQ(s.active(), 1);
  for (int i = 0; i < 3; ++i) EXPECT_EQ(w.held(i), 1u) << "w" << i << " freed a sequence still in a step";
  w.Release("step");
  Outcome o = Collect(r->get());
  EXPECT_EQ(o.reason, flashmesh::v1::FINISH_REASON_CANCELLED);
  EXPECT_TRUE(o.ids.empty());
  EXPECT_TRUE(WaitFor([&] { return w.held(0) + w.held(1) + w.held(2) == 0; }));
  EXPECT_EQ(w.steps().size(), 9u) << "nothing of a cancelled request is sent";
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

// Worker 0's items of a shared prompt's steps, in step order.
struct SharedPromptSteps {
  uint64_t prefix = 0;                       // the prefix sequence (its first chunk's id)
  std::vector<std::vector<int32_t>> chunks;  // the prefix sequence's
  std::vector<bool> continues;               // its chunks' prefill_continues
  size_t chunks_before_first_fork = 0;
  std::vector<uint64_t> forks;               // the forked sequences, in order
  std::vector<uint64_t> fork_from;
  std::vector<std::vector<int32_t>> fork_tokens;
  size_t whole_prompts = 0;                  // items that ran the prompt from its first token alone
  size_t rows = 0;
};
SharedPromptSteps Worker0Items(FakeWorkers& w, int32_t first_token) {
  SharedPromptSteps s;
  for (const auto& step : w.steps())
    for (const auto& item : step.req.items())
      if (item.fork_from() != 0) s.prefix = item.fork_from();
  for (const auto& step : w.steps()) {
    if (step.worker != 0) continue;
    for (const auto& item : step.req.items()) {
      s.rows += static_cast<size_t>(item.tokens_size());
      const std::vector<int32_t> tokens(item.tokens().begin(), item.tokens().end());
      if (item.fork_from() != 0) {
        if (s.forks.empty()) s.chunks_before_first_fork = s.chunks.size();
        s.forks.push_back(item.seq_id());
        s.fork_from.push_back(item.fork_from());
        s.fork_tokens.push_back(tokens);
        continue;
      }
      if (item.seq_id() == s.prefix) {
        s.chunks.push_back(tokens);
        s.continues.push_back(item.prefill_continues());
      } else if (tokens[0] == first_token) {
        ++s.whole_prompts;
      }
    }
  }
  return s;
}

// The requests of one SubmitAll (the n choices of an HTTP request) share their prompt's
// prefill: a prefix sequence runs all of it but the last token, in the prompt's chunks and
// sampling nothing; each request forks from it in a later step (StepItem.fork_from) and runs
// the last token itself; then the prefix sequence is freed. Each gets the tokens it would alone.
TEST(Scheduler, RequestsOfOnePromptShareItsPrefill) {
  FakeWorkers w(2);
  Scheduler s(&w, nullptr, ChunksOf4());
  const std::vector<int32_t> prompt = TenTokensFrom100();
  w.Hold("step");
  auto streams = s.SubmitAll(std::vector<GenerateParams>(3, Params(prompt, 2)));
  ASSERT_TRUE(streams.ok()) << streams.status().ToString();
  ASSERT_TRUE(WaitFor([&] { return w.HeldCalls("step") >= 2; }));
  EXPECT_EQ(s.active(), 3) << "the prefix sequence is not a request";
  EXPECT_EQ(w.held(0), 4u) << "but it is a sequence on the workers";
  w.Release("step");
  for (const auto& st : *streams) EXPECT_EQ(Collect(st.get()).ids, (std::vector<int32_t>{110, 111}));
  const SharedPromptSteps got = Worker0Items(w, 100);
  EXPECT_EQ(got.chunks, (std::vector<std::vector<int32_t>>{{100, 101, 102, 103}, {104, 105, 106, 107}, {108}}));
  EXPECT_EQ(got.continues, (std::vector<bool>{true, true, true})) << "the prefix sequence samples nothing";
  EXPECT_EQ(got.chunks_before_first_fork, 3u) << "a fork comes after the prefix's last chunk";
  ASSERT_EQ(got.forks.size(), 3u);
  EXPECT_EQ(std::set<uint64_t>(got.forks.begin(), got.forks.end()).size(), 3u);
  for (size_t i = 0; i < 3; ++i) {
    EXPECT_EQ(got.fork_from[i], got.prefix);
    EXPECT_EQ(got.fork_tokens[i], std::vector<int32_t>{109});
  }
  EXPECT_EQ(got.whole_prompts, 0u);
  EXPECT_EQ(got.rows, 9u + 3u + 3u) << "one prefill of 9 tokens, 3 forks, 3 decode rows (alone: 33)";
  // The prefix sequence, started first, reaches its 9 tokens; each request 10 + 2.
  EXPECT_EQ(w.started_contexts(), (std::vector<int32_t>{9, 12, 12, 12}));
  EXPECT_TRUE(WaitFor([&] { return w.held(0) + w.held(1) == 0; })) << "the prefix sequence is freed too";
  EXPECT_EQ(s.active(), 0);
}

// Without batch slots for the prefix sequence and two requests, nothing is shared (one fork
// would save nothing for its slot). With slots for three, two requests fork at once, and the
// prefix sequence keeps its slot while requests of its prompt are still queued: the other three
// fork as slots free. A one-token prompt has nothing to share.
TEST(Scheduler, APrefixServesTheRequestsQueuedBehindTheBatchToo) {
  const std::vector<int32_t> prompt = TenTokensFrom100();
  for (int64_t max_batch : {2, 3}) {
    FakeWorkers w(1);
    SchedulerLimits limits = ChunksOf4();
    limits.max_batch = max_batch;
    Scheduler s(&w, nullptr, limits);
    auto streams = s.SubmitAll(std::vector<GenerateParams>(5, Params(prompt, 2)));
    ASSERT_TRUE(streams.ok());
    for (const auto& st : *streams) EXPECT_EQ(Collect(st.get()).ids, (std::vector<int32_t>{110, 111}));
    const SharedPromptSteps got = Worker0Items(w, 100);
    EXPECT_EQ(got.forks.size(), max_batch == 2 ? 0u : 5u) << "max_batch " << max_batch;
    EXPECT_EQ(got.whole_prompts, max_batch == 2 ? 5u : 0u) << "max_batch " << max_batch;
    EXPECT_EQ(got.chunks.size(), max_batch == 2 ? 0u : 3u) << "max_batch " << max_batch;
    EXPECT_TRUE(WaitFor([&] { return w.held(0) == 0; }));
  }
  FakeWorkers w(1);
  Scheduler s(&w, nullptr, {});
  auto streams = s.SubmitAll(std::vector<GenerateParams>(2, Params({42}, 1)));
  ASSERT_TRUE(streams.ok());
  for (const auto& st : *streams) EXPECT_EQ(Collect(st.get()).ids, std::vector<int32_t>{43});
  for (const auto& step : w.steps())
    for (const auto& item : step.req.items()) EXPECT_EQ(item.fork_from(), 0u);
}

// Requests cancelled while their prefix sequence prefills: it stops after the chunks in flight
// and is freed; nothing is left on the workers.
TEST(Scheduler, APrefixNobodyWaitsForAnyMoreIsFreed) {
  FakeWorkers w(1);
  Scheduler s(&w, nullptr, ChunksOf4());
  w.Hold("step");
  auto streams = s.SubmitAll(std::vector<GenerateParams>(2, Params(TenTokensFrom100(), 2)));
  ASSERT_TRUE(streams.ok());
  ASSERT_TRUE(WaitFor([&] { return w.HeldCalls("step") == 1; }));
  for (const auto& st : *streams) st->Cancel();
  w.Release("step");
  for (const auto& st : *streams) EXPECT_EQ(Collect(st.get()).reason, flashmesh::v1::FINISH_REASON_CANCELLED);
  EXPECT_TRUE(WaitFor([&] { return w.held(0) == 0 && s.active() == 0; }));
  EXPECT_EQ(w.steps().size(), 1u) << "no chunk after the first";
}

// n requests of one 10-token prompt on one stage of 2 EP members under `limits`, where no
// prefix sequence is expected: each prefills alone. The rows each member ran.
std::vector<size_t> EpRowsWithoutAPrefix(size_t n, const SchedulerLimits& limits) {
  FakeWorkers w(1, 2);
  Scheduler s(&w, nullptr, limits);
  auto streams = s.SubmitAll(std::vector<GenerateParams>(n, Params(TenTokensFrom100(), 2)));
  EXPECT_TRUE(streams.ok());
  if (!streams.ok()) return {};
  for (const auto& st : *streams) EXPECT_EQ(Collect(st.get()).ids, (std::vector<int32_t>{110, 111}));
  std::vector<size_t> rows(2, 0);
  for (const auto& step : w.steps())
    for (const auto& item : step.req.items()) {
      rows[step.worker] += static_cast<size_t>(item.tokens_size());
      EXPECT_EQ(item.fork_from(), 0u) << n << " requests";
    }
  EXPECT_EQ(w.started_contexts().size(), n) << n << " requests: no prefix sequence";
  return rows;
}

// Under expert parallelism (data-parallel attention) each member that takes requests of the
// prompt gets its own prefix sequence, and its requests fork from that one: 4 requests on 2
// members spread 2 and 2, as 4 separate requests would, with one prefill of the prompt each;
// 2 requests on 2 members start no prefix.
TEST(Scheduler, EachEpMemberForksItsRequestsFromItsOwnPrefix) {
  FakeWorkers w(1, 2);
  Scheduler s(&w, nullptr, ChunksOf4());
  auto streams = s.SubmitAll(std::vector<GenerateParams>(4, Params(TenTokensFrom100(), 2)));
  ASSERT_TRUE(streams.ok());
  for (const auto& st : *streams) EXPECT_EQ(Collect(st.get()).ids, (std::vector<int32_t>{110, 111}));
  for (int m = 0; m < 2; ++m) {
    std::set<uint64_t> prefixes, forks;
    size_t rows = 0;
    for (const auto& step : w.steps()) {
      if (step.worker != m) continue;
      for (const auto& item : step.req.items()) {
        rows += static_cast<size_t>(item.tokens_size());
        if (item.fork_from() != 0) {
          prefixes.insert(item.fork_from());
          forks.insert(item.seq_id());
          EXPECT_EQ(item.tokens_size(), 1);
        }
      }
    }
    EXPECT_EQ(prefixes.size(), 1u) << "member " << m << ": its own prefix";
    EXPECT_EQ(forks.size(), 2u) << "member " << m;
    EXPECT_EQ(rows, 9u + 2u + 2u) << "member " << m << ": one prefill, two forks, two decode rows";
  }
  EXPECT_TRUE(WaitFor([&] { return w.held(0) + w.held(1) == 0; }));
  // 2 requests on 2 members: each member would get one, which a prefix cannot save anything
  // for, so none starts.
  EXPECT_EQ(EpRowsWithoutAPrefix(2, ChunksOf4()), (std::vector<size_t>{10 + 1, 10 + 1}));
  // 3 requests on 2 members: member 0's prefix would count as a sequence there, so the next two
  // go to member 1 and the prefix would serve one request: none starts (nor on member 1, where
  // the last one goes back to member 0). Sequences stay balanced: 2 and 1.
  EXPECT_EQ(EpRowsWithoutAPrefix(3, ChunksOf4()), (std::vector<size_t>{2 * (10 + 1), 10 + 1}))
      << "three whole prompts";
  // 4 requests on 2 members with max_batch 4: a prefix would leave room for only two more of
  // them in this pass (both placed on the other member), and a member's prefix does not wait
  // for a later pass: none starts, each member prefills two.
  SchedulerLimits tight = ChunksOf4();
  tight.max_batch = 4;
  EXPECT_EQ(EpRowsWithoutAPrefix(4, tight), (std::vector<size_t>{2 * (10 + 1), 2 * (10 + 1)}));
}

// A prefix sequence kept for requests of its prompt still queued is freed as soon as those
// leave the queue instead (cancelled), while the forked requests decode on: nothing stays.
TEST(Scheduler, APrefixKeptForQueuedRequestsIsFreedWhenTheyLeaveTheQueue) {
  FakeWorkers w(1);
  SchedulerLimits limits = ChunksOf4();
  limits.max_batch = 3;
  Scheduler s(&w, nullptr, limits);
  w.Hold("step");
  auto streams = s.SubmitAll(std::vector<GenerateParams>(4, Params(TenTokensFrom100(), 40)));
  ASSERT_TRUE(streams.ok());
  // Steps one at a time until the two admitted requests have forked and decoded once.
  auto decoded_after_fork = [&] {
    bool forked = false;
    for (const auto& step : w.steps())
      for (const auto& item : step.req.items()) {
        if (item.fork_from() != 0) forked = true;
        else if (forked && item.tokens_size() == 1 && item.tokens(0) >= 110) return true;
      }
    return false;
  };
  for (int i = 0; i < 20 && !decoded_after_fork(); ++i) {
    ASSERT_TRUE(WaitFor([&] { return w.HeldCalls("step") == 1; }));
    w.ReleaseOldest("step", 1);
  }
  ASSERT_TRUE(decoded_after_fork());
  ASSERT_TRUE(WaitFor([&] { return w.HeldCalls("step") == 1; }));
  EXPECT_EQ(w.held(0), 3u) << "the prefix sequence and two requests";
  EXPECT_EQ(s.queued(), 2);
  (*streams)[2]->Cancel();
  (*streams)[3]->Cancel();
  EXPECT_TRUE(WaitFor([&] { return w.held(0) == 2; })) << "the prefix stays with nobody queued";
  w.Release("step");
  for (int i = 0; i < 2; ++i) EXPECT_EQ(Collect((*streams)[i].get()).ids.size(), 40u);
  for (int i = 2; i < 4; ++i) EXPECT_FALSE(Collect((*streams)[i].get()).error.ok()) << "cancelled while queued";
  EXPECT_TRUE(WaitFor([&] { return w.held(0) == 0 && s.active() == 0; }));
}

// On a pipeline, requests cancelled while their fork step is in flight: the prefix sequence
// stays until that step is back (a stage may not have run it yet; the fake fails a fork whose
// source is gone), then the requests end cancelled and everything is freed.
TEST(Scheduler, APrefixLivesUntilItsForkStepsAreBack) {
  FakeWorkers w(2);
  Scheduler s(&w, nullptr, ChunksOf4());
  w.Hold("step");
  auto streams = s.SubmitAll(std::vector<GenerateParams>(2, Params(TenTokensFrom100(), 2)));
  ASSERT_TRUE(streams.ok());
  auto has_fork = [&] {
    for (const auto& step : w.steps())
      for (const auto& item : step.req.items())
        if (item.fork_from() != 0) return true;
    return false;
  };
  // The prefix's 3 chunks (2 calls each: the oldest held), answered one step at a time; the
  // forks go out behind them and stay held.
  for (int released = 0; released < 6; released += 2) {
    ASSERT_TRUE(WaitFor([&] { return w.HeldCalls("step") >= 2; }));
    w.ReleaseOldest("step", 2);
  }
  ASSERT_TRUE(WaitFor(has_fork));
  ASSERT_TRUE(WaitFor([&] { return w.HeldCalls("step") >= 2; }));
  for (const auto& st : *streams) st->Cancel();
  std::this_thread::sleep_for(50ms);   // turns of the scheduling thread while the forks are held
  EXPECT_EQ(w.held(0), 3u) << "the prefix sequence was freed under its fork step";
  w.Release("step");
  for (const auto& st : *streams) {
    Outcome o = Collect(st.get());
    EXPECT_TRUE(o.finished) << o.error.ToString();
    EXPECT_EQ(o.reason, flashmesh::v1::FINISH_REASON_CANCELLED);
  }
  EXPECT_TRUE(WaitFor([&] { return w.held(0) + w.held(1) == 0; }));
}

}  // namespace
}  // namespace fm
