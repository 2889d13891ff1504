#include <cstring>
#include <vector>

#include "common/numfmt.h"
#include "kernels/cpu/matvec.h"

namespace fm {

// Element i of a tensor that may sit at any byte offset of a safetensors mapping.
template <typename T>
static T LoadUnaligned(const void* data, int64_t i) {
  T v;
  std::memcpy(&v, static_cast<const uint8_t*>(data) + i * sizeof(T), sizeof(T));
  return v;
}

// W_real[r, c] for every supported format (MODEL.md "Number formats").
static float WeightAt(const QWeight& w, int64_t r, int64_t c) {
  const int64_t i = r * w.cols + c;
  switch (w.format) {
    case WeightFormat::kF32: return LoadUnaligned<float>(w.data, i);
    case WeightFormat::kBF16: return Bf16ToF32(LoadUnaligned<uint16_t>(w.data, i));
    case WeightFormat::kFP8Block: {
      const int64_t scale_cols = (w.cols + 127) / 128;
      const float s = E8m0ToF32(w.scale[(r / 128) * scale_cols + c / 128]);
      return E4m3ToF32(static_cast<const uint8_t*>(w.data)[i]) * s;
    }
    case WeightFormat::kFP4Block32: {
      const uint8_t byte = static_cast<const uint8_t*>(w.data)[i / 2];
      const uint8_t nib = (c & 1) ? (byte >> 4) : (byte & 0xF);
      const float s = E8m0ToF32(w.scale[r * (w.cols / 32) + c / 32]);
      return Fp4ToF32(nib) * s;
    }
  }
  return 0.0f;
}

void MatvecRef(const QWeight& w, const float* x, float* y) {
  for (int64_t r = 0; r < w.rows; ++r) {
    double acc = 0.0;
    for (int64_t c = 0; c < w.cols; ++c) acc += static_cast<double>(WeightAt(w, r, c)) * x[c];
    y[r] = static_cast<float>(acc);
  }
}

}  // namespace fm
