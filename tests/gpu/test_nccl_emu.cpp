// The NCCL communicator (net/nccl_communicator.cpp) on the CPU emulation (tests/gpu/emu/nccl.h,
// cuda_runtime.h), run by tests/gpu/emulate.sh only: its ranks are threads on the one emulated
// device, which real NCCL refuses (one rank per GPU). Device memory is host memory there, so a
// "device" buffer is ordinary memory flagged .device; the host<->device byte counters
// (common/device_transfers.h) show which bytes the communicator staged through host memory.
#include <gtest/gtest.h>
#include <nccl.h>

#include <algorithm>
#include <chrono>
#include <cstring>
#include <functional>
#include <memory>
#include <thread>

#include "common/device_transfers.h"
#include "net/frame.h"
#include "net/nccl_communicator.h"
#include "tests/gpu/nccl_test_group.h"

namespace fm {
namespace {

using namespace std::chrono_literals;
using Clock = std::chrono::steady_clock;
using net::FrameDType;
using net::FrameKind;
constexpr uint64_t kHeader = net::kFrameHeaderSize;

// n communicators of one fresh unique id on the emulation's one device, named g0..g{n-1}.
struct EmuGroup {
  std::vector<std::unique_ptr<net::NcclCommunicator>> c;
  explicit EmuGroup(int n) : c(NcclGroupInProcess(n, "g")) {}
  int size() const { return static_cast<int>(c.size()); }
  // Runs fn(rank) on every rank at once.
  void All(const std::function<void(int)>& fn) {
    std::vector<std::thread> threads;
    for (int r = 0; r < size(); ++r) threads.emplace_back(fn, r);
    for (auto& t : threads) t.join();
  }
};

// Distinct bytes per (from, to): a payload that landed in the wrong place shows.
std::vector<uint8_t> Pattern(size_t n, int from, int to) {
  std::vector<uint8_t> v(n);
  for (size_t i = 0; i < n; ++i) v[i] = static_cast<uint8_t>(from * 71 + to * 13 + i * 7 + 1);
  return v;
}

// What every rank of a group of `ranks` stages per exchange: its whole header area each way.
uint64_t HeaderStaging(int ranks) { return uint64_t(ranks) * ranks * kHeader; }

TransferBytes StepDelta(const DeviceTransfers& before) {
  const DeviceTransfers after = TransfersOf(0);
  return {after.step.host_to_device - before.step.host_to_device,
          after.step.device_to_host - before.step.device_to_host};
}

// Rank `from` to rank `to` of 3: `from + to` rows of 4 f32 from rank 0, of 4 i32 from rank 1;
// rank 2 sends nothing (rank-2 shapes with 0 rows).
net::CommBuffer AllToAllBuffer(int from, int to, const std::vector<uint8_t>& bytes, bool device) {
  const uint32_t rows = from == 2 ? 0 : from + to;
  return {from == 1 ? FrameDType::kI32 : FrameDType::kF32, {rows, 4}, bytes.data(), rows * 16u,
          device};
}

TEST(NcclEmu, AllToAllVRoundTripsHostAndDeviceBuffersAndEmptyOnes) {
  for (const bool device : {false, true}) {
    SCOPED_TRACE(device ? "device buffers" : "host buffers");
    EmuGroup g(3);
    const DeviceTransfers before = TransfersOf(0);
    uint64_t sent_bytes = 0;
    for (int from = 0; from < 2; ++from)
      for (int to = 0; to < 3; ++to) sent_bytes += to == from ? 0 : (from + to) * 16;
    g.All([&](int me) {
      std::vector<std::vector<uint8_t>> data(3);
      std::vector<net::CommBuffer> send(3);
      for (int to = 0; to < 3; ++to) {
        data[to] = Pattern(64, me, to);
        send[to] = AllToAllBuffer(me, to, data[to], device);
      }
      auto got = g.c[me]->AllToAllV(FrameKind::kEpDispatch, 3, 5, send, 10000ms);
      ASSERT_TRUE(got.ok()) << "rank " << me << ": " << got.status().ToString();
      EXPECT_TRUE((*got)[me].payload.empty());
      for (int from = 0; from < 3; ++from) {
        if (from == me) continue;
        const net::Frame& f = (*got)[from];
        const std::vector<uint8_t> want = Pattern(64, from, me);
        const net::CommBuffer sent = AllToAllBuffer(from, me, want, device);
        EXPECT_EQ(f.header.kind, FrameKind::kEpDispatch);
        EXPECT_EQ(f.header.step_id, 3u);
        EXPECT_EQ(f.header.tag, 5u);
        EXPECT_EQ(f.header.dtype, sent.dtype) << me << " from " << from;
        EXPECT_EQ(f.header.shape(), sent.shape) << me << " from " << from;
        ASSERT_EQ(f.payload.size(), sent.nbytes) << me << " from " << from;
        EXPECT_TRUE(std::equal(f.payload.begin(), f.payload.end(), want.begin()));
      }
      // The group goes on: a barrier moves headers only.
      EXPECT_TRUE(g.c[me]->Barrier(4, 10000ms).ok());
    });
    // Host sends are staged to the device, every received payload back (AllToAllV returns
    // host Frames); device sends cross no host copy.
    const TransferBytes d = StepDelta(before);
    EXPECT_EQ(d.host_to_device, 2 * HeaderStaging(3) + (device ? 0 : sent_bytes));
    EXPECT_EQ(d.device_to_host, 2 * HeaderStaging(3) + sent_bytes);
  }
}

TEST(NcclEmu, RecvIntoADeviceTargetTakesThePayloadWithoutAHostCopyAndAHostTargetIsStaged) {
  EmuGroup g(2);
  const std::vector<uint8_t> payload = Pattern(256, 0, 1);   // 8 x 8 f32
  for (const bool device_target : {true, false}) {
    SCOPED_TRACE(device_target ? "device target" : "host target");
    std::vector<uint8_t> target(1000, 0xEE);
    const uint64_t step = device_target ? 1 : 2;
    const DeviceTransfers before = TransfersOf(0);
    g.All([&](int me) {
      if (me == 0) {
        Status st = g.c[0]->Send(1, FrameKind::kActivation, step, 0,
                                 {FrameDType::kF32, {8, 8}, payload.data(), payload.size(), true},
                                 10000ms);
        EXPECT_TRUE(st.ok()) << st.ToString();
        return;
      }
      auto h = g.c[1]->RecvInto(0, FrameKind::kActivation, step, 0,
                                {target.data(), target.size(), device_target}, 10000ms);
      ASSERT_TRUE(h.ok()) << h.status().ToString();
      EXPECT_EQ(h->shape(), (std::vector<uint32_t>{8, 8}));
      EXPECT_EQ(h->payload_bytes, 256u);
    });
    EXPECT_TRUE(std::equal(payload.begin(), payload.end(), target.begin()));
    EXPECT_EQ(target[256], 0xEE);   // nothing past the payload
    EXPECT_EQ(target[999], 0xEE);
    const TransferBytes d = StepDelta(before);
    EXPECT_EQ(d.host_to_device, HeaderStaging(2));
    EXPECT_EQ(d.device_to_host, HeaderStaging(2) + (device_target ? 0 : payload.size()));
  }
}

TEST(NcclEmu, AllToAllVIntoFillsDeviceTargetsStraightAndStagesHostOnes) {
  EmuGroup g(3);
  // The payload from rank `from` to rank `to`: (from + 1) * (to + 2) rows of 2 f32; the target
  // is device memory when from + to is odd.
  auto bytes = [](int from, int to) { return size_t(from + 1) * (to + 2) * 8; };
  auto on_device = [](int from, int to) { return (from + to) % 2 == 1; };
  uint64_t host_target_bytes = 0;
  for (int from = 0; from < 3; ++from)
    for (int to = 0; to < 3; ++to)
      if (from != to && !on_device(from, to)) host_target_bytes += bytes(from, to);
  std::vector<std::vector<std::vector<uint8_t>>> targets(3, std::vector<std::vector<uint8_t>>(3));
  const DeviceTransfers before = TransfersOf(0);
  g.All([&](int me) {
    std::vector<std::vector<uint8_t>> data(3);
    std::vector<net::CommBuffer> send(3);
    std::vector<net::RecvTarget> into(3);
    for (int r = 0; r < 3; ++r) {
      data[r] = Pattern(bytes(me, r), me, r);
      send[r] = {FrameDType::kF32, {uint32_t(bytes(me, r) / 8), 2}, data[r].data(), data[r].size(), true};
      targets[me][r].assign(bytes(r, me) + 16, 0xEE);   // room to spare
      into[r] = {targets[me][r].data(), targets[me][r].size(), on_device(r, me)};
    }
    auto headers = g.c[me]->AllToAllVInto(FrameKind::kEpCombine, 9, 2, send, into, 10000ms);
    ASSERT_TRUE(headers.ok()) << "rank " << me << ": " << headers.status().ToString();
    EXPECT_EQ((*headers)[me].payload_bytes, 0u);
    for (int from = 0; from < 3; ++from) {
      if (from == me) continue;
      const net::FrameHeader& h = (*headers)[from];
      EXPECT_EQ(h.step_id, 9u);
      EXPECT_EQ(h.tag, 2u);
      EXPECT_EQ(h.shape(), (std::vector<uint32_t>{uint32_t(bytes(from, me) / 8), 2}));
      ASSERT_EQ(h.payload_bytes, bytes(from, me));
    }
  });
  for (int me = 0; me < 3; ++me)
    for (int from = 0; from < 3; ++from) {
      if (from == me) continue;
      const std::vector<uint8_t>& t = targets[me][from];
      const std::vector<uint8_t> want = Pattern(bytes(from, me), from, me);
      EXPECT_TRUE(std::equal(want.begin(), want.end(), t.begin())) << me << " from " << from;
      EXPECT_EQ(t[want.size()], 0xEE) << me << " from " << from;
    }
  // Device sends and device targets cross no host copy; only the host targets' payloads do.
  const TransferBytes d = StepDelta(before);
  EXPECT_EQ(d.host_to_device, HeaderStaging(3));
  EXPECT_EQ(d.device_to_host, HeaderStaging(3) + host_target_bytes);
}

TEST(NcclEmu, APayloadAboveTheCapacityIsNamedAndBreaksTheGroup) {
  EmuGroup g(2);
  const std::vector<uint8_t> big = Pattern(400, 0, 1), small = Pattern(4, 1, 0);
  std::vector<uint8_t> target0(100), target1(100);
  g.All([&](int me) {
    std::vector<net::CommBuffer> send(2);
    std::vector<net::RecvTarget> into(2);
    if (me == 0) {
      send[1] = {FrameDType::kU8, {400}, big.data(), big.size(), true};
      into[1] = {target0.data(), target0.size(), true};
    } else {
      send[0] = {FrameDType::kU8, {4}, small.data(), small.size(), true};
      into[0] = {target1.data(), target1.size(), true};
    }
    auto got = g.c[me]->AllToAllVInto(FrameKind::kEpDispatch, 6, 0, send, into, 10000ms);
    ASSERT_FALSE(got.ok());
    if (me == 1) {
      EXPECT_EQ(got.status().code(), Code::kInvalidArgument) << got.status().ToString();
      EXPECT_NE(got.status().message().find("receive from rank 0: a payload of 400 bytes for a buffer of 100"),
                std::string::npos)
          << got.status().message();
    } else {
      // Rank 1 left before its payload round: rank 0 waits for bytes that never come.
      EXPECT_EQ(got.status().code(), Code::kUnavailable) << got.status().ToString();
      EXPECT_NE(got.status().message().find("a member died or left the group"), std::string::npos)
          << got.status().message();
    }
    EXPECT_TRUE(g.c[me]->broken());
    Status later = g.c[me]->Barrier(7, 10000ms);
    EXPECT_EQ(later.code(), Code::kUnavailable) << later.ToString();
    EXPECT_NE(later.message().find("loaded again"), std::string::npos) << later.message();
  });
}

// A received header is checked against the limit the worker sets from its plan (SetMaxPayload),
// not a fixed 1 GiB: a stage hop of more rows than 1 GiB holds must pass where the plan says so,
// and one above the plan's limit is refused naming both sizes.
TEST(NcclEmu, AHeaderIsCheckedAgainstTheLimitTheWorkerSets) {
  for (const uint64_t limit : {uint64_t{400}, uint64_t{399}}) {
    EmuGroup g(2);
    for (auto& c : g.c) c->SetMaxPayload(limit);
    const std::vector<uint8_t> bytes = Pattern(400, 0, 1);
    g.All([&](int me) {
      if (me == 0) {
        (void)g.c[0]->Send(1, FrameKind::kActivation, 4, 0,
                           {FrameDType::kU8, {400}, bytes.data(), bytes.size(), true}, 10000ms);
        return;
      }
      auto got = g.c[1]->Recv(0, FrameKind::kActivation, 4, 0, 10000ms);
      if (limit == 400) {
        ASSERT_TRUE(got.ok()) << got.status().ToString();
        EXPECT_EQ(got->payload, bytes);
      } else {
        ASSERT_FALSE(got.ok());
        EXPECT_NE(got.status().message().find("exceeds the limit of 399"), std::string::npos)
            << got.status().message();
      }
    });
  }
}

TEST(NcclEmu, APeerOutOfStepIsAnErrorNamingThatRank) {
  EmuGroup g(3);
  g.All([&](int me) {
    const uint32_t tag = me == 2 ? 9 : 5;   // rank 2 is on another exchange
    auto got = g.c[me]->AllToAllV(FrameKind::kEpDispatch, 3, tag, std::vector<net::CommBuffer>(3),
                                  10000ms);
    ASSERT_FALSE(got.ok());
    const std::string want =
        me == 2 ? "rank 0 (g0) sent EP_DISPATCH step 3 tag 5, expected EP_DISPATCH step 3 tag 9"
                : "rank 2 (g2) sent EP_DISPATCH step 3 tag 9, expected EP_DISPATCH step 3 tag 5";
    EXPECT_NE(got.status().message().find(want), std::string::npos) << got.status().message();
    EXPECT_TRUE(g.c[me]->broken());
  });
}

TEST(NcclEmu, ASilentMemberIsADeadlineAndAbortStepEndsAWaitPromptly) {
  EmuGroup g(2);
  g.All([&](int me) { EXPECT_TRUE(g.c[me]->Barrier(1, 10000ms).ok()); });   // the group formed
  // Rank 1 never sends step 2.
  auto t0 = Clock::now();
  auto got = g.c[0]->Recv(1, FrameKind::kActivation, 2, 0, 300ms);
  auto waited = Clock::now() - t0;
  EXPECT_EQ(got.status().code(), Code::kDeadlineExceeded) << got.status().ToString();
  EXPECT_NE(got.status().message().find("did not finish in time (members g0, g1"), std::string::npos)
      << got.status().message();
  EXPECT_GE(waited, 300ms);
  EXPECT_LT(waited, 3000ms);

  EmuGroup h(2);
  h.All([&](int me) { EXPECT_TRUE(h.c[me]->Barrier(1, 10000ms).ok()); });
  std::vector<uint8_t> target(64);
  std::thread aborter([&] {
    std::this_thread::sleep_for(200ms);
    h.c[1]->AbortStep(4);   // the waiting rank's own reset
  });
  t0 = Clock::now();
  auto hdr = h.c[1]->RecvInto(0, FrameKind::kActivation, 4, 0, {target.data(), target.size(), true}, 60000ms);
  waited = Clock::now() - t0;
  aborter.join();
  EXPECT_EQ(hdr.status().code(), Code::kUnavailable) << hdr.status().ToString();
  EXPECT_NE(hdr.status().message().find("step 4 aborted by a reset"), std::string::npos)
      << hdr.status().message();
  EXPECT_GE(waited, 200ms);
  EXPECT_LT(waited, 3000ms);
}

// The emulation itself: the group forms with its last member, a byte-count mismatch and a
// peer's abort are errors of the receiver, an aborted communicator refuses every call.
// A buffer whose byte count does not match its shape is the caller's error, found before the
// group is touched: the communicator stays whole and the next exchange goes through.
TEST(NcclEmu, ABufferThatDoesNotMatchItsShapeIsRefusedAndTheGroupStaysWhole) {
  EmuGroup g(2);
  std::vector<float> v(8, 1.0f);
  const net::CommBuffer bad{FrameDType::kF32, {2, 4}, v.data(), 12, false};   // 32 bytes
  const Status st = g.c[0]->Send(1, FrameKind::kEpDispatch, 1, 0, bad, 2000ms);
  EXPECT_EQ(st.code(), Code::kInvalidArgument) << st.ToString();
  EXPECT_NE(st.message().find("send to rank 1"), std::string::npos) << st.ToString();
  EXPECT_FALSE(g.c[0]->broken());
  g.All([&](int r) {
    const net::CommBuffer good{FrameDType::kF32, {2, 4}, v.data(), 32, false};
    std::vector<net::CommBuffer> send(2, good);
    auto got = g.c[r]->AllToAllV(FrameKind::kEpDispatch, 2, 0, send, 5000ms);
    ASSERT_TRUE(got.ok()) << got.status().ToString();
    EXPECT_EQ((*got)[1 - r].payload.size(), 32u);
  });
}

TEST(NcclEmu, TheEmulationFormsGroupsAndFailsAsNcclWould) {
  ncclUniqueId id;
  ASSERT_EQ(ncclGetUniqueId(&id), ncclSuccess);
  ncclConfig_t config = NCCL_CONFIG_INITIALIZER;
  config.blocking = 0;
  ncclComm_t c0 = nullptr, c1 = nullptr;
  ASSERT_EQ(ncclCommInitRankConfig(&c0, 2, id, 0, &config), ncclInProgress);
  ncclResult_t async = ncclSuccess;
  ASSERT_EQ(ncclCommGetAsyncError(c0, &async), ncclSuccess);
  EXPECT_EQ(async, ncclInProgress);   // rank 1 has not come
  EXPECT_EQ(ncclSend("x", 1, ncclUint8, 1, c0, nullptr), ncclInvalidUsage);   // not formed yet
  ncclComm_t dup = nullptr;
  EXPECT_EQ(ncclCommInitRankConfig(&dup, 2, id, 0, &config), ncclInvalidUsage);   // rank 0 again
  ASSERT_EQ(ncclCommInitRankConfig(&c1, 2, id, 1, &config), ncclInProgress);
  ASSERT_EQ(ncclCommGetAsyncError(c0, &async), ncclSuccess);
  EXPECT_EQ(async, ncclSuccess);

  uint8_t eight[8] = {1, 2, 3, 4, 5, 6, 7, 8}, got[8] = {};
  ASSERT_EQ(ncclGroupStart(), ncclSuccess);
  ASSERT_EQ(ncclSend(eight, 8, ncclUint8, 1, c0, nullptr), ncclSuccess);
  ASSERT_EQ(ncclRecv(got, 8, ncclUint8, 0, c1, nullptr), ncclSuccess);
  ASSERT_EQ(ncclGroupEnd(), ncclSuccess);
  ASSERT_EQ(ncclCommGetAsyncError(c1, &async), ncclSuccess);
  EXPECT_EQ(async, ncclSuccess);
  EXPECT_EQ(std::memcmp(got, eight, 8), 0);

  EXPECT_EQ(ncclSend(eight, 8, ncclUint8, 1, c0, nullptr), ncclSuccess);
  EXPECT_EQ(ncclRecv(got, 4, ncclUint8, 0, c1, nullptr), ncclSuccess);
  ASSERT_EQ(ncclCommGetAsyncError(c1, &async), ncclSuccess);
  EXPECT_EQ(async, ncclInvalidUsage);   // 8 bytes sent, 4 expected

  EXPECT_EQ(ncclRecv(got, 8, ncclUint8, 1, c0, nullptr), ncclSuccess);
  ASSERT_EQ(ncclCommGetAsyncError(c0, &async), ncclSuccess);
  EXPECT_EQ(async, ncclInProgress);   // rank 1 may still send
  EXPECT_EQ(ncclCommAbort(c1), ncclSuccess);
  ASSERT_EQ(ncclCommGetAsyncError(c0, &async), ncclSuccess);
  EXPECT_EQ(async, ncclRemoteError);   // now it never will
  EXPECT_EQ(ncclSend(eight, 8, ncclUint8, 0, c1, nullptr), ncclInvalidUsage);
  EXPECT_EQ(ncclCommGetAsyncError(c1, &async), ncclInvalidUsage);
  EXPECT_EQ(ncclCommAbort(c0), ncclSuccess);
}

}  // namespace
}  // namespace fm
