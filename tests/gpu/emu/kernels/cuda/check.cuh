// Emulation stand-in for kernels/cuda/check.cuh: emulated launches cannot fail.
#pragma once
#include "common/status.h"

namespace fm::cuda {
inline Status LaunchStatus(const char*) { return Status::Ok(); }
}  // namespace fm::cuda
