// ShardModel on the tiny preset (6 layers [0,0,4,128,4,128] + MTP, hash layers 0-1, 8 experts
// top-2, hidden 64, hc 4, vocab 512, window 16): decode == prefill, batched == alone, threads,
// hash routing, pipeline split, the local expert executor, MTP, and bad requests.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <limits>
#include <cstdio>
#include <cstdlib>
#include <fstream>
#include <filesystem>
#include <memory>
#include <random>
#include <string>
#include <vector>

#include "kernels/cpu/swiglu.h"
#include "model/checkpoint.h"
#include "model/forward.h"
#include "model/kv_cache.h"
#include "model/mkmodel.h"
#include "model/moe.h"
#include "tests/model_test_util.h"

namespace fm {
namespace {

using modeltest::RelErr;

class ForwardTest : public ::testing::Test {
 protected:
  static void SetUpTestSuite() {
    char tmpl[] = "/tmp/fm_forward_XXXXXX";
    ASSERT_NE(mkdtemp(tmpl), nullptr);
    dir_ = new std::string(tmpl);
    Status st = WritePresetCheckpoint(*dir_, "tiny", 7);
    ASSERT_TRUE(st.ok()) << st.ToString();
  }
  static void TearDownTestSuite() {
    std::filesystem::remove_all(*dir_);
    delete dir_;
  }

  struct Model {
    std::unique_ptr<Checkpoint> ckpt;
    std::unique_ptr<ShardModel> shard;
  };
  static Model Open(ThreadPool* pool, const ShardSelection& sel = {}) {
    Model m;
    auto ck = Checkpoint::Open(*dir_, sel);
    EXPECT_TRUE(ck.ok()) << ck.status().ToString();
    if (!ck.ok()) return m;
    m.ckpt = std::move(ck).value();
    auto sh = ShardModel::Create(*m.ckpt, pool);
    EXPECT_TRUE(sh.ok()) << sh.status().ToString();
    if (sh.ok()) m.shard = std::move(sh).value();
    return m;
  }

  static std::vector<int32_t> Tokens(int n, uint32_t seed) {
    return modeltest::RandomTokens(n, seed, 512);
  }

  // Embed + layers + logits for one step of a single sequence; appends [T, V] to out.
  static Status Step(const ShardModel& m, SequenceCache* c, std::span<const int32_t> toks,
                     std::vector<float>* out, std::vector<float>* state = nullptr) {
    const BatchItem item{c, toks};
    return modeltest::RunItems(m, {&item, 1}, out, state);
  }

  void DecodeVsPrefill(int n_tokens) {
    ThreadPool pool(2);
    Model m = Open(&pool);
    ASSERT_TRUE(m.shard);
    const auto toks = Tokens(n_tokens, 11);
    std::vector<float> prefill, decode;
    auto c1 = m.shard->NewSequence(1024).value();
    ASSERT_TRUE(Step(*m.shard, c1.get(), toks, &prefill).ok());
    auto c2 = m.shard->NewSequence(1024).value();
    for (int t = 0; t < n_tokens; ++t)
      ASSERT_TRUE(Step(*m.shard, c2.get(), std::span(toks).subspan(t, 1), &decode).ok());
    EXPECT_EQ(c1->next_pos(), n_tokens);
    EXPECT_EQ(c2->next_pos(), n_tokens);
    ASSERT_EQ(prefill.size(), decode.size());
    EXPECT_LT(RelErr(decode, prefill), 1e-4);
    // The logits are not degenerate: positions differ and values are finite.
    for (float v : prefill) ASSERT_TRUE(std::isfinite(v));
    EXPECT_NE(prefill[0], prefill[(n_tokens - 1) * 512]);
  }

