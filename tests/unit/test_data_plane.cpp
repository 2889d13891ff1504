// worker/data_plane: two StageExecutors joined by real TCP transports on loopback (pushed frames,
// or a communicator link the receiving stage pulls from) give the same tokens, bit for bit, as
// one executor holding every layer; a frame that is not an
// activation of this stage's shape drops that connection and the next good one is served. The
// links pick the path of a device X: in place on a communicator that takes device buffers
// (NCCL), one copy to or from the host otherwise.
#include <gtest/gtest.h>
#include <signal.h>
#include <sys/wait.h>
#include <unistd.h>

#include <atomic>
#include <chrono>
#include <cstring>
#include <future>
#include <utility>
#include <thread>

#include "model/config.h"
#include "model/mkmodel.h"
#include "net/tcp_transport.h"
#include "tests/unit/stage_test_util.h"
#include "tests/unit/test_checkpoint_util.h"
#include "worker/data_plane.h"
#include "worker/shard_runtime.h"
#include "worker/stage_executor.h"

namespace fm {
namespace {

using namespace std::chrono_literals;

const std::string& Tiny() {
  static const std::string d = [] {
    const std::string p = testing_ck::TempDir("data_plane_tiny");
    EXPECT_TRUE(WritePresetCheckpoint(p, "tiny", 7).ok());
    return p;
  }();
  return d;
}

ShardPlacement Stage(int stage, int num_stages, int64_t begin, int64_t end) {
  return testing_stage::StagePlacement(Tiny(), stage, num_stages, begin, end);
}

std::unique_ptr<net::Transport> Transport(const std::string& name) { return testing_stage::LoopbackTransport(name); }

// Runs step `id` on every executor at once (as the coordinator does) and returns the samples.
std::vector<SampledId> Step(std::vector<StageExecutor*> stages, uint64_t id,
                            const std::vector<StepSlice>& slices) {
  std::vector<Status> st(stages.size());
  std::vector<SampledId> out;
  std::vector<std::thread> threads;
  const auto deadline = StageExecutor::Clock::now() + 20s;
  for (size_t i = 0; i < stages.size(); ++i)
    threads.emplace_back([&, i] {
      st[i] = stages[i]->RunStep(id, id - 1, slices, deadline, i + 1 == stages.size() ? &out : nullptr);
    });
  for (auto& t : threads) t.join();
  for (size_t i = 0; i < st.size(); ++i) EXPECT_TRUE(st[i].ok()) << "stage " << i << ": " << st[i].ToString();
  return out;
}

struct TwoStages {
  std::unique_ptr<net::Transport> t0 = Transport("s0"), t1 = Transport("s1");
  ShardRuntime r0{1}, r1{1};
  StageExecutor e0{&r0}, e1{&r1};
  ActivationReceiver recv1{t1.get(), &e1};

