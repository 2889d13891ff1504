// The NCCL backend of the Communicator (net/nccl_communicator.h). Argument checks run on any
// machine; the exchanges need GPUs: the failure tests one (a group whose second rank never
// comes), the data tests two (NCCL refuses two ranks of one communicator on the same GPU).
#include <gtest/gtest.h>

#include <chrono>
#include <cstring>
#include <thread>

#include "common/device_transfers.h"
#include "kernels/cuda/device.h"
#include "net/frame.h"
#include "net/nccl_communicator.h"

namespace fm {
namespace {

using namespace std::chrono_literals;
using Clock = std::chrono::steady_clock;

std::vector<net::CommMember> Members(int n) {
  std::vector<net::CommMember> m;
  for (int i = 0; i < n; ++i) m.push_back({"g" + std::to_string(i), ""});
  return m;
}

TEST(NcclCommunicator, BadArgumentsAreRefusedNamingTheArgument) {
  ASSERT_TRUE(net::NcclBuilt());
  const std::string id(net::kNcclUniqueIdBytes, '\0');
  auto r = net::MakeNcclCommunicator(Members(2), 2, 0, id);
  ASSERT_FALSE(r.ok());
  EXPECT_NE(r.status().message().find("rank 2 outside [0, 2)"), std::string::npos) << r.status().message();
  r = net::MakeNcclCommunicator(Members(2), 0, 0, "short");
  ASSERT_FALSE(r.ok());
  EXPECT_NE(r.status().message().find("unique id of 5 bytes, want 128"), std::string::npos);
  r = net::MakeNcclCommunicator(Members(2), 0, cuda::DeviceCount(), id);
  ASSERT_FALSE(r.ok());
  EXPECT_NE(r.status().message().find("cuda:" + std::to_string(cuda::DeviceCount())), std::string::npos)
      << r.status().message();
}

TEST(NcclCommunicator, AMemberThatNeverComesIsADeadlineAndTheGroupStaysBroken) {
  if (cuda::DeviceCount() < 1) GTEST_SKIP() << "no CUDA device";
  auto id = net::NcclNewUniqueId();
  ASSERT_TRUE(id.ok()) << id.status().ToString();
  ASSERT_EQ(id->size(), net::kNcclUniqueIdBytes);
  auto c = net::MakeNcclCommunicator(Members(2), 0, 0, *id);
  ASSERT_TRUE(c.ok()) << c.status().ToString();
  const auto t0 = Clock::now();
  Status st = (*c)->Barrier(1, 1500ms);   // rank 1 never joins
  EXPECT_LT(Clock::now() - t0, 10s);
  EXPECT_EQ(st.code(), Code::kDeadlineExceeded) << st.ToString();
  EXPECT_NE(st.message().find("g0, g1"), std::string::npos) << st.message();
  EXPECT_TRUE((*c)->broken());
  st = (*c)->Barrier(2, 1500ms);
  EXPECT_EQ(st.code(), Code::kUnavailable) << st.ToString();
  EXPECT_NE(st.message().find("loaded again"), std::string::npos) << st.message();
}

TEST(NcclCommunicator, AbortStepEndsTheWaitPromptly) {
  if (cuda::DeviceCount() < 1) GTEST_SKIP() << "no CUDA device";
  auto id = net::NcclNewUniqueId();
  ASSERT_TRUE(id.ok()) << id.status().ToString();
  auto c = net::MakeNcclCommunicator(Members(2), 0, 0, *id);
  ASSERT_TRUE(c.ok()) << c.status().ToString();
  std::thread aborter([&] {
    std::this_thread::sleep_for(300ms);
    (*c)->AbortStep(7);
  });
  const auto t0 = Clock::now();
  Status st = (*c)->Barrier(7, 60000ms);
  aborter.join();
  EXPECT_EQ(st.code(), Code::kUnavailable) << st.ToString();
  EXPECT_LT(Clock::now() - t0, 10s);
}

TEST(NcclCommunicator, TwoGpusExchangeEveryBufferAndCatchAPeerOutOfStep) {
  if (cuda::DeviceCount() < 2) GTEST_SKIP() << "needs 2 CUDA devices (NCCL: one rank per GPU)";
  auto id = net::NcclNewUniqueId();
  ASSERT_TRUE(id.ok()) << id.status().ToString();
  std::unique_ptr<net::NcclCommunicator> c[2];
  for (int r = 0; r < 2; ++r) {
    auto m = net::MakeNcclCommunicator(Members(2), r, r, *id);
    ASSERT_TRUE(m.ok()) << m.status().ToString();
    c[r] = std::move(m).value();
  }
  auto both = [&](auto fn) {
    std::thread t1([&] { fn(1); });
    fn(0);
    t1.join();
  };
  // All-to-all-v: rank r sends (r + 1) * 1000 floats to the other; an empty buffer too.
  std::vector<float> data[2];
  for (int r = 0; r < 2; ++r) {
    data[r].resize((r + 1) * 1000);
    for (size_t i = 0; i < data[r].size(); ++i) data[r][i] = static_cast<float>(r * 100000 + i) * 0.5f;
  }
  both([&](int r) {
    std::vector<net::CommBuffer> send(2);
    send[1 - r] = {net::FrameDType::kF32, {static_cast<uint32_t>(data[r].size())}, data[r].data(),
                   data[r].size() * sizeof(float)};
    const DeviceTransfers before = TransfersOf(r);
    auto got = c[r]->AllToAllV(net::FrameKind::kEpDispatch, 3, 5, send, 20000ms);
    ASSERT_TRUE(got.ok()) << "rank " << r << ": " << got.status().ToString();
    // Staged through host memory, counted on the rank's device: both ranks' header slots each
    // way, then what it sends and what it receives.
    const DeviceTransfers after = TransfersOf(r);
    EXPECT_EQ(after.step.host_to_device - before.step.host_to_device,
              2 * net::kFrameHeaderSize + data[r].size() * sizeof(float));
    EXPECT_EQ(after.step.device_to_host - before.step.device_to_host,
              2 * net::kFrameHeaderSize + data[1 - r].size() * sizeof(float));
    const net::Frame& f = (*got)[1 - r];
    EXPECT_EQ(f.header.step_id, 3u);
    EXPECT_EQ(f.header.tag, 5u);
    ASSERT_EQ(f.payload.size(), data[1 - r].size() * sizeof(float));
    EXPECT_EQ(std::memcmp(f.payload.data(), data[1 - r].data(), f.payload.size()), 0);
    EXPECT_TRUE((*got)[r].payload.empty());
  });
  both([&](int r) {
    std::vector<net::CommBuffer> none(2);
    auto got = c[r]->AllToAllV(net::FrameKind::kEpCombine, 4, 0, none, 20000ms);
    ASSERT_TRUE(got.ok()) << got.status().ToString();
    EXPECT_EQ((*got)[1 - r].header.numel(), 0u);
  });
  // Different tags: out of step, both see an error naming the other rank.
  both([&](int r) {
    std::vector<net::CommBuffer> none(2);
    auto got = c[r]->AllToAllV(net::FrameKind::kEpCombine, 5, r, none, 20000ms);
    ASSERT_FALSE(got.ok());
    EXPECT_NE(got.status().message().find("rank " + std::to_string(1 - r) + " ("), std::string::npos)
        << got.status().message();
    EXPECT_TRUE(c[r]->broken());
  });
}

}  // namespace
}  // namespace fm