  static std::string* dir_;
};
std::string* ForwardTest::dir_ = nullptr;

// The error helpers every GPU-vs-CPU test uses: a NaN anywhere (a value a kernel never wrote,
// in the emulation's 0xFF memory) makes the error NaN, which fails every EXPECT_LT bound.
TEST(ErrorHelpers, ANanAnywhereMakesTheErrorNan) {
  const float nan = std::numeric_limits<float>::quiet_NaN();
  EXPECT_TRUE(std::isnan(RelErr({1, nan, 3}, {1, 2, 3})));
  EXPECT_TRUE(std::isnan(RelErr({nan, 2, 3}, {1, 2, 3})));
  EXPECT_TRUE(std::isnan(modeltest::RowRelErr({1, nan, 3, 4}, {1, 2, 3, 4}, 2)));   // row 0 of 2
  EXPECT_EQ(RelErr({1, 2, 3}, {1, 2, 4}), 0.25);
  EXPECT_TRUE(std::isinf(RelErr({1, 2}, {1, 2, 3})));
}

TEST_F(ForwardTest, DecodeMatchesPrefillOverThreeWindows) { DecodeVsPrefill(48); }

TEST_F(ForwardTest, DecodeMatchesPrefillPastTwoRatio128Windows) { DecodeVsPrefill(270); }

TEST_F(ForwardTest, ChunkedPrefillMatchesOneShot) {
  ThreadPool pool(2);
  Model m = Open(&pool);
  ASSERT_TRUE(m.shard);
  const auto toks = Tokens(140, 12);
  std::vector<float> whole, chunked;
  auto c1 = m.shard->NewSequence(1024).value(), c2 = m.shard->NewSequence(1024).value();
  ASSERT_TRUE(Step(*m.shard, c1.get(), toks, &whole).ok());
  const std::span<const int32_t> all(toks);
  ASSERT_TRUE(Step(*m.shard, c2.get(), all.subspan(0, 37), &chunked).ok());
  ASSERT_TRUE(Step(*m.shard, c2.get(), all.subspan(37, 64), &chunked).ok());
  ASSERT_TRUE(Step(*m.shard, c2.get(), all.subspan(101), &chunked).ok());
  // Bit for bit: every row's sums run in a fixed order whatever the step holds, which is what
  // lets the scheduler chunk long prompts (limits.max_step_tokens) without changing a token.
  EXPECT_EQ(chunked, whole);
}

// A sequence forked from another at its position (ShardModel::CopySequence: the n choices of a
// request share one prefill) continues exactly as one that ran the whole prompt, bit for bit,
// from the middle of every compressor's window; its source is untouched; a fork that cannot
// hold the state, or of another shard's layers, is refused.
TEST_F(ForwardTest, AForkContinuesBitForBitAsTheWholeSequence) {
  ThreadPool pool(2);
  Model m = Open(&pool);
  ASSERT_TRUE(m.shard);
  const int64_t V = m.shard->config().vocab_size;
  // P: inside a ratio-4 and the third ratio-128 window, which the fork completes at 383.
  const int64_t N = 390, P = 261;
  const auto toks = Tokens(N, 13);
  const std::span<const int32_t> all(toks);
  std::vector<float> whole, ignore;
  auto alone = m.shard->NewSequence(1024).value();
  ASSERT_TRUE(Step(*m.shard, alone.get(), all, &whole).ok());
  auto prefix = m.shard->NewSequence(P).value();
  ASSERT_TRUE(Step(*m.shard, prefix.get(), all.subspan(0, P), &ignore).ok());
  const std::vector<float> tail(whole.begin() + P * V, whole.end());
  for (int f = 0; f < 2; ++f) {   // the second fork shows the first left its source as it was
    auto fork = m.shard->NewSequence(1024).value();
    Status st = m.shard->CopySequence(*prefix, fork.get());
    ASSERT_TRUE(st.ok()) << st.ToString();
    EXPECT_EQ(fork->next_pos(), P);
    std::vector<float> forked;
    ASSERT_TRUE(Step(*m.shard, fork.get(), all.subspan(P, 3), &forked).ok());
    for (int64_t t = P + 3; t < N; ++t) ASSERT_TRUE(Step(*m.shard, fork.get(), all.subspan(t, 1), &forked).ok());
    EXPECT_EQ(forked, tail) << "fork " << f;
  }
  EXPECT_EQ(prefix->next_pos(), P);
  auto small = m.shard->NewSequence(P - 1).value();
  EXPECT_EQ(m.shard->CopySequence(*prefix, small.get()).code(), Code::kOutOfRange);
  ShardSelection first3;
  first3.layer_begin = 0, first3.layer_end = 3, first3.head = false, first3.mtp = false;
  Model part = Open(&pool, first3);
  ASSERT_TRUE(part.shard);
  auto other = part.shard->NewSequence(1024).value();
  const Status st = m.shard->CopySequence(*other, small.get());
  EXPECT_EQ(st.code(), Code::kInvalidArgument) << st.ToString();
}

TEST_F(ForwardTest, BatchIsBitIdenticalToEachSequenceAlone) {
  ThreadPool pool(2);
  Model m = Open(&pool);
  ASSERT_TRUE(m.shard);
  const auto& cfg = m.shard->config();
  const int64_t row = cfg.hc_mult * cfg.hidden_size, V = cfg.vocab_size;
  // Four sequences at different positions: a history of hist[i] tokens, then a step of
  // step[i] tokens run together in one batch.
  const int hist[4] = {0, 5, 20, 130}, step[4] = {3, 1, 6, 2};
  std::vector<std::unique_ptr<SequenceCache>> batched, alone;
  std::vector<std::vector<int32_t>> steps;
  for (int i = 0; i < 4; ++i) {
    batched.push_back(m.shard->NewSequence(512).value());
    alone.push_back(m.shard->NewSequence(512).value());
    const auto h = Tokens(hist[i], 100 + i);
    std::vector<float> ignore;
    if (hist[i]) {
      ASSERT_TRUE(Step(*m.shard, batched[i].get(), h, &ignore).ok());
      ASSERT_TRUE(Step(*m.shard, alone[i].get(), h, &ignore).ok());
    }
    steps.push_back(Tokens(step[i], 200 + i));
  }
  std::vector<int32_t> all;
  std::vector<BatchItem> items;
  for (int i = 0; i < 4; ++i) {
    all.insert(all.end(), steps[i].begin(), steps[i].end());
    items.push_back({batched[i].get(), steps[i]});
  }
  const int64_t T = static_cast<int64_t>(all.size());
  std::vector<float> x(T * row), lg(T * V);
  ASSERT_TRUE(m.shard->Embed(all, x.data()).ok());
  ASSERT_TRUE(m.shard->ForwardLayers(items, x.data()).ok());
  ASSERT_TRUE(m.shard->Logits(x.data(), T, lg.data()).ok());
  int64_t off = 0;
  for (int i = 0; i < 4; ++i) {
    std::vector<float> one;
    ASSERT_TRUE(Step(*m.shard, alone[i].get(), steps[i], &one).ok());
    const std::vector<float> part(lg.begin() + off * V, lg.begin() + (off + step[i]) * V);
    EXPECT_EQ(part, one) << "sequence " << i;
    EXPECT_EQ(batched[i]->next_pos(), hist[i] + step[i]);
    off += step[i];
  }
}

TEST_F(ForwardTest, ThreadCountDoesNotChangeBits) {
  ThreadPool one(1), two(2);
  Model a = Open(&one), b = Open(&two);
  ASSERT_TRUE(a.shard && b.shard);
  const auto toks = Tokens(48, 13);
  std::vector<float> la, lb;
  auto ca = a.shard->NewSequence(64).value(), cb = b.shard->NewSequence(64).value();
  ASSERT_TRUE(Step(*a.shard, ca.get(), toks, &la).ok());
  ASSERT_TRUE(Step(*b.shard, cb.get(), toks, &lb).ok());
  EXPECT_EQ(la, lb);
  Model c = Open(nullptr);
  ASSERT_TRUE(c.shard);
  std::vector<float> lc;
  auto cc = c.shard->NewSequence(64).value();
  ASSERT_TRUE(Step(*c.shard, cc.get(), toks, &lc).ok());
  EXPECT_EQ(la, lc);
}

// The CPU shard's ScoreNext: row r's ScoreToken of targets[r] over Logits' row r, bit for bit,
// on a pool and without one; a target outside the vocabulary is that row's error, a `top` past
// kMaxTopLogprobs the call's.
TEST_F(ForwardTest, ScoreNextIsScoreTokenOverTheLogitsWithOrWithoutAPool) {
  ThreadPool pool(2);
  Model a = Open(&pool), b = Open(nullptr);
  ASSERT_TRUE(a.shard && b.shard);
  const int64_t V = a.shard->config().vocab_size;
  const auto toks = Tokens(12, 5);
  std::vector<float> lg, x;
  auto c = a.shard->NewSequence(64).value();
  ASSERT_TRUE(Step(*a.shard, c.get(), toks, &lg, &x).ok());
  ASSERT_EQ(lg.size(), static_cast<size_t>(12 * V));
  std::vector<int32_t> targets(toks.begin() + 1, toks.end());
  targets.push_back(static_cast<int32_t>(V));
  for (Model* m : {&a, &b}) {
    auto got = m->shard->ScoreNext(x.data(), targets, 3);
    ASSERT_TRUE(got.ok()) << got.status().ToString();
    ASSERT_EQ(got->size(), 12u);
    for (size_t r = 0; r < 11; ++r) {
      auto want = ScoreToken(std::span(&lg[r * V], V), targets[r], 3);
      ASSERT_TRUE(want.ok()) << want.status().ToString();
      EXPECT_TRUE((*got)[r].error.ok()) << (*got)[r].error.ToString();
      EXPECT_EQ((*got)[r].id, targets[r]);
      EXPECT_EQ((*got)[r].logprob, want->logprob) << "row " << r;
      EXPECT_EQ((*got)[r].rank, want->rank) << "row " << r;
      EXPECT_EQ((*got)[r].top, want->top) << "row " << r;
      EXPECT_EQ((*got)[r].top.size(), 3u);
    }
    EXPECT_NE((*got)[11].error.message().find("is outside the"), std::string::npos)
        << (*got)[11].error.ToString();
  }
  auto wide = a.shard->ScoreNext(x.data(), targets, kMaxTopLogprobs + 1);
  EXPECT_NE(wide.status().message().find("top 21"), std::string::npos) << wide.status().ToString();
}

TEST_F(ForwardTest, PipelineSplitChainsBitExactly) {
  ThreadPool pool(2);
  Model full = Open(&pool);
  ShardSelection s0, s1;
  s0.layer_begin = 0, s0.layer_end = 3, s0.head = false, s0.mtp = false;
  s1.layer_begin = 3, s1.layer_end = 6, s1.embed = false;
  Model a = Open(&pool, s0), b = Open(&pool, s1);
  ASSERT_TRUE(full.shard && a.shard && b.shard);
  EXPECT_TRUE(a.shard->has_embed() && !a.shard->has_head());
  EXPECT_TRUE(!b.shard->has_embed() && b.shard->has_head());
  EXPECT_EQ(a.shard->layer_end(), 3);
  EXPECT_EQ(b.shard->layer_begin(), 3);
  const auto& cfg = full.shard->config();
  const int64_t row = cfg.hc_mult * cfg.hidden_size, V = cfg.vocab_size;
  auto cf = full.shard->NewSequence(256).value(), ca = a.shard->NewSequence(256).value(),
       cb = b.shard->NewSequence(256).value();
  const auto toks = Tokens(40, 14);
  const std::span<const int32_t> all(toks);
  for (auto chunk : {all.subspan(0, 33), all.subspan(33, 1), all.subspan(34)}) {
    std::vector<float> want;
    ASSERT_TRUE(Step(*full.shard, cf.get(), chunk, &want).ok());
    const int64_t T = static_cast<int64_t>(chunk.size());
    std::vector<float> x(T * row), got(T * V);
    ASSERT_TRUE(a.shard->Embed(chunk, x.data()).ok());
    BatchItem ia{ca.get(), chunk}, ib{cb.get(), chunk};
    ASSERT_TRUE(a.shard->ForwardLayers({&ia, 1}, x.data()).ok());
    ASSERT_TRUE(b.shard->ForwardLayers({&ib, 1}, x.data()).ok());
    ASSERT_TRUE(b.shard->Logits(x.data(), T, got.data()).ok());
    EXPECT_EQ(got, want);
  }
  // A cache of one stage is refused by the other.
  std::vector<float> x(row);
  BatchItem wrong{ca.get(), all.subspan(0, 1)};
  const Status st = b.shard->ForwardLayers({&wrong, 1}, x.data());
  EXPECT_EQ(st.code(), Code::kInvalidArgument);
  EXPECT_NE(st.message().find("another shard"), std::string::npos) << st.message();
}

// Records the routing of every layer and returns zero routed output.
class RecordingExecutor : public ExpertExecutor {
 public:
  Status RunRouted(int64_t layer, const float* x, int64_t T, const int32_t* ids, const float* w,
                   float* routed) override {
    calls.push_back({layer, std::vector<int32_t>(ids, ids + T * 2), std::vector<float>(w, w + T * 2)});
    std::fill(routed, routed + T * 64, 0.0f);
    return Status::Ok();
  }
  Status RunSlots(int64_t layer, const float* x, int64_t T, const int32_t* ids,
                  float* slots) override {
    calls.push_back({layer, std::vector<int32_t>(ids, ids + T * 2), {}});
    std::fill(slots, slots + T * 2 * 64, 0.0f);
    return Status::Ok();
  }
  struct Call {
    int64_t layer;
    std::vector<int32_t> ids;
    std::vector<float> w;
  };
  std::vector<Call> calls;
};

TEST_F(ForwardTest, HashLayersRouteByTokenId) {
  Model m = Open(nullptr);
  ASSERT_TRUE(m.shard);
  RecordingExecutor rec;
  m.shard->SetExpertExecutor(&rec);
  // Token 77 at positions 0 and 3 (different hidden states), other tokens between.
  const std::vector<int32_t> toks = {77, 5, 300, 77, 9};
  std::vector<float> lg;
  auto c = m.shard->NewSequence(16).value();
  ASSERT_TRUE(Step(*m.shard, c.get(), toks, &lg).ok());
  ASSERT_EQ(rec.calls.size(), 6u);
  for (int64_t layer = 0; layer < 2; ++layer) {
    auto table = m.ckpt->GetI64("layers." + std::to_string(layer) + ".ffn.gate.tid2eid");
    ASSERT_TRUE(table.ok());
    const auto& call = rec.calls[layer];
    EXPECT_EQ(call.layer, layer);
    for (size_t t = 0; t < toks.size(); ++t)
      for (int j = 0; j < 2; ++j)
        EXPECT_EQ(call.ids[t * 2 + j], (*table)[toks[t] * 2 + j]) << "layer " << layer;
    EXPECT_EQ(call.ids[0], call.ids[6]);
    EXPECT_EQ(call.ids[1], call.ids[7]);
    EXPECT_NEAR(call.w[0] + call.w[1], 1.5f, 1e-5);  // routed_scaling_factor
  }
  // Score layers choose by score: some token gets experts that are not its table row.
  auto table0 = m.ckpt->GetI64("layers.0.ffn.gate.tid2eid");
  bool differs = false;
  for (size_t t = 0; t < toks.size(); ++t)
    for (int j = 0; j < 2; ++j) differs |= rec.calls[2].ids[t * 2 + j] != (*table0)[toks[t] * 2 + j];
  EXPECT_TRUE(differs);
  m.shard->SetExpertExecutor(nullptr);  // back to local experts
  std::vector<float> lg2;
  auto c2 = m.shard->NewSequence(16).value();
  ASSERT_TRUE(Step(*m.shard, c2.get(), toks, &lg2).ok());
  EXPECT_NE(lg, lg2);
}

TEST_F(ForwardTest, LocalExecutorEqualsPerRowExperts) {
  auto ck = Checkpoint::Open(*dir_);
  ASSERT_TRUE(ck.ok());
  const ModelConfig& cfg = (*ck)->config();
  auto moe = BindMoe(**ck, "layers.2.ffn.", 2);
  ASSERT_TRUE(moe.ok()) << moe.status().ToString();
  const int64_t T = 300, H = cfg.hidden_size, k = 2;  // > one 256-row chunk
  std::mt19937 rng(5);
  std::normal_distribution<float> d(0.0f, 1.0f);
  std::vector<float> x(T * H);
  for (auto& v : x) v = d(rng);
  std::vector<int32_t> ids(T * k), toks(T, 1);
  std::vector<float> w(T * k), routed(T * H);
  ASSERT_TRUE(RouteMoe(cfg, *moe, x.data(), toks.data(), T, ids.data(), w.data(), nullptr).ok());
  std::vector<const MoeWeights*> layers(7, nullptr);
  layers[2] = &*moe;
  LocalExpertExecutor exec(cfg, layers, nullptr);
  ASSERT_TRUE(exec.RunRouted(2, x.data(), T, ids.data(), w.data(), routed.data()).ok());
  for (int64_t t = 0; t < T; t += 37) {
    std::vector<float> c(k * H), y(H);
    for (int64_t j = 0; j < k; ++j)
      RunExpertFfn(moe->experts[ids[t * k + j]], 10.0f, x.data() + t * H, 1, c.data() + j * H,
                   nullptr);
    MoeCombine_kH(c.data(), w.data() + t * k, k, H, y.data());
    EXPECT_EQ(std::vector<float>(routed.begin() + t * H, routed.begin() + (t + 1) * H), y)
        << "row " << t;
  }
  EXPECT_EQ(exec.RunRouted(4, x.data(), 1, ids.data(), w.data(), routed.data()).code(),
            Code::kInvalidArgument);
}

TEST_F(ForwardTest, MtpDraftsConsistentlyAndBatchIndependently) {
  ThreadPool pool(2);
  Model m = Open(&pool);
  ASSERT_TRUE(m.shard);
  ASSERT_TRUE(m.shard->has_mtp());
  const auto& cfg = m.shard->config();
  const int64_t row = cfg.hc_mult * cfg.hidden_size, V = cfg.vocab_size, T = 40;
  const auto toks = Tokens(T + 1, 15);
  const std::span<const int32_t> all(toks);
  auto c = m.shard->NewSequence(128).value();
  std::vector<float> lg, state;
  ASSERT_TRUE(Step(*m.shard, c.get(), all.subspan(0, T), &lg, &state).ok());
  // Prefill of the MTP block over all rows vs one row at a time.
  std::vector<float> draft(T * V);
  BatchItem item{c.get(), all.subspan(1, T)};
  ASSERT_TRUE(m.shard->MtpLogits({&item, 1}, state.data(), draft.data()).ok());
  EXPECT_EQ(c->mtp_next_pos(), T);
  auto c2 = m.shard->NewSequence(128).value();
  std::vector<float> ignore, state2, step_draft;
  ASSERT_TRUE(Step(*m.shard, c2.get(), all.subspan(0, T), &ignore, &state2).ok());
  for (int64_t t = 0; t < T; ++t) {
    std::vector<float> one(V);
    BatchItem it{c2.get(), all.subspan(t + 1, 1)};
    ASSERT_TRUE(m.shard->MtpLogits({&it, 1}, state2.data() + t * row, one.data()).ok());
    step_draft.insert(step_draft.end(), one.begin(), one.end());
  }
  EXPECT_EQ(step_draft, draft);   // bit for bit, as the main model's rows
  for (float v : draft) ASSERT_TRUE(std::isfinite(v));
  EXPECT_NE(draft, lg);  // the draft head is its own block, not the main logits
  // Bad: a row beyond the vocab, and an MTP request on a shard without the block.
  std::vector<int32_t> bad = {600};
  BatchItem ib{c.get(), bad};
  EXPECT_EQ(m.shard->MtpLogits({&ib, 1}, state.data(), draft.data()).code(),
            Code::kInvalidArgument);
  ShardSelection s;
  s.layer_end = 3, s.head = false, s.mtp = false;
  Model part = Open(&pool, s);
  ASSERT_TRUE(part.shard);
  EXPECT_FALSE(part.shard->has_mtp());
  auto pc = part.shard->NewSequence(8).value();
  BatchItem ip{pc.get(), all.subspan(0, 1)};
  EXPECT_EQ(part.shard->MtpLogits({&ip, 1}, state.data(), draft.data()).code(),
            Code::kInvalidArgument);
}

TEST_F(ForwardTest, BadRequestsGiveClearErrors) {
  Model m = Open(nullptr);
  ASSERT_TRUE(m.shard);
  const auto& cfg = m.shard->config();
  std::vector<float> x(16 * cfg.hc_mult * cfg.hidden_size);
  const std::vector<int32_t> too_big = {3, 512}, empty, negative = {-1};
  Status st = m.shard->Embed(too_big, x.data());
  EXPECT_EQ(st.code(), Code::kInvalidArgument);
  EXPECT_NE(st.message().find("token id 512"), std::string::npos) << st.message();
  EXPECT_EQ(m.shard->Embed(empty, x.data()).code(), Code::kInvalidArgument);
  EXPECT_EQ(m.shard->Embed(negative, x.data()).code(), Code::kInvalidArgument);

  auto c = m.shard->NewSequence(8).value();
  BatchItem big{c.get(), too_big};
  st = m.shard->ForwardLayers({&big, 1}, x.data());
  EXPECT_EQ(st.code(), Code::kInvalidArgument);
  EXPECT_NE(st.message().find("512"), std::string::npos) << st.message();
  BatchItem none{c.get(), empty};
  st = m.shard->ForwardLayers({&none, 1}, x.data());
  EXPECT_EQ(st.code(), Code::kInvalidArgument);
  EXPECT_NE(st.message().find("empty"), std::string::npos) << st.message();
  EXPECT_EQ(m.shard->ForwardLayers({}, x.data()).code(), Code::kInvalidArgument);
  BatchItem null_cache{nullptr, too_big};
  EXPECT_EQ(m.shard->ForwardLayers({&null_cache, 1}, x.data()).code(), Code::kInvalidArgument);

  const auto nine = Tokens(9, 16);
  ASSERT_TRUE(m.shard->Embed(nine, x.data()).ok());
  BatchItem long_item{c.get(), nine};
  st = m.shard->ForwardLayers({&long_item, 1}, x.data());
  EXPECT_EQ(st.code(), Code::kOutOfRange);
  EXPECT_NE(st.message().find("max_context 8"), std::string::npos) << st.message();
  EXPECT_EQ(c->next_pos(), 0);  // nothing ran
  // Filling up to the limit works, one more token does not.
  BatchItem eight{c.get(), std::span(nine).subspan(0, 8)};
  ASSERT_TRUE(m.shard->ForwardLayers({&eight, 1}, x.data()).ok());
  BatchItem ninth{c.get(), std::span(nine).subspan(8)};
  EXPECT_EQ(m.shard->ForwardLayers({&ninth, 1}, x.data()).code(), Code::kOutOfRange);
  auto fresh = m.shard->NewSequence(8).value();
  BatchItem twice[2] = {{fresh.get(), std::span(nine).subspan(0, 1)},
                        {fresh.get(), std::span(nine).subspan(0, 1)}};
  st = m.shard->ForwardLayers(twice, x.data());
  EXPECT_EQ(st.code(), Code::kInvalidArgument);
  EXPECT_NE(st.message().find("twice"), std::string::npos) << st.message();
  EXPECT_EQ(m.shard->Logits(x.data(), 0, x.data()).code(), Code::kInvalidArgument);
}

// `flashmesh logits` as external tools call it: raw f32 [T, V] file + argmax line.
TEST_F(ForwardTest, LogitsCommandWritesRawLogitsAndArgmax) {
  const std::string bin = std::string(FM_BINARY_DIR) + "/cli/flashmesh";
  if (!std::filesystem::exists(bin)) GTEST_SKIP() << bin << " is not built";
  const std::string out = *dir_ + "/logits.bin";
  const std::string cmd = bin + " logits --model " + *dir_ +
                          " --tokens 3,17,42 --mode decode --threads 2 --out " + out +
                          " 2>/dev/null";
  FILE* p = popen(cmd.c_str(), "r");
  ASSERT_NE(p, nullptr);
  char line[256] = {0};
  ASSERT_NE(fgets(line, sizeof line, p), nullptr);
  ASSERT_EQ(pclose(p), 0);
  std::ifstream f(out, std::ios::binary);
  std::vector<float> got(3 * 512);
  f.read(reinterpret_cast<char*>(got.data()), got.size() * 4);
  ASSERT_EQ(f.gcount(), 3 * 512 * 4);
  f.get();
  EXPECT_TRUE(f.eof());  // exactly [T, vocab]

  ThreadPool pool(2);
  Model m = Open(&pool);
  ASSERT_TRUE(m.shard);
  const std::vector<int32_t> toks = {3, 17, 42};
  std::vector<float> want;
  auto c = m.shard->NewSequence(3).value();
  ASSERT_TRUE(Step(*m.shard, c.get(), toks, &want).ok());
  EXPECT_LT(RelErr(got, want), 1e-4);
  std::string argmax;
  for (int t = 0; t < 3; ++t) {
    const auto row = want.begin() + t * 512;
    argmax += (t ? " " : "") + std::to_string(std::max_element(row, row + 512) - row);
  }
  EXPECT_EQ(std::string(line), argmax + "\n");
  const std::string bad = bin + " logits --model " + *dir_ + " --tokens 3,512 --out " + out +
                          " 2>&1";
  p = popen(bad.c_str(), "r");
  ASSERT_NE(p, nullptr);
  std::string err;
  while (fgets(line, sizeof line, p)) err += line;
  EXPECT_NE(pclose(p), 0);
  EXPECT_NE(err.find("token id 512"), std::string::npos) << err;
}

// The CPU shard's activations are host rows [rows, hc*H]: they grow (never shrink) and check
// every row range, naming it.
TEST_F(ForwardTest, ActivationsAreHostRowsThatGrowKeepTheirMemoryAndCheckRanges) {
  ThreadPool pool(1);
  Model m = Open(&pool);
  ASSERT_TRUE(m.shard);
  auto made = m.shard->NewActivations();
  ASSERT_TRUE(made.ok()) << made.status().ToString();
  Activations& x = **made;
  const auto& cfg = m.shard->config();
  EXPECT_FALSE(x.device());
  EXPECT_EQ(x.row_floats(), cfg.hc_mult * cfg.hidden_size);
  EXPECT_EQ(x.rows(), 0);
  ASSERT_TRUE(x.Resize(3).ok());
  std::vector<float> rows(3 * x.row_floats());
  for (size_t i = 0; i < rows.size(); ++i) rows[i] = static_cast<float>(i);
  ASSERT_TRUE(x.CopyFromHost(0, 3, rows.data()).ok());
  float* const mem = x.data();
  ASSERT_TRUE(x.Resize(2).ok());
  EXPECT_EQ(x.data(), mem) << "shrinking keeps the memory";
  EXPECT_EQ(x.bytes(), 2 * x.row_floats() * sizeof(float));
  std::vector<float> back(x.row_floats());
  ASSERT_TRUE(x.CopyToHost(1, 1, back.data()).ok());
  EXPECT_EQ(back[0], static_cast<float>(x.row_floats()));
  const Status past = x.CopyToHost(1, 2, back.data());
  EXPECT_EQ(past.code(), Code::kOutOfRange);
  EXPECT_EQ(past.message(), "activations CopyToHost: rows [1, 3) outside the 2 rows of the activations");
  // Row copies, also within one buffer (the last rows of a batch gathered to its front).
  ASSERT_TRUE(x.CopyRows(0, x, 1, 1).ok());
  EXPECT_EQ(x.data()[0], static_cast<float>(x.row_floats()));
  EXPECT_EQ(x.CopyRows(1, x, 0, 2).code(), Code::kOutOfRange);
  EXPECT_EQ(x.Resize(-1).code(), Code::kInvalidArgument);
}

}  // namespace
}  // namespace fm