  explicit TwoStages(net::FrameDType dtype) {
    EXPECT_TRUE(r0.Load(Stage(0, 2, 0, 3)).ok());
    EXPECT_TRUE(r1.Load(Stage(1, 2, 3, -1)).ok());
    e0.SetNext(NewTransportActivationSink(t0.get(), "s1", t1->listen_address(), dtype));
    recv1.SetPeer("s0");
  }
  void Start(uint64_t seq) {
    SamplerConfig greedy;
    greedy.greedy = true;
    EXPECT_TRUE(r0.StartSequence(seq, 64, greedy).ok());
    EXPECT_TRUE(r1.StartSequence(seq, 64, greedy).ok());
  }
};

// Greedy continuation of `prompt` for `n` tokens through `stages` (all started for seq 1).
std::vector<int32_t> Decode(std::vector<StageExecutor*> stages, std::vector<int32_t> prompt, int n,
                            uint64_t* step) {
  std::vector<int32_t> out;
  std::vector<int32_t> next = std::move(prompt);
  for (int i = 0; i < n; ++i) {
    auto s = Step(stages, (*step)++, {StepSlice{1, next}});
    if (s.size() != 1) return out;
    out.push_back(s[0].id);
    next = {s[0].id};
  }
  return out;
}

// One executor holding every layer, sequence 1 started (context 64, greedy).
struct OneStage {
  ShardRuntime whole{1};
  StageExecutor single{&whole};
  OneStage() {
    EXPECT_TRUE(whole.Load(Stage(0, 1, 0, -1)).ok());
    SamplerConfig greedy;
    greedy.greedy = true;
    EXPECT_TRUE(whole.StartSequence(1, 64, greedy).ok());
  }
};

// The reference: one executor holding every layer decodes `n` tokens after `prompt`.
std::vector<int32_t> OneStageDecode(std::vector<int32_t> prompt, int n) {
  OneStage one;
  uint64_t step = 1;
  return Decode({&one.single}, std::move(prompt), n, &step);
}

// LoadShard's expert ranges route every expert id: ranges that leave some id to no member (or
// to one past the last) are refused by name before any group is used.
TEST(ShardRuntimeLoad, ExpertRangesThatDoNotCoverTheExpertsAreRefusedByName) {
  const std::vector<std::vector<int64_t>> bad = {{0, 1, 2}, {1, 4, 8}, {0, 6, 4, 8}, {0, 4, 9}};
  for (const auto& b : bad) {
    ShardPlacement p = Stage(0, 1, 0, -1);
    p.ep_expert_begin = b;
    ShardRuntime r(1);
    const Status s = r.Load(p);
    EXPECT_EQ(s.code(), Code::kInvalidArgument) << s.ToString();
    EXPECT_NE(s.message().find("shard.ep_expert_begin: ["), std::string::npos) << s.ToString();
    EXPECT_NE(s.message().find("the model's 8 routed experts"), std::string::npos) << s.ToString();
    EXPECT_FALSE(r.loaded());
  }
  ShardPlacement p = Stage(0, 1, 0, -1);
  p.ep_expert_begin = {0, 4, 8};   // good ranges: it gets as far as wanting its group
  ShardRuntime r(1);
  EXPECT_EQ(r.Load(p).message().find("shard.ep_expert_begin"), std::string::npos);
}

// A step's slices are checked before X is sized by them: a stage-0 step of far more tokens than
// the sequence's context is refused without embedding them (a StepBatch of tens of millions of
// ids would otherwise size X in terabytes and end the worker).
TEST(StageExecutorChecks, TooManyTokensAreRefusedBeforeXIsSized) {
  OneStage one;
  ASSERT_TRUE(one.whole.loaded() && one.whole.HasSequence(1));
  const std::vector<int32_t> many(100000, 5);
  std::vector<SampledId> out;
  const Status s =
      one.single.RunStep(1, 0, {StepSlice{1, many}}, StageExecutor::Clock::now() + 20s, &out);
  EXPECT_EQ(s.code(), Code::kOutOfRange) << s.ToString();
  EXPECT_NE(s.message().find("sequence 1: context beyond 64"), std::string::npos) << s.ToString();
  EXPECT_LT(one.whole.activations().rows(), 100000) << "X was sized for the refused step";
  uint64_t step = 2;
  EXPECT_EQ(Decode({&one.single}, {1, 2, 3}, 2, &step).size(), 2u) << "the sequence still runs";
}

// Slices that each fit their sequence but not together: one sequence listed 2000 times, or
// sequences whose tokens add up past the plan's largest step. Refused before X is sized.
TEST(StageExecutorChecks, ARepeatedSequenceOrTooManyRowsInAllAreRefusedBeforeXIsSized) {
  OneStage one;
  const std::vector<StepSlice> repeated(2000, StepSlice{1, std::vector<int32_t>(64, 5)});
  std::vector<SampledId> out;
  Status s = one.single.RunStep(1, 0, repeated, StageExecutor::Clock::now() + 20s, &out);
  EXPECT_EQ(s.code(), Code::kInvalidArgument) << s.ToString();
  EXPECT_NE(s.message().find("sequence 1 appears twice in the step"), std::string::npos) << s.ToString();
  EXPECT_LT(one.whole.activations().rows(), 128) << "X was sized for the refused step";

  ShardPlacement p = Stage(0, 1, 0, -1);
  p.max_step_rows = 100;
  ShardRuntime r(1);
  ASSERT_TRUE(r.Load(p).ok());
  StageExecutor e(&r);
  SamplerConfig greedy;
  greedy.greedy = true;
  for (uint64_t id : {1, 2}) ASSERT_TRUE(r.StartSequence(id, 64, greedy).ok());
  const std::vector<int32_t> sixty(60, 5);
  s = e.RunStep(1, 0, {StepSlice{1, sixty}, StepSlice{2, sixty}}, StageExecutor::Clock::now() + 20s, &out);
  EXPECT_EQ(s.code(), Code::kInvalidArgument) << s.ToString();
  EXPECT_NE(s.message().find("the step's 120 tokens exceed the 100 a step may carry"), std::string::npos)
      << s.ToString();
  EXPECT_LT(r.activations().rows(), 120);
  uint64_t step = 2;
  EXPECT_EQ(Decode({&e}, {1, 2, 3}, 2, &step).size(), 2u) << "the sequence still runs";
}

// A fork (StepSlice.fork_from) on a pipeline: every stage copies the source's state before the
// step runs, so the fork then decodes exactly as a sequence that ran the whole prompt, sampled
// (a repetition penalty reads the prompt the fork adopted) or greedy; the source is untouched.
TEST(StageExecutorForks, AForkOnEveryStageDecodesAsTheWholePrompt) {
  for (bool greedy : {true, false}) {
    TwoStages two(net::FrameDType::kF32);
    SamplerConfig cfg;
    cfg.greedy = greedy;
    cfg.temperature = 1.5f;
    cfg.seed = 11;
    cfg.repetition_penalty = 1.3f;
    for (uint64_t seq : {1, 2, 3}) {
      ASSERT_TRUE(two.r0.StartSequence(seq, 64, cfg).ok());
      ASSERT_TRUE(two.r1.StartSequence(seq, 64, cfg).ok());
    }
    const std::vector<int32_t> prompt = {5, 9, 13, 5, 22, 31, 9, 40};
    const std::vector<int32_t> prefix(prompt.begin(), prompt.end() - 1);
    uint64_t step = 1;
    EXPECT_TRUE(Step({&two.e0, &two.e1}, step++, {StepSlice{1, prefix, false}}).empty());
    auto whole = Step({&two.e0, &two.e1}, step++, {StepSlice{3, prompt}});
    const auto first = whole;
    auto fork = Step({&two.e0, &two.e1}, step++, {StepSlice{2, {prompt.back()}, true, 1}});
    for (int t = 0; t < 6 && whole.size() == 1 && fork.size() == 1; ++t) {
      EXPECT_EQ(fork[0].id, whole[0].id) << "token " << t << (greedy ? " greedy" : " sampled");
      EXPECT_EQ(fork[0].logprob, whole[0].logprob) << "token " << t;
      whole = Step({&two.e0, &two.e1}, step++, {StepSlice{3, {whole[0].id}}});
      fork = Step({&two.e0, &two.e1}, step++, {StepSlice{2, {fork[0].id}}});
    }
    ASSERT_EQ(whole.size(), 1u);
    ASSERT_EQ(fork.size(), 1u);
    EXPECT_EQ(fork[0].id, whole[0].id);
    // The source, untouched by the fork: its own last token gives the whole prompt's first.
    const auto source = Step({&two.e0, &two.e1}, step++, {StepSlice{1, {prompt.back()}}});
    ASSERT_EQ(source.size(), 1u);
    ASSERT_EQ(first.size(), 1u);
    EXPECT_EQ(source[0].id, first[0].id);
    EXPECT_EQ(source[0].logprob, first[0].logprob);
  }
}

// A fork the worker cannot make is refused by name before anything runs: from itself, from a
// sequence it does not hold, from one forked in the same step, into one that has run, or past
// the fork's context.
TEST(StageExecutorForks, BadForksAreRefusedByName) {
  OneStage one;
  SamplerConfig greedy;
  greedy.greedy = true;
  for (uint64_t id : {2, 3}) ASSERT_TRUE(one.whole.StartSequence(id, 64, greedy).ok());
  ASSERT_TRUE(one.whole.StartSequence(4, 5, greedy).ok());
  std::vector<SampledId> out;
  uint64_t step = 1;
  auto run = [&](std::vector<StepSlice> slices) {
    return one.single.RunStep(step, step - 1, std::move(slices), StageExecutor::Clock::now() + 20s, &out);
  };
  ASSERT_TRUE(run({StepSlice{1, {1, 2, 3, 4}, false}}).ok());
  ++step;
  const std::pair<std::vector<StepSlice>, std::string> bad[] = {
      {{StepSlice{2, {5}, true, 2}}, "sequence 2 is forked from itself"},
      {{StepSlice{2, {5}, true, 9}}, "sequence 9, which sequence 2 is forked from, is not held here"},
      {{StepSlice{2, {5}, true, 1}, StepSlice{3, {5}, true, 2}},
       "sequence 2, which sequence 3 is forked from, is forked in the same step"},
      {{StepSlice{1, {5}, true, 2}}, "sequence 1 is forked at position 4"},
      {{StepSlice{4, {5, 6}, true, 1}}, "sequence 4: context beyond 5"},
  };
  for (const auto& [slices, why] : bad) {
    const Status s = run(slices);
    EXPECT_FALSE(s.ok()) << why;
    EXPECT_NE(s.message().find(why), std::string::npos) << s.ToString();
    ++step;
  }
  EXPECT_EQ(one.whole.activations().rows(), 4) << "a refused step ran nothing";
  // The last stage's sampler cannot take the prompt (its repetition penalty reads it, the
  // source kept none): refused before any copy, so the sequence later runs from position 0.
  SamplerConfig penalized = greedy;
  penalized.repetition_penalty = 1.2f;
  ASSERT_TRUE(one.whole.StartSequence(5, 64, penalized).ok());
  Status s = run({StepSlice{5, {5}, true, 1}});
  EXPECT_NE(s.message().find("sequence 5 cannot be forked from sequence 1: the sequence forked from has "
                             "no repetition_penalty"), std::string::npos) << s.ToString();
  ++step;
  s = run({StepSlice{5, std::vector<int32_t>(61, 7)}});
  EXPECT_TRUE(s.ok()) << "61 tokens from position 0 fit 64: " << s.ToString();
  ++step;
  const Status ok = run({StepSlice{4, {5}, true, 1}});
  EXPECT_TRUE(ok.ok()) << ok.ToString();
  EXPECT_EQ(out.size(), 1u);
}

// A step id at or below the last one run is a repeat: refused, the KV not advanced again.
TEST(StageExecutorChecks, ARepeatedStepIdIsRefused) {
  OneStage one;
  std::vector<SampledId> out;
  ASSERT_TRUE(one.single.RunStep(7, 0, {StepSlice{1, {5, 6}}}, StageExecutor::Clock::now() + 20s, &out).ok());
  for (uint64_t id : {7, 3}) {
    const Status s = one.single.RunStep(id, 0, {StepSlice{1, {9}}}, StageExecutor::Clock::now() + 20s, &out);
    EXPECT_EQ(s.code(), Code::kInvalidArgument) << s.ToString();
    EXPECT_NE(s.message().find("step " + std::to_string(id) + " is not after the last step run (7)"),
              std::string::npos) << s.ToString();
  }
  // The next step samples what it samples without the refused ones.
  ASSERT_TRUE(one.single.RunStep(8, 7, {StepSlice{1, {9}}}, StageExecutor::Clock::now() + 20s, &out).ok());
  OneStage fresh;
  std::vector<SampledId> want;
  ASSERT_TRUE(fresh.single.RunStep(1, 0, {StepSlice{1, {5, 6}}}, StageExecutor::Clock::now() + 20s, &want).ok());
  ASSERT_TRUE(fresh.single.RunStep(2, 1, {StepSlice{1, {9}}}, StageExecutor::Clock::now() + 20s, &want).ok());
  ASSERT_EQ(out.size(), 1u);
  ASSERT_EQ(want.size(), 1u);
  EXPECT_EQ(out[0].id, want[0].id);
  EXPECT_EQ(out[0].logprob, want[0].logprob);
}

// An f32 ACTIVATION frame of step `step`: [rows, row_floats] zeros.
net::Frame ZeroActivation(uint64_t step, int64_t rows, int64_t row_floats) {
  net::Frame f;
  f.header.kind = net::FrameKind::kActivation;
  f.header.dtype = net::FrameDType::kF32;
  f.header.step_id = step;
  f.header.set_shape({static_cast<uint32_t>(rows), static_cast<uint32_t>(row_floats)});
  f.payload.assign(static_cast<size_t>(rows * row_floats) * sizeof(float), 0);
  return f;
}

// A frame is checked against the shard it arrives for, and a LoadShard may replace that shard
// before the frame's step runs (a wider hc*H would read past the payload): the swap drops the
// inbox, and the copy into X checks the frame against X again.
TEST(StageExecutorChecks, AFrameFromBeforeAShardSwapIsNotUsed) {
  ShardRuntime r(1);
  ASSERT_TRUE(r.Load(Stage(1, 2, 3, -1)).ok());
  StageExecutor e(&r);
  SamplerConfig greedy;
  greedy.greedy = true;
  ASSERT_TRUE(r.StartSequence(1, 64, greedy).ok());
  const int64_t rf = r.row_floats();
  const net::Frame f = ZeroActivation(5, 3, rf);
  ASSERT_TRUE(e.Receive(f).ok());
  ASSERT_TRUE(e.Exclusive([] { return Status::Ok(); }).ok());
  std::vector<SampledId> out;
  const Status s = e.RunStep(5, 0, {StepSlice{1, {5, 6, 7}}}, StageExecutor::Clock::now() + 300ms, &out);
  EXPECT_EQ(s.code(), Code::kDeadlineExceeded) << s.ToString();
  EXPECT_NE(s.message().find("waited too long for its input"), std::string::npos) << s.ToString();

  auto wider = NewHostActivations(2 * rf);
  ASSERT_TRUE(wider->Resize(3).ok());
  const Status copy = CopyPayloadIn(f, wider.get());
  EXPECT_EQ(copy.code(), Code::kInvalidArgument) << copy.ToString();
  EXPECT_NE(copy.message().find("the step wants [3, " + std::to_string(2 * rf) + "]"),
            std::string::npos) << copy.ToString();
}

// The inbox holds at most max(4, stages + 1) of the largest step's frames, as the transport
// bounds a peer's unread frames: the receiver moves them on at once, so the count alone (64
// frames of up to 8 GiB at V4's max_step_rows) bounded nothing. On a deep pipeline a slow stage
// may find every step in flight (one a stage) queued by the stage before it: with 4, a burst of
// chunked prompts on pp8 was dropped (a review found it) and its steps hung until the deadline.
TEST(StageExecutorChecks, TheInboxHoldsAStepPerStageAndAtLeastFourOfTheLargest) {
  for (const auto& [stages, fit] : {std::pair<int, uint64_t>{2, 4}, {8, 9}}) {
    ShardPlacement p = Stage(1, stages, 3, -1);
    p.max_step_rows = 4;
    ShardRuntime r(1);
    ASSERT_TRUE(r.Load(p).ok());
    StageExecutor e(&r);
    const int64_t rf = r.row_floats();
    auto frame = [&](uint64_t step) { return ZeroActivation(step, 4, rf); };
    for (uint64_t step = 1; step <= fit; ++step)
      ASSERT_TRUE(e.Receive(frame(step)).ok()) << stages << " stages, step " << step;
    EXPECT_TRUE(e.Receive(frame(fit)).ok()) << "a repeat replaces its frame";
    const Status s = e.Receive(frame(fit + 1));
    EXPECT_EQ(s.code(), Code::kResourceExhausted) << s.ToString();
    EXPECT_NE(s.message().find("at most " + std::to_string(fit * 4 * rf * 4)), std::string::npos)
        << s.ToString();
  }
}

// The KV budget charges each sequence its bytes at max_context when it starts (a CPU cache holds
// almost nothing until it decodes): two fit a budget of two, a third is refused by name until
// one is freed, and a sequence decoded to its max_context holds no more than it was charged.
TEST(ShardRuntimeKv, TheBudgetChargesEachSequenceItsBytesAtMaxContext) {
  ShardRuntime probe(1);
  ASSERT_TRUE(probe.Load(Stage(0, 1, 0, -1)).ok());
  const ModelConfig& cfg = probe.config();
  uint64_t charge = 0;  // every layer (this shard loads no MTP layer)
  for (int64_t l = 0; l < cfg.num_hidden_layers; ++l) charge += KvBytesPerSequence(cfg, l, 64);
  ShardPlacement p = Stage(0, 1, 0, -1);
  p.kv_cache_bytes = 2 * charge + charge / 2;
  ShardRuntime r(1);
  ASSERT_TRUE(r.Load(p).ok());
  StageExecutor e(&r);
  SamplerConfig greedy;
  greedy.greedy = true;
  ASSERT_TRUE(r.StartSequence(1, 64, greedy).ok());
  ASSERT_TRUE(r.StartSequence(2, 64, greedy).ok());
  const Status full = r.StartSequence(3, 64, greedy);
  EXPECT_EQ(full.code(), Code::kResourceExhausted) << full.ToString();
  EXPECT_NE(full.message().find("KV cache budget of " + std::to_string(p.kv_cache_bytes) +
                                " bytes is full: 2 sequences hold " + std::to_string(2 * charge)),
            std::string::npos) << full.ToString();
  EXPECT_FALSE(r.HasSequence(3));
  uint64_t step = 1;
  // A Stats call reads kv_bytes() while the executor grows the caches: what it reads only
  // grows (and ThreadSanitizer, which runs this test in CI, sees no race).
  std::atomic<bool> decoding{true};
  uint64_t last_read = 0;
  bool only_grew = true;
  std::thread stats([&] {
    while (decoding) {
      const uint64_t b = r.kv_bytes();
      only_grew = only_grew && b >= last_read;
      last_read = b;
    }
  });
  EXPECT_EQ(Decode({&e}, std::vector<int32_t>(32, 7), 32, &step).size(), 32u);
  decoding = false;
  stats.join();
  EXPECT_TRUE(only_grew);
  EXPECT_LE(last_read, r.kv_bytes());
  EXPECT_GT(r.kv_bytes(), 0u);
  EXPECT_LE(r.kv_bytes(), 2 * charge) << "sequence 1 at its max_context holds more than charged";
  // A queued free gives the budget back at once (the coordinator starts the next sequence as
  // soon as it has sent the free), before the executor frees the sequence.
  r.Uncharge({2});
  EXPECT_TRUE(r.HasSequence(2));
  EXPECT_TRUE(r.StartSequence(3, 64, greedy).ok());
}

// A free waits for at most the running step, also when the next step is always ready (two
// streams submitting back to back): it used to contend for the executor's mutex with the loop,
// which took it again at once, and waited for seconds.
TEST(StageExecutorFree, AFreeUnderBackToBackStepsEndsWithinAStepOrTwo) {
  ShardRuntime r(1);
  ASSERT_TRUE(r.Load(Stage(0, 1, 0, -1)).ok());
  StageExecutor e(&r);
  SamplerConfig greedy;
  greedy.greedy = true;
  for (uint64_t id : {1, 2, 3}) ASSERT_TRUE(r.StartSequence(id, 4000, greedy).ok());
  std::atomic<uint64_t> next_step{1};
  std::atomic<bool> stop{false};
  std::atomic<int> steps{0};
  std::vector<std::thread> load;
  for (uint64_t seq : {1, 2})
    load.emplace_back([&, seq] {
      std::vector<SampledId> out;
      for (int i = 0; i < 240 && !stop; ++i) {  // 16 tokens a step: 3840 of the 4000
        const Status st = e.RunStep(next_step++, 0, {StepSlice{seq, std::vector<int32_t>(16, 5)}},
                                    StageExecutor::Clock::now() + 10s, &out);
        if (st.code() == Code::kInvalidArgument) continue;  // the other stream's later id ran first
        if (!st.ok()) break;
        ++steps;
      }
    });
  while (steps < 20) std::this_thread::sleep_for(1ms);
  const auto t0 = std::chrono::steady_clock::now();
  e.Free({3});
  const double worst_ms = std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - t0).count();
  const int during = steps;
  stop = true;
  for (auto& t : load) t.join();
  EXPECT_FALSE(r.HasSequence(3));
  EXPECT_TRUE(r.HasSequence(1) && r.HasSequence(2));
  EXPECT_LT(during, 480) << "the free waited for all the steps to end";
  EXPECT_LT(worst_ms, 500.0) << "steps kept running: " << during;
}

TEST(DataPlane, TwoStagesOverTcpEqualOneStageTokenForToken) {
  const std::vector<int32_t> want = OneStageDecode({5, 17, 42, 99}, 6);
  ASSERT_EQ(want.size(), 6u);
  TwoStages two(net::FrameDType::kF32);
  two.Start(1);
  uint64_t step = 1;
  EXPECT_EQ(Decode({&two.e0, &two.e1}, {5, 17, 42, 99}, 6, &step), want);
  // One frame per step: header + rows of [hc*H] f32 (4 prompt rows + 5 decode rows) + the
  // 16-byte tag (the transports share a secret).
  const uint64_t rows = 4 + 5;
  EXPECT_EQ(two.t0->stats().bytes_sent, 6 * (64 + 16) + rows * two.r0.row_floats() * 4);
  EXPECT_EQ(two.recv1.frames_rejected(), 0u);
}

TEST(DataPlane, FrameOfTheWrongKindOrShapeDropsOnlyThatConnection) {
  TwoStages two(net::FrameDType::kF32);
  two.Start(1);
  std::vector<float> junk(3 * 5, 1.f);
  net::FrameHeader control;
  control.kind = net::FrameKind::kControl;
  control.dtype = net::FrameDType::kU8;
  control.set_shape({4});
  net::FrameHeader bad_shape;   // an activation whose rows are not hc*H wide
  bad_shape.set_shape({3, 5});
  const std::pair<net::FrameHeader, size_t> frames[] = {{control, 4}, {bad_shape, junk.size() * 4}};
  uint64_t rejected = 0;
  for (const auto& [header, nbytes] : frames) {
    ASSERT_TRUE(two.t0->Connect("s1", two.t1->listen_address(), 5000ms).ok());
    ASSERT_TRUE(two.t0->Send("s1", header, junk.data(), nbytes, 5000ms).ok());
    ++rejected;
    const auto deadline = std::chrono::steady_clock::now() + 5s;
    while ((two.recv1.frames_rejected() < rejected || two.t0->IsConnected("s1")) &&
           std::chrono::steady_clock::now() < deadline)
      std::this_thread::sleep_for(5ms);
    EXPECT_EQ(two.recv1.frames_rejected(), rejected);
    EXPECT_FALSE(two.t0->IsConnected("s1")) << "the receiver closes a connection that sent junk";
  }
  // The sink dials again on its next send; the stage keeps serving.
  uint64_t step = 1;
  EXPECT_EQ(Decode({&two.e0, &two.e1}, {1, 2, 3}, 2, &step).size(), 2u);
}

// A refused frame for a step that waits fails that step at once, naming the peer and the
// reason, instead of leaving it to its deadline.
TEST(DataPlane, ARefusedFrameFailsTheStepWaitingForItAtOnce) {
  TwoStages two(net::FrameDType::kF32);
  two.Start(1);
  Status st;
  std::atomic<bool> ended{false};
  const auto t0 = std::chrono::steady_clock::now();
  std::thread waiting([&] {
    st = two.e1.RunStep(7, 0, {StepSlice{1, {1, 2}}}, StageExecutor::Clock::now() + 30s, nullptr);
    ended = true;
  });
  std::vector<float> junk(3 * 5, 1.f);
  net::FrameHeader bad_shape;
  bad_shape.step_id = 7;
  bad_shape.set_shape({3, 5});
  // Until step 7 has ended: a frame refused before the step is queued fails nothing.
  while (!ended && std::chrono::steady_clock::now() - t0 < 10s) {
    if (!two.t0->IsConnected("s1")) {
      ASSERT_TRUE(two.t0->Connect("s1", two.t1->listen_address(), 5000ms).ok());
    }
    (void)two.t0->Send("s1", bad_shape, junk.data(), junk.size() * 4, 5000ms);
    std::this_thread::sleep_for(20ms);
  }
  waiting.join();
  EXPECT_LT(std::chrono::steady_clock::now() - t0, 10s);
  EXPECT_EQ(st.code(), Code::kUnavailable) << st.ToString();
  EXPECT_NE(st.message().find("the input from 's0' was refused: activation of step 7: shape [3, 5]"),
            std::string::npos) << st.ToString();
  // After the coordinator's reset the stages serve again (once the sender saw the close: the
  // sink dials again on its next send).
  while (two.t0->IsConnected("s1") && std::chrono::steady_clock::now() - t0 < 20s)
    std::this_thread::sleep_for(5ms);
  two.e0.Reset();
  two.e1.Reset();
  two.Start(1);
  uint64_t step = 1;
  EXPECT_EQ(Decode({&two.e0, &two.e1}, {1, 2, 3}, 2, &step).size(), 2u);
}

// The frame can come before the coordinator's StepBatch queues its step: the refusal is kept,
// and the step fails as soon as it is queued, not at its deadline.
TEST(DataPlane, AFrameRefusedBeforeItsStepIsQueuedFailsThatStepWhenItComes) {
  TwoStages two(net::FrameDType::kF32);
  two.Start(1);
  std::vector<float> junk(3 * 5, 1.f);
  net::FrameHeader bad_shape;
  bad_shape.step_id = 7;
  bad_shape.set_shape({3, 5});
  ASSERT_TRUE(two.t0->Connect("s1", two.t1->listen_address(), 5000ms).ok());
  ASSERT_TRUE(two.t0->Send("s1", bad_shape, junk.data(), junk.size() * 4, 5000ms).ok());
  const auto t0 = std::chrono::steady_clock::now();
  while (two.recv1.frames_rejected() == 0 && std::chrono::steady_clock::now() - t0 < 10s)
    std::this_thread::sleep_for(5ms);
  ASSERT_EQ(two.recv1.frames_rejected(), 1u);
  const auto queued = std::chrono::steady_clock::now();
  Status st = two.e1.RunStep(7, 0, {StepSlice{1, {1, 2}}}, StageExecutor::Clock::now() + 30s, nullptr);
  EXPECT_LT(std::chrono::steady_clock::now() - queued, 5s);
  EXPECT_EQ(st.code(), Code::kUnavailable) << st.ToString();
  EXPECT_NE(st.message().find("the input from 's0' was refused: activation of step 7: shape [3, 5]"),
            std::string::npos) << st.ToString();
  // Once: the refusal went with the step it failed, so steps 1 to 7 run when their input is
  // good (once the sender saw the close: the sink dials again on its next send).
  while (two.t0->IsConnected("s1") && std::chrono::steady_clock::now() - t0 < 20s)
    std::this_thread::sleep_for(5ms);
  uint64_t step = 1;
  EXPECT_EQ(Decode({&two.e0, &two.e1}, {1, 2, 3}, 7, &step).size(), 7u);
}

TEST(DataPlane, Bf16FramesHalveThePayloadAndStillDecode) {
  TwoStages two(net::FrameDType::kBF16);
  two.Start(1);
  uint64_t step = 1;
  EXPECT_EQ(Decode({&two.e0, &two.e1}, {5, 17, 42}, 3, &step).size(), 3u);
  const uint64_t rows = 3 + 2;
  EXPECT_EQ(two.t0->stats().bytes_sent, 3 * (64 + 16) + rows * two.r0.row_floats() * 2);
}

// The stages of `transport: nccl` pull their input through a communicator link (sender rank 0,
// receiver rank 1); the TCP communicator stands in for NCCL's here.
struct LinkedStages {
  std::unique_ptr<net::Transport> t0 = Transport("s0"), t1 = Transport("s1");
  std::unique_ptr<net::Communicator> c0, c1;
  ShardRuntime r0{1}, r1{1};
  StageExecutor e0{&r0}, e1{&r1};

