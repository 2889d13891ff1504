// CUDA error -> fm::Status, for the .cu files of kernels/cuda (never abort on a CUDA error).
#pragma once
#include <cuda_runtime.h>

#include <atomic>
#include <cstdint>
#include <string>

#include "common/status.h"

namespace fm::cuda {

// "cudaMalloc(&p, bytes): cudaErrorMemoryAllocation (out of memory)": ResourceExhausted when
// the device is out of memory (a request may fail alone), Internal for every other error.
inline Status CudaStatus(cudaError_t err, const char* call) {
  if (err == cudaSuccess) return Status::Ok();
  const std::string what = std::string(call) + ": " + cudaGetErrorName(err) + " (" +
                           cudaGetErrorString(err) + ")";
  return err == cudaErrorMemoryAllocation ? ResourceExhausted(what) : Internal(what);
}

// The stream this thread's launches go to (device.h StreamScope; null = the default stream).
cudaStream_t CurrentStream();

// Kernel launches of this process (device.h KernelLaunches): every launcher checks its one
// launch with LaunchStatus, which counts it.
inline std::atomic<int64_t> launches_made{0};

// After a kernel launch: a bad configuration shows up here, not at the launch.
inline Status LaunchStatus(const char* kernel) {
  launches_made.fetch_add(1, std::memory_order_relaxed);
  return CudaStatus(cudaGetLastError(), kernel);
}

}  // namespace fm::cuda

#define FM_CUDA_RETURN_IF_ERROR(call) FM_RETURN_IF_ERROR(::fm::cuda::CudaStatus((call), #call))
