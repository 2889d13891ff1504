#include <cuda_runtime.h>

#include <cstdio>
#include <string>
#include <utility>

#include "kernels/cuda/check.cuh"
#include "kernels/cuda/device.h"

namespace fm::cuda {

int DeviceCount() {
  int n = 0;
  if (cudaGetDeviceCount(&n) != cudaSuccess) {
    cudaGetLastError();  // clear the sticky "no driver" error
    return 0;
  }
  return n;
}

std::string DeviceDescription(int index) {
  cudaDeviceProp p{};
  cudaError_t e = cudaGetDeviceProperties(&p, index);
  if (e != cudaSuccess) return cudaGetErrorString(e);
  char buf[640];  // name (256) + numbers
  std::snprintf(buf, sizeof buf, "%s (sm_%d%d, %.1f GiB)", p.name, p.major, p.minor,
                p.totalGlobalMem / double(1ull << 30));
  return buf;
}

Status Synchronize() {
  FM_CUDA_RETURN_IF_ERROR(cudaDeviceSynchronize());
  return Status::Ok();
}

Status SetDevice(int index) {
  const int n = DeviceCount();
  if (index < 0 || index >= n)
    return InvalidArgument("cuda:" + std::to_string(index) + ": this host has " +
                           std::to_string(n) + " CUDA device(s)");
  FM_CUDA_RETURN_IF_ERROR(cudaSetDevice(index));
  return Status::Ok();
}

Result<DeviceBuffer> DeviceBuffer::Alloc(size_t bytes) {
  DeviceBuffer b;
  if (bytes == 0) return Result<DeviceBuffer>(std::move(b));
  cudaError_t e = cudaMalloc(&b.ptr_, bytes);
  if (e != cudaSuccess) {
    cudaGetLastError();
    b.ptr_ = nullptr;
    return CudaStatus(e, "cudaMalloc").Wrap("allocating " + std::to_string(bytes) +
                                            " device bytes");
  }
  b.size_ = bytes;
  return Result<DeviceBuffer>(std::move(b));
}

DeviceBuffer::~DeviceBuffer() {
  if (ptr_) cudaFree(ptr_);
}

DeviceBuffer::DeviceBuffer(DeviceBuffer&& other) noexcept
    : ptr_(std::exchange(other.ptr_, nullptr)), size_(std::exchange(other.size_, 0)) {}

DeviceBuffer& DeviceBuffer::operator=(DeviceBuffer&& other) noexcept {
  if (this != &other) {
    if (ptr_) cudaFree(ptr_);
    ptr_ = std::exchange(other.ptr_, nullptr);
    size_ = std::exchange(other.size_, 0);
  }
  return *this;
}

static Status CheckRange(size_t bytes, size_t offset, size_t size, const char* what) {
  if (offset > size || bytes > size - offset)
    return OutOfRange(std::string(what) + ": " + std::to_string(bytes) + " bytes at offset " +
                      std::to_string(offset) + " exceed the device buffer of " +
                      std::to_string(size) + " bytes");
  return Status::Ok();
}

Status DeviceBuffer::CopyFromHost(const void* src, size_t bytes, size_t offset) {
  FM_RETURN_IF_ERROR(CheckRange(bytes, offset, size_, "DeviceBuffer::CopyFromHost"));
  if (bytes == 0) return Status::Ok();
  FM_CUDA_RETURN_IF_ERROR(
      cudaMemcpy(static_cast<char*>(ptr_) + offset, src, bytes, cudaMemcpyHostToDevice));
  return Status::Ok();
}

Status DeviceBuffer::CopyToHost(void* dst, size_t bytes, size_t offset) const {
  FM_RETURN_IF_ERROR(CheckRange(bytes, offset, size_, "DeviceBuffer::CopyToHost"));
  if (bytes == 0) return Status::Ok();
  FM_CUDA_RETURN_IF_ERROR(
      cudaMemcpy(dst, static_cast<const char*>(ptr_) + offset, bytes, cudaMemcpyDeviceToHost));
  return Status::Ok();
}

Result<DeviceBuffer> Upload(const void* src, size_t bytes) {
  FM_ASSIGN_OR_RETURN(DeviceBuffer b, DeviceBuffer::Alloc(bytes));
  FM_RETURN_IF_ERROR(b.CopyFromHost(src, bytes));
  return Result<DeviceBuffer>(std::move(b));
}

}  // namespace fm::cuda
