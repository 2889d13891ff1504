// How this project's kernels are launched: programmatic dependent launch (PDL, sm_90+).
// Decode is a chain of ~15 launches a layer, and at T = 1 many of them are short: each boundary
// leaves the GPU draining the last blocks of one kernel and then starting the next. With
// SetLaunchOverlap(true) (ops.h) every launch carries the attribute
// cudaLaunchAttributeProgrammaticStreamSerialization, so a kernel's blocks may start while its
// predecessor still runs. The rules that keep the results exact:
// - every kernel calls AllowDependents() and then WaitPredecessors() before it reads or writes
//   any buffer that an earlier launch writes or reads (the step's activations, caches, counters);
//   KernelPrologue() does both;
// - before the wait a kernel only reads what no launch writes during a step (the weights) and
//   only as an L2 prefetch (PrefetchL2), so its first DRAM reads overlap the predecessor's tail;
// - every block waits before it exits. A grid then completes only after its predecessor did,
//   so the chain stays ordered (a later kernel's wait covers every earlier one), and a copy or
//   host read queued after a kernel sees everything before it.
// Without the attribute (the default) the wait returns at once and the stream is ordered as
// always; the emulation runs launches one after another, so both are no-ops there.
#pragma once
#include <cuda_runtime.h>

#include <atomic>
#include <cstdint>

#include "kernels/cuda/check.cuh"

namespace fm::cuda {

// The next launch in the stream may start its blocks once every block of this grid has called
// this (or exited). Its blocks then wait in WaitPredecessors, holding their SM slots.
__device__ __forceinline__ void AllowDependents() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("griddepcontrol.launch_dependents;" ::: "memory");
#endif
}

// Returns once the kernel before this one in the stream has completed and its writes are
// visible. That covers every earlier launch only because every kernel calls this before it exits
// (the rules above): a new kernel must start with it too.
__device__ __forceinline__ void WaitPredecessors() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("griddepcontrol.wait;" ::: "memory");
#endif
}

// The start of every kernel that prefetches nothing.
__device__ __forceinline__ void KernelPrologue() {
  AllowDependents();
  WaitPredecessors();
}

// Asks L2 for bytes [p, p + bytes) without waiting (a hint: no registers, no completion).
// p is rounded up and the end down to 16 bytes, as the bulk prefetch needs; pieces of 64 KiB.
__device__ __forceinline__ void PrefetchL2(const void* p, int64_t bytes) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  const uintptr_t p0 = reinterpret_cast<uintptr_t>(p);
  const uintptr_t a = (p0 + 15) & ~uintptr_t{15};
  const uintptr_t end = (p0 + static_cast<uintptr_t>(bytes)) & ~uintptr_t{15};
  for (uintptr_t q = a; q < end; q += 65536) {
    const uint32_t n = static_cast<uint32_t>(end - q < 65536 ? end - q : 65536);
    asm volatile("cp.async.bulk.prefetch.L2.global [%0], %1;" ::"l"(q), "r"(n) : "memory");
  }
#else
  (void)p, (void)bytes;
#endif
}

// Blocks of `threads` covering n elements (one thread each).
inline unsigned BlocksFor(int64_t n, int threads) {
  return static_cast<unsigned>((n + threads - 1) / threads);
}

// Whether launches carry the PDL attribute (ops.h SetLaunchOverlap), read at each launch: a
// captured graph keeps the edges it was captured with.
inline std::atomic<bool> launch_overlap{false};

// kernel<<<grid, block, shared, CurrentStream()>>>(args...), with the PDL attribute when
// launch_overlap is set; counted and checked as LaunchStatus(name).
template <class... P, class... A>
Status Launch(const char* name, void (*kernel)(P...), dim3 grid, dim3 block, size_t shared,
              A... args) {
  cudaLaunchAttribute attr[1];
  attr[0].id = cudaLaunchAttributeProgrammaticStreamSerialization;
  attr[0].val.programmaticStreamSerializationAllowed = 1;
  cudaLaunchConfig_t cfg = {};
  cfg.gridDim = grid;
  cfg.blockDim = block;
  cfg.dynamicSmemBytes = shared;
  cfg.stream = CurrentStream();
  cfg.attrs = attr;
  cfg.numAttrs = launch_overlap.load(std::memory_order_relaxed) ? 1 : 0;
  // A failed launch also sets the runtime's last error, which LaunchStatus reads and clears.
  (void)cudaLaunchKernelEx(&cfg, kernel, args...);
  return LaunchStatus(name);
}

}  // namespace fm::cuda
