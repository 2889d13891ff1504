// The device ShardModel (model/cuda/shard_model.h) against the CPU ShardModel on the tiny preset
// (layers [0,0,4,128,4,128], window 16, indexer top-4): decode logits within 1e-3 relative over
// three windows and past a ratio-128 entry (each step a replay of the bucket-1 CUDA graph), graph
// replay == eager launches bit for bit for one sequence and for decode batches on the bucket
// graphs, a batched prefill of two sequences over two device steps then decode, the
// expert-executor (EP) path, the launches a layer, and the errors (pipeline stages and X resident
// on the device: test_cuda_shard_stages.cpp). X is always in the shard's device buffers
// (NewActivations). Without a CUDA device only the no-device error runs.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <limits>
#include <memory>
#include <random>
#include <set>
#include <span>
#include <string>
#include <vector>

#include "common/thread_pool.h"
#include "kernels/cuda/device.h"
#include "model/checkpoint.h"
#include "model/cuda/device_weights.h"
#include "model/cuda/shard_model.h"
#include "model/cuda/step_inputs.h"
#include "model/forward.h"
#include "model/kv_cache.h"
#include "model/mkmodel.h"
#include "model/moe.h"
#include "tests/model_test_util.h"
#include "tests/gpu/cuda_shard_test.h"
#include "tests/unit/test_comm_group.h"
#include "worker/ep_expert_executor.h"

