// Device sampling (kernels/cuda/sample_ops.h SampleRows) against the CPU Sampler
// (model/sampler.h SampleWith) given the same uniform draw: greedy, temperature alone, top-k,
// top-p, both, ties (-0 and +0 among them), -inf logits, several rows in one call, the top
// logprobs of each, the errors, and the hand-off to the host when the candidate set is larger
// than the device keeps; score rows against ScoreToken; logit adjustments (AdjustLogits) against
// Sampler::Adjusted, bit for bit. Device tests skip without a GPU.
#include <gtest/gtest.h>

#include <cfloat>
#include <cmath>
#include <cstring>
#include <random>
#include <string>
#include <vector>

#include "kernels/cuda/device.h"
#include "kernels/cuda/sample_ops.h"
#include "model/cuda/logit_edits.h"
#include "model/sampler.h"
#include "tests/gpu/cuda_test_util.h"

namespace fm {
namespace {

using namespace cudatest;
using cuda::DeviceBuffer;
using cuda::SampleParams;
using cuda::SampleResult;

// A row's result with its alternatives.
struct Picked : SampleResult {
  cuda::SampleTop top;
};

// Runs SampleRows over logits [rows, vocab] and returns each row's result.
std::vector<Picked> DeviceSample(const std::vector<float>& logits, int64_t vocab,
                                 const std::vector<SampleParams>& params) {
  const int64_t rows = static_cast<int64_t>(params.size());
  DeviceBuffer l = ToDevice(logits);
  DeviceBuffer p = ToDevice(params);
  auto scratch = DeviceBuffer::Alloc(cuda::SampleScratchBytes(rows, vocab));
  auto out = DeviceBuffer::Alloc(rows * sizeof(SampleResult));
  auto top = DeviceBuffer::Alloc(rows * sizeof(cuda::SampleTop));
  EXPECT_TRUE(scratch.ok() && out.ok() && top.ok());
  std::vector<Picked> res(rows);
  if (!scratch.ok() || !out.ok() || !top.ok()) return res;
  const Status st = cuda::SampleRows(l.as<float>(), rows, vocab, p.as<SampleParams>(),
                                     scratch->data(), out->as<SampleResult>(),
                                     top->as<cuda::SampleTop>());
  EXPECT_TRUE(st.ok()) << st.ToString();
  std::vector<SampleResult> r(rows);
  std::vector<cuda::SampleTop> t(rows);
  EXPECT_TRUE(out->CopyToHost(r.data(), rows * sizeof(SampleResult)).ok());
  EXPECT_TRUE(top->CopyToHost(t.data(), rows * sizeof(cuda::SampleTop)).ok());
  for (int64_t i = 0; i < rows; ++i) {
    static_cast<SampleResult&>(res[i]) = r[i];
    res[i].top = t[i];
  }
  return res;
}

SampleParams ParamsOf(const SamplerConfig& c, double u) {
  const bool greedy = c.greedy || c.temperature == 0.0f;
  return SampleParams{c.temperature, c.top_p, c.top_k, greedy ? 1 : 0, greedy ? 0.0 : u,
                      c.top_logprobs, -1};
}

float Tolerance(float want) { return 1e-5f * std::max(1.0f, std::fabs(want)); }

// The device's alternatives are the CPU's: the same ids in the same order, logprobs within 1e-5.
void ExpectSameTop(const Picked& got, const std::vector<TokenLogprob>& want,
                   const std::string& what) {
  ASSERT_EQ(got.top_count, static_cast<int32_t>(want.size())) << what;
  for (size_t j = 0; j < want.size(); ++j) {
    EXPECT_EQ(got.top.id[j], want[j].id) << what << " alternative " << j;
    EXPECT_NEAR(got.top.logprob[j], want[j].logprob, Tolerance(want[j].logprob))
        << what << " alternative " << j;
  }
}

// Each config x several draws: the device picks the CPU's token with the CPU's logprob.
void ExpectMatchesCpu(const std::vector<float>& logits, int64_t vocab,
                      const std::vector<SamplerConfig>& configs, std::mt19937* rng) {
  std::uniform_real_distribution<double> unif(0.0, 1.0);
  std::vector<SampleParams> params;
  std::vector<SampledToken> want;
  for (const SamplerConfig& c : configs) {
    auto s = Sampler::Create(c);
    ASSERT_TRUE(s.ok()) << s.status().ToString();
    for (int d = 0; d < 3; ++d) {
      const double u = unif(*rng);
      auto t = s->SampleWith(std::span(logits.data(), vocab), u);
      ASSERT_TRUE(t.ok()) << t.status().ToString();
      want.push_back(*t);
      params.push_back(ParamsOf(c, u));
    }
  }
  // Every (config, draw) is one row over the same logits.
  std::vector<float> rows;
  for (size_t i = 0; i < params.size(); ++i) rows.insert(rows.end(), logits.begin(), logits.end());
  const std::vector<Picked> got = DeviceSample(rows, vocab, params);
  for (size_t i = 0; i < params.size(); ++i) {
    const SamplerConfig& c = configs[i / 3];
    const std::string what = "row " + std::to_string(i) + " (T " + std::to_string(c.temperature) +
                             " k " + std::to_string(c.top_k) + " p " + std::to_string(c.top_p) +
                             " greedy " + std::to_string(c.greedy) + " top " +
                             std::to_string(c.top_logprobs) + ")";
    ASSERT_EQ(got[i].status, cuda::kSampleOk) << what;
    EXPECT_EQ(got[i].id, want[i].id) << what;
    EXPECT_NEAR(got[i].logprob, want[i].logprob, Tolerance(want[i].logprob)) << what;
    ExpectSameTop(got[i], want[i].top, what);
  }
}

std::vector<SamplerConfig> AllKinds() {
  std::vector<SamplerConfig> c(7);
  c[0].greedy = true;
  c[1].temperature = 0.8f;
  c[2].temperature = 1.3f, c[2].top_k = 5;
  c[3].temperature = 0.7f, c[3].top_p = 0.9f;
  c[4].temperature = 1.0f, c[4].top_k = 40, c[4].top_p = 0.5f;
  c[5].temperature = 0.0f;  // greedy by temperature
  c[6].temperature = 2.0f, c[6].top_k = 1;
  return c;
}

// AllKinds, each asking for n alternatives.
std::vector<SamplerConfig> AllKindsWithTop(int32_t n) {
  std::vector<SamplerConfig> c = AllKinds();
  for (SamplerConfig& k : c) k.top_logprobs = n;
  return c;
}

TEST(CudaSample, RejectsBadArguments) {
  SampleResult r;
  cuda::SampleTop t;
  SampleParams p;
  float f = 0.0f;
  Status s = cuda::SampleRows(&f, 0, 4, &p, &r, &r, &t);
  EXPECT_NE(s.message().find("rows 0"), std::string::npos) << s.ToString();
  s = cuda::SampleRows(&f, 1, 0, &p, &r, &r, &t);
  EXPECT_NE(s.message().find("vocab 0"), std::string::npos) << s.ToString();
  s = cuda::SampleRows(nullptr, 1, 4, &p, &r, &r, &t);
  EXPECT_NE(s.message().find("null"), std::string::npos) << s.ToString();
  s = cuda::SampleRows(&f, 1, 4, &p, &r, &r, nullptr);
  EXPECT_NE(s.message().find("null"), std::string::npos) << s.ToString();
}

TEST(CudaSample, MatchesCpuSamplerOnRandomLogits) {
  if (cuda::DeviceCount() == 0) GTEST_SKIP() << "no CUDA device";
  std::mt19937 rng(11);
  // One chunk, and several chunks of the vocabulary (2048 logits a chunk).
  for (int64_t vocab : {int64_t{300}, int64_t{5000}}) {
    const std::vector<float> logits = RandomNormal(vocab, rng, 2.0f);
    ExpectMatchesCpu(logits, vocab, AllKinds(), &rng);
  }
}

TEST(CudaSample, TiesAndNegativeInfinityFollowTheCpuOrder) {
  if (cuda::DeviceCount() == 0) GTEST_SKIP() << "no CUDA device";
  std::mt19937 rng(5);
  const int64_t vocab = 2600;
  std::vector<float> logits = RandomNormal(vocab, rng);
  for (int64_t i = 0; i < vocab; i += 3) logits[i] = 1.5f;  // many equal logits: ties by id
  for (int64_t i = 1; i < vocab; i += 7) logits[i] = -INFINITY;
  logits[2500] = 4.0f, logits[2501] = 4.0f;  // the argmax tie: the lower id wins
  ExpectMatchesCpu(logits, vocab, AllKinds(), &rng);
}

TEST(CudaSample, SignedZerosTieAndTheLowerIdComesFirst) {
  if (cuda::DeviceCount() == 0) GTEST_SKIP() << "no CUDA device";
  std::mt19937 rng(3);
  const int64_t vocab = 3001;  // not a multiple of 4: rows past the first are not 16-byte aligned
  std::vector<float> logits(vocab, -1.0f);
  logits[5] = -0.0f, logits[9] = 0.0f, logits[3000] = -0.0f;  // -0 == +0: id 5, 9, 3000
  std::vector<SamplerConfig> c(3);
  c[0].temperature = 1.0f, c[0].top_k = 1;
  c[1].temperature = 1.0f, c[1].top_k = 2;
  c[2].temperature = 0.5f, c[2].top_p = 0.3f;
  ExpectMatchesCpu(logits, vocab, c, &rng);
}

// Top logprobs (Sampler's `top`): the best n ids of the row, or of the kept top-k / top-p set
// (fewer when it holds fewer), under the pick's distribution; over one chunk and several (each
// chunk's best n, merged), with ties across chunks, -inf logits (left out), n above the vocab.
TEST(CudaSample, TopLogprobsAreTheCpuSamplersAlternatives) {
  if (cuda::DeviceCount() == 0) GTEST_SKIP() << "no CUDA device";
  std::mt19937 rng(17);
  for (int64_t vocab : {int64_t{300}, int64_t{5000}}) {
    const std::vector<float> logits = RandomNormal(vocab, rng, 2.0f);
    for (int32_t n : {1, 5, 20}) ExpectMatchesCpu(logits, vocab, AllKindsWithTop(n), &rng);
  }
  // Equal logits in every chunk: the alternatives take the lower ids first, across chunks.
  const int64_t vocab = 6200;
  std::vector<float> ties = RandomNormal(vocab, rng);
  for (int64_t i = 5; i < vocab; i += 700) ties[i] = 6.0f;
  for (int64_t i = 0; i < vocab; i += 2) ties[i] = -INFINITY;
  ExpectMatchesCpu(ties, vocab, AllKindsWithTop(20), &rng);
  // Three finite logits among seven, 20 asked for: three (-inf has probability 0).
  const std::vector<float> few = {-INFINITY, 1.0f, -INFINITY, 3.0f, -INFINITY, -INFINITY, 1.0f};
  ExpectMatchesCpu(few, 7, AllKindsWithTop(20), &rng);
}

// Score rows (score_id >= 0): ScoreToken's logprob (log_softmax of the raw logits), rank (ids
// whose logit is >= the scored one's) and top ids, whatever the row's temperature; the argmax,
// an id tied with others, a -inf id; an id past the vocab is refused, NaN named.
TEST(CudaSample, ScoreRowsAreScoreToken) {
  if (cuda::DeviceCount() == 0) GTEST_SKIP() << "no CUDA device";
  std::mt19937 rng(23);
  const int64_t vocab = 4500;
  std::vector<float> logits = RandomNormal(vocab, rng, 2.0f);
  for (int64_t i = 3; i < vocab; i += 500) logits[i] = 1.25f;  // ties, across chunks
  logits[77] = -INFINITY;
  int64_t argmax = 0;
  for (int64_t i = 1; i < vocab; ++i) argmax = logits[i] > logits[argmax] ? i : argmax;
  const int32_t ids[] = {static_cast<int32_t>(argmax), 2503, 77, 0, static_cast<int32_t>(vocab - 1)};
  std::vector<float> rows;
  std::vector<SampleParams> params;
  for (int32_t id : ids) {
    rows.insert(rows.end(), logits.begin(), logits.end());
    SampleParams p;
    p.temperature = 0.7f;  // not read: a score is log_softmax's
    p.top_n = 4;
    p.score_id = id;
    params.push_back(p);
  }
  const std::vector<Picked> got = DeviceSample(rows, vocab, params);
  for (size_t i = 0; i < params.size(); ++i) {
    const std::string what = "id " + std::to_string(ids[i]);
    auto want = ScoreToken(logits, ids[i], 4);
    ASSERT_TRUE(want.ok()) << want.status().ToString();
    ASSERT_EQ(got[i].status, cuda::kSampleOk) << what;
    EXPECT_EQ(got[i].id, ids[i]) << what;
    if (std::isinf(want->logprob)) EXPECT_EQ(got[i].logprob, want->logprob) << what;
    else EXPECT_NEAR(got[i].logprob, want->logprob, Tolerance(want->logprob)) << what;
    EXPECT_EQ(got[i].rank, want->rank) << what;
    ExpectSameTop(got[i], want->top, what);
  }
  EXPECT_EQ(got[2].rank, vocab) << "every logit is >= -inf";
  EXPECT_EQ(got[1].rank, ScoreToken(logits, 3, 0)->rank) << "tied ids share the group's last rank";
  // Refusals: an id past the vocab; a NaN row scored.
  std::vector<float> bad = logits;
  bad.insert(bad.end(), logits.begin(), logits.end());
  bad[vocab + 10] = NAN;
  std::vector<SampleParams> bp(2);
  bp[0].score_id = static_cast<int32_t>(vocab), bp[1].score_id = 3;
  const std::vector<Picked> refused = DeviceSample(bad, vocab, bp);
  EXPECT_EQ(refused[0].status, cuda::kSampleBadId);
  EXPECT_EQ(refused[1].status, cuda::kSampleNaN);
  EXPECT_EQ(refused[1].id, 10);
}

TEST(CudaSample, ErrorsNameTheLogit) {
  if (cuda::DeviceCount() == 0) GTEST_SKIP() << "no CUDA device";
  const int64_t vocab = 4100;
  std::vector<float> rows(3 * vocab, 0.5f);
  rows[3000] = NAN, rows[4000] = NAN;                     // row 0: NaN at 3000
  for (int64_t i = 0; i < vocab; ++i) rows[vocab + i] = -INFINITY;  // row 1: nothing finite
  rows[2 * vocab + 2049] = INFINITY;                      // row 2: +inf at 2049
  std::vector<SampleParams> params(3);
  for (auto& p : params) p.greedy = 1;
  const std::vector<Picked> got = DeviceSample(rows, vocab, params);
  EXPECT_EQ(got[0].status, cuda::kSampleNaN);
  EXPECT_EQ(got[0].id, 3000);
  EXPECT_EQ(got[1].status, cuda::kSampleNoFinite);
  EXPECT_EQ(got[2].status, cuda::kSamplePosInf);
  EXPECT_EQ(got[2].id, 2049);
}

TEST(CudaSample, LargeCandidateSetsGoToTheHost) {
  if (cuda::DeviceCount() == 0) GTEST_SKIP() << "no CUDA device";
  std::mt19937 rng(9);
  const int64_t vocab = 6000;
  const std::vector<float> flat = RandomNormal(vocab, rng, 0.01f);  // top-p 0.99 needs ~5900
  std::vector<float> rows = flat;
  rows.insert(rows.end(), flat.begin(), flat.end());
  std::vector<SampleParams> params(2);
  params[0].top_k = cuda::kSampleMaxCandidates + 1, params[0].u = 0.3;
  params[1].top_p = 0.99f, params[1].u = 0.3;
  const std::vector<Picked> got = DeviceSample(rows, vocab, params);
  EXPECT_EQ(got[0].status, cuda::kSampleNeedsHost);
  EXPECT_EQ(got[1].status, cuda::kSampleNeedsHost);
}

// The four rows' samplers of AdjustedLogitsHaveTheHostsBits, their histories observed.
std::vector<Sampler> AdjustingSamplers(int64_t vocab) {
  std::vector<SamplerConfig> c(4);
  // Two biases on id 5 (added in turn), one past the vocabulary (skipped), penalties, min-p.
  c[0].temperature = 0.8f, c[0].seed = 1, c[0].min_p = 0.05f;
  c[0].logit_bias = {{5, 2.5f}, {7, -100.0f}, {static_cast<int32_t>(vocab) + 3, 9.0f}, {5, 1.25f}};
  c[0].repetition_penalty = 1.3f, c[0].frequency_penalty = 0.5f, c[0].presence_penalty = 0.25f;
  // Greedy: a bias on a held id (then -inf), a tiny repetition penalty (clamped at FLT_MAX).
  c[1].greedy = true, c[1].min_tokens = 3, c[1].min_tokens_ids = {0, 4, 9, 4};
  c[1].logit_bias = {{4, 50.0f}}, c[1].repetition_penalty = 1e-3f;
  // Holding back every id would leave nothing: none is held.
  c[2].temperature = 1.0f, c[2].min_tokens = 5, c[2].frequency_penalty = -2.0f;
  for (int32_t i = 0; i < vocab; ++i) c[2].min_tokens_ids.push_back(i);
  // NaN, +inf and -inf logits among penalized ids stay as they are; +inf is the max (no min-p).
  c[3].temperature = 1.5f, c[3].min_p = 0.5f, c[3].repetition_penalty = 0.7f;
  c[3].logit_bias = {{20, 3.0f}, {22, 3.0f}};
  std::vector<Sampler> s;
  for (const SamplerConfig& k : c) s.push_back(*Sampler::Create(k));
  s[0].Observe(std::vector<int32_t>{1, 2, 3, 5, 10}, false);
  s[0].Observe(std::vector<int32_t>{7, 7, 11}, true);
  s[1].Observe(std::vector<int32_t>{10, 12}, false);
  s[2].Observe(std::vector<int32_t>{8, 8, 8}, true);  // 3 of 5 generated: still held
  s[3].Observe(std::vector<int32_t>{20, 21, 22, 30}, false);
  return s;
}

// AdjustLogits over AppendLogitEdits' lists gives Sampler::Adjusted's logits bit for bit: biases
// in turn, the mask (and the case where it would leave nothing), repetition on positive and
// negative logits, frequency and presence, min-p, the clamp at FLT_MAX, non-finite logits left
// alone; four rows in one launch. A row past its limits is not taken, and adds nothing.
TEST(CudaSample, AdjustedLogitsHaveTheHostsBits) {
  const int64_t vocab = 5000;  // past one pass of 256 threads x 16 loads, with a tail
  std::vector<Sampler> samplers = AdjustingSamplers(vocab);
  {
    LogitEditBatch none;
    EXPECT_FALSE(AppendLogitEdits(samplers[0], 0, vocab, 4, 100, &none)) << "7 edits past 4";
    EXPECT_FALSE(AppendLogitEdits(samplers[0], 0, vocab, 100, 2, &none)) << "3 biases past 2";
    EXPECT_TRUE(none.rows.empty() && none.edits.empty() && none.biases.empty());
    LogitEditBatch two;  // the limits are a row's, not the batch's
    EXPECT_TRUE(AppendLogitEdits(samplers[0], 0, vocab, 7, 3, &two));
    EXPECT_TRUE(AppendLogitEdits(samplers[0], 1, vocab, 7, 3, &two));
    ASSERT_EQ(two.rows.size(), 2u);
    EXPECT_EQ(two.rows[1].edit_begin, 7);
    EXPECT_EQ(two.rows[1].edit_end, 14);
    EXPECT_EQ(two.biases.size(), 6u);
  }
  if (cuda::DeviceCount() == 0) GTEST_SKIP() << "no CUDA device";
  std::mt19937 rng(29);
  std::vector<float> rows;
  for (int r = 0; r < 4; ++r) {
    std::vector<float> l = RandomNormal(vocab, rng, 3.0f);
    l[10] = 3.0e38f;  // row 1: / 1e-3 is past FLT_MAX
    l[2] = -1.5f, l[3] = 2.0f;  // repetition on a negative and a positive logit
    if (r == 3) l[20] = NAN, l[21] = INFINITY, l[22] = -INFINITY;
    rows.insert(rows.end(), l.begin(), l.end());
  }
  LogitEditBatch batch;
  for (int r = 0; r < 4; ++r)
    ASSERT_TRUE(AppendLogitEdits(samplers[r], r, vocab, 65536, 1024, &batch)) << "row " << r;
  DeviceBuffer l = ToDevice(rows), ar = ToDevice(batch.rows), ae = ToDevice(batch.edits),
               ab = ToDevice(batch.biases);
  const Status st = cuda::AdjustLogits(l.as<float>(), vocab, ar.as<cuda::AdjustRow>(), 4,
                                       ae.as<cuda::LogitEdit>(), ab.as<float>());
  ASSERT_TRUE(st.ok()) << st.ToString();
  std::vector<float> got(rows.size());
  ASSERT_TRUE(l.CopyToHost(got.data(), got.size() * sizeof(float)).ok());
  for (int r = 0; r < 4; ++r) {
    const std::vector<float> want = samplers[r].Adjusted(std::span(&rows[r * vocab], vocab));
    int differ = 0;
    for (int64_t i = 0; i < vocab; ++i) {
      uint32_t a, b;
      std::memcpy(&a, &got[r * vocab + i], 4);
      std::memcpy(&b, &want[i], 4);
      if (a != b && differ++ < 5)
        ADD_FAILURE() << "row " << r << " id " << i << ": " << got[r * vocab + i] << " vs " << want[i];
    }
    EXPECT_EQ(differ, 0) << "row " << r;
  }
  // What the rows show (so that each rule above did something).
  EXPECT_EQ(got[1 * vocab + 4], -INFINITY) << "held";
  EXPECT_EQ(got[1 * vocab + 10], FLT_MAX) << "clamped";
  EXPECT_NE(got[2 * vocab + 0], -INFINITY) << "nothing held when everything would be";
  EXPECT_EQ(got[2 * vocab + 8], rows[2 * vocab + 8] + 6.0f) << "frequency -2 x 3";
  EXPECT_TRUE(std::isnan(got[3 * vocab + 20]));
  EXPECT_EQ(got[3 * vocab + 21], INFINITY);
  int dropped = 0;
  for (int64_t i = 0; i < vocab; ++i) dropped += got[i] == -INFINITY ? 1 : 0;
  EXPECT_GT(dropped, 100) << "min-p 0.05 drops the tail of row 0";
}

}  // namespace
}  // namespace fm
