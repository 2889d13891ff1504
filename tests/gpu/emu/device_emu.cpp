// Emulation stand-in for kernels/cuda/device.cu: one "device" whose memory is host memory.
#include <cstdlib>
#include <cstring>
#include <string>
#include <utility>

#include "kernels/cuda/device.h"
#include "kernels/cuda/ops.h"

namespace fm::cuda {

int DeviceCount() { return 1; }
std::string DeviceDescription(int) { return "CPU emulation"; }
Status Synchronize() { return Status::Ok(); }
Status SetDevice(int index) {
  if (index == 0) return Status::Ok();
  return InvalidArgument("cuda:" + std::to_string(index) + ": this host has 1 CUDA device(s)");
}

Result<DeviceBuffer> DeviceBuffer::Alloc(size_t bytes) {
  DeviceBuffer b;
  if (bytes == 0) return Result<DeviceBuffer>(std::move(b));
  b.ptr_ = std::aligned_alloc(256, (bytes + 255) / 256 * 256);  // cudaMalloc's alignment
  if (!b.ptr_) return ResourceExhausted("emulated cudaMalloc of " + std::to_string(bytes));
  b.size_ = bytes;
  return Result<DeviceBuffer>(std::move(b));
}

DeviceBuffer::~DeviceBuffer() { std::free(ptr_); }

DeviceBuffer::DeviceBuffer(DeviceBuffer&& other) noexcept
    : ptr_(std::exchange(other.ptr_, nullptr)), size_(std::exchange(other.size_, 0)) {}

DeviceBuffer& DeviceBuffer::operator=(DeviceBuffer&& other) noexcept {
  if (this != &other) {
    std::free(ptr_);
    ptr_ = std::exchange(other.ptr_, nullptr);
    size_ = std::exchange(other.size_, 0);
  }
  return *this;
}

Status DeviceBuffer::CopyFromHost(const void* src, size_t bytes, size_t offset) {
  if (offset > size_ || bytes > size_ - offset) return OutOfRange("CopyFromHost past the buffer");
  if (bytes) std::memcpy(static_cast<char*>(ptr_) + offset, src, bytes);
  return Status::Ok();
}

Status DeviceBuffer::CopyToHost(void* dst, size_t bytes, size_t offset) const {
  if (offset > size_ || bytes > size_ - offset) return OutOfRange("CopyToHost past the buffer");
  if (bytes) std::memcpy(dst, static_cast<const char*>(ptr_) + offset, bytes);
  return Status::Ok();
}

// kernels/cuda/membw.cu times device memory; the emulation has none to time.
Result<double> MeasureReadBandwidth(size_t, int) {
  return Unavailable("MeasureReadBandwidth: no device memory in the CPU emulation");
}

Result<DeviceBuffer> Upload(const void* src, size_t bytes) {
  FM_ASSIGN_OR_RETURN(DeviceBuffer b, DeviceBuffer::Alloc(bytes));
  FM_RETURN_IF_ERROR(b.CopyFromHost(src, bytes));
  return Result<DeviceBuffer>(std::move(b));
}

}  // namespace fm::cuda
