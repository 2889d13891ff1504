#include <gtest/gtest.h>

#include <atomic>
#include <chrono>
#include <cmath>
#include <stdexcept>
#include <thread>
#include <vector>

#include "common/device_transfers.h"
#include "common/numfmt.h"
#include "common/status.h"
#include "common/utf8.h"
#include "common/thread_pool.h"

namespace fm {
namespace {

TEST(NumFmt, E4m3KnownValues) {
  EXPECT_EQ(E4m3ToF32(0x00), 0.0f);
  EXPECT_EQ(E4m3ToF32(0x38), 1.0f);         // exp 7, man 0
  EXPECT_EQ(E4m3ToF32(0x7E), 448.0f);       // max finite
  EXPECT_EQ(E4m3ToF32(0xFE), -448.0f);
  EXPECT_EQ(E4m3ToF32(0x01), std::ldexp(1.0f, -9));  // smallest subnormal
  EXPECT_TRUE(std::isnan(E4m3ToF32(0x7F)));
  EXPECT_TRUE(std::isnan(E4m3ToF32(0xFF)));
}

TEST(NumFmt, E4m3RoundTripAllCodes) {
  for (int c = 0; c < 256; ++c) {
    if ((c & 0x7F) == 0x7F) continue;
    if (c == 0x80) continue;  // -0 encodes back as -0 (0x80); checked below
    EXPECT_EQ(F32ToE4m3(E4m3ToF32(static_cast<uint8_t>(c))), c) << c;
  }
  EXPECT_EQ(F32ToE4m3(-0.0f), 0x80);
  EXPECT_EQ(F32ToE4m3(1000.0f), 0x7E);  // saturates
}

TEST(NumFmt, E8m0AndFp4AndBf16) {
  EXPECT_EQ(E8m0ToF32(127), 1.0f);
  EXPECT_EQ(E8m0ToF32(130), 8.0f);
  EXPECT_EQ(E8m0ToF32(120), std::ldexp(1.0f, -7));
  EXPECT_TRUE(std::isnan(E8m0ToF32(255)));
  EXPECT_EQ(F32ToE8m0Ceil(5.0f), 130);
  const float mags[8] = {0, .5f, 1, 1.5f, 2, 3, 4, 6};
  for (int i = 0; i < 8; ++i) {
    EXPECT_EQ(Fp4ToF32(static_cast<uint8_t>(i)), mags[i]);
    EXPECT_EQ(Fp4ToF32(static_cast<uint8_t>(i | 8)), -mags[i]);
    EXPECT_EQ(F32ToFp4(mags[i]), i);
  }
  EXPECT_EQ(Bf16ToF32(0x3F80), 1.0f);
  EXPECT_EQ(F32ToBf16(1.0f), 0x3F80);
  EXPECT_EQ(F32ToBf16(1.00390625f), 0x3F80);  // exact tie rounds to even
}

TEST(ThreadPool, CoversRangeOnceForAnySize) {
  for (int threads : {1, 2, 3, 5}) {
    ThreadPool pool(threads);
    for (size_t n : {1u, 7u, 100u, 1001u}) {
      std::vector<std::atomic<int>> hits(n);
      for (int rep = 0; rep < 3; ++rep)
        pool.ParallelFor(n, 1, [&](size_t b, size_t e) {
          for (size_t i = b; i < e; ++i) hits[i]++;
        });
      for (size_t i = 0; i < n; ++i) EXPECT_EQ(hits[i].load(), 3) << threads << " " << n;
    }
  }
}

// Each device's counters by phase and direction, apart from every other device's; counts from
// several threads all land. (No CUDA here: nothing else counts in this process.)
TEST(DeviceTransfers, CountsEachDevicePhaseAndDirectionApart) {
  EXPECT_EQ(TransfersOf(3).step.host_to_device, 0u);
  CountTransfer(3, TransferPhase::kLoad, TransferDirection::kHostToDevice, 1000);
  CountTransfer(3, TransferPhase::kStep, TransferDirection::kHostToDevice, 64);
  CountTransfer(3, TransferPhase::kStep, TransferDirection::kDeviceToHost, 12);
  CountTransfer(4, TransferPhase::kStep, TransferDirection::kDeviceToHost, 5);
  const DeviceTransfers d3 = TransfersOf(3), d4 = TransfersOf(4);
  EXPECT_EQ(d3.load.host_to_device, 1000u);
  EXPECT_EQ(d3.load.device_to_host, 0u);
  EXPECT_EQ(d3.step.host_to_device, 64u);
  EXPECT_EQ(d3.step.device_to_host, 12u);
  EXPECT_EQ(d4.step.device_to_host, 5u);
  EXPECT_EQ(d4.step.host_to_device + d4.load.host_to_device + d4.load.device_to_host, 0u);
  EXPECT_EQ(TransfersOf(5).step.device_to_host, 0u);

  ThreadPool pool(4);
  pool.ParallelFor(1000, 1, [](size_t b, size_t e) {
    for (size_t i = b; i < e; ++i)
      CountTransfer(6, TransferPhase::kStep, TransferDirection::kHostToDevice, i);
  });
  EXPECT_EQ(TransfersOf(6).step.host_to_device, 999u * 1000u / 2);
}

// A chunk that throws (bad_alloc in a layer's buffers) reaches the caller once every chunk
// ended, from the caller's part or a worker's, and the pool stays usable; it used to leave
// workers running a destroyed job (the caller's throw) or end the process (a worker's).
TEST(ThreadPool, AChunkThatThrowsReachesTheCallerAndThePoolStaysUsable) {
  ThreadPool pool(4);
  for (const size_t thrower : {size_t{0}, size_t{2}}) {
    std::atomic<int> finished{0};
    EXPECT_THROW(pool.ParallelFor(4, 1,
                                  [&](size_t b, size_t) {
                                    if (b == thrower) throw std::runtime_error("chunk");
                                    std::this_thread::sleep_for(std::chrono::milliseconds(30));
                                    ++finished;
                                  }),
                 std::runtime_error);
    EXPECT_EQ(finished.load(), 3) << "the call returned before the other chunks ended";
    std::atomic<int> parts{0};
    pool.ParallelFor(4, 1, [&](size_t, size_t) { ++parts; });
    EXPECT_EQ(parts.load(), 4);
  }
}

TEST(Status, ResultCarriesValueOrError) {
  Result<int> good(5);
  ASSERT_TRUE(good.ok());
  EXPECT_EQ(*good, 5);
  Result<int> bad(NotFound("tensor layers.0.attn.wq_a.weight"));
  ASSERT_FALSE(bad.ok());
  EXPECT_EQ(bad.status().code(), Code::kNotFound);
  EXPECT_NE(bad.status().ToString().find("layers.0.attn.wq_a.weight"), std::string::npos);
}

// Well-formed text passes; each kind of malformed sequence is found at its first byte.
TEST(Utf8, FirstInvalidByteOfEachMalformedKind) {
  constexpr size_t kOk = std::string_view::npos;
  EXPECT_EQ(FirstInvalidUtf8(""), kOk);
  EXPECT_EQ(FirstInvalidUtf8("plain ascii"), kOk);
  EXPECT_EQ(FirstInvalidUtf8("h\xC3\xA9llo \xE2\x82\xAC \xF0\x9F\x98\x80 \xF4\x8F\xBF\xBF"), kOk);
  EXPECT_EQ(FirstInvalidUtf8("ab\x80"), 2u);               // stray continuation byte
  EXPECT_EQ(FirstInvalidUtf8("a\xC0\xAF"), 1u);            // overlong (C0/C1 leads)
  EXPECT_EQ(FirstInvalidUtf8("a\xE0\x80\xAF"), 1u);        // overlong 3-byte form
  EXPECT_EQ(FirstInvalidUtf8("xy\xED\xA0\x80"), 2u);       // surrogate U+D800
  EXPECT_EQ(FirstInvalidUtf8("\xF4\x90\x80\x80"), 0u);     // past U+10FFFF
  EXPECT_EQ(FirstInvalidUtf8("\xF5\x80\x80\x80"), 0u);     // F5..FF never lead
  EXPECT_EQ(FirstInvalidUtf8("ok\xE2\x82"), 2u);           // truncated at the end
  EXPECT_EQ(FirstInvalidUtf8("ok\xE2\x28\xA1"), 2u);       // bad continuation
}

}  // namespace
}  // namespace fm
