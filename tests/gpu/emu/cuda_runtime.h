// CPU stand-in for the part of CUDA that kernels/cuda/*.cu use, so tests/gpu/emulate.sh can run
// the real kernel code on a machine without a GPU. The threads of a block are fibers on the
// calling thread. Blocks run one after another, a block's warps one after another, each to its
// next __syncthreads (or its end), and a warp's lanes one after another, each to its next warp
// operation (a shuffle, vote or mma: warp-scoped, as on a GPU) or block barrier. The order of
// blocks, of warps and of lanes changes from launch to launch and from barrier to barrier
// (forward or reverse), so a read that a barrier does not order after its write (shared memory
// written by another warp with only a warp operation between, by another lane with nothing
// between, or a "last block" that assumes its index) gives a wrong result in some launches
// instead of the right one by luck of the order. A warp operation reached while another lane of
// the warp waits at __syncthreads or has exited stops the test: that is undefined on a GPU.
// Device memory starts as 0xFF bytes (NaN, -1), not zeros, as cudaMalloc promises nothing, and
// ends at a page that faults when touched: an access past a buffer's end stops the test.
// The fibers are Boost.Context's: a switch is a few instructions, where ucontext's swapcontext
// made a sigprocmask system call per switch (most of the emulation's time on this project's VMs).
// Streams are one queue: a launch runs at once, except while a graph is being captured
// (device_emu.cpp Graph::Capture), when it is recorded with its arguments by value and runs on
// each replay, as a CUDA graph bakes them.
// It checks indexing, layouts, reductions, barrier structure and the alignment of __ldg/__ldcg
// loads; not timing, the memory model between blocks, FMA contraction or the alignment of plain
// loads.
#pragma once
#include <boost/context/fiber.hpp>
#include <sys/mman.h>
#include <unistd.h>

#include <cmath>
#include <atomic>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <functional>
#include <mutex>
#include <unordered_map>
#include <vector>

struct dim3 {
  unsigned x = 1, y = 1, z = 1;
  dim3(unsigned a = 1, unsigned b = 1, unsigned c = 1) : x(a), y(b), z(c) {}
};
using cudaStream_t = void*;
// The launch configuration <<<grid, block, shared bytes, stream>>>.
struct EmuConfig {
  dim3 grid, block;
  size_t shared = 0;
  cudaStream_t stream = nullptr;
};
inline int min(int a, int b) { return a < b ? a : b; }
inline int max(int a, int b) { return a > b ? a : b; }
struct alignas(16) uint4 { unsigned x, y, z, w; };
struct alignas(16) float4 { float x, y, z, w; };

inline dim3 threadIdx, blockIdx, gridDim;
inline float emu_shuffle_slots[1024];

#define __global__
#define __device__
#define __host__
#define __forceinline__ inline
#define __launch_bounds__(...)
#define __shared__ static  // blocks run one at a time, so one static copy is the block's

// emulate.sh follows each __shared__ declaration with this, for each of its variables: the first
// thread of a block to reach it fills the variable with 0xFF bytes (NaN, -1), so a block that
// reads shared memory it did not write gets those, as on a GPU it would get whatever was
// there, not the block before's values.
inline uint64_t emu_blocks_run = 0;
inline void EmuPoisonShared(void* p, size_t bytes) {
  static std::unordered_map<void*, uint64_t> poisoned_in;  // variable -> block number + 1
  uint64_t& block = poisoned_in[p];
  if (block == emu_blocks_run + 1) return;
  block = emu_blocks_run + 1;
  std::memset(p, 0xFF, bytes);
}

// The fibers of the running block: each thread's own (suspended) fiber and, while it runs,
// the scheduler's, which it resumes to yield; and what each thread waits for.
struct EmuFiber {
  boost::context::fiber self, scheduler;
  std::vector<char> stack;
};
enum class EmuWait : unsigned char { kRunnable, kWarp, kBlock, kExited };
inline std::vector<EmuFiber> emu_fibers;
inline std::vector<EmuWait> emu_wait;
inline unsigned emu_current = 0;
inline std::function<void()> emu_body;

