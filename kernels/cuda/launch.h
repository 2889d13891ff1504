// Launch geometry shared by the kernels of kernels/cuda (plain C++: the CPU emulation of
// tests/gpu/emulate.sh uses it as is).
#pragma once
#include <cstdint>

namespace fm::cuda {

// Blocks of `threads` covering n elements (one thread each).
inline unsigned BlocksFor(int64_t n, int threads) {
  return static_cast<unsigned>((n + threads - 1) / threads);
}

}  // namespace fm::cuda
