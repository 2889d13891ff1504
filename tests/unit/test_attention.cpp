// The attention block: against a whole-sequence reference written the HF way (all windows at
// once, masks, double math), decode == prefill, batch == alone, threads, errors, tiny preset.
#include <gtest/gtest.h>
#include <unistd.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <filesystem>
#include <random>
#include <vector>

#include "kernels/cpu/matvec.h"
#include "model/attention.h"
#include "model/checkpoint.h"
#include "model/mkmodel.h"

namespace fm {
namespace {

using Vec = std::vector<double>;

ModelConfig TestConfig(int64_t ratio) {
  ModelConfig c;
  c.hidden_size = 64;
  c.num_attention_heads = 4;
  c.head_dim = 32;
  c.qk_rope_head_dim = 16;
  c.q_lora_rank = 48;
  c.o_lora_rank = 16;
  c.o_groups = 2;
  c.sliding_window = 16;
  c.index_n_heads = 3;
  c.index_head_dim = 24;
  c.index_topk = 8;
  c.rms_norm_eps = 1e-6;
  c.num_hidden_layers = 1;
  c.compress_ratios = {ratio, 0};
  return c;
}

// In-memory F32 weights of one layer (no checkpoint).
struct RandomLayer {
  std::vector<std::vector<float>> store;
  AttentionWeights w;
  std::mt19937 rng;