inline void EmuYield(EmuWait why) {
  EmuFiber& f = emu_fibers[emu_current];
  emu_wait[emu_current] = why;
  f.scheduler = std::move(f.scheduler).resume();
}
inline void __syncthreads() { EmuYield(EmuWait::kBlock); }
// The barrier of a warp operation: the caller's warp only (the kernels pass the full mask).
inline void __syncwarp(unsigned = 0xFFFFFFFFu) { EmuYield(EmuWait::kWarp); }
// Hands Boost.Context a thread's own stack, kept for the next block (no allocation a launch).
struct EmuStack {
  std::vector<char>* stack;
  boost::context::stack_context allocate() {
    boost::context::stack_context sc;
    sc.size = stack->size();
    sc.sp = stack->data() + stack->size();
    return sc;
  }
  void deallocate(boost::context::stack_context&) noexcept {}
};

// Every lane of the caller's warp takes part (the kernels pass the full mask).
inline float __shfl_xor_sync(unsigned, float v, int lane_mask) {
  const unsigned t = threadIdx.x;
  emu_shuffle_slots[t] = v;
  __syncwarp();
  const float other = emu_shuffle_slots[t ^ lane_mask];
  __syncwarp();
  return other;
}

// Lane src of the caller's warp, as above.
inline float __shfl_sync(unsigned, float v, int src) {
  const unsigned t = threadIdx.x;
  emu_shuffle_slots[t] = v;
  __syncwarp();
  const float other = emu_shuffle_slots[(t & ~31u) | static_cast<unsigned>(src & 31)];
  __syncwarp();
  return other;
}

// Bit l of the result: lane l's predicate, for the caller's warp, as above.
inline unsigned __ballot_sync(unsigned, int pred) {
  static int votes[1024];
  const unsigned t = threadIdx.x;
  votes[t] = pred != 0;
  __syncwarp();
  unsigned bits = 0;
  for (unsigned l = 0; l < 32; ++l) bits |= (votes[(t & ~31u) | l] ? 1u : 0u) << l;
  __syncwarp();
  return bits;
}

// Bit l of the result: whether lane l's value equals the caller's, for the caller's warp, as
// above.
inline unsigned __match_any_sync(unsigned, unsigned v) {
  static unsigned vals[1024];
  const unsigned t = threadIdx.x;
  vals[t] = v;
  __syncwarp();
  unsigned bits = 0;
  for (unsigned l = 0; l < 32; ++l) bits |= (vals[(t & ~31u) | l] == v ? 1u : 0u) << l;
  __syncwarp();
  return bits;
}
inline int __popc(unsigned v) { return __builtin_popcount(v); }
inline int __ffs(int v) { return __builtin_ffs(v); }

// A device load of T needs an address aligned to T (a 16-byte vector to 16): these check it,
// as the GPU would fault, so that a kernel's choice of vector loads is tested here too.
template <class T>
const T* EmuAlignedLoad(const T* p) {
  if (reinterpret_cast<uintptr_t>(p) % alignof(T) != 0) {
    std::fprintf(stderr, "emu: misaligned %zu-byte load at %p\n", sizeof(T), static_cast<const void*>(p));
    std::abort();
  }
  return p;
}
template <class T>
T __ldg(const T* p) { return *EmuAlignedLoad(p); }
template <class T>
T __ldcg(const T* p) { return *EmuAlignedLoad(p); }

// Blocks run one after another, each to its end: every write of an earlier block is done and
// visible, so the fence has nothing to order, and an atomic is a plain read-modify-write (a
// "last block" check sees the block that ran last, which is not always gridDim - 1).
inline void __threadfence() {}
inline int atomicAdd(int* p, int v) {
  const int old = *p;
  *p = old + v;
  return old;
}

inline float __int_as_float(int i) {
  float f;
  std::memcpy(&f, &i, sizeof f);
  return f;
}
inline unsigned __float_as_uint(float f) {
  unsigned u;
  std::memcpy(&u, &f, sizeof u);
  return u;
}

// Set while a graph is captured on this thread: its launches are appended here instead of run.
inline thread_local std::vector<std::function<void()>>* emu_capture = nullptr;
// One kernel runs at a time in the process: the block's state (__shared__ statics, fibers,
// threadIdx) is global, and tensor-parallel tests run a shard on each of several threads.
inline std::mutex emu_run_mu;

