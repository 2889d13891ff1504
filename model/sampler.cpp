#include "model/sampler.h"

#include <algorithm>
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
  return Status::Ok();
}

Result<Sampler> Sampler::Create(const SamplerConfig& cfg) {
  FM_RETURN_IF_ERROR(ValidateSamplerConfig(cfg));
  return Sampler(cfg);
}

Result<SampledToken> Sampler::Sample(std::span<const float> logits) {
  return SampleWith(logits, is_greedy() ? 0.0 : DrawUniform());
}

Result<SampledToken> Sampler::SampleWith(std::span<const float> logits, double u) const {
  const int64_t n = static_cast<int64_t>(logits.size());
  int64_t best = -1;
  for (int64_t i = 0; i < n; ++i) {
    if (std::isnan(logits[i]))
      return InvalidArgument("logits[" + std::to_string(i) + "] is NaN");
    if (logits[i] != -INFINITY && (best < 0 || logits[i] > logits[best])) best = i;  // ties: lower id
  }
  if (best < 0) return InvalidArgument("logits: no finite value among " + std::to_string(n));
  if (logits[best] == INFINITY) return InvalidArgument("logits[" + std::to_string(best) + "] is +inf");

  if (is_greedy()) {
    double sum = 0.0;  // log_softmax in id order, max subtracted
    for (int64_t i = 0; i < n; ++i) sum += std::exp(static_cast<double>(logits[i]) - logits[best]);
    return SampledToken{static_cast<int32_t>(best), static_cast<float>(-std::log(sum))};
  }

  const double inv_t = 1.0 / static_cast<double>(cfg_.temperature);
  const double top = static_cast<double>(logits[best]) * inv_t;
  auto weight = [&](int32_t id) { return std::exp(static_cast<double>(logits[id]) * inv_t - top); };
  // Candidates: without truncation every id in id order (no sort); with top-k / top-p a prefix
  // of the total order "larger logit first, lower id among equal logits".
  std::vector<int32_t> order(n);
  std::iota(order.begin(), order.end(), 0);
  auto before = [&](int32_t a, int32_t b) {
    return logits[a] != logits[b] ? logits[a] > logits[b] : a < b;
  };
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
  return SampledToken{order[pick], static_cast<float>(std::log(weight(order[pick]) / total))};
}

}  // namespace fm
