#include "common/tensor.h"

namespace fm {

const char* DTypeName(DType t) {
  switch (t) {
    case DType::kF32: return "F32";
    case DType::kBF16: return "BF16";
    case DType::kF16: return "F16";
    case DType::kF8E4M3: return "F8_E4M3";
    case DType::kF8E8M0: return "F8_E8M0";
    case DType::kI8: return "I8";
    case DType::kU8: return "U8";
    case DType::kI16: return "I16";
    case DType::kI32: return "I32";
    case DType::kI64: return "I64";
    case DType::kBool: return "BOOL";
  }
  return "?";
}

bool ParseDType(const std::string& s, DType* out) {
  static const struct { const char* name; DType t; } kTable[] = {
      {"F32", DType::kF32},       {"BF16", DType::kBF16}, {"F16", DType::kF16},
      {"F8_E4M3", DType::kF8E4M3}, {"F8_E8M0", DType::kF8E8M0}, {"I8", DType::kI8},
      {"U8", DType::kU8},         {"I16", DType::kI16},   {"I32", DType::kI32},
      {"I64", DType::kI64},       {"BOOL", DType::kBool},
  };
  for (const auto& e : kTable)
    if (s == e.name) {
      *out = e.t;
      return true;
    }
  return false;
}

size_t DTypeSize(DType t) {
  switch (t) {
    case DType::kF32: case DType::kI32: return 4;
    case DType::kBF16: case DType::kF16: case DType::kI16: return 2;
    case DType::kI64: return 8;
    default: return 1;
  }
}

size_t QWeight::bytes() const {
  const size_t n = static_cast<size_t>(rows) * static_cast<size_t>(cols);
  switch (format) {
    case WeightFormat::kF32: return n * 4;
    case WeightFormat::kBF16: return n * 2;
    case WeightFormat::kFP8Block:
      return n + static_cast<size_t>((rows + 127) / 128) * static_cast<size_t>((cols + 127) / 128);
    case WeightFormat::kFP4Block32: return n / 2 + static_cast<size_t>(rows) * (cols / 32);
  }
  return 0;
}

bool SliceRows(const QWeight& w, int64_t row0, int64_t n, QWeight* out) {
  if (row0 < 0 || n < 0 || row0 + n > w.rows) return false;
  QWeight s = w;
  s.rows = n;
  switch (w.format) {
    case WeightFormat::kF32:
      s.data = static_cast<const float*>(w.data) + row0 * w.cols;
      break;
    case WeightFormat::kBF16:
      s.data = static_cast<const uint16_t*>(w.data) + row0 * w.cols;
      break;
    case WeightFormat::kFP8Block:
      if (row0 % 128 != 0) return false;
      s.data = static_cast<const uint8_t*>(w.data) + row0 * w.cols;
      s.scale = w.scale + (row0 / 128) * ((w.cols + 127) / 128);
      break;
    case WeightFormat::kFP4Block32:
      s.data = static_cast<const uint8_t*>(w.data) + row0 * w.cols / 2;
      s.scale = w.scale + row0 * (w.cols / 32);
      break;
  }
  *out = s;
  return true;
}

}  // namespace fm