// Runs the live lanes [first, end) of a warp until each waits at __syncthreads or has exited,
// releasing them each time all wait at a warp operation. Lanes go in forward or reverse order.
inline void EmuRunWarp(unsigned first, unsigned end, bool reverse_lanes) {
  for (;;) {
    for (unsigned i = 0; i < end - first; ++i) {
      const unsigned t = reverse_lanes ? end - 1 - i : first + i;
      if (emu_wait[t] != EmuWait::kRunnable) continue;
      emu_current = t;
      threadIdx = dim3(t);
      emu_fibers[t].self = std::move(emu_fibers[t].self).resume();
      if (!emu_fibers[t].self) emu_wait[t] = EmuWait::kExited;
    }
    unsigned at_warp_op = 0;
    for (unsigned t = first; t < end; ++t) at_warp_op += emu_wait[t] == EmuWait::kWarp;
    if (at_warp_op == 0) return;
    if (at_warp_op != end - first) {
      std::fprintf(stderr, "emu: block (%u, %u): a warp operation in warp %u while %u of its lanes "
                   "wait at __syncthreads or have exited (undefined on a GPU)\n",
                   blockIdx.x, blockIdx.y, first / 32, end - first - at_warp_op);
      std::abort();
    }
    if (end - first < 32) {   // the kernels pass the full mask, which names the missing lanes
      std::fprintf(stderr, "emu: block (%u, %u): a warp operation in warp %u, which has %u lanes "
                   "(a partial warp: block.x %% 32 != 0; undefined on a GPU with the full mask)\n",
                   blockIdx.x, blockIdx.y, first / 32, end - first);
      std::abort();
    }
    for (unsigned t = first; t < end; ++t) emu_wait[t] = EmuWait::kRunnable;
  }
}

// The order of one launch's blocks, warps and lanes: forward or reverse, varied per launch and
// per barrier by a fixed hash, so a run is repeatable.
inline uint64_t emu_launches_run = 0;
inline bool EmuReverse(uint64_t launch, uint64_t block, uint64_t round, unsigned bit) {
  uint64_t h = (launch * 0x9E3779B97F4A7C15ull) ^ (block * 0xC2B2AE3D27D4EB4Full) ^ (round * 0x165667B19E3779F9ull);
  h ^= h >> 29;
  h *= 0xBF58476D1CE4E5B9ull;
  h ^= h >> 32;
  return (h >> bit) & 1u;
}

template <class... P, class... A>
void EmuRun(void (*kernel)(P...), dim3 grid, dim3 block, A... args) {
  constexpr size_t kStack = 256 << 10;
  std::lock_guard<std::mutex> one_kernel_at_a_time(emu_run_mu);
  if (emu_fibers.size() < block.x) emu_fibers.resize(block.x);
  emu_wait.assign(block.x, EmuWait::kRunnable);
  emu_body = [&] { kernel(args...); };
  const uint64_t launch = emu_launches_run++;
  const unsigned blocks = grid.x * grid.y;
  const bool reverse_blocks = EmuReverse(launch, 0, 0, 7);
  for (unsigned i = 0; i < blocks; ++i) {
    const unsigned b = reverse_blocks ? blocks - 1 - i : i;
    blockIdx = dim3(b % grid.x, b / grid.x);
    gridDim = grid;
    ++emu_blocks_run;
    for (unsigned t = 0; t < block.x; ++t) {
      EmuFiber& f = emu_fibers[t];
      if (f.stack.empty()) f.stack.resize(kStack);
      f.self = boost::context::fiber(std::allocator_arg, EmuStack{&f.stack},
                                     [&f](boost::context::fiber&& scheduler) {
                                       f.scheduler = std::move(scheduler);
                                       emu_body();
                                       return std::move(f.scheduler);
                                     });
      emu_wait[t] = EmuWait::kRunnable;
    }
    // One round runs every warp to the next __syncthreads (or its end), then releases it.
    const unsigned warps = (block.x + 31) / 32;
    for (uint64_t round = 0;; ++round) {
      const bool reverse_warps = EmuReverse(launch, b + 1, round, 3);
      const bool reverse_lanes = EmuReverse(launch, b + 1, round, 5);
      for (unsigned i = 0; i < warps; ++i) {
        const unsigned w = reverse_warps ? warps - 1 - i : i;
        EmuRunWarp(32 * w, min(32 * w + 32, block.x), reverse_lanes);
      }
      bool live = false;
      for (unsigned t = 0; t < block.x; ++t) {
        if (emu_wait[t] == EmuWait::kBlock) emu_wait[t] = EmuWait::kRunnable, live = true;
      }
      if (!live) break;
    }
  }
}

