#include <cuda_runtime.h>

#include <cstdio>

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
  char buf[256];
  std::snprintf(buf, sizeof buf, "%s (sm_%d%d, %.1f GiB)", p.name, p.major, p.minor,
                p.totalGlobalMem / double(1ull << 30));
  return buf;
}

}  // namespace fm::cuda
