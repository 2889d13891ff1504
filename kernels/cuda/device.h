// CUDA device discovery and device memory. Safe to call on machines without a GPU or driver:
// every fallible call returns a Status naming the CUDA call and its error, never aborts.
// No CUDA types here, so plain C++ code can include it.
#pragma once
#include <cstddef>
#include <string>

#include "common/status.h"

namespace fm::cuda {
// Number of usable CUDA devices; 0 when there is no driver or no GPU.
int DeviceCount();
// "NVIDIA H200 (sm_90, 139.8 GiB)" for device `index`, or the CUDA error text.
std::string DeviceDescription(int index);
// Waits for all work queued on the current device; reports the first asynchronous error.
Status Synchronize();
// Makes device `index` current for this thread (its allocations and launches go there);
// InvalidArgument naming the index and the device count when there is no such device.
Status SetDevice(int index);

// Owns `size()` bytes of device memory (cudaMalloc'd, so 256-byte aligned); move-only.
class DeviceBuffer {
 public:
  DeviceBuffer() = default;
  // bytes == 0 gives an empty buffer with data() == nullptr.
  static Result<DeviceBuffer> Alloc(size_t bytes);
  ~DeviceBuffer();
  DeviceBuffer(DeviceBuffer&& other) noexcept;
  DeviceBuffer& operator=(DeviceBuffer&& other) noexcept;
  DeviceBuffer(const DeviceBuffer&) = delete;
  DeviceBuffer& operator=(const DeviceBuffer&) = delete;

  void* data() const { return ptr_; }
  size_t size() const { return size_; }
  template <typename T>
  T* as() const { return static_cast<T*>(ptr_); }

  // Blocking copies of `bytes` at byte `offset` of this buffer; OutOfRange past size().
  Status CopyFromHost(const void* src, size_t bytes, size_t offset = 0);
  Status CopyToHost(void* dst, size_t bytes, size_t offset = 0) const;

 private:
  void* ptr_ = nullptr;
  size_t size_ = 0;
};

// Allocates a buffer and fills it with `bytes` from host memory.
Result<DeviceBuffer> Upload(const void* src, size_t bytes);
}  // namespace fm::cuda
