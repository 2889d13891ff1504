// Helpers of the tests that run a ShardModel end to end (tests/unit/test_forward.cpp on CPU,
// tests/gpu/test_cuda_shard.cpp on the device): random token ids, one call of embed + layers +
// logits over a batch, and the relative error the tolerances are stated in.
#pragma once
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <random>
#include <span>
#include <vector>

#include "common/status.h"
#include "model/forward.h"

namespace fm::modeltest {

// n token ids in [0, vocab), the same for the same seed.
inline std::vector<int32_t> RandomTokens(int n, uint32_t seed, int32_t vocab) {
  std::mt19937 rng(seed);
  std::vector<int32_t> t(static_cast<size_t>(n));
  for (auto& v : t) v = static_cast<int32_t>(rng() % static_cast<uint32_t>(vocab));
  return t;
}

// Embed + ForwardLayers + Logits over `items` (each sequence's next tokens, rows in item order);
// appends the logits [T, V] to logits and, when given, the final manifold [T, hc, H] to state.
inline Status RunItems(const ShardModel& m, std::span<const BatchItem> items,
                       std::vector<float>* logits, std::vector<float>* state = nullptr) {
  const auto& cfg = m.config();
  std::vector<int32_t> toks;
  for (const BatchItem& it : items) toks.insert(toks.end(), it.tokens.begin(), it.tokens.end());
  const int64_t T = static_cast<int64_t>(toks.size());
  std::vector<float> x(T * cfg.hc_mult * cfg.hidden_size), lg(T * cfg.vocab_size);
  FM_RETURN_IF_ERROR(m.Embed(toks, x.data()));
  FM_RETURN_IF_ERROR(m.ForwardLayers(items, x.data()));
  FM_RETURN_IF_ERROR(m.Logits(x.data(), T, lg.data()));
  logits->insert(logits->end(), lg.begin(), lg.end());
  if (state) state->insert(state->end(), x.begin(), x.end());
  return Status::Ok();
}

// max |a - b| / max |b|
inline double RelErr(const std::vector<float>& a, const std::vector<float>& b) {
  double num = 0.0, den = 0.0;
  for (size_t i = 0; i < a.size(); ++i) {
    num = std::max(num, std::fabs(static_cast<double>(a[i]) - b[i]));
    den = std::max(den, std::fabs(static_cast<double>(b[i])));
  }
  return num / den;
}

}  // namespace fm::modeltest
