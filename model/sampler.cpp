#include "model/sampler.h"

#include <algorithm>
#include <cfloat>
#include <cmath>
#include <numeric>
#include <vector>

namespace fm {
namespace {

uint64_t SplitMix64(uint64_t* x) {
  uint64_t z = (*x += 0x9E3779B97F4A7C15ull);
  z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
  z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
  return z ^ (z >> 31);
}

uint64_t Rotl(uint64_t x, int k) { return (x << k) | (x >> (64 - k)); }

// The first m of ids [0, n) in the order `before` (m <= n, n > 0), sorted.
template <class Before>
std::vector<int32_t> TopIds(int64_t n, int64_t m, const Before& before) {
  std::vector<int32_t> ids(n);
  std::iota(ids.begin(), ids.end(), 0);
  m = std::min(m, n);
  std::partial_sort(ids.begin(), ids.begin() + m, ids.end(), before);
  ids.resize(m);
  return ids;
}

// The argmax of a row of logits (equal logits: the lower id), -inf left out; InvalidArgument
// for a NaN, +inf or no finite value (what neither a pick nor a score can be made from).
Result<int64_t> CheckedArgmax(std::span<const float> logits) {
  const int64_t n = static_cast<int64_t>(logits.size());
  int64_t best = -1;
  for (int64_t i = 0; i < n; ++i) {
    if (std::isnan(logits[i])) return InvalidArgument("logits[" + std::to_string(i) + "] is NaN");
    if (logits[i] != -INFINITY && (best < 0 || logits[i] > logits[best])) best = i;
  }
  if (best < 0) return InvalidArgument("logits: no finite value among " + std::to_string(n));
  if (logits[best] == INFINITY) return InvalidArgument("logits[" + std::to_string(best) + "] is +inf");
  return best;
}

// log_softmax of a row whose argmax is `best`: (l_i - l_max) - log(sum), the sum in id order
// with the max subtracted. The greedy sampler and ScoreToken both take their values here, so a
// token scored has the bits it has when sampled.
class LogSoftmax {
 public:
  LogSoftmax(std::span<const float> logits, int64_t best) : l_(logits), best_(best) {
    double sum = 0.0;
    for (float v : l_) sum += std::exp(static_cast<double>(v) - l_[best_]);
    log_sum_ = std::log(sum);
  }
  // The argmax's is -log(sum) (-log(1) is -0, where 0 - log(1) would be +0).
  float At(int64_t i) const {
    return i == best_ ? static_cast<float>(-log_sum_)
                      : static_cast<float>((static_cast<double>(l_[i]) - l_[best_]) - log_sum_);
  }
  // The `top` most likely ids with theirs, most likely first (equal logits: lower id first);
  // -inf logits left out.
  std::vector<TokenLogprob> Top(int32_t top) const {
    std::vector<TokenLogprob> out;
    if (top <= 0) return out;
    auto before = [&](int32_t a, int32_t b) { return l_[a] != l_[b] ? l_[a] > l_[b] : a < b; };
    for (int32_t id : TopIds(static_cast<int64_t>(l_.size()), top, before))
      if (l_[id] != -INFINITY) out.push_back({id, At(id)});
    return out;
  }

