// Device memory read bandwidth (ops.h MeasureReadBandwidth): every thread sums float4s of a
// buffer far larger than L2, grid-strided; one partial per thread is written so nothing is
// optimized away. The figure the GPU benchmark divides its weight traffic by.
#include <cuda_runtime.h>

#include <algorithm>
#include <string>

#include "kernels/cuda/check.cuh"
#include "kernels/cuda/ops.h"

namespace fm::cuda {
namespace {

constexpr int kThreads = 256;

__global__ void ReadKernel(const float4* p, size_t n, float* partial) {
  const size_t stride = static_cast<size_t>(gridDim.x) * kThreads;
  float acc = 0.0f;
  for (size_t i = static_cast<size_t>(blockIdx.x) * kThreads + threadIdx.x; i < n; i += stride) {
    const float4 v = p[i];
    acc += v.x + v.y + v.z + v.w;
  }
  partial[static_cast<size_t>(blockIdx.x) * kThreads + threadIdx.x] = acc;
}

}  // namespace

Result<double> MeasureReadBandwidth(size_t bytes, int passes) {
  if (bytes < (1u << 20) || passes < 1)
    return InvalidArgument("MeasureReadBandwidth: bytes " + std::to_string(bytes) + " (>= 1 MiB), passes " +
                           std::to_string(passes) + " (>= 1)");
  int sms = 0, device = 0;
  FM_CUDA_RETURN_IF_ERROR(cudaGetDevice(&device));   // the caller's device, not always 0
  FM_CUDA_RETURN_IF_ERROR(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, device));
  const unsigned blocks = static_cast<unsigned>(std::max(sms, 1) * 8);
  FM_ASSIGN_OR_RETURN(DeviceBuffer buf, DeviceBuffer::Alloc(bytes));
  FM_ASSIGN_OR_RETURN(DeviceBuffer partial, DeviceBuffer::Alloc(size_t{blocks} * kThreads * 4));
  FM_CUDA_RETURN_IF_ERROR(cudaMemset(buf.data(), 0, bytes));
  const size_t n = bytes / sizeof(float4);
  ReadKernel<<<blocks, kThreads>>>(buf.as<const float4>(), n, partial.as<float>());  // warm-up
  cudaEvent_t start, stop;
  FM_CUDA_RETURN_IF_ERROR(cudaEventCreate(&start));
  if (const cudaError_t e = cudaEventCreate(&stop); e != cudaSuccess) {
    cudaEventDestroy(start);
    return CudaStatus(e, "cudaEventCreate");
  }
  cudaEventRecord(start);
  for (int i = 0; i < passes; ++i)
    ReadKernel<<<blocks, kThreads>>>(buf.as<const float4>(), n, partial.as<float>());
  cudaEventRecord(stop);
  const cudaError_t err = cudaEventSynchronize(stop);
  float ms = 0.0f;
  cudaEventElapsedTime(&ms, start, stop);
  cudaEventDestroy(start);
  cudaEventDestroy(stop);
  FM_CUDA_RETURN_IF_ERROR(err);
  FM_RETURN_IF_ERROR(LaunchStatus("ReadKernel"));
  return static_cast<double>(n * sizeof(float4)) * passes / (ms * 1e-3) / 1e9;
}

}  // namespace fm::cuda
