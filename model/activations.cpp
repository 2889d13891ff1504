#include "model/activations.h"

#include <cstring>
#include <string>

namespace fm {

Status Activations::CheckRows(const char* what, int64_t row0, int64_t n) const {
  if (row0 < 0 || n < 0 || row0 + n > rows_)
    return OutOfRange(std::string(what) + ": rows [" + std::to_string(row0) + ", " +
                      std::to_string(row0 + n) + ") outside the " + std::to_string(rows_) +
                      " rows of the activations");
  return Status::Ok();
}

namespace {

class HostActivations final : public Activations {
 public:
  explicit HostActivations(int64_t row_floats) : Activations(row_floats) {}
  bool device() const override { return false; }

  Status Resize(int64_t rows) override {
    if (rows < 0) return InvalidArgument("activations: " + std::to_string(rows) + " rows");
    const size_t floats = static_cast<size_t>(rows * row_floats_);
    if (floats > mem_.size()) mem_.resize(floats);
    data_ = mem_.data();
    rows_ = rows;
    return Status::Ok();
  }
  Status CopyFromHost(int64_t row0, int64_t n, const float* src) override {
    FM_RETURN_IF_ERROR(CheckRows("activations CopyFromHost", row0, n));
    if (n > 0) std::memcpy(row(row0), src, RowBytes(n));
    return Status::Ok();
  }
  Status CopyToHost(int64_t row0, int64_t n, float* dst) const override {
    FM_RETURN_IF_ERROR(CheckRows("activations CopyToHost", row0, n));
    if (n > 0) std::memcpy(dst, row(row0), RowBytes(n));
    return Status::Ok();
  }
  Status CopyRows(int64_t row0, const Activations& src, int64_t src_row, int64_t n) override {
    if (src.device() || src.row_floats() != row_floats_)
      return InvalidArgument("activations CopyRows: the source is not host rows of the same width");
    FM_RETURN_IF_ERROR(CheckRows("activations CopyRows", row0, n));
    if (src_row < 0 || src_row + n > src.rows())
      return OutOfRange("activations CopyRows: source rows [" + std::to_string(src_row) + ", " +
                        std::to_string(src_row + n) + ") outside its " +
                        std::to_string(src.rows()) + " rows");
    if (n > 0) std::memmove(row(row0), src.row(src_row), RowBytes(n));
    return Status::Ok();
  }

 private:
  size_t RowBytes(int64_t n) const { return static_cast<size_t>(n * row_floats_) * sizeof(float); }
  std::vector<float> mem_;
};

}  // namespace

std::unique_ptr<Activations> NewHostActivations(int64_t row_floats) {
  return std::make_unique<HostActivations>(row_floats);
}

}  // namespace fm