// kernel<<<config>>>(args) is rewritten to EmuLaunch(kernel, EmuConfig{config}, args) by
// emulate.sh.
template <class... P, class... A>
void EmuLaunch(void (*kernel)(P...), EmuConfig cfg, A... args) {
  if (emu_capture) {
    emu_capture->push_back([=] { EmuRun(kernel, cfg.grid, cfg.block, args...); });
    return;
  }
  EmuRun(kernel, cfg.grid, cfg.block, args...);
}

// cudaLaunchKernelEx (kernels/cuda/launch.cuh): the launch as EmuLaunch; the programmatic
// dependent launch attribute changes nothing here, where launches run one after another.
enum cudaLaunchAttributeID { cudaLaunchAttributeProgrammaticStreamSerialization = 6 };
union cudaLaunchAttributeValue {
  int programmaticStreamSerializationAllowed;
};
struct cudaLaunchAttribute {
  cudaLaunchAttributeID id;
  cudaLaunchAttributeValue val;
};
struct cudaLaunchConfig_t {
  dim3 gridDim, blockDim;
  size_t dynamicSmemBytes;
  cudaStream_t stream;
  cudaLaunchAttribute* attrs;
  unsigned numAttrs;
};
template <class... P, class... A>
int cudaLaunchKernelEx(const cudaLaunchConfig_t* c, void (*kernel)(P...), A... args) {
  EmuLaunch(kernel, EmuConfig{c->gridDim, c->blockDim, c->dynamicSmemBytes, c->stream}, args...);
  return 0;
}

// The runtime API that net/nccl_communicator.cpp calls (tests/gpu/emu/nccl.h runs it): one
// device, 0, whose memory is host memory; a stream is a handle whose work is done at once.
enum cudaError_t {
  cudaSuccess = 0,
  cudaErrorInvalidValue = 1,
  cudaErrorMemoryAllocation = 2,
  cudaErrorInvalidDevice = 101,
  cudaErrorNotReady = 600,
};
enum cudaMemcpyKind {
  cudaMemcpyHostToHost = 0,
  cudaMemcpyHostToDevice = 1,
  cudaMemcpyDeviceToHost = 2,
  cudaMemcpyDeviceToDevice = 3,
};
inline constexpr unsigned cudaStreamNonBlocking = 0x01;

inline const char* cudaGetErrorName(cudaError_t e) {
  switch (e) {
    case cudaSuccess: return "cudaSuccess";
    case cudaErrorInvalidValue: return "cudaErrorInvalidValue";
    case cudaErrorMemoryAllocation: return "cudaErrorMemoryAllocation";
    case cudaErrorInvalidDevice: return "cudaErrorInvalidDevice";
    case cudaErrorNotReady: return "cudaErrorNotReady";
  }
  return "cudaErrorUnknown";
}
inline const char* cudaGetErrorString(cudaError_t e) {
  switch (e) {
    case cudaSuccess: return "no error";
    case cudaErrorInvalidValue: return "invalid argument";
    case cudaErrorMemoryAllocation: return "out of memory";
    case cudaErrorInvalidDevice: return "invalid device ordinal";
    case cudaErrorNotReady: return "device not ready";
  }
  return "unknown error";
}

inline cudaError_t cudaGetDeviceCount(int* count) {
  *count = 1;
  return cudaSuccess;
}
inline cudaError_t cudaGetDevice(int* device) {
  *device = 0;
  return cudaSuccess;
}
inline cudaError_t cudaSetDevice(int device) {
  return device == 0 ? cudaSuccess : cudaErrorInvalidDevice;
}