  LinkedStages() {
    const std::vector<net::CommMember> m = {{"s0", t0->listen_address()}, {"s1", t1->listen_address()}};
    c0 = std::move(net::MakeTcpCommunicator(t0.get(), m, 0)).value();
    c1 = std::move(net::MakeTcpCommunicator(t1.get(), m, 1)).value();
    EXPECT_TRUE(r0.Load(Stage(0, 2, 0, 3)).ok());
    EXPECT_TRUE(r1.Load(Stage(1, 2, 3, -1)).ok());
    e0.SetNext(NewCommActivationSink(c0.get(), 1, net::FrameDType::kF32));
    e1.SetPrev(NewCommActivationSource(c1.get(), 0, net::FrameDType::kF32));
    SamplerConfig greedy;
    greedy.greedy = true;
    EXPECT_TRUE(r0.StartSequence(1, 64, greedy).ok());
    EXPECT_TRUE(r1.StartSequence(1, 64, greedy).ok());
  }
};

TEST(DataPlane, TwoStagesOverACommunicatorLinkEqualOneStageTokenForToken) {
  const std::vector<int32_t> want = OneStageDecode({5, 17, 42, 99}, 5);
  ASSERT_EQ(want.size(), 5u);
  LinkedStages two;
  uint64_t step = 1;
  EXPECT_EQ(Decode({&two.e0, &two.e1}, {5, 17, 42, 99}, 5, &step), want);
}

// A frame of the wrong shape fails the receiving step naming it; a reset ends a receive that
// waits for a step the previous stage never sends, well before the step's deadline.
TEST(DataPlane, CommunicatorLinkChecksTheShapeAndAResetEndsItsWait) {
  LinkedStages two;
  std::vector<float> junk(3 * 5, 1.f);
  net::CommBuffer bad{net::FrameDType::kF32, {3, 5}, junk.data(), junk.size() * 4};
  std::thread sender([&] {
    EXPECT_TRUE(two.c0->Send(1, net::FrameKind::kActivation, 1, 0, bad, 10000ms).ok());
  });
  const auto deadline = StageExecutor::Clock::now() + 20s;
  Status st = two.e1.RunStep(1, 0, {StepSlice{1, {5, 6, 7}}}, deadline, nullptr);
  sender.join();
  EXPECT_EQ(st.code(), Code::kInvalidArgument) << st.ToString();
  EXPECT_NE(st.message().find("[3, 5], want [3, "), std::string::npos) << st.ToString();

  const auto t0 = StageExecutor::Clock::now();
  std::thread reset([&] {
    std::this_thread::sleep_for(300ms);
    two.e1.Reset();
  });
  st = two.e1.RunStep(2, 0, {StepSlice{1, {5}}}, t0 + 20s, nullptr);
  reset.join();
  EXPECT_FALSE(st.ok());
  EXPECT_LT(StageExecutor::Clock::now() - t0, 5s) << st.ToString();
}

}  // namespace
}  // namespace fm
