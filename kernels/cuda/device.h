// CUDA device discovery. Safe to call on machines without a GPU or driver.
#pragma once
#include <string>

namespace fm::cuda {
// Number of usable CUDA devices; 0 when there is no driver or no GPU.
int DeviceCount();
// "NVIDIA H200 (sm_90, 139.8 GiB)" for device `index`, or the CUDA error text.
std::string DeviceDescription(int index);
}  // namespace fm::cuda