inline cudaError_t cudaStreamCreateWithFlags(cudaStream_t* stream, unsigned) {
  static int the_queue;
  *stream = &the_queue;
  return cudaSuccess;
}
inline cudaError_t cudaStreamDestroy(cudaStream_t) { return cudaSuccess; }
inline cudaError_t cudaStreamQuery(cudaStream_t) { return cudaSuccess; }

// Device memory: each allocation ends 16 bytes or less before a page that may not be touched,
// so a kernel that reads or writes past the end of a buffer faults here (SIGSEGV) as
// compute-sanitizer would report it on a GPU. 16-byte aligned (the widest load any kernel makes;
// cudaMalloc gives 256), filled with 0xFF bytes: cudaMalloc's memory holds whatever was there.
struct EmuMapping {
  void* base;
  size_t length;
  size_t bytes;  // as asked for (counted against emu_device_memory)
};
inline std::mutex emu_alloc_mu;
inline std::unordered_map<void*, EmuMapping> emu_mappings;
// The emulated device's memory: allocations past it fail as cudaMalloc's out of memory would
// (EmuSetDeviceMemory; unlimited by default), for tests of what a full device does.
inline size_t emu_device_memory = SIZE_MAX, emu_device_used = 0;
inline void EmuSetDeviceMemory(size_t bytes) {
  std::lock_guard<std::mutex> lock(emu_alloc_mu);
  emu_device_memory = bytes;
}

// A lost device (EmuLoseDevice(true)): as after a kernel's illegal address on a GPU, every
// later runtime call of the emulated kernels/cuda (device_emu.cpp) fails with that error.
inline std::atomic<bool> emu_device_lost{false};
inline void EmuLoseDevice(bool lost) { emu_device_lost = lost; }
// Graph captures that fail (EmuFailCaptures(true)), as one that cannot be instantiated would.
inline std::atomic<bool> emu_fail_captures{false};
inline void EmuFailCaptures(bool fail) { emu_fail_captures = fail; }

inline void* EmuDeviceAlloc(size_t bytes) {
  {
    std::lock_guard<std::mutex> lock(emu_alloc_mu);
    if (bytes > emu_device_memory - emu_device_used) return nullptr;
    emu_device_used += bytes;
  }
  const size_t page = static_cast<size_t>(sysconf(_SC_PAGESIZE));
  const size_t used = (bytes + 15) / 16 * 16;
  const size_t length = (used + page - 1) / page * page + page;
  void* base = mmap(nullptr, length, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
  char* guard = base == MAP_FAILED ? nullptr : static_cast<char*>(base) + length - page;
  if (!guard || mprotect(guard, page, PROT_NONE) != 0) {
    if (guard) munmap(base, length);
    std::lock_guard<std::mutex> lock(emu_alloc_mu);
    emu_device_used -= bytes;
    return nullptr;
  }
  void* p = guard - used;
  std::memset(p, 0xFF, bytes);
  std::lock_guard<std::mutex> lock(emu_alloc_mu);
  emu_mappings[p] = EmuMapping{base, length, bytes};
  return p;
}

inline void EmuDeviceFree(void* p) {
  if (!p) return;
  EmuMapping m;
  {
    std::lock_guard<std::mutex> lock(emu_alloc_mu);
    auto it = emu_mappings.find(p);
    if (it == emu_mappings.end()) {
      std::fprintf(stderr, "emu: freeing %p, which is not device memory\n", p);
      std::abort();
    }
    m = it->second;
    emu_mappings.erase(it);
    emu_device_used -= m.bytes;
  }
  munmap(m.base, m.length);
}

inline cudaError_t cudaMallocAsync(void** p, size_t bytes, cudaStream_t) {
  *p = nullptr;
  if (bytes == 0) return cudaSuccess;
  *p = EmuDeviceAlloc(bytes);
  return *p ? cudaSuccess : cudaErrorMemoryAllocation;
}
inline cudaError_t cudaFreeAsync(void* p, cudaStream_t) {
  EmuDeviceFree(p);
  return cudaSuccess;
}
inline cudaError_t cudaMemcpyAsync(void* dst, const void* src, size_t bytes, cudaMemcpyKind,
                                   cudaStream_t) {
  if (bytes > 0) std::memcpy(dst, src, bytes);
  return cudaSuccess;
}
