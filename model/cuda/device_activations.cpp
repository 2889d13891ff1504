#include "model/cuda/device_activations.h"

#include <algorithm>
#include <cstdlib>
#include <string>

#include "kernels/cuda/device.h"

namespace fm {
namespace {

class DeviceActivations final : public Activations {
 public:
  DeviceActivations(int device, int64_t row_floats, cuda::Stream stream)
      : Activations(row_floats), device_(device), stream_(std::move(stream)) {}
  bool device() const override { return true; }

  Status Resize(int64_t rows) override {
    if (rows < 0) return InvalidArgument("activations: " + std::to_string(rows) + " rows");
    const size_t want = RowBytes(rows);
    if (want > mem_.size()) {
      FM_RETURN_IF_ERROR(cuda::SetDevice(device_));
      data_ = nullptr;  // the old rows go with the old buffer, also when the new one fails
      rows_ = 0;
      FM_ASSIGN_OR_RETURN(mem_, cuda::GrowBuffer(std::move(mem_), want));
    }
    data_ = mem_.as<float>();
    rows_ = rows;
    return Status::Ok();
  }
  Status CopyFromHost(int64_t row0, int64_t n, const float* src) override {
    FM_RETURN_IF_ERROR(CheckRows("activations CopyFromHost", row0, n));
    FM_RETURN_IF_ERROR(cuda::SetDevice(device_));
    cuda::StreamScope on(stream_);
    return mem_.CopyFromHost(src, RowBytes(n), RowBytes(row0));
  }
  Status CopyToHost(int64_t row0, int64_t n, float* dst) const override {
    FM_RETURN_IF_ERROR(CheckRows("activations CopyToHost", row0, n));
    FM_RETURN_IF_ERROR(cuda::SetDevice(device_));
    cuda::StreamScope on(stream_);
    return mem_.CopyToHost(dst, RowBytes(n), RowBytes(row0));
  }
  Status CopyRows(int64_t row0, const Activations& src, int64_t src_row, int64_t n) override {
    if (!src.device() || src.row_floats() != row_floats_)
      return InvalidArgument(
          "activations CopyRows: the source is not device rows of the same width");
    FM_RETURN_IF_ERROR(CheckRows("activations CopyRows", row0, n));
    if (src_row < 0 || src_row + n > src.rows())
      return OutOfRange("activations CopyRows: source rows [" + std::to_string(src_row) + ", " +
                        std::to_string(src_row + n) + ") outside its " +
                        std::to_string(src.rows()) + " rows");
    if (n == 0 || (&src == this && src_row == row0)) return Status::Ok();
    if (&src == this && std::abs(src_row - row0) < n)
      return InvalidArgument("activations CopyRows: overlapping rows of one buffer");
    FM_RETURN_IF_ERROR(cuda::SetDevice(device_));
    cuda::StreamScope on(stream_);
    FM_RETURN_IF_ERROR(cuda::CopyOnDevice(row(row0), src.row(src_row), RowBytes(n)));
    return stream_.Synchronize();
  }

 private:
  size_t RowBytes(int64_t n) const { return static_cast<size_t>(n * row_floats_) * sizeof(float); }
  int device_;
  cuda::Stream stream_;
  cuda::DeviceBuffer mem_;
};

}  // namespace

Result<std::unique_ptr<Activations>> NewDeviceActivations(int device, int64_t row_floats) {
  FM_RETURN_IF_ERROR(cuda::SetDevice(device));
  FM_ASSIGN_OR_RETURN(cuda::Stream stream, cuda::Stream::Create());
  return std::unique_ptr<Activations>(
      std::make_unique<DeviceActivations>(device, row_floats, std::move(stream)));
}

}  // namespace fm
