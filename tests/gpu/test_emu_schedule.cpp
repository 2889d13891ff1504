// The emulation's own schedule (tests/gpu/emu/cuda_runtime.h), run by tests/gpu/emulate.sh only:
// a race that the emulation used to order by luck (blocks, warps and lanes always in index
// order, shuffles as block barriers, device memory zeroed by fresh pages) now gives a wrong
// answer in some launches, and the same kernel with the barrier a GPU needs gives the right one
// in every launch; an access past a buffer's end faults. The kernels here are plain functions
// launched through EmuLaunch, as emulate.sh rewrites kernel<<<...>>>(...) calls.
#include <gtest/gtest.h>

#include <cuda_runtime.h>

#include <cstdint>
#include <cstring>
#include <set>

#include "kernels/cuda/device.h"

namespace {

constexpr int kLaunches = 16;

// Warp 0's lane 0 writes a shared flag that warp 1's lane 0 reads. `barrier` 0: nothing between
// (a race); 1: a shuffle in each warp (warp-scoped: still a race on a GPU); 2: __syncthreads.
void CrossWarpFlag(int barrier, int* out) {
  __shared__ int flag;
  if (threadIdx.x == 0) flag = 0;
  __syncthreads();
  if (threadIdx.x == 0) flag = 1;
  if (barrier == 1) (void)__shfl_sync(0xFFFFFFFFu, 0.0f, 0);
  if (barrier == 2) __syncthreads();
  if (threadIdx.x == 32) *out = flag;
}

// Lane 0 writes a shared value that lane 31 of the same warp reads, with or without __syncwarp.
void InWarpValue(bool syncwarp, int* out) {
  __shared__ int value;
  if (threadIdx.x == 0) value = 0;
  __syncthreads();
  if (threadIdx.x == 0) value = 7;
  if (syncwarp) __syncwarp();
  if (threadIdx.x == 31) *out = value;
}

// The block that takes the counter last writes its index (a "last block finishes" pattern).
void LastBlockIndex(int* counter, int* out) {
  if (threadIdx.x == 0 && atomicAdd(counter, 1) == static_cast<int>(gridDim.x) - 1) *out = blockIdx.x;
}

// Block 0's thread 0 writes a shared value that thread 1 reads after a barrier; block 1 reads it
// without writing. The poison call is the one emulate.sh puts after every __shared__ declaration.
void SharedLeftByTheBlockBefore(int, int* out) {
  __shared__ int v;
  EmuPoisonShared(&v, sizeof v);
  if (blockIdx.x == 0 && threadIdx.x == 0) v = 5;
  __syncthreads();
  if (threadIdx.x == 1) out[blockIdx.x] = v;
}

// Thread i stores element i of a buffer of n floats: threads past n write past its end.
void StoreIndex(int n, float* buf) {
  (void)n;
  buf[threadIdx.x] = static_cast<float>(threadIdx.x);
}

// Lanes past `live` return before the shuffle, which then runs with exited lanes in the mask.
void ShuffleAfterExit(int live) {
  if (static_cast<int>(threadIdx.x) >= live) return;
  (void)__shfl_xor_sync(0xFFFFFFFFu, 1.0f, 1);
}

std::set<int> Outcomes(void (*kernel)(int, int*), int arg, dim3 block) {
  std::set<int> seen;
  for (int i = 0; i < kLaunches; ++i) {
    int out = -1;
    EmuLaunch(kernel, EmuConfig{dim3(1), block}, arg, &out);
    seen.insert(out);
  }
  return seen;
}

TEST(EmuSchedule, WarpsRunInVaryingOrderSoAShuffleDoesNotOrderOtherWarps) {
  EXPECT_EQ(Outcomes(CrossWarpFlag, 0, dim3(64)), (std::set<int>{0, 1}));
  EXPECT_EQ(Outcomes(CrossWarpFlag, 1, dim3(64)), (std::set<int>{0, 1}));
  EXPECT_EQ(Outcomes(CrossWarpFlag, 2, dim3(64)), (std::set<int>{1}));
}

TEST(EmuSchedule, LanesRunInVaryingOrderUntilASyncwarp) {
  std::set<int> racy, synced;
  for (int i = 0; i < kLaunches; ++i) {
    int a = -1, b = -1;
    EmuLaunch(InWarpValue, EmuConfig{dim3(1), dim3(32)}, false, &a);
    EmuLaunch(InWarpValue, EmuConfig{dim3(1), dim3(32)}, true, &b);
    racy.insert(a), synced.insert(b);
  }
  EXPECT_EQ(racy, (std::set<int>{0, 7}));
  EXPECT_EQ(synced, (std::set<int>{7}));
}

TEST(EmuSchedule, TheLastBlockIsNotAlwaysTheLastIndex) {
  std::set<int> finishers;
  for (int i = 0; i < kLaunches; ++i) {
    int counter = 0, out = -1;
    EmuLaunch(LastBlockIndex, EmuConfig{dim3(5), dim3(32)}, &counter, &out);
    EXPECT_EQ(counter, 5);
    finishers.insert(out);
  }
  EXPECT_EQ(finishers, (std::set<int>{0, 4}));
}

TEST(EmuSchedule, DeviceMemoryStartsAsOnesNotZeros) {
  auto b = fm::cuda::DeviceBuffer::Alloc(64);
  ASSERT_TRUE(b.ok()) << b.status().ToString();
  uint8_t bytes[64];
  std::memcpy(bytes, b.value().as<uint8_t>(), sizeof bytes);
  for (uint8_t v : bytes) ASSERT_EQ(v, 0xFF);
  void* p = nullptr;
  ASSERT_EQ(cudaMallocAsync(&p, 8, nullptr), cudaSuccess);
  int32_t word;
  std::memcpy(&word, p, sizeof word);
  EXPECT_EQ(word, -1);
  cudaFreeAsync(p, nullptr);
}

TEST(EmuSchedule, EveryBlockStartsItsSharedMemoryAsOnes) {
  for (int i = 0; i < kLaunches; ++i) {
    int out[2] = {0, 0};
    EmuLaunch(SharedLeftByTheBlockBefore, EmuConfig{dim3(2), dim3(32)}, 0, out);
    EXPECT_EQ(out[0], 5);   // a later thread's poison call does not undo an earlier write
    EXPECT_EQ(out[1], -1);  // not block 0's 5
  }
}

// A full emulated device refuses an allocation (EmuSetDeviceMemory), and GrowBuffer grows a
// buffer in it without holding the old and the new at once: doubled while that fits, then the
// exact size asked for.
TEST(EmuDeviceMemory, GrowBufferFreesTheOldFirstAndFallsBackToTheExactSize) {
  constexpr size_t kMiB = 1 << 20;
  EmuSetDeviceMemory(3 * kMiB);
  {
    auto a = fm::cuda::DeviceBuffer::Alloc(kMiB);
    ASSERT_TRUE(a.ok());
    EXPECT_FALSE(fm::cuda::DeviceBuffer::Alloc(2 * kMiB + kMiB / 2).ok()) << "past the device";
    auto b = fm::cuda::GrowBuffer(std::move(*a), kMiB + kMiB / 2);  // doubled: 2 MiB
    ASSERT_TRUE(b.ok()) << b.status().ToString();
    EXPECT_EQ(b->size(), 2 * kMiB);
    auto c = fm::cuda::GrowBuffer(std::move(*b), 2 * kMiB + kMiB / 2);  // 4 MiB does not fit
    ASSERT_TRUE(c.ok()) << c.status().ToString() << ": the old 2 MiB was still held";
    EXPECT_EQ(c->size(), 2 * kMiB + kMiB / 2);
    EXPECT_FALSE(fm::cuda::GrowBuffer(std::move(*c), 4 * kMiB).ok());
    EXPECT_TRUE(fm::cuda::DeviceBuffer::Alloc(3 * kMiB).ok()) << "the failed growth freed the old";
  }
  EmuSetDeviceMemory(SIZE_MAX);
}

TEST(EmuScheduleDeathTest, AStorePastABuffersEndFaults) {
  GTEST_FLAG_SET(death_test_style, "threadsafe");
  auto b = fm::cuda::DeviceBuffer::Alloc(32 * sizeof(float));
  ASSERT_TRUE(b.ok()) << b.status().ToString();
  float* buf = b.value().as<float>();
  EXPECT_EQ(reinterpret_cast<uintptr_t>(buf) % 16, 0u);
  EmuLaunch(StoreIndex, EmuConfig{dim3(1), dim3(32)}, 32, buf);  // in bounds
  EXPECT_EQ(buf[31], 31.0f);
  EXPECT_DEATH(EmuLaunch(StoreIndex, EmuConfig{dim3(1), dim3(36)}, 32, buf), "");
}

TEST(EmuScheduleDeathTest, AShuffleWithExitedLanesStopsTheTest) {
  GTEST_FLAG_SET(death_test_style, "threadsafe");
  EXPECT_DEATH(EmuLaunch(ShuffleAfterExit, EmuConfig{dim3(1), dim3(32)}, 16),
               "a warp operation in warp 0 while 16 of its lanes");
  EmuLaunch(ShuffleAfterExit, EmuConfig{dim3(1), dim3(32)}, 32);  // the whole warp: fine
  // A block of 40 threads: its second warp has 8 lanes, and a full-mask shuffle names 24 absent.
  EXPECT_DEATH(EmuLaunch(ShuffleAfterExit, EmuConfig{dim3(1), dim3(40)}, 40),
               "a warp operation in warp 1, which has 8 lanes");
}

}  // namespace