  QWeight Mat(int64_t rows, int64_t cols) {
    std::normal_distribution<float> d(0.0f, 1.0f / std::sqrt(float(cols)));
    store.emplace_back(rows * cols);
    for (auto& v : store.back()) v = d(rng);
    QWeight q;
    q.format = WeightFormat::kF32;
    q.rows = rows, q.cols = cols, q.data = store.back().data();
    return q;
  }
  std::vector<float> Vecf(int64_t n, float mean, float sd) {
    std::normal_distribution<float> d(mean, sd);
    std::vector<float> v(n);
    for (auto& x : v) x = d(rng);
    return v;
  }
  CompressorWeights Comp(int64_t ratio, int64_t dim, int64_t H) {
    CompressorWeights c;
    c.ratio = ratio, c.dim = dim, c.overlap = ratio == 4;
    c.wkv = Mat(c.width(), H);
    c.wgate = Mat(c.width(), H);
    c.ape = Vecf(ratio * c.width(), 0.0f, 0.5f);
    c.norm = Vecf(dim, 1.0f, 0.1f);
    return c;
  }
  RandomLayer(const ModelConfig& c, int64_t ratio, uint32_t seed) : rng(seed) {
    const int64_t H = c.hidden_size, nH = c.num_attention_heads, D = c.head_dim;
    store.reserve(16);
    w.ratio = ratio;
    w.wq_a = Mat(c.q_lora_rank, H);
    w.q_norm = Vecf(c.q_lora_rank, 1.0f, 0.1f);
    w.wq_b = Mat(nH * D, c.q_lora_rank);
    w.wkv = Mat(D, H);
    w.kv_norm = Vecf(D, 1.0f, 0.1f);
    w.wo_a = Mat(c.o_groups * c.o_lora_rank, nH * D / c.o_groups);
    w.wo_b = Mat(H, c.o_groups * c.o_lora_rank);
    w.attn_sink = Vecf(nH, 0.0f, 1.0f);
    w.rope_inv_freq = AttentionRopeInvFreq(c, ratio);
    if (ratio > 1) w.compressor = Comp(ratio, D, H);
    if (ratio == 4) {
      w.index_compressor = Comp(4, c.index_head_dim, H);
      w.index_wq_b = Mat(c.index_n_heads * c.index_head_dim, c.q_lora_rank);
      w.index_weights_proj = Mat(c.index_n_heads, H);
    }
  }
};

// ---- the reference: HF's structure, double math (projections through MatvecRef) ----

Vec Lin(const QWeight& w, const double* x) {
  std::vector<float> xf(x, x + w.cols), y(w.rows);
  MatvecRef(w, xf.data(), y.data());
  return Vec(y.begin(), y.end());
}

void Norm(double* x, int64_t n, const float* g, double eps) {
  double ss = 0;
  for (int64_t i = 0; i < n; ++i) ss += x[i] * x[i];
  const double inv = 1.0 / std::sqrt(ss / n + eps);
  for (int64_t i = 0; i < n; ++i) x[i] = x[i] * inv * (g ? g[i] : 1.0);
}

// Frequencies straight from MODEL.md / HF _compute_yarn_parameters, rounded to f32 as HF keeps them.
std::vector<float> RefFreq(const ModelConfig& c, int64_t ratio) {
  const int64_t rd = c.qk_rope_head_dim;
  const double theta = ratio == 0 ? c.rope_theta : c.compress_rope_theta;
  const auto& y = c.rope_scaling;
  auto corr = [&](double b) {
    return rd * std::log(y.original_max_position_embeddings / (2 * M_PI * b)) / (2 * std::log(theta));
  };
  double lo = std::max(std::floor(corr(y.beta_fast)), 0.0);
  double hi = std::min(std::ceil(corr(y.beta_slow)), double(rd - 1));
  if (lo == hi) hi += 0.001;
  std::vector<float> f(rd / 2);
  for (int64_t i = 0; i < rd / 2; ++i) {
    const double base = std::pow(theta, -2.0 * i / rd);
    const double ramp = std::clamp((i - lo) / (hi - lo), 0.0, 1.0);
    f[i] = float(ratio == 0 ? base : base * (1 - ramp) + base / y.factor * ramp);
  }
  return f;
}

void Rope(double* x, int64_t dim, int64_t rd, int64_t pos, const std::vector<float>& f, double sign) {
  for (int64_t i = 0; i < rd / 2; ++i) {
    const double ang = sign * double(float(pos) * f[i]);  // HF: the f32 product pos * f
    double& a = x[dim - rd + 2 * i];
    double& b = x[dim - rd + 2 * i + 1];
    const double na = a * std::cos(ang) - b * std::sin(ang), nb = a * std::sin(ang) + b * std::cos(ang);
    a = na, b = nb;
  }
}

// All entries of one compressor over the whole sequence (HF's stateless new_kv / new_gate layout).
std::vector<Vec> RefEntries(const ModelConfig& c, const CompressorWeights& cw, const std::vector<float>& x,
                            int64_t T, const std::vector<float>& f) {
  const int64_t r = cw.ratio, d = cw.dim, wd = cw.width(), H = c.hidden_size;
  std::vector<Vec> a(T), z(T), out;
  for (int64_t t = 0; t < T; ++t) {
    Vec xt(x.begin() + t * H, x.begin() + (t + 1) * H);
    a[t] = Lin(cw.wkv, xt.data());
    z[t] = Lin(cw.wgate, xt.data());
    for (int64_t ch = 0; ch < wd; ++ch) z[t][ch] += cw.ape[(t % r) * wd + ch];
  }
  for (int64_t w = 0; w < T / r; ++w) {
    Vec e(d);
    for (int64_t ch = 0; ch < d; ++ch) {
      std::vector<std::pair<double, double>> slots;  // (logit, value)
      if (cw.overlap) {
        for (int64_t j = 0; j < r; ++j) {
          if (w > 0) slots.push_back({z[(w - 1) * r + j][ch], a[(w - 1) * r + j][ch]});
        }
        for (int64_t j = 0; j < r; ++j) slots.push_back({z[w * r + j][d + ch], a[w * r + j][d + ch]});
      } else {
        for (int64_t j = 0; j < r; ++j) slots.push_back({z[w * r + j][ch], a[w * r + j][ch]});
      }
      double m = -1e300, s = 0, acc = 0;
      for (auto& [l, v] : slots) m = std::max(m, l);
      for (auto& [l, v] : slots) s += std::exp(l - m);
      for (auto& [l, v] : slots) acc += std::exp(l - m) / s * v;
      e[ch] = acc;
    }
    Norm(e.data(), d, cw.norm.data(), c.rms_norm_eps);
    Rope(e.data(), d, c.qk_rope_head_dim, w * r, f, 1.0);
    out.push_back(e);
  }
  return out;
}

std::vector<double> RefForward(const ModelConfig& c, const AttentionWeights& w, const std::vector<float>& x,
                               int64_t T) {
  const int64_t H = c.hidden_size, nH = c.num_attention_heads, D = c.head_dim, rd = c.qk_rope_head_dim;
  const int64_t nI = c.index_n_heads, dI = c.index_head_dim, r = w.ratio, G = c.o_groups, R = c.o_lora_rank;
  const auto f = RefFreq(c, r);
  std::vector<Vec> q(T), kv(T), cq(T), iq(T), iw(T);
  for (int64_t t = 0; t < T; ++t) {
    Vec xt(x.begin() + t * H, x.begin() + (t + 1) * H);
    cq[t] = Lin(w.wq_a, xt.data());
    Norm(cq[t].data(), c.q_lora_rank, w.q_norm.data(), c.rms_norm_eps);
    q[t] = Lin(w.wq_b, cq[t].data());
    for (int64_t h = 0; h < nH; ++h) {
      Norm(q[t].data() + h * D, D, nullptr, c.rms_norm_eps);
      Rope(q[t].data() + h * D, D, rd, t, f, 1.0);
    }
    kv[t] = Lin(w.wkv, xt.data());
    Norm(kv[t].data(), D, w.kv_norm.data(), c.rms_norm_eps);
    Rope(kv[t].data(), D, rd, t, f, 1.0);
    if (r == 4) {
      iq[t] = Lin(w.index_wq_b, cq[t].data());
      for (int64_t h = 0; h < nI; ++h) Rope(iq[t].data() + h * dI, dI, rd, t, f, 1.0);
      iw[t] = Lin(w.index_weights_proj, xt.data());
    }
  }
  std::vector<Vec> E, IE;
  if (r > 1) E = RefEntries(c, w.compressor, x, T, f);
  if (r == 4) IE = RefEntries(c, w.index_compressor, x, T, f);

  std::vector<double> out(T * H);
  for (int64_t t = 0; t < T; ++t) {
    std::vector<const Vec*> keys;
    for (int64_t s = 0; s <= t; ++s) if (s > t - c.sliding_window) keys.push_back(&kv[s]);
    if (r > 1) {
      const int64_t nv = (t + 1) / r;
      std::vector<int64_t> chosen;
      if (r != 4 || nv <= c.index_topk) {
        for (int64_t e = 0; e < nv; ++e) chosen.push_back(e);
      } else {
        std::vector<std::pair<double, int64_t>> sc;
        for (int64_t e = 0; e < nv; ++e) {
          double s = 0;
          for (int64_t h = 0; h < nI; ++h) {
            double dot = 0;
            for (int64_t ch = 0; ch < dI; ++ch) dot += iq[t][h * dI + ch] * IE[e][ch];
            s += std::max(dot, 0.0) / std::sqrt(double(dI)) * iw[t][h] / std::sqrt(double(nI));
          }
          sc.push_back({-s, e});
        }
        std::sort(sc.begin(), sc.end());
        for (int64_t i = 0; i < c.index_topk; ++i) chosen.push_back(sc[i].second);
        std::sort(chosen.begin(), chosen.end());
      }
      for (int64_t e : chosen) keys.push_back(&E[e]);
    }
    Vec o(nH * D, 0.0);
    for (int64_t h = 0; h < nH; ++h) {
      std::vector<double> s(keys.size());
      double m = w.attn_sink[h];
      for (size_t i = 0; i < keys.size(); ++i) {
        double dot = 0;
        for (int64_t ch = 0; ch < D; ++ch) dot += q[t][h * D + ch] * (*keys[i])[ch];
        s[i] = dot / std::sqrt(double(D));
        m = std::max(m, s[i]);
      }
      double den = std::exp(w.attn_sink[h] - m);
      for (auto& v : s) den += (v = std::exp(v - m));
      for (size_t i = 0; i < keys.size(); ++i)
        for (int64_t ch = 0; ch < D; ++ch) o[h * D + ch] += s[i] / den * (*keys[i])[ch];
      Rope(o.data() + h * D, D, rd, t, f, -1.0);
    }
    Vec u;
    const int64_t gin = nH * D / G;
    for (int64_t g = 0; g < G; ++g) {
      QWeight wg = w.wo_a;  // F32 rows or full product: take rows [g*R, (g+1)*R)
      Vec full = Lin(wg, o.data() + g * gin);
      u.insert(u.end(), full.begin() + g * R, full.begin() + (g + 1) * R);
    }
    Vec y = Lin(w.wo_b, u.data());
    std::copy(y.begin(), y.end(), out.begin() + t * H);
  }
  return out;
}

// ---- helpers ----

std::vector<float> RandomInput(int64_t T, int64_t H, uint32_t seed) {
  std::mt19937 rng(seed);
  std::normal_distribution<float> d(0.0f, 1.0f);
  std::vector<float> x(T * H);
  for (auto& v : x) v = d(rng);
  return x;
}

// Feeds x [T, H] to a fresh cache in chunks of `chunk` rows (0: all at once).
std::vector<float> RunChunked(const ModelConfig& c, const AttentionWeights& w, const std::vector<float>& x,
                              int64_t T, int64_t chunk, ThreadPool* pool) {
  auto cache = NewAttentionCache(c, w.ratio, T);
  const int64_t H = c.hidden_size;
  std::vector<float> out(T * H);
  for (int64_t t0 = 0; t0 < T;) {
    const int64_t n = chunk == 0 ? T : std::min(chunk, T - t0);
    AttentionSeq s{cache.get(), n};
    Status st = AttentionForward(c, w, std::span<const AttentionSeq>(&s, 1), x.data() + t0 * H,
                                 out.data() + t0 * H, pool);
    EXPECT_TRUE(st.ok()) << st.ToString();
    t0 += n;
  }
  EXPECT_EQ(cache->next_pos(), T);
  return out;
}

template <typename A, typename B>
double MaxRelErr(const A& a, const B& ref) {
  double num = 0, den = 0;
  for (size_t i = 0; i < ref.size(); ++i) {
    const double d = std::fabs(double(a[i]) - double(ref[i]));
    if (!std::isnan(num) && !(d <= num)) num = d;   // a NaN, once there, stays (std::max skips it)
    den = std::max(den, std::fabs(double(ref[i])));
  }
  return num / den;
}

class AttentionKinds : public ::testing::TestWithParam<int64_t> {};

// More than 3 windows and more than 4 ratio-128 windows; the ratio-4 indexer must choose.
constexpr int64_t kT = 530;

TEST_P(AttentionKinds, PrefillMatchesReference) {
  const int64_t ratio = GetParam();
  const ModelConfig c = TestConfig(ratio);
  RandomLayer L(c, ratio, 100 + ratio);
  ASSERT_TRUE(ValidateAttention(c, L.w, "test.").ok());
  const int64_t T = 300;
  auto x = RandomInput(T, c.hidden_size, 7);
  auto out = RunChunked(c, L.w, x, T, 0, nullptr);
  auto ref = RefForward(c, L.w, x, T);
  EXPECT_LT(MaxRelErr(out, ref), 1e-4);
  // Per position as well: early rows (few keys) and late rows (entries, indexer picks).
  for (int64_t t : {0, 3, 15, 16, 130, 299}) {
    std::vector<float> o(out.begin() + t * c.hidden_size, out.begin() + (t + 1) * c.hidden_size);
    std::vector<double> r(ref.begin() + t * c.hidden_size, ref.begin() + (t + 1) * c.hidden_size);
    EXPECT_LT(MaxRelErr(o, r), 1e-4) << "position " << t;
  }
}

TEST_P(AttentionKinds, DecodeEqualsPrefill) {
  const int64_t ratio = GetParam();
  const ModelConfig c = TestConfig(ratio);
  RandomLayer L(c, ratio, 200 + ratio);
  auto x = RandomInput(kT, c.hidden_size, 8);
  auto prefill = RunChunked(c, L.w, x, kT, 0, nullptr);
  auto decode = RunChunked(c, L.w, x, kT, 1, nullptr);
  auto chunks = RunChunked(c, L.w, x, kT, 37, nullptr);
  EXPECT_LT(MaxRelErr(decode, prefill), 1e-4);
  EXPECT_LT(MaxRelErr(chunks, prefill), 1e-4);
  // Prefill of 400 then decoding the rest, one by one.
  auto cache = NewAttentionCache(c, ratio, kT);
  std::vector<float> mixed(kT * c.hidden_size);
  for (int64_t t0 = 0; t0 < kT;) {
    const int64_t n = t0 == 0 ? 400 : 1;
    AttentionSeq s{cache.get(), n};
    ASSERT_TRUE(AttentionForward(c, L.w, std::span<const AttentionSeq>(&s, 1), x.data() + t0 * c.hidden_size,
                                 mixed.data() + t0 * c.hidden_size, nullptr)
                    .ok());
    t0 += n;
  }
  EXPECT_LT(MaxRelErr(mixed, prefill), 1e-4);
}

// Three sequences at positions start[i] get rows[i] new rows in one batch, vs each alone.
void CheckBatchEqualsAlone(int64_t ratio, const int64_t (&start)[3], const int64_t (&rows)[3]) {
  const ModelConfig c = TestConfig(ratio);
  const int64_t H = c.hidden_size;
  RandomLayer L(c, ratio, 300 + ratio);
  std::vector<std::unique_ptr<AttentionCache>> alone, batched;
  std::vector<std::vector<float>> prefix;
  for (int i = 0; i < 3; ++i) {
    prefix.push_back(RandomInput(start[i], H, 40 + i));
    std::vector<float> scratch(start[i] * H);
    for (auto* set : {&alone, &batched}) {
      set->push_back(NewAttentionCache(c, ratio, 1000));
      AttentionSeq s{set->back().get(), start[i]};
      ASSERT_TRUE(AttentionForward(c, L.w, std::span<const AttentionSeq>(&s, 1), prefix[i].data(),
                                   scratch.data(), nullptr)
                      .ok());
    }
  }
  const int64_t total = rows[0] + rows[1] + rows[2];
  auto x = RandomInput(total, H, 50);
  std::vector<float> out_batch(total * H), out_alone(total * H);
  std::vector<AttentionSeq> seqs;
  for (int i = 0; i < 3; ++i) seqs.push_back({batched[i].get(), rows[i]});
  ThreadPool pool(2);
  ASSERT_TRUE(AttentionForward(c, L.w, seqs, x.data(), out_batch.data(), &pool).ok());
  int64_t row = 0;
  for (int i = 0; i < 3; ++i) {
    AttentionSeq s{alone[i].get(), rows[i]};
    ASSERT_TRUE(AttentionForward(c, L.w, std::span<const AttentionSeq>(&s, 1), x.data() + row * H,
                                 out_alone.data() + row * H, nullptr)
                    .ok());
    row += rows[i];
    EXPECT_EQ(batched[i]->next_pos(), start[i] + rows[i]);
    EXPECT_EQ(batched[i]->bytes(), alone[i]->bytes());
  }
  EXPECT_EQ(0, std::memcmp(out_batch.data(), out_alone.data(), out_batch.size() * sizeof(float)));
}

TEST_P(AttentionKinds, BatchOfThreeEqualsAloneBitExact) {
  CheckBatchEqualsAlone(GetParam(), {5, 140, 300}, {1, 3, 2});
  // 351 rows: more than one internal pass, the middle sequence split between two.
  CheckBatchEqualsAlone(GetParam(), {0, 17, 260}, {200, 150, 1});
}

TEST_P(AttentionKinds, ThreadCountDoesNotChangeBits) {
  const int64_t ratio = GetParam();
  const ModelConfig c = TestConfig(ratio);
  RandomLayer L(c, ratio, 400 + ratio);
  auto x = RandomInput(200, c.hidden_size, 9);
  ThreadPool one(1), two(2);
  auto a = RunChunked(c, L.w, x, 200, 0, &one);
  auto b = RunChunked(c, L.w, x, 200, 0, &two);
  auto d = RunChunked(c, L.w, x, 200, 0, nullptr);
  EXPECT_EQ(0, std::memcmp(a.data(), b.data(), a.size() * sizeof(float)));
  EXPECT_EQ(0, std::memcmp(a.data(), d.data(), a.size() * sizeof(float)));
}

INSTANTIATE_TEST_SUITE_P(Ratios, AttentionKinds, ::testing::Values(0, 4, 128),
                         [](const auto& info) { return "ratio" + std::to_string(info.param); });

TEST(Attention, CacheBytesGrowWithEntries) {
  const ModelConfig c = TestConfig(128);
  RandomLayer L(c, 128, 5);
  auto x = RandomInput(300, c.hidden_size, 10);
  auto cache = NewAttentionCache(c, 128, 300);
  EXPECT_EQ(cache->bytes(), 0u);
  std::vector<float> out(300 * c.hidden_size);
  AttentionSeq s{cache.get(), 300};
  ASSERT_TRUE(AttentionForward(c, L.w, std::span<const AttentionSeq>(&s, 1), x.data(), out.data(), nullptr).ok());
  // At least the window ring and two entries of width D.
  EXPECT_GE(cache->bytes(), sizeof(float) * (c.sliding_window + 2) * c.head_dim);
}

TEST(Attention, IndexerPicksExactlyTopK) {
  const int64_t nI = 3, dI = 24, topk = 8;
  std::mt19937 rng(3);
  std::normal_distribution<float> d(0.0f, 1.0f);
  std::vector<float> q(nI * dI), proj(nI), keys(40 * dI);
  for (auto* v : {&q, &proj, &keys})
    for (auto& e : *v) e = d(rng);
  std::vector<int32_t> picks;
  IndexerSelect(q.data(), proj.data(), nI, dI, keys.data(), 40, topk, &picks);
  ASSERT_EQ(picks.size(), size_t(topk));
  for (size_t i = 1; i < picks.size(); ++i) EXPECT_LT(picks[i - 1], picks[i]);
  for (int32_t p : picks) EXPECT_LT(p, 40);
  IndexerSelect(q.data(), proj.data(), nI, dI, keys.data(), 5, topk, &picks);  // fewer visible
  EXPECT_EQ(picks, (std::vector<int32_t>{0, 1, 2, 3, 4}));
  IndexerSelect(q.data(), proj.data(), nI, dI, keys.data(), 8, topk, &picks);  // exactly topk
  EXPECT_EQ(picks.size(), 8u);
}

TEST(Attention, ErrorsLeaveCachesUntouched) {
  const ModelConfig c = TestConfig(4);
  RandomLayer L(c, 4, 6);
  auto x = RandomInput(10, c.hidden_size, 11);
  std::vector<float> out(10 * c.hidden_size);
  auto ok_cache = NewAttentionCache(c, 4, 100);
  auto small = NewAttentionCache(c, 4, 8);
  AttentionSeq seqs[2] = {{ok_cache.get(), 1}, {small.get(), 9}};
  Status st = AttentionForward(c, L.w, seqs, x.data(), out.data(), nullptr);
  EXPECT_EQ(st.code(), Code::kOutOfRange);
  EXPECT_NE(st.message().find("max_context 8"), std::string::npos) << st.message();
  EXPECT_EQ(ok_cache->next_pos(), 0);
  EXPECT_EQ(small->next_pos(), 0);

  auto wrong = NewAttentionCache(c, 128, 100);
  AttentionSeq w1{wrong.get(), 1};
  st = AttentionForward(c, L.w, std::span<const AttentionSeq>(&w1, 1), x.data(), out.data(), nullptr);
  EXPECT_EQ(st.code(), Code::kInvalidArgument);
  AttentionSeq twice[2] = {{ok_cache.get(), 1}, {ok_cache.get(), 1}};
  EXPECT_EQ(AttentionForward(c, L.w, twice, x.data(), out.data(), nullptr).code(), Code::kInvalidArgument);
}

TEST(Attention, ValidateNamesTheTensor) {
  const ModelConfig c = TestConfig(4);
  RandomLayer L(c, 4, 7);
  AttentionWeights bad = L.w;
  bad.wkv.rows = 31;
  Status st = ValidateAttention(c, bad, "layers.2.attn.");
  EXPECT_FALSE(st.ok());
  EXPECT_NE(st.message().find("layers.2.attn.wkv"), std::string::npos) << st.message();
  bad = L.w;
  bad.index_compressor.ape.pop_back();
  st = ValidateAttention(c, bad, "layers.2.attn.");
  EXPECT_NE(st.message().find("layers.2.attn.indexer.compressor.ape"), std::string::npos) << st.message();
  bad = L.w;
  bad.ratio = 1;
  EXPECT_FALSE(ValidateAttention(c, bad, "x.").ok());
}

// ---- the tiny preset: real formats (FP8 + scales, BF16 compressor weights) ----

class TinyPreset : public ::testing::Test {
 protected:
  static void SetUpTestSuite() {
    dir_ = new std::string(std::filesystem::temp_directory_path() /
                           ("fm_attn_tiny_" + std::to_string(getpid())));
    Status st = WritePresetCheckpoint(*dir_, "tiny", 1);
    ASSERT_TRUE(st.ok()) << st.ToString();
    auto ck = Checkpoint::Open(*dir_);
    ASSERT_TRUE(ck.ok()) << ck.status().ToString();
    ckpt_ = std::move(ck.value()).release();
  }
  static void TearDownTestSuite() {
    delete ckpt_;
    std::filesystem::remove_all(*dir_);
    delete dir_;
  }
  static std::string* dir_;
  static Checkpoint* ckpt_;
};
std::string* TinyPreset::dir_ = nullptr;
Checkpoint* TinyPreset::ckpt_ = nullptr;

TEST_F(TinyPreset, EveryLayerDecodeEqualsPrefillAndReference) {
  ASSERT_NE(ckpt_, nullptr);
  const ModelConfig& c = ckpt_->config();
  const int64_t T = 3 * 128 + 20;  // > 3 ratio-128 windows, > 3 sliding windows
  auto x = RandomInput(T, c.hidden_size, 12);
  for (int64_t layer = 0; layer <= c.num_hidden_layers; ++layer) {
    const bool mtp = layer == c.num_hidden_layers;
    const std::string prefix = mtp ? "mtp.0.attn." : "layers." + std::to_string(layer) + ".attn.";
    const int64_t ratio = c.compress_ratio(layer);
    auto w = BindAttention(*ckpt_, prefix, ratio);
    ASSERT_TRUE(w.ok()) << w.status().ToString();
    auto prefill = RunChunked(c, **w, x, T, 0, nullptr);
    auto decode = RunChunked(c, **w, x, T, 1, nullptr);
    EXPECT_LT(MaxRelErr(decode, prefill), 1e-4) << prefix;
    auto ref = RefForward(c, **w, x, T);
    EXPECT_LT(MaxRelErr(prefill, ref), 1e-4) << prefix;
  }
}

TEST_F(TinyPreset, BindErrorsNameTheTensor) {
  ASSERT_NE(ckpt_, nullptr);
  auto w = BindAttention(*ckpt_, "layers.0.attn.", 4);  // layer 0 has no compressor
  ASSERT_FALSE(w.ok());
  EXPECT_NE(w.status().message().find("layers.0.attn.compressor."), std::string::npos)
      << w.status().message();
}

}  // namespace
}  // namespace fm
