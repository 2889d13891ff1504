// The embedding lookup of model/forward.h, on its own so that the CUDA kernel tests (and their
// CPU emulation) can hold the device lookup to it without the rest of the forward.
#include <cstring>

#include "common/numfmt.h"
#include "model/forward.h"

namespace fm {

void EmbedRow(const TensorView& embed, int32_t token, int64_t H, float* row) {
  if (embed.dtype == DType::kF32) {
    std::memcpy(row, embed.data + static_cast<size_t>(token) * H * 4, H * sizeof(float));
    return;
  }
  const uint8_t* src = embed.data + static_cast<size_t>(token) * H * 2;
  for (int64_t h = 0; h < H; ++h) {
    uint16_t b;
    std::memcpy(&b, src + h * 2, 2);
    row[h] = Bf16ToF32(b);
  }
}

void EmbedManifold(const TensorView& embed, std::span<const int32_t> tokens, int64_t n, int64_t H,
                   float* x) {
  for (size_t t = 0; t < tokens.size(); ++t) {
    float* xt = x + t * n * H;
    EmbedRow(embed, tokens[t], H, xt);
    for (int64_t k = 1; k < n; ++k) std::memcpy(xt + k * H, xt, H * sizeof(float));
  }
}

}  // namespace fm
