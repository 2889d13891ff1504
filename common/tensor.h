// Tensor views over mmapped checkpoint bytes, and the quantized weight handle the kernels take.
#pragma once
#include <cstddef>
#include <cstdint>
#include <string>
#include <vector>

namespace fm {

// safetensors dtypes that the official checkpoint (and mkmodel) use.
enum class DType { kF32, kBF16, kF16, kF8E4M3, kF8E8M0, kI8, kU8, kI16, kI32, kI64, kBool };
const char* DTypeName(DType t);           // the safetensors spelling, e.g. "F8_E4M3"
bool ParseDType(const std::string& s, DType* out);
size_t DTypeSize(DType t);                // bytes per element

// A read-only view of one tensor's bytes (owned by the checkpoint's mapping).
struct TensorView {
  std::string name;
  DType dtype = DType::kF32;
  std::vector<int64_t> shape;
  const uint8_t* data = nullptr;
  size_t nbytes = 0;
  int64_t numel() const {
    int64_t n = 1;
    for (auto d : shape) n *= d;
    return n;
  }
};

// A 2-D weight W[rows=out, cols=in] as the matvec/GEMM kernels consume it, still quantized.
enum class WeightFormat {
  kF32,        // data: float[rows*cols]
  kBF16,       // data: uint16[rows*cols]
  kFP8Block,   // data: e4m3[rows*cols]; scale: e8m0 [ceil(rows/128), ceil(cols/128)]
  kFP4Block32, // data: uint8[rows*cols/2] (elem 2j low nibble); scale: e8m0 [rows, cols/32]
};
struct QWeight {
  WeightFormat format = WeightFormat::kF32;
  int64_t rows = 0, cols = 0;
  const void* data = nullptr;
  const uint8_t* scale = nullptr;   // kFP8Block, kFP4Block32 only
  // Bytes a matvec reads: the weights plus their scales (used by bench and inspect).
  size_t bytes() const;
};

// Rows [row0, row0 + n) of w as a weight of its own (the same pointers, offset; device pointers
// work too), or false when the rows start inside an FP8 128-row scale block (QWeight cannot say
// so) or fall outside w.
bool SliceRows(const QWeight& w, int64_t row0, int64_t n, QWeight* out);

}  // namespace fm
