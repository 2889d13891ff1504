#include "kernels/cpu/router.h"

#include <algorithm>
#include <cmath>
#include <numeric>
#include <vector>

namespace fm {

void RouterSqrtSoftplus_E(const float* logits, int64_t E, float* scores) {
  for (int64_t e = 0; e < E; ++e) {
    const float v = logits[e];
    const float sp = v > 20.0f ? v : std::log1p(std::exp(v));
    scores[e] = std::sqrt(sp);
  }
}

static void NormalizeSelected(const float* scores, int64_t k, float routed_scale,
                              const int32_t* ids, float* w) {
  float sum = 0.0f;
  for (int64_t j = 0; j < k; ++j) sum += scores[ids[j]];
  const float denom = sum + 1e-20f;
  for (int64_t j = 0; j < k; ++j) w[j] = scores[ids[j]] / denom * routed_scale;
}

void RouterTopkBias_E(const float* scores, const float* bias, int64_t E, int64_t k,
                      float routed_scale, int32_t* ids, float* w) {
  // Selection by repeated insertion: keeps the k best seen so far, strict > so an equal later
  // candidate never displaces an earlier (lower-index) one.
  std::vector<float> best(k);
  int64_t have = 0;
  for (int64_t e = 0; e < E; ++e) {
    const float v = scores[e] + bias[e];
    if (have == k && !(v > best[k - 1])) continue;
    int64_t pos = have < k ? have++ : k - 1;
    while (pos > 0 && v > best[pos - 1]) {
      best[pos] = best[pos - 1];
      ids[pos] = ids[pos - 1];
      --pos;
    }
    best[pos] = v;
    ids[pos] = static_cast<int32_t>(e);
  }
  NormalizeSelected(scores, k, routed_scale, ids, w);
}

void RouterHash_k(const float* scores, const int64_t* eids, int64_t k, float routed_scale,
                  int32_t* ids, float* w) {
  for (int64_t j = 0; j < k; ++j) ids[j] = static_cast<int32_t>(eids[j]);
  NormalizeSelected(scores, k, routed_scale, ids, w);
}

void RouterTopkBiasRef(const float* scores, const float* bias, int64_t E, int64_t k,
                       double routed_scale, int32_t* ids, float* w) {
  std::vector<int32_t> order(E);
  std::iota(order.begin(), order.end(), 0);
  std::stable_sort(order.begin(), order.end(), [&](int32_t a, int32_t b) {
    return static_cast<double>(scores[a] + bias[a]) > static_cast<double>(scores[b] + bias[b]);
  });
  double sum = 0.0;
  for (int64_t j = 0; j < k; ++j) sum += scores[order[j]];
  for (int64_t j = 0; j < k; ++j) {
    ids[j] = order[j];
    w[j] = static_cast<float>(scores[order[j]] / (sum + 1e-20) * routed_scale);
  }
}

}  // namespace fm