namespace fm {
namespace {

using modeltest::RowRelErr;

TEST_F(CudaShardTest, WithoutADeviceCreateSaysSo) {
  if (cuda::DeviceCount() > 0) GTEST_SKIP() << "has a CUDA device";
  auto ck = Checkpoint::Open(Dir(), {});
  ASSERT_TRUE(ck.ok()) << ck.status().ToString();
  auto m = CreateCudaShardModel(**ck, 0);
  ASSERT_FALSE(m.ok());
  EXPECT_NE(m.status().ToString().find("cuda:0: this host has 0 CUDA device(s)"),
            std::string::npos)
      << m.status().ToString();
}

// Before any upload the shard's weight bytes are held against the device's free memory.
TEST(CudaShardFit, ShardLargerThanTheFreeDeviceMemoryIsRefusedNamingBoth) {
  const size_t gib = size_t{1} << 30;
  EXPECT_TRUE(CheckShardFits(100 * gib, 121 * gib, 128 * gib, 0).ok());
  const Status s = CheckShardFits(130 * gib + gib / 5, 121 * gib, 128 * gib, 1);
  EXPECT_EQ(s.code(), Code::kResourceExhausted);
  EXPECT_NE(s.message().find("cuda:1: the shard's weights need 130.2 GiB but the device has "
                             "121.0 GiB free (of 128.0 GiB)"),
            std::string::npos)
      << s.ToString();
}

TEST_F(CudaShardTest, DecodeMatchesCpuOverThreeWindows) {
  if (cuda::DeviceCount() == 0) GTEST_SKIP() << "no CUDA device";
  DecodeMatchesCpu(48);  // ratio-4 entries from position 3, indexer top-k from position 19
}

TEST_F(CudaShardTest, DecodeMatchesCpuPastARatio128Entry) {
  if (cuda::DeviceCount() == 0) GTEST_SKIP() << "no CUDA device";
  DecodeMatchesCpu(136);
}

// The graph replays exactly the eager launches: the same bits at every step, on a second
// sequence too (the bucket-1 graph over its caches) interleaved with the first.
TEST_F(CudaShardTest, GraphReplayEqualsEagerLaunchesBitForBit) {
  if (cuda::DeviceCount() == 0) GTEST_SKIP() << "no CUDA device";
  auto ck = Checkpoint::Open(Dir(), {});
  ASSERT_TRUE(ck.ok()) << ck.status().ToString();
  auto graph = CreateCudaShardModel(**ck, 0, CudaStepMode::kGraph);
  auto eager = CreateCudaShardModel(**ck, 0, CudaStepMode::kEager);
  ASSERT_TRUE(graph.ok() && eager.ok());
  const auto a = Tokens(24, 41), b = Tokens(6, 42);
  auto ga = (*graph)->NewSequence(512).value(), gb = (*graph)->NewSequence(512).value();
  auto ea = (*eager)->NewSequence(512).value(), eb = (*eager)->NewSequence(512).value();
  std::vector<float> g, e;
  for (int t = 0; t < 24; ++t) {  // window wrap at 16, ratio-4 entries, b interleaved
    const BatchItem gi{ga.get(), std::span(a).subspan(t, 1)}, ei{ea.get(), std::span(a).subspan(t, 1)};
    ASSERT_TRUE(modeltest::RunItems(**graph, {&gi, 1}, &g).ok());
    ASSERT_TRUE(modeltest::RunItems(**eager, {&ei, 1}, &e).ok());
    if (t < 6) {
      const BatchItem gj{gb.get(), std::span(b).subspan(t, 1)}, ej{eb.get(), std::span(b).subspan(t, 1)};
      ASSERT_TRUE(modeltest::RunItems(**graph, {&gj, 1}, &g).ok());
      ASSERT_TRUE(modeltest::RunItems(**eager, {&ej, 1}, &e).ok());
    }
  }
  ASSERT_EQ(g.size(), e.size());
  EXPECT_EQ(std::memcmp(g.data(), e.data(), g.size() * sizeof(float)), 0);
}

// Decode batches on the bucket graphs (one per batch-size bucket, over the shard's row table):
// steps of 1, 2, 3 (bucket 4: one padding row) and 5 (bucket 8: three) sequences, sequences
// joining and leaving between steps so a bucket's graph serves other sequences, each step the
// eager launches' bits (final manifold) and the CPU's logits within 1e-3; the padding rows write
// no real sequence's cache (the later steps would differ from eager's if they did).
TEST_F(CudaShardTest, BucketGraphsEqualEagerBitForBitAsSequencesJoinAndLeave) {
  if (cuda::DeviceCount() == 0) GTEST_SKIP() << "no CUDA device";
  ThreadPool pool(2);
  Pair p = Open(&pool);  // p.gpu: kGraph
  ASSERT_TRUE(p.gpu);
  auto eager = CreateCudaShardModel(*p.ckpt, 0, CudaStepMode::kEager);
  ASSERT_TRUE(eager.ok()) << eager.status().ToString();
  // Prefills of 2+ tokens (eager), so the first step of a bucket is its capture; two past a window.
  const int lens[6] = {3, 17, 2, 9, 22, 5};
  const std::vector<std::vector<int>> steps = {{0},       {0, 1},    {0, 1, 2}, {1, 2, 3, 4, 5},
                                               {3, 0, 5}, {2, 4},    {5, 3, 1}, {4, 0, 1, 2, 3},
                                               {5}};
  std::vector<std::vector<int32_t>> toks;
  std::vector<std::unique_ptr<SequenceCache>> cs, gs, es;
  for (int s = 0; s < 6; ++s) {
    toks.push_back(Tokens(lens[s] + 8, 70 + s));
    cs.push_back(p.cpu->NewSequence(256).value());
    gs.push_back(p.gpu->NewSequence(256).value());
    es.push_back((*eager)->NewSequence(256).value());
    const auto pre = std::span(toks[s]).first(lens[s]);
    const BatchItem ci{cs[s].get(), pre}, gi{gs[s].get(), pre}, ei{es[s].get(), pre};
    std::vector<float> unused;
    ASSERT_TRUE(modeltest::RunItems(*p.cpu, {&ci, 1}, &unused).ok());
    ASSERT_TRUE(modeltest::RunItems(*p.gpu, {&gi, 1}, &unused).ok());
    ASSERT_TRUE(modeltest::RunItems(**eager, {&ei, 1}, &unused).ok());
  }
  const ModelConfig& cfg = p.gpu->config();
  std::vector<float> cpu, gpu;
  std::set<int> captured;  // buckets
  for (size_t step = 0; step < steps.size(); ++step) {
    std::vector<BatchItem> citems, gitems, eitems;
    std::vector<int32_t> ids;
    for (const int s : steps[step]) {
      const auto tok = std::span(toks[s]).subspan(gs[s]->next_pos(), 1);
      ids.push_back(tok[0]);
      citems.push_back({cs[s].get(), tok});
      gitems.push_back({gs[s].get(), tok});
      eitems.push_back({es[s].get(), tok});
    }
    std::vector<float> unused, ex;
    ASSERT_TRUE(modeltest::RunItems(*p.cpu, citems, &cpu).ok());
    const int64_t n = static_cast<int64_t>(gitems.size());
    std::vector<float> lg(n * cfg.vocab_size);
    auto dx = p.gpu->NewActivations();
    ASSERT_TRUE(dx.ok() && (*dx)->Resize(n).ok());
    ASSERT_TRUE(p.gpu->Embed(ids, (*dx)->data()).ok());
    const int64_t before = cuda::KernelLaunches();
    const Status st = p.gpu->ForwardLayers(gitems, (*dx)->data());
    ASSERT_TRUE(st.ok()) << "step " << step << ": " << st.ToString();
    // The first step of a bucket captures its graph (launches recorded), later ones replay it:
    // no kernel launched from the host.
    const int64_t launched = cuda::KernelLaunches() - before;
    if (captured.insert(StepBucket(n)).second) {
      EXPECT_GT(launched, 0) << "step " << step;
    } else {
      EXPECT_EQ(launched, 0) << "step " << step << ": a replay of bucket " << StepBucket(n);
    }
    ASSERT_TRUE(p.gpu->Logits((*dx)->data(), n, lg.data()).ok());
    gpu.insert(gpu.end(), lg.begin(), lg.end());
    ASSERT_TRUE(modeltest::RunItems(**eager, eitems, &unused, &ex).ok());
    const std::vector<float> gx = modeltest::ToHostRows(**dx);
    ASSERT_EQ(gx.size(), ex.size());
    EXPECT_EQ(std::memcmp(gx.data(), ex.data(), gx.size() * sizeof(float)), 0)
        << "step " << step << " of " << steps[step].size() << " sequences";
  }
  for (float v : gpu) ASSERT_TRUE(std::isfinite(v));
  EXPECT_LT(RowRelErr(gpu, cpu, p.gpu->config().vocab_size), 1e-3);
  for (int s = 0; s < 6; ++s) EXPECT_EQ(gs[s]->next_pos(), es[s]->next_pos()) << "sequence " << s;
}

TEST_F(CudaShardTest, PrefillAndBatchMatchCpu) {
  if (cuda::DeviceCount() == 0) GTEST_SKIP() << "no CUDA device";
  ThreadPool pool(2);
  Pair p = Open(&pool);
  ASSERT_TRUE(p.gpu);
  // 49 rows: two device steps (32 + 17), sequence a in both; then a decodes on its graph.
  const auto a = Tokens(42, 31), b = Tokens(9, 32);
  auto ca = p.cpu->NewSequence(256).value(), cb = p.cpu->NewSequence(256).value();
  auto ga = p.gpu->NewSequence(256).value(), gb = p.gpu->NewSequence(256).value();
  const auto a0 = std::span(a).first(40);
  const BatchItem citems[2] = {{ca.get(), a0}, {cb.get(), b}};
  const BatchItem gitems[2] = {{ga.get(), a0}, {gb.get(), b}};
  std::vector<float> cpu, gpu;
  ASSERT_TRUE(modeltest::RunItems(*p.cpu, citems, &cpu).ok());
  const Status st = modeltest::RunItems(*p.gpu, gitems, &gpu);
  ASSERT_TRUE(st.ok()) << st.ToString();
  EXPECT_EQ(ga->next_pos(), 40);
  EXPECT_EQ(gb->next_pos(), 9);
  ASSERT_NO_FATAL_FAILURE(DecodeBoth(p, ca.get(), ga.get(), a, 40, 42, &cpu, &gpu));
  EXPECT_LT(RowRelErr(gpu, cpu, p.gpu->config().vocab_size), 1e-3);
}

// A decode step of three sequences (different lengths, one past the indexer's top-k) is one
// device step whose attention-side kernels each take all three rows through the row table: the
// logits match the CPU's, and a step of two sequences launches the same kernels but for Moe's
// per-row expert products.
TEST_F(CudaShardTest, DecodeBatchOfSequencesIsOneLaunchSequence) {
  if (cuda::DeviceCount() == 0) GTEST_SKIP() << "no CUDA device";
  ThreadPool pool(2);
  Pair p = Open(&pool);
  ASSERT_TRUE(p.gpu);
  // Eager: a graph replay launches nothing from the host (that case is the bucket test's).
  auto eager = CreateCudaShardModel(*p.ckpt, 0, CudaStepMode::kEager);
  ASSERT_TRUE(eager.ok()) << eager.status().ToString();
  p.gpu = std::move(eager).value();
  const int lens[3] = {23, 5, 12};
  std::vector<std::vector<int32_t>> toks;
  std::vector<std::unique_ptr<SequenceCache>> cs, gs;
  std::vector<float> cpu, gpu;
  for (int s = 0; s < 3; ++s) {
    toks.push_back(Tokens(lens[s] + 4, 60 + s));
    cs.push_back(p.cpu->NewSequence(256).value());
    gs.push_back(p.gpu->NewSequence(256).value());
    const auto pre = std::span(toks[s]).first(lens[s]);
    const BatchItem ci{cs[s].get(), pre}, gi{gs[s].get(), pre};
    std::vector<float> unused;
    ASSERT_TRUE(modeltest::RunItems(*p.cpu, {&ci, 1}, &unused).ok());
    ASSERT_TRUE(modeltest::RunItems(*p.gpu, {&gi, 1}, &unused).ok());
  }
  // Steps of all three, then one of the first two: ForwardLayers' launches each time.
  const auto& cfg = p.gpu->config();
  std::vector<int64_t> launches;
  for (int step = 0; step < 4; ++step) {
    const int n = step < 3 ? 3 : 2;
    std::vector<BatchItem> citems, gitems;
    std::vector<int32_t> ids;
    for (int s = 0; s < n; ++s) {
      const auto tok = std::span(toks[s]).subspan(lens[s] + step, 1);
      citems.push_back({cs[s].get(), tok});
      gitems.push_back({gs[s].get(), tok});
      ids.push_back(tok[0]);
    }
    ASSERT_TRUE(modeltest::RunItems(*p.cpu, citems, &cpu).ok());
    std::vector<float> lg(n * cfg.vocab_size);
    auto x = p.gpu->NewActivations();
    ASSERT_TRUE(x.ok() && (*x)->Resize(n).ok());
    ASSERT_TRUE(p.gpu->Embed(ids, (*x)->data()).ok());
    const int64_t before = cuda::KernelLaunches();
    const Status st = p.gpu->ForwardLayers(gitems, (*x)->data());
    launches.push_back(cuda::KernelLaunches() - before);
    ASSERT_TRUE(st.ok()) << st.ToString();
    ASSERT_TRUE(p.gpu->Logits((*x)->data(), n, lg.data()).ok());
    gpu.insert(gpu.end(), lg.begin(), lg.end());
  }
  EXPECT_LT(RowRelErr(gpu, cpu, p.gpu->config().vocab_size), 1e-3);
  EXPECT_EQ(launches[1], launches[0]);
  EXPECT_EQ(launches[2], launches[0]);
  // Every kernel takes the batch's rows in one launch (the attention side through the row table,
  // the experts of all rows in two launches): a step of 3 rows launches what a step of 2 does.
  EXPECT_EQ(launches[0], launches[3]) << "a step of 3 rows vs one of 2";
}

// Sampling where the logits are (SampleNext): the device's picks equal the host Sampler's over
// the device's own logits, for greedy, top-k and top-p rows in one call, over three draws (the
// RNG advances the same way on both sides), and so are the alternatives of rows that ask for top
// logprobs (within 1e-5) and the picks of a row with a bias, min_tokens, penalties and min-p (its
// logits adjusted on the device, AdjustLogits), over three steps of its history.
TEST_F(CudaShardTest, DeviceSamplingEqualsTheHostSamplerOnTheSameLogits) {
  if (cuda::DeviceCount() == 0) GTEST_SKIP() << "no CUDA device";
  ThreadPool pool(2);
  Pair p = Open(&pool);
  ASSERT_TRUE(p.gpu);
  const auto a = Tokens(6, 41);
  auto ga = p.gpu->NewSequence(64).value();
  const BatchItem item{ga.get(), a};
  std::vector<float> lg, state;
  ASSERT_TRUE(modeltest::RunItems(*p.gpu, {&item, 1}, &lg, &state).ok());
  const ModelConfig& cfg = p.gpu->config();
  const int64_t V = cfg.vocab_size, row = cfg.hc_mult * cfg.hidden_size;
  std::vector<SamplerConfig> configs(6);
  configs[0].greedy = true;
  configs[1].temperature = 0.9f, configs[1].top_k = 8, configs[1].seed = 3;
  configs[2].temperature = 1.1f, configs[2].top_p = 0.8f, configs[2].seed = 4;
  configs[3].greedy = true, configs[3].top_logprobs = 3;
  configs[4].temperature = 1.2f, configs[4].top_k = 20, configs[4].seed = 5, configs[4].top_logprobs = 5;
  configs[5].temperature = 0.8f, configs[5].seed = 6, configs[5].min_p = 0.02f;
  configs[5].repetition_penalty = 1.2f, configs[5].frequency_penalty = 0.5f;
  configs[5].logit_bias = {{3, 1.5f}}, configs[5].min_tokens = 2, configs[5].min_tokens_ids = {0, 1};
  configs[5].top_logprobs = 4;
  std::vector<Sampler> dev, host;
  for (const SamplerConfig& c : configs) {
    dev.push_back(*Sampler::Create(c));
    host.push_back(*Sampler::Create(c));
  }
  dev[5].Observe(a, false);
  host[5].Observe(a, false);
  // The prefill's 6 final rows, one per sampler.
  auto x = modeltest::ToShard(*p.gpu, state);
  ASSERT_TRUE(x.ok()) << x.status().ToString();
  ASSERT_EQ(static_cast<int64_t>(state.size()), 6 * row);
  std::vector<float> logits(6 * V);
  ASSERT_TRUE(p.gpu->Logits((*x)->data(), 6, logits.data()).ok());
  for (int draw = 0; draw < 3; ++draw) {
    Sampler* const ds[] = {&dev[0], &dev[1], &dev[2], &dev[3], &dev[4], &dev[5]};
    auto got = p.gpu->SampleNext((*x)->data(), 6, ds);
    ASSERT_TRUE(got.ok()) << got.status().ToString();
    for (int r = 0; r < 6; ++r) {
      auto want = host[r].Sample(std::span(&logits[r * V], V));
      ASSERT_TRUE(want.ok()) << want.status().ToString();
      EXPECT_EQ((*got)[r].id, want->id) << "draw " << draw << " row " << r;
      EXPECT_NEAR((*got)[r].logprob, want->logprob, 1e-5) << "draw " << draw << " row " << r;
      ASSERT_EQ((*got)[r].top.size(), want->top.size()) << "draw " << draw << " row " << r;
      for (size_t j = 0; j < want->top.size(); ++j) {
        EXPECT_EQ((*got)[r].top[j].id, want->top[j].id) << "draw " << draw << " row " << r;
        EXPECT_NEAR((*got)[r].top[j].logprob, want->top[j].logprob, 1e-5) << "row " << r;
      }
      EXPECT_EQ((*got)[r].top.size(), static_cast<size_t>(configs[r].top_logprobs)) << "row " << r;
    }
    // The penalized row's pick joins its history on both sides, as a pipeline feeds it back.
    const int32_t fed = (*got)[5].id;
    for (Sampler* s : {&dev[5], &host[5]}) s->Observe(std::span<const int32_t>(&fed, 1), true);
  }
}

// A row whose logits cannot be sampled (a NaN state, so NaN logits) carries its error, on the
// device's pick and on the host's (a row with a logit_bias); the other rows' picks
// are the host Sampler's over the same logits, as if the row were not there.
TEST_F(CudaShardTest, DeviceSamplingGivesARowsErrorToThatRowAlone) {
  if (cuda::DeviceCount() == 0) GTEST_SKIP() << "no CUDA device";
  ThreadPool pool(2);
  Pair p = Open(&pool);
  ASSERT_TRUE(p.gpu);
  const auto a = Tokens(3, 43);
  auto ga = p.gpu->NewSequence(16).value();
  const BatchItem item{ga.get(), a};
  std::vector<float> lg, state;
  ASSERT_TRUE(modeltest::RunItems(*p.gpu, {&item, 1}, &lg, &state).ok());
  const ModelConfig& cfg = p.gpu->config();
  const int64_t V = cfg.vocab_size, row = cfg.hc_mult * cfg.hidden_size;
  // Rows: NaN (device pick), the last state (greedy), NaN (host pick), the last state (top-k).
  std::vector<float> rows(4 * row, std::numeric_limits<float>::quiet_NaN());
  std::copy(state.end() - row, state.end(), rows.begin() + row);
  std::copy(state.end() - row, state.end(), rows.begin() + 3 * row);
  SamplerConfig greedy, host_pick, top_k;
  greedy.greedy = true;
  host_pick.greedy = true, host_pick.top_logprobs = 2, host_pick.logit_bias = {{1, 0.5f}};
  top_k.temperature = 0.9f, top_k.top_k = 8, top_k.seed = 3;
  std::vector<Sampler> dev = {*Sampler::Create(greedy), *Sampler::Create(greedy), *Sampler::Create(host_pick),
                              *Sampler::Create(top_k)};
  Sampler want = *Sampler::Create(top_k);
  auto x = modeltest::ToShard(*p.gpu, rows);
  ASSERT_TRUE(x.ok()) << x.status().ToString();
  std::vector<float> logits(V);
  ASSERT_TRUE(p.gpu->Logits((*x)->data() + row, 1, logits.data()).ok());
  Sampler* const ds[] = {&dev[0], &dev[1], &dev[2], &dev[3]};
  auto got = p.gpu->SampleNext((*x)->data(), 4, ds);
  ASSERT_TRUE(got.ok()) << got.status().ToString();
  for (int r : {0, 2}) {
    EXPECT_EQ((*got)[r].id, -1) << "row " << r;
    EXPECT_NE((*got)[r].error.message().find("is NaN"), std::string::npos) << (*got)[r].error.ToString();
  }
  int64_t argmax = 0;
  for (int64_t i = 1; i < V; ++i) argmax = logits[i] > logits[argmax] ? i : argmax;
  EXPECT_TRUE((*got)[1].error.ok()) << (*got)[1].error.ToString();
  EXPECT_EQ((*got)[1].id, argmax);
  auto w = want.Sample(logits);
  ASSERT_TRUE(w.ok());
  EXPECT_TRUE((*got)[3].error.ok()) << (*got)[3].error.ToString();
  EXPECT_EQ((*got)[3].id, w->id);
}

// With an expert executor (what EP sets) the routed experts run outside the device: each layer
// copies its rows' inputs, ids and weights out and the routed sum back; steps are eager. Here
// the executor runs the experts on the CPU: a prefill of 12 rows then decode match the CPU.
// The shard's expert-parallel path (slots from an executor, summed on the device) with a group
// of one: the EP executor's device path (rows gathered, pairs run, slots gathered, all in device
// memory) gives the CPU shard's logits; a host-only executor is refused, naming the layer.
TEST_F(CudaShardTest, ExpertExecutorPathMatchesCpu) {
  if (cuda::DeviceCount() == 0) GTEST_SKIP() << "no CUDA device";
  ThreadPool pool(2);
  Pair p = Open(&pool);
  ASSERT_TRUE(p.gpu);
  const ModelConfig& cfg = p.ckpt->config();
  CommGroup solo(1);
  EpExpertExecutor exec(cfg, p.gpu->LocalExperts(), solo.comms[0].get(),
                        {0, cfg.n_routed_experts}, std::chrono::milliseconds(20000), 64);
  p.gpu->SetExpertExecutor(&exec);
  const auto toks = Tokens(16, 51);
  auto cc = p.cpu->NewSequence(256).value(), gc = p.gpu->NewSequence(256).value();
  std::vector<float> cpu, gpu;
  const BatchItem ci{cc.get(), std::span(toks).first(12)}, gi{gc.get(), std::span(toks).first(12)};
  ASSERT_TRUE(modeltest::RunItems(*p.cpu, {&ci, 1}, &cpu).ok());
  const Status st = modeltest::RunItems(*p.gpu, {&gi, 1}, &gpu);
  ASSERT_TRUE(st.ok()) << st.ToString();
  ASSERT_NO_FATAL_FAILURE(DecodeBoth(p, cc.get(), gc.get(), toks, 12, 16, &cpu, &gpu));
  EXPECT_LT(RowRelErr(gpu, cpu, p.gpu->config().vocab_size), 1e-3);

  std::vector<const MoeWeights*> none(cfg.num_hidden_layers + cfg.num_nextn_predict_layers, nullptr);
  LocalExpertExecutor host_only(cfg, none, &pool);
  p.gpu->SetExpertExecutor(&host_only);
  auto seq = p.gpu->NewSequence(256).value();
  const BatchItem item{seq.get(), std::span(toks).first(3)};
  const Status refused = modeltest::RunItems(*p.gpu, {&item, 1}, &gpu);
  EXPECT_NE(refused.message().find("layer 0: this expert executor takes rows in host memory only"),
            std::string::npos) << refused.ToString();
}

// Kernel launches of one eager decode step (T = 1) per layer of the bench preset (its 8 layers
// cover every kind: window-only with hash routing, ratio 4 with the indexer, ratio 128), each
// layer as a stage of its own [l, l + 1). A stage runs 1 + sum over its layers of (a layer's
// launches, its hc_post fused with the next hc_pre or the last hc_post): the 1 is the stage's
// first hc_pre, with no hc_post before it to fuse into. So a layer's launches are its stage's
// minus 1, and they are the same at every position (positions 0-3: ring rows, a ratio-4 entry
// at 3; a fixed launch sequence, the premise of replaying graphs). The bound is the issue's: <=
// 15 a layer (docs/gpu.md "Launches of a decode layer": 14 / 15 / 14 for ratio 0 / 4 / 128).
// Layers 0-3 hold every kind (hash and score routing, ratios 0, 4 and 128) and step through
// positions 0-3; layers 4-7 repeat kinds 2-3 and take position 0 (the emulation runs every
// kernel of each step: 20 layer-steps instead of 32 keep CI shorter).
TEST_F(CudaShardTest, DecodeStepLaunchesPerLayer) {
  if (cuda::DeviceCount() == 0) GTEST_SKIP() << "no CUDA device";
  // Was 36 / 58 / 44 for ratio 0 / 4 / 128; 12 since hc_post combines the expert slots itself,
  // AttnPrep makes the cache updates and the router rides in the gate's launch (11 / 12 / 11).
  constexpr int64_t kMaxLaunchesPerLayer = 12;
  const std::string& dir = modeltest::PresetDir("bench");
  auto whole = Checkpoint::Open(dir, {});
  ASSERT_TRUE(whole.ok()) << whole.status().ToString();
  const int64_t layers = (*whole)->config().num_hidden_layers;
  for (int64_t l = 0; l < layers; ++l) {
    ShardSelection sel;
    sel.layer_begin = l;
    sel.layer_end = l + 1;
    sel.embed = false;
    sel.head = false;
    auto ck = Checkpoint::Open(dir, sel);
    ASSERT_TRUE(ck.ok()) << ck.status().ToString();
    auto m = CreateCudaShardModel(**ck, 0, CudaStepMode::kEager);
    ASSERT_TRUE(m.ok()) << m.status().ToString();
    const ModelConfig& cfg = (*m)->config();
    auto seq = (*m)->NewSequence(1024).value();
    auto x = modeltest::ToShard(**m, std::vector<float>(cfg.hc_mult * cfg.hidden_size, 0.5f));
    ASSERT_TRUE(x.ok()) << x.status().ToString();
    const std::vector<int32_t> toks = Tokens(4, 9);
    int64_t first = 0;
    for (int t = 0; t < (l < 4 ? 4 : 1); ++t) {
      const BatchItem item{seq.get(), std::span(toks).subspan(t, 1)};
      const int64_t before = cuda::KernelLaunches();
      ASSERT_TRUE((*m)->ForwardLayers({&item, 1}, (*x)->data()).ok());
      const int64_t n = cuda::KernelLaunches() - before - 1;
      if (t == 0) first = n;
      EXPECT_EQ(n, first) << "layer " << l << " at position " << t;
    }
    std::printf("layer %lld (ratio %lld): %lld launches\n", static_cast<long long>(l),
                static_cast<long long>(cfg.compress_ratio(l)), static_cast<long long>(first));
    EXPECT_LE(first, kMaxLaunchesPerLayer) << "layer " << l;
  }
}

TEST_F(CudaShardTest, BadRequestsAreErrorsAndMoveNothing) {
  if (cuda::DeviceCount() == 0) GTEST_SKIP() << "no CUDA device";
  ThreadPool pool(1);
  Pair p = Open(&pool);
  ASSERT_TRUE(p.gpu);
  const auto& cfg = p.gpu->config();
  auto c = p.gpu->NewSequence(4).value();
  auto x = modeltest::ToShard(*p.gpu, std::vector<float>(8 * cfg.hc_mult * cfg.hidden_size));
  ASSERT_TRUE(x.ok()) << x.status().ToString();
  const std::vector<int32_t> bad = {1, 512};
  const BatchItem b{c.get(), bad};
  const Status st = p.gpu->ForwardLayers({&b, 1}, (*x)->data());
  EXPECT_NE(st.ToString().find("token id 512"), std::string::npos) << st.ToString();
  // The embedding refuses it on the host before any id reaches the device.
  const Status se = p.gpu->Embed(bad, (*x)->data());
  EXPECT_NE(se.ToString().find("token id 512 at position 1"), std::string::npos) << se.ToString();
  const std::vector<int32_t> five = {1, 2, 3, 4, 5};
  const BatchItem l{c.get(), five};
  EXPECT_EQ(p.gpu->ForwardLayers({&l, 1}, (*x)->data()).code(), Code::kOutOfRange);
  EXPECT_EQ(c->next_pos(), 0);
}

// A stage that holds no layers (only the head) passes X through and its sequences' positions
// advance, as on the CPU (its context check would otherwise never fire).
TEST_F(CudaShardTest, AStageOfNoLayersAdvancesItsPositionsAsTheCpuDoes) {
  if (cuda::DeviceCount() == 0) GTEST_SKIP() << "no CUDA device";
  ThreadPool pool(1);
  ShardSelection sel;
  sel.layer_begin = sel.layer_end = 6;   // tiny: 6 layers
  sel.embed = false;
  sel.mtp = false;
  Pair p = Open(&pool, sel);
  ASSERT_TRUE(p.gpu);
  const auto& cfg = p.gpu->config();
  auto cc = p.cpu->NewSequence(8).value(), gc = p.gpu->NewSequence(8).value();
  const std::vector<int32_t> toks = {1, 2, 3};
  auto x = modeltest::ToShard(*p.gpu, std::vector<float>(3 * cfg.hc_mult * cfg.hidden_size, 0.5f));
  ASSERT_TRUE(x.ok()) << x.status().ToString();
  std::vector<float> xc(3 * cfg.hc_mult * cfg.hidden_size, 0.5f);
  const BatchItem ci{cc.get(), toks}, gi{gc.get(), toks};
  ASSERT_TRUE(p.cpu->ForwardLayers({&ci, 1}, xc.data()).ok());
  ASSERT_TRUE(p.gpu->ForwardLayers({&gi, 1}, (*x)->data()).ok());
  EXPECT_EQ(cc->next_pos(), 3);
  EXPECT_EQ(gc->next_pos(), 3);
}

// A sequence's KV cache the device cannot hold is an error for that request (ResourceExhausted,
// naming the device), not an unusable cache whose first step failed every live request; and a
// sequence may be longer than max_position_embeddings, as on the CPU (the worker's max_context
// is the limit).
TEST_F(CudaShardTest, ASequenceTooLargeForTheDeviceIsAnErrorAndContextIsNotCapped) {
  if (cuda::DeviceCount() == 0) GTEST_SKIP() << "no CUDA device";
  ThreadPool pool(1);
  Pair p = Open(&pool);
  ASSERT_TRUE(p.gpu);
  auto huge = p.gpu->NewSequence(int64_t{1} << 44);
  ASSERT_FALSE(huge.ok());
  EXPECT_EQ(huge.status().code(), Code::kResourceExhausted) << huge.status().ToString();
  EXPECT_NE(huge.status().message().find("cuda:0 has no memory for the KV cache"), std::string::npos)
      << huge.status().message();
  const int64_t past = p.gpu->config().max_position_embeddings + 16;
  auto long_seq = p.gpu->NewSequence(past);
  ASSERT_TRUE(long_seq.ok()) << long_seq.status().ToString();
  EXPECT_EQ((*long_seq)->max_context(), past);
}

}  // namespace
}  // namespace fm
