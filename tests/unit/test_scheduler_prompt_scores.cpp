// The Scheduler's prompt logprobs (GenerateParams.sampling.prompt_logprobs) against the fake
// cluster (scheduler_fake_workers.h): chunks carry the token after them, the scores come in one
// event before the first token whatever order the steps come back in, and a worker's missing,
// misplaced or failed scores end the step or that request alone.
#include <gtest/gtest.h>

#include "tests/unit/scheduler_fake_workers.h"

namespace fm {
namespace {

using namespace std::chrono_literals;
using namespace scheduler_test;

GenerateParams Scored(std::vector<int32_t> prompt, int64_t max_tokens) {
  GenerateParams p = Params(std::move(prompt), max_tokens);
  p.sampling.set_prompt_logprobs(1);
  return p;
}

// Every event of a request in order: 'P' (its scores), 'T' (a token), 'F' (finish), 'E' (error).
struct Events {
  std::string kinds;
  flashmesh::v1::PromptLogprobs prompt;
  std::vector<int32_t> ids;
  Status error;
};
Events Drain(RequestStream* s) {
  Events e;
  const auto until = Clock::now() + 5s;
  RequestStream::Event ev;
  while (Clock::now() < until) {
    if (!s->Pop(&ev, 20ms)) continue;
    if (ev.kind == RequestStream::Event::kPrompt) {
      e.kinds += 'P';
      e.prompt = ev.prompt;
    } else if (ev.kind == RequestStream::Event::kToken) {
      e.kinds += 'T';
      e.ids.push_back(ev.token.id());
    } else {
      e.kinds += ev.kind == RequestStream::Event::kFinish ? 'F' : 'E';
      e.error = ev.error;
      return e;
    }
  }
  return e;
}

// A prompt of 8 tokens in chunks of 4 on a 2-stage pipeline: the first chunk tells the last
// stage the second's first token. The second (last) chunk's step comes back first: its token
// waits for the first chunk's scores, and the scores of positions 1..7 come in one event before
// it, each with the alternatives asked for and no more.
TEST(SchedulerPromptScores, TheScoresComeBeforeTheFirstTokenWhateverOrderTheStepsComeBackIn) {
  FakeWorkers w(2);
  Scheduler s(&w, nullptr, ChunksOf4());
  w.Hold("step");
  auto r = s.Submit(Scored({10, 11, 12, 13, 14, 15, 16, 17}, 2));
  ASSERT_TRUE(r.ok());
  ASSERT_TRUE(WaitFor([&] { return w.HeldCalls("step") == 4; }));   // both chunks, both stages
  w.ReleaseNewest("step", 2);
  RequestStream::Event ev;
  EXPECT_FALSE((*r)->Pop(&ev, 100ms)) << "the first token waits for the first chunk's scores";
  w.Release("step");
  Events e = Drain(r->get());
  EXPECT_EQ(e.kinds, "PTTF");
  EXPECT_EQ(e.ids, (std::vector<int32_t>{18, 19}));
  ASSERT_EQ(e.prompt.tokens_size(), 7);
  for (int k = 0; k < 7; ++k) {
    EXPECT_EQ(e.prompt.tokens(k).id(), 11 + k);
    EXPECT_EQ(e.prompt.tokens(k).logprob(), -static_cast<float>(k + 1));
    ASSERT_EQ(e.prompt.tokens(k).top_logprobs_size(), 1);
    EXPECT_EQ(e.prompt.tokens(k).top_logprobs(0).id(), 111 + k);
  }
  std::vector<int32_t> next_tokens;
  for (const auto& step : w.steps())
    if (step.worker == 0)
      for (const auto& item : step.req.items()) next_tokens.push_back(item.has_next_token() ? item.next_token() : -1);
  EXPECT_EQ(next_tokens, (std::vector<int32_t>{14, -1, -1})) << "the first chunk names the next one's first token";
}

// Requests that score their prompt do not share its prefill (each runs all of it); a prompt of
// one token has nothing to score: an empty event, then its token.
TEST(SchedulerPromptScores, ScoringRequestsPrefillAloneAndAOneTokenPromptScoresNothing) {
  FakeWorkers w(1);
  Scheduler s(&w, nullptr, SchedulerLimits{});
  auto both = s.SubmitAll({Scored({5, 6, 7}, 1), Scored({5, 6, 7}, 1)});
  ASSERT_TRUE(both.ok());
  for (const auto& stream : *both) {
    Events e = Drain(stream.get());
    EXPECT_EQ(e.kinds, "PTF");
    EXPECT_EQ(e.prompt.tokens_size(), 2);
  }
  for (const auto& step : w.steps())
    for (const auto& item : step.req.items()) {
      EXPECT_EQ(item.fork_from(), 0u);
      EXPECT_EQ(item.tokens_size(), 3);
    }
  auto one = s.Submit(Scored({9}, 1));
  ASSERT_TRUE(one.ok());
  Events e = Drain(one->get());
  EXPECT_EQ(e.kinds, "PTF");
  EXPECT_EQ(e.prompt.tokens_size(), 0);
}

// A worker's scores must cover exactly what the step was due: none, others' positions or other
// ids fail the step (every request, the workers reset), naming the node and the sequence.
TEST(SchedulerPromptScores, ScoresThatAreNotTheOnesDueFailTheStep) {
  struct Case {
    std::function<void(flashmesh::v1::StepBatchResponse*)> rewrite;
    std::string want;
  };
  const Case cases[] = {
      {[](auto* r) { r->clear_prompt_scores(); }, "the last stage returned no prompt logprobs for sequence 1 of step {step}"},
      {[](auto* r) { r->mutable_prompt_scores(0)->set_first(2); },
       "node w0 (fake:0) returned the scores of prompt positions [2, 6) of sequence 1 of step {step}, due [1, 5)"},
      {[](auto* r) { r->mutable_prompt_scores(0)->mutable_tokens(1)->set_id(99); },
       "node w0 (fake:0) scored token 99 at prompt position 2 of sequence 1 of step {step}, which holds 12"},
      {[](auto* r) { r->add_prompt_scores()->set_seq_id(7); },
       "node w0 (fake:0) returned prompt logprobs for sequence 7 of step {step}, which were not due"},
  };
  for (const Case& c : cases) {
    FakeWorkers w(1);
    w.SetTokenRewrite(c.rewrite);
    Scheduler s(&w, nullptr, ChunksOf4());
    auto r = s.Submit(Scored({10, 11, 12, 13, 14}, 1));
    ASSERT_TRUE(r.ok());
    Events e = Drain(r->get());
    EXPECT_EQ(e.kinds, "E");
    EXPECT_EQ(e.error.code(), Code::kInternal);
    ASSERT_FALSE(w.steps().empty());
    std::string want = c.want;
    want.replace(want.find("{step}"), 6, std::to_string(w.steps()[0].req.step_id()));
    EXPECT_EQ(e.error.message(), want);
  }
}

// A chunk whose rows could not be scored (the model's NaN) ends that request alone, once its
// chunks in flight are back, freed on every worker; a request beside it gets its tokens.
TEST(SchedulerPromptScores, ARowThatCouldNotBeScoredEndsOnlyItsRequest) {
  FakeWorkers w(2);
  w.SetTokenRewrite([](flashmesh::v1::StepBatchResponse* r) {
    for (auto& p : *r->mutable_prompt_scores())
      if (p.first() == 1) {
        p.clear_tokens();
        p.set_error("prompt position 3: logits[4] is NaN");
      }
  });
  Scheduler s(&w, nullptr, ChunksOf4());
  w.Hold("step");
  auto bad = s.Submit(Scored({10, 11, 12, 13, 14, 15, 16, 17, 18, 19}, 2));
  ASSERT_TRUE(bad.ok());
  ASSERT_TRUE(WaitFor([&] { return w.HeldCalls("step") == 4; }));
  auto good = s.Submit(Params({3, 4}, 3));
  ASSERT_TRUE(good.ok());
  w.Release("step");
  Events e = Drain(bad->get());
  EXPECT_EQ(e.kinds, "E");
  EXPECT_EQ(e.error.code(), Code::kInternal);
  EXPECT_EQ(e.error.message(),
            "the prompt of sequence 1 could not be scored: node w1: prompt position 3: logits[4] is NaN");
  Outcome o = Collect(good->get());
  EXPECT_TRUE(o.finished);
  EXPECT_EQ(o.ids, (std::vector<int32_t>{5, 6, 7}));
  EXPECT_TRUE(WaitFor([&] { return w.held(0) == 0 && w.held(1) == 0; }));
  for (const auto& step : w.steps())
    for (const auto& item : step.req.items())
      EXPECT_FALSE(item.seq_id() == 1 && item.tokens(0) == 18) << "no chunk is sent after the failed one";
}

// However large max_step_tokens is, a scored prompt goes in chunks of at most 16384 rows (the
// last stage's reply stays far below the 16 MiB a coordinator takes from a worker); the same
// prompt unscored goes whole.
TEST(SchedulerPromptScores, AScoredPromptsChunksStayWithinTheReplyCap) {
  FakeWorkers w(1);
  SchedulerLimits limits;
  limits.max_step_tokens = 40000;
  limits.max_context = 65536;
  Scheduler s(&w, nullptr, limits);
  std::vector<int32_t> prompt(20000, 7);
  auto scored = s.Submit(Scored(prompt, 1));
  ASSERT_TRUE(scored.ok());
  Events e = Drain(scored->get());
  EXPECT_EQ(e.kinds, "PTF");
  EXPECT_EQ(e.prompt.tokens_size(), 19999);
  auto plain = s.Submit(Params(prompt, 1));
  ASSERT_TRUE(plain.ok());
  EXPECT_TRUE(Collect(plain->get()).finished);
  std::vector<int> sizes;
  for (const auto& step : w.steps())
    for (const auto& item : step.req.items()) sizes.push_back(item.tokens_size());
  EXPECT_EQ(sizes, (std::vector<int>{16384, 3616, 20000}));
}

}  // namespace
}  // namespace fm