 private:
  std::span<const float> l_;
  int64_t best_;
  double log_sum_ = 0.0;
};

}  // namespace

Rng::Rng(uint64_t seed) {
  for (uint64_t& s : s_) s = SplitMix64(&seed);
}

uint64_t Rng::Next() {
  const uint64_t result = Rotl(s_[1] * 5, 7) * 9;
  const uint64_t t = s_[1] << 17;
  s_[2] ^= s_[0];
  s_[3] ^= s_[1];
  s_[1] ^= s_[2];
  s_[0] ^= s_[3];
  s_[2] ^= t;
  s_[3] = Rotl(s_[3], 45);
  return result;
}

double Rng::Uniform() { return static_cast<double>(Next() >> 11) * 0x1.0p-53; }

Status ValidateSamplerConfig(const SamplerConfig& cfg) {
  if (!(cfg.temperature >= 0.0f) || !std::isfinite(cfg.temperature))
    return InvalidArgument("temperature: " + std::to_string(cfg.temperature) +
                           " (must be a finite value >= 0)");
  if (!(cfg.top_p > 0.0f && cfg.top_p <= 1.0f))
    return InvalidArgument("top_p: " + std::to_string(cfg.top_p) + " (must be in (0, 1])");
  if (cfg.top_k < 0)
    return InvalidArgument("top_k: " + std::to_string(cfg.top_k) + " (must be >= 0; 0 = off)");
  if (!(cfg.repetition_penalty > 0.0f) || !std::isfinite(cfg.repetition_penalty))
    return InvalidArgument("repetition_penalty: " + std::to_string(cfg.repetition_penalty) +
                           " (must be a finite value > 0; 1 = off)");
  if (!(cfg.frequency_penalty >= -2.0f && cfg.frequency_penalty <= 2.0f))
    return InvalidArgument("frequency_penalty: " + std::to_string(cfg.frequency_penalty) + " (must be in [-2, 2])");
  if (!(cfg.presence_penalty >= -2.0f && cfg.presence_penalty <= 2.0f))
    return InvalidArgument("presence_penalty: " + std::to_string(cfg.presence_penalty) + " (must be in [-2, 2])");
  if (!(cfg.min_p >= 0.0f && cfg.min_p <= 1.0f))
    return InvalidArgument("min_p: " + std::to_string(cfg.min_p) + " (must be in [0, 1])");
  for (const auto& [id, bias] : cfg.logit_bias)
    if (id < 0 || !(bias >= -100.0f && bias <= 100.0f))
      return InvalidArgument("logit_bias: token " + std::to_string(id) + " bias " + std::to_string(bias) +
                             " (a token >= 0, a bias in [-100, 100])");
  if (cfg.min_tokens < 0)
    return InvalidArgument("min_tokens: " + std::to_string(cfg.min_tokens) + " (must be >= 0)");
  if (cfg.top_logprobs < 0 || cfg.top_logprobs > kMaxTopLogprobs)
    return InvalidArgument("top_logprobs: " + std::to_string(cfg.top_logprobs) + " (must be in [0, " +
                           std::to_string(kMaxTopLogprobs) + "])");
  if (cfg.prompt_logprobs < -1 || cfg.prompt_logprobs > kMaxTopLogprobs)
    return InvalidArgument("prompt_logprobs: " + std::to_string(cfg.prompt_logprobs) +
                           " (must be in [0, " + std::to_string(kMaxTopLogprobs) + "], or -1: off)");
  return Status::Ok();
}

Status CheckScoredId(int32_t id, int64_t n) {
  if (id < 0 || id >= n)
    return InvalidArgument("token " + std::to_string(id) + " is outside the " + std::to_string(n) + " logits");
  return Status::Ok();
}

Result<SampledToken> ScoreToken(std::span<const float> logits, int32_t id, int32_t top) {
  const int64_t n = static_cast<int64_t>(logits.size());
  FM_RETURN_IF_ERROR(CheckScoredId(id, n));
  FM_ASSIGN_OR_RETURN(const int64_t best, CheckedArgmax(logits));
  const LogSoftmax log_softmax(logits, best);
  SampledToken out{id, log_softmax.At(id), log_softmax.Top(top), {}};
  for (int64_t i = 0; i < n; ++i) out.rank += logits[i] >= logits[id];
  return out;
}

Result<Sampler> Sampler::Create(const SamplerConfig& cfg) {
  FM_RETURN_IF_ERROR(ValidateSamplerConfig(cfg));
  return Sampler(cfg);
}

Result<SampledToken> Sampler::Sample(std::span<const float> logits) {
  return SampleWith(logits, is_greedy() ? 0.0 : DrawUniform());
}

bool Sampler::has_penalties() const {
  return cfg_.repetition_penalty != 1.0f || cfg_.frequency_penalty != 0.0f || cfg_.presence_penalty != 0.0f;
}

bool Sampler::masks_min_tokens() const {
  return generated_count_ < cfg_.min_tokens && !cfg_.min_tokens_ids.empty();
}

bool Sampler::adjusts(bool sampling) const {
  return has_penalties() || !cfg_.logit_bias.empty() || masks_min_tokens() || (sampling && cfg_.min_p > 0.0f);
}

bool Sampler::AdjustsLogits() const { return adjusts(!is_greedy()); }

void Sampler::Observe(std::span<const int32_t> tokens, bool generated) {
  if (generated) generated_count_ += static_cast<int64_t>(tokens.size());
  if (!has_penalties()) return;
  const bool counts = generated && (cfg_.frequency_penalty != 0.0f || cfg_.presence_penalty != 0.0f);
  for (int32_t id : tokens) {
    if (cfg_.repetition_penalty != 1.0f) seen_.insert(id);
    if (counts) ++generated_[id];
  }
}

Status Sampler::CanAdoptPrompt(const Sampler& src) const {
  if (generated_count_ != 0 || src.generated_count_ != 0)
    return InvalidArgument("a sampler takes the prompt of a sequence only before either generates");
  if (cfg_.repetition_penalty != 1.0f && src.cfg_.repetition_penalty == 1.0f)
    return InvalidArgument("the sequence forked from has no repetition_penalty, so kept no prompt tokens");
  return Status::Ok();
}

Status Sampler::AdoptPrompt(const Sampler& src) {
  FM_RETURN_IF_ERROR(CanAdoptPrompt(src));
  if (cfg_.repetition_penalty != 1.0f) seen_ = src.seen_;
  return Status::Ok();
}

std::vector<float> Sampler::Adjusted(std::span<const float> logits) const {
  std::vector<float> l(logits.begin(), logits.end());
  const int64_t n = static_cast<int64_t>(l.size());
  auto in_range = [&](int32_t id) { return id >= 0 && id < n; };   // ids came from the network
  // A finite logit stays finite: a tiny repetition_penalty must not make one +inf (the model's
  // own +inf or NaN stay errors, -inf stays out).
  auto set = [&](int32_t id, double v) {
    if (std::isfinite(l[id])) l[id] = static_cast<float>(std::clamp(v, -double(FLT_MAX), double(FLT_MAX)));
  };
  // Each token's change depends on that token alone, so the sets' order does not matter.
  for (const auto& [id, bias] : cfg_.logit_bias)
    if (in_range(id)) set(id, static_cast<double>(l[id]) + bias);
  if (masks_min_tokens()) {
    // Held back unless that leaves nothing to draw (a request whose stop tokens cover the
    // vocabulary would otherwise fail the step of every sequence with it).
    std::vector<char> held(n, 0);
    for (int32_t id : cfg_.min_tokens_ids)
      if (in_range(id)) held[id] = 1;
    bool any_left = false;
    for (int64_t i = 0; i < n && !any_left; ++i) any_left = !held[i] && std::isfinite(l[i]);
    for (int64_t i = 0; i < n && any_left; ++i)
      if (held[i] && !std::isnan(l[i])) l[i] = -INFINITY;
  }
  const double r = cfg_.repetition_penalty;
  for (int32_t id : seen_)
    if (in_range(id)) set(id, l[id] > 0.0f ? static_cast<double>(l[id]) / r : static_cast<double>(l[id]) * r);
  for (const auto& [id, count] : generated_)
    if (in_range(id)) set(id, static_cast<double>(l[id]) - penalty_subtraction(count));
  if (cfg_.min_p > 0.0f && !is_greedy()) {
    // p_i / p_max = exp((l_i - l_max) / T): below min_p the token is out (-inf).
    float top = -INFINITY;
    for (float v : l)
      if (!std::isnan(v)) top = std::max(top, v);
    if (std::isfinite(top)) {
      const MinPCut cut = min_p_cut();
      for (float& v : l)
        if ((static_cast<double>(v) - top) * cut.inv_t < cut.floor) v = -INFINITY;
    }
  }
  return l;
}

double Sampler::penalty_subtraction(int32_t count) const {
  return cfg_.frequency_penalty * static_cast<double>(count) + cfg_.presence_penalty;
}

Sampler::MinPCut Sampler::min_p_cut() const {
  return {1.0 / static_cast<double>(cfg_.temperature), std::log(static_cast<double>(cfg_.min_p))};
}

Result<SampledToken> Sampler::SampleWith(std::span<const float> raw, double u) const {
  if (!adjusts(!is_greedy())) return SampleAdjustedWith(raw, u);
  const std::vector<float> adjusted = Adjusted(raw);
  return SampleAdjustedWith(adjusted, u);
}

Result<SampledToken> Sampler::SampleAdjustedWith(std::span<const float> logits, double u) const {
  const int64_t n = static_cast<int64_t>(logits.size());
  FM_ASSIGN_OR_RETURN(const int64_t best, CheckedArgmax(logits));   // ties: lower id
  if (is_greedy()) {   // log_softmax of the (adjusted) logits
    const LogSoftmax log_softmax(logits, best);
    return SampledToken{static_cast<int32_t>(best), log_softmax.At(best), log_softmax.Top(cfg_.top_logprobs), {}};
  }

  auto before = [&](int32_t a, int32_t b) {
    return logits[a] != logits[b] ? logits[a] > logits[b] : a < b;
  };

  const double inv_t = 1.0 / static_cast<double>(cfg_.temperature);
  const double top = static_cast<double>(logits[best]) * inv_t;
  auto weight = [&](int32_t id) { return std::exp(static_cast<double>(logits[id]) * inv_t - top); };
  // Candidates: without truncation every id in id order (no sort); with top-k / top-p a prefix
  // of the total order "larger logit first, lower id among equal logits".
  std::vector<int32_t> order(n);
  std::iota(order.begin(), order.end(), 0);
  int64_t keep = n;
  double total = 0.0;
  if (cfg_.top_k > 0 && cfg_.top_k < n) {
    keep = cfg_.top_k;
    std::partial_sort(order.begin(), order.begin() + keep, order.end(), before);
    for (int64_t j = 0; j < keep; ++j) total += weight(order[j]);
  } else {
    for (int64_t i = 0; i < n; ++i) total += weight(static_cast<int32_t>(i));
  }
  if (cfg_.top_p < 1.0f) {  // the shortest sorted prefix whose probability reaches top_p
    const double target = static_cast<double>(cfg_.top_p) * total;
    const bool sorted = keep < n;
    // Untruncated: sort a growing prefix until it holds the target mass (rarely all of it).
    for (int64_t m = std::min<int64_t>(n, 1024);; m = std::min<int64_t>(n, m * 8)) {
      if (!sorted) std::partial_sort(order.begin(), order.begin() + m, order.end(), before);
      const int64_t limit = sorted ? keep : m;
      double cum = 0.0;
      int64_t j = 0;
      while (j < limit) {
        cum += weight(order[j++]);
        if (cum >= target) break;
      }
      if (cum >= target || limit == keep) {
        keep = j;
        total = cum;
        break;
      }
    }
  }
  const double target = u * total;
  double cum = 0.0;
  int64_t pick = keep - 1;  // rounding can leave u just above the last cumulative sum
  for (int64_t j = 0; j < keep; ++j) {
    cum += weight(order[j]);
    if (target < cum) {
      pick = j;
      break;
    }
  }
  auto logprob = [&](int32_t id) { return static_cast<float>(std::log(weight(id) / total)); };
  SampledToken out{order[pick], logprob(order[pick]), {}, {}};
  if (cfg_.top_logprobs > 0) {
    // The kept set is sorted when top-k or top-p truncated it; else it is every id in id order.
    const int64_t m = std::min<int64_t>(keep, cfg_.top_logprobs);
    if (keep == n) std::partial_sort(order.begin(), order.begin() + m, order.end(), before);
    for (int64_t j = 0; j < m; ++j)
      if (weight(order[j]) > 0.0) out.top.push_back({order[j], logprob(order[j])});
  }
  return out;
}

}  // namespace fm
