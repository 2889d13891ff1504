#include "kernels/cpu/compressor_pool.h"

#include <cmath>
#include <vector>

namespace fm {

void CompressorPool_nd(const float* const* a, const float* const* z, int64_t n, int64_t d,
                       float* pooled) {
  for (int64_t c = 0; c < d; ++c) {
    float m = z[0][c];
    for (int64_t j = 1; j < n; ++j) m = z[j][c] > m ? z[j][c] : m;
    float sum = 0.0f;
    for (int64_t j = 0; j < n; ++j) sum += std::exp(z[j][c] - m);
    float acc = 0.0f;
    for (int64_t j = 0; j < n; ++j) acc += (std::exp(z[j][c] - m) / sum) * a[j][c];
    pooled[c] = acc;
  }
}

void CompressorPoolWindow_rd(const float* cur_a, const float* cur_z, const float* prev_a,
                             const float* prev_z, int64_t r, int64_t d, bool overlap,
                             float* pooled) {
  const int64_t width = overlap ? 2 * d : d;
  std::vector<const float*> a, z;
  a.reserve(static_cast<size_t>(2 * r));
  z.reserve(static_cast<size_t>(2 * r));
  if (overlap && prev_a) {
    for (int64_t j = 0; j < r; ++j) {
      a.push_back(prev_a + j * width);
      z.push_back(prev_z + j * width);
    }
  }
  const int64_t off = overlap ? d : 0;
  for (int64_t j = 0; j < r; ++j) {
    a.push_back(cur_a + j * width + off);
    z.push_back(cur_z + j * width + off);
  }
  CompressorPool_nd(a.data(), z.data(), static_cast<int64_t>(a.size()), d, pooled);
}

}  // namespace fm
