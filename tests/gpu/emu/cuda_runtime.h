// CPU stand-in for the part of CUDA that kernels/cuda/*.cu use, so tests/gpu/emulate.sh can run
// the real kernel code on a machine without a GPU: one std::thread per CUDA thread, blocks one
// after another, __syncthreads and warp shuffles through a block-wide std::barrier.
// It checks indexing, layouts and reductions; not timing, memory model, FMA or alignment faults.
#pragma once
#include <barrier>
#include <cmath>
#include <cstdint>
#include <thread>
#include <vector>

struct dim3 {
  unsigned x = 1, y = 1, z = 1;
  dim3(unsigned a = 1, unsigned b = 1, unsigned c = 1) : x(a), y(b), z(c) {}
};
struct alignas(16) uint4 { unsigned x, y, z, w; };
struct alignas(16) float4 { float x, y, z, w; };

inline thread_local dim3 threadIdx, blockIdx;
inline std::barrier<>* emu_block_barrier;
inline float emu_shuffle_slots[1024];

#define __global__
#define __device__
#define __host__
#define __forceinline__ inline
#define __shared__ static  // blocks run one at a time, so one static copy is the block's

inline void __syncthreads() { emu_block_barrier->arrive_and_wait(); }

// Every live thread of the block takes part (kernels shuffle only where whole warps are live).
inline float __shfl_xor_sync(unsigned, float v, int lane_mask) {
  const unsigned t = threadIdx.x;
  emu_shuffle_slots[t] = v;
  __syncthreads();
  const float other = emu_shuffle_slots[t ^ lane_mask];
  __syncthreads();
  return other;
}

template <class T>
T __ldg(const T* p) { return *p; }

// kernel<<<grid, block>>>(args) is rewritten to EmuLaunch(kernel, grid, block, args) by emulate.sh.
template <class... P, class... A>
void EmuLaunch(void (*kernel)(P...), dim3 grid, dim3 block, A... args) {
  for (unsigned b = 0; b < grid.x; ++b) {
    std::barrier<> bar(block.x);
    emu_block_barrier = &bar;
    std::vector<std::thread> threads;
    for (unsigned t = 0; t < block.x; ++t)
      threads.emplace_back([&, t, b] {
        threadIdx = dim3(t);
        blockIdx = dim3(b);
        kernel(args...);
        bar.arrive_and_drop();  // a returned thread no longer holds up the others
      });
    for (auto& th : threads) th.join();
  }
}
