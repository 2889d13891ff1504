#include "kernels/cpu/indexer.h"

#include <algorithm>
#include <cmath>
#include <limits>
#include <numeric>
#include <vector>

#include "kernels/cpu/attention_core.h"

namespace fm {

void IndexerScores_hd(const float* q, const float* w, int64_t nh, int64_t d, const float* keys,
                      int64_t n, float scale, float* score) {
  for (int64_t e = 0; e < n; ++e) {
    const float* k = keys + e * d;
    float acc = 0.0f;
    for (int64_t h = 0; h < nh; ++h) {
      const float dot = DotF32_n(q + h * d, k, d);
      acc += ((dot > 0.0f ? dot : 0.0f) * scale) * w[h];
    }
    score[e] = acc;
  }
}

void TopKAscending_n(const float* score, int64_t n, int64_t k, int32_t* out) {
  if (k <= 0) return;
  std::vector<int32_t> idx(static_cast<size_t>(n));
  std::iota(idx.begin(), idx.end(), 0);
  auto key = [&](int32_t i) {
    return std::isnan(score[i]) ? -std::numeric_limits<float>::infinity() : score[i];
  };
  // A strict total order (score desc, index asc): the chosen set never depends on the sort.
  auto before = [&](int32_t x, int32_t y) {
    const float kx = key(x), ky = key(y);
    return kx != ky ? kx > ky : x < y;
  };
  std::nth_element(idx.begin(), idx.begin() + (k - 1), idx.end(), before);
  std::sort(idx.begin(), idx.begin() + k);
  std::copy(idx.begin(), idx.begin() + k, out);
}

}  // namespace fm
