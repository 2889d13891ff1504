// Expert parallelism: the TCP Communicator (all-to-all-v, barrier, tags, dead ranks) and the
// EpExpertExecutor, whose routed output on k members (each holding a contiguous expert range
// and its own rows) is bit-identical to one process holding every expert.
#include <gtest/gtest.h>

#include <atomic>
#include <chrono>
#include <cstring>
#include <limits>
#include <random>
#include <thread>

#include "model/checkpoint.h"
#include "model/mkmodel.h"
#include "model/moe.h"
#include "net/communicator.h"
#include "net/tcp_transport.h"
#include "tests/unit/test_checkpoint_util.h"
#include "tests/unit/test_comm_group.h"
#include "worker/ep_expert_executor.h"

namespace fm {
namespace {

using namespace std::chrono_literals;
using net::Millis;

TEST(Communicator, AllToAllVDeliversEveryRanksBufferIncludingEmptyOnes) {
  CommGroup g(3);
  ASSERT_TRUE(g.comms[2]);
  g.All([&](int me) {
    // Rank me sends (me * 10 + r) repeated r+me times to rank r; rank 1 sends nothing to 0.
    std::vector<std::vector<float>> data(3);
    std::vector<net::CommBuffer> send(3);
    for (int r = 0; r < 3; ++r) {
      const size_t n = (me == 1 && r == 0) ? 0 : r + me;
      data[r].assign(n, static_cast<float>(me * 10 + r));
      send[r] = {net::FrameDType::kF32, {static_cast<uint32_t>(n)}, data[r].data(), n * 4};
    }
    auto recv = g.comms[me]->AllToAllV(net::FrameKind::kEpDispatch, 7, 3, send, 5000ms);
    ASSERT_TRUE(recv.ok()) << recv.status().ToString();
    for (int r = 0; r < 3; ++r) {
      if (r == me) continue;
      const size_t n = (r == 1 && me == 0) ? 0 : me + r;
      auto v = net::FramePayloadAsF32((*recv)[r]);
      ASSERT_TRUE(v.ok());
      EXPECT_EQ(*v, std::vector<float>(n, static_cast<float>(r * 10 + me))) << me << " from " << r;
    }
    EXPECT_TRUE(g.comms[me]->Barrier(8, 5000ms).ok());
  });
}

// The base class's AllToAllVInto over TCP: host targets only, each payload checked against
// its target's capacity.
TEST(Communicator, AllToAllVIntoFillsHostTargetsAndRefusesDeviceAndShortOnes) {
  CommGroup g(3);
  ASSERT_TRUE(g.comms[2]);
  // Rank me sends me + r + 1 floats of value me * 10 + r to rank r; targets have 2 floats spare.
  std::vector<std::vector<std::vector<float>>> targets(3, std::vector<std::vector<float>>(3));
  g.All([&](int me) {
    std::vector<std::vector<float>> data(3);
    std::vector<net::CommBuffer> send(3);
    std::vector<net::RecvTarget> into(3);
    for (int r = 0; r < 3; ++r) {
      const uint32_t n = me + r + 1;
      data[r].assign(n, static_cast<float>(me * 10 + r));
      send[r] = {net::FrameDType::kF32, {n}, data[r].data(), n * 4};
      targets[me][r].assign(n + 2, -1.0f);
      into[r] = {targets[me][r].data(), targets[me][r].size() * 4};
    }
    auto headers = g.comms[me]->AllToAllVInto(net::FrameKind::kEpDispatch, 10, 1, send, into, 5000ms);
    ASSERT_TRUE(headers.ok()) << headers.status().ToString();
    for (int r = 0; r < 3; ++r) {
      if (r == me) continue;
      const uint32_t n = me + r + 1;
      EXPECT_EQ((*headers)[r].shape(), std::vector<uint32_t>{n}) << me << " from " << r;
      EXPECT_EQ((*headers)[r].payload_bytes, n * 4u);
      std::vector<float> want(n, static_cast<float>(r * 10 + me));
      want.insert(want.end(), {-1.0f, -1.0f});   // nothing past the payload
      EXPECT_EQ(targets[me][r], want) << me << " from " << r;
    }
  });

  // Refused before anything is sent: a device target, a target count other than the group's.
  float spare[4];
  std::vector<net::CommBuffer> none(3);
  std::vector<net::RecvTarget> device_target(3, net::RecvTarget{spare, sizeof spare});
  device_target[1].device = true;
  auto refused = g.comms[0]->AllToAllVInto(net::FrameKind::kEpDispatch, 11, 0, none, device_target, 5000ms);
  EXPECT_EQ(refused.status().code(), Code::kInvalidArgument) << refused.status().ToString();
  EXPECT_NE(refused.status().message().find("a device buffer for rank 1"), std::string::npos)
      << refused.status().message();
  refused = g.comms[0]->AllToAllVInto(net::FrameKind::kEpDispatch, 11, 0, none,
                                      std::vector<net::RecvTarget>(2), 5000ms);
  EXPECT_EQ(refused.status().code(), Code::kInvalidArgument) << refused.status().ToString();
  EXPECT_NE(refused.status().message().find("all-to-all: 2 buffers for 3 ranks"), std::string::npos)
      << refused.status().message();

  // Rank 2 sends rank 0 three floats into a target of one: rank 0's call names both sizes; the
  // others' exchange completes, and the group goes on.
  g.All([&](int me) {
    std::vector<float> three(3, 7.0f);
    std::vector<net::CommBuffer> send(3);
    if (me == 2) send[0] = {net::FrameDType::kF32, {3}, three.data(), 12};
    std::vector<net::RecvTarget> into(3, net::RecvTarget{spare, sizeof spare});
    if (me == 0) into[2].capacity = 4;
    auto got = g.comms[me]->AllToAllVInto(net::FrameKind::kEpDispatch, 12, 0, send, into, 5000ms);
    if (me != 0) {
      EXPECT_TRUE(got.ok()) << "rank " << me << ": " << got.status().ToString();
      return;
    }
    EXPECT_EQ(got.status().code(), Code::kInvalidArgument) << got.status().ToString();
    EXPECT_NE(got.status().message().find("receive from rank 2: a payload of 12 bytes for a buffer of 4"),
              std::string::npos)
        << got.status().message();
  });
  g.All([&](int me) { EXPECT_TRUE(g.comms[me]->Barrier(13, 5000ms).ok()); });
}

TEST(Communicator, StaleFramesAreSkippedAndAPeerAheadEndsTheStepButKeepsItsFrame) {
  CommGroup g(2);
  ASSERT_TRUE(g.comms[1]);
  g.All([&](int me) { EXPECT_TRUE(g.comms[me]->Barrier(1, 5000ms).ok()); });  // connects the pair
  float v[3] = {1, 2, 3};
  auto send = [&](uint64_t step, int i) {
    return g.comms[1]->Send(0, net::FrameKind::kEpDispatch, step, 1,
                            {net::FrameDType::kF32, {1}, &v[i], 4}, 2000ms);
  };
  ASSERT_TRUE(send(5, 0).ok());   // left over from an aborted step 5
  ASSERT_TRUE(send(6, 1).ok());
  ASSERT_TRUE(send(8, 2).ok());   // ahead of the receiver
  auto f = g.comms[0]->Recv(1, net::FrameKind::kEpDispatch, 6, 1, 2000ms);
  ASSERT_TRUE(f.ok()) << f.status().ToString();
  EXPECT_EQ(*net::FramePayloadAsF32(*f), std::vector<float>{2});
  // Step 7 never comes from rank 1: it gave that step up. The wait ends at once, not at
  // the deadline, and the step-8 frame is kept for step 8.
  const auto t0 = std::chrono::steady_clock::now();
  auto ahead = g.comms[0]->Recv(1, net::FrameKind::kEpDispatch, 7, 1, 2000ms);
  ASSERT_FALSE(ahead.ok());
  EXPECT_LT(std::chrono::steady_clock::now() - t0, 1000ms);
  EXPECT_EQ(ahead.status().code(), Code::kUnavailable);
  EXPECT_NE(ahead.status().message().find("EP rank 1 (m1) gave up step 7 (it is on step 8)"),
            std::string::npos)
      << ahead.status().message();
  auto next = g.comms[0]->Recv(1, net::FrameKind::kEpDispatch, 8, 1, 2000ms);
  ASSERT_TRUE(next.ok()) << next.status().ToString();
  EXPECT_EQ(*net::FramePayloadAsF32(*next), std::vector<float>{3});
  // Same step, other tag: out of step, an error naming the peer.
  ASSERT_TRUE(send(9, 0).ok());
  auto wrong = g.comms[0]->Recv(1, net::FrameKind::kEpDispatch, 9, 2, 2000ms);
  ASSERT_FALSE(wrong.ok());
  EXPECT_NE(wrong.status().message().find("EP rank 1 (m1) sent EP_DISPATCH step 9 tag 1"), std::string::npos)
      << wrong.status().message();
}

TEST(Communicator, AbortStepEndsAWaitOnASilentRankPromptlyAndOnlyForThatStep) {
  CommGroup g(2);
  ASSERT_TRUE(g.comms[1]);
  g.All([&](int me) { EXPECT_TRUE(g.comms[me]->Barrier(1, 5000ms).ok()); });
  std::thread aborter([&] {
    std::this_thread::sleep_for(200ms);
    g.comms[0]->AbortStep(3);
  });
  const auto t0 = std::chrono::steady_clock::now();
  auto r = g.comms[0]->Recv(1, net::FrameKind::kEpDispatch, 3, 0, 20000ms);   // rank 1 is silent
  const auto waited = std::chrono::steady_clock::now() - t0;
  aborter.join();
  ASSERT_FALSE(r.ok());
  EXPECT_EQ(r.status().code(), Code::kUnavailable) << r.status().ToString();
  EXPECT_NE(r.status().message().find("step 3 aborted"), std::string::npos) << r.status().message();
  EXPECT_GE(waited, 200ms);
  EXPECT_LT(waited, 2000ms);
  // Another step still runs while step 3 stays aborted; after AbortStep(0) step 3 runs too.
  g.All([&](int me) { EXPECT_TRUE(g.comms[me]->Barrier(4, 5000ms).ok()); });
  g.comms[0]->AbortStep(0);
  g.All([&](int me) { EXPECT_TRUE(g.comms[me]->Barrier(3, 5000ms).ok()); });
}

TEST(Communicator, RestartedRankRejoinsWithoutTheOthersReconnecting) {
  CommGroup g(3);
  ASSERT_TRUE(g.comms[2]);
  std::vector<net::CommBuffer> none(3);
  g.All([&](int me) { EXPECT_TRUE(g.comms[me]->AllToAllV(net::FrameKind::kEpCombine, 1, 0, none, 5000ms).ok()); });
  // Rank 1 dies and comes back on the same address (a new process).
  const std::string addr = g.transports[1]->listen_address();
  g.comms[1].reset();
  g.transports[1].reset();
  // A real restart takes far longer than the others need to see the old connection close (a
  // frame sent into that instant is lost: the documented limit of the TCP backend).
  for (int i : {0, 2}) {
    const auto until = std::chrono::steady_clock::now() + 5s;
    while (g.transports[i]->IsConnected("m1") && std::chrono::steady_clock::now() < until)
      std::this_thread::sleep_for(1ms);
    ASSERT_FALSE(g.transports[i]->IsConnected("m1")) << "rank " << i;
  }
  auto t = net::MakeTcpTransport({.self_name = "m1", .secret = g.secret});
  ASSERT_TRUE(t.ok());
  ASSERT_TRUE((*t)->Listen(addr).ok());
  g.transports[1] = std::move(t).value();
  std::vector<net::CommMember> members;
  for (int i = 0; i < 3; ++i) members.push_back({"m" + std::to_string(i), i == 1 ? addr : g.transports[i]->listen_address()});
  g.comms[1] = std::move(net::MakeTcpCommunicator(g.transports[1].get(), members, 1)).value();
  g.All([&](int me) {
    auto r = g.comms[me]->AllToAllV(net::FrameKind::kEpCombine, 2, 0, none, 5000ms);
    EXPECT_TRUE(r.ok()) << "rank " << me << ": " << r.status().ToString();
  });
}

TEST(Communicator, DeadRankTurnsIntoAnErrorWithinTheDeadline) {
  CommGroup g(3);
  ASSERT_TRUE(g.comms[2]);
  g.comms[2].reset();
  g.transports[2].reset();   // rank 2 is gone
  const auto t0 = std::chrono::steady_clock::now();
  std::vector<net::CommBuffer> none(3);
  auto r = g.comms[0]->AllToAllV(net::FrameKind::kEpCombine, 1, 0, none, 1500ms);
  EXPECT_LT(std::chrono::steady_clock::now() - t0, 4s);
  ASSERT_FALSE(r.ok());
  EXPECT_NE(r.status().message().find("m2"), std::string::npos) << r.status().message();
}

TEST(Communicator, BadGroupsAreRefused) {
  auto t = net::MakeTcpTransport({.self_name = "a", .secret = ""});
  ASSERT_TRUE(t.ok());
  EXPECT_FALSE(net::MakeTcpCommunicator(t->get(), {}, 0).ok());
  EXPECT_FALSE(net::MakeTcpCommunicator(t->get(), {{"a", "127.0.0.1:1"}}, 1).ok());
  auto dup = net::MakeTcpCommunicator(t->get(), {{"a", "x:1"}, {"a", "x:2"}}, 0);
  ASSERT_FALSE(dup.ok());
  EXPECT_NE(dup.status().message().find("'a' listed twice"), std::string::npos);
}

const std::string& Tiny() {
  static const std::string d = [] {
    const std::string p = testing_ck::TempDir("ep_tiny");
    EXPECT_TRUE(WritePresetCheckpoint(p, "tiny", 7).ok());
    return p;
  }();
  return d;
}

std::vector<float> RandomRows(int64_t T, int64_t H, uint32_t seed) {
  std::mt19937 rng(seed);
  std::normal_distribution<float> d(0.f, 1.f);
  std::vector<float> x(T * H);
  for (auto& v : x) v = d(rng);
  return x;
}

// The EP executor's device path (RunSlotsOnDevice) in every build, under the sanitizers too: a
// DeviceRows whose "device memory" is host memory, around a CPU runner. Buffers are refilled
// with NaN on every Buffer call, so a path that relied on what a buffer held before shows.
class HostDeviceRows : public ExpertRunner, public DeviceRows {
 public:
  HostDeviceRows(ExpertRunner* cpu, int64_t H) : cpu_(cpu), H_(H) {}
  Status RunPairs(int64_t layer, const float* rows, int64_t n, const int32_t* pairs, int64_t p,
                  float* out) override {
    return cpu_->RunPairs(layer, rows, n, pairs, p, out);
  }
  DeviceRows* device_rows() override { return this; }
  Result<float*> Buffer(int which, int64_t floats) override {
    buf_[which].assign(static_cast<size_t>(floats), std::numeric_limits<float>::quiet_NaN());
    return buf_[which].data();
  }
  Status GatherRows(const float* src, int64_t src_rows, const int32_t* idx, int64_t n,
                    float* dst) override {
    for (int64_t i = 0; i < n; ++i) {
      if (idx[i] < 0 || idx[i] >= src_rows) return InvalidArgument("gather index out of range");
      std::memcpy(dst + i * H_, src + idx[i] * H_, H_ * sizeof(float));
    }
    return Status::Ok();
  }
  Status ToHost(const void* src, void* dst, size_t bytes) override {
    if (bytes) std::memcpy(dst, src, bytes);
    to_host += bytes;
    return Status::Ok();
  }
  Status FromHost(const void* src, void* dst, size_t bytes) override {
    if (bytes) std::memcpy(dst, src, bytes);
    from_host += bytes;
    return Status::Ok();
  }
  Status RunPairsOnDevice(int64_t layer, const float* rows, int64_t n, const int32_t* pairs,
                          int64_t p, float* out) override {
    return cpu_->RunPairs(layer, rows, n, pairs, p, out);
  }
  Status Wait() override { return Status::Ok(); }

  uint64_t to_host = 0, from_host = 0;

 private:
  ExpertRunner* cpu_;
  int64_t H_;
  std::vector<float> buf_[2];
};

// k members split the experts; member r routes its own T_r rows of layer `layer`. Members whose
// bit is set in `device_members` run the device path (HostDeviceRows) and the others the host
// path: both put the same frames on the wire, so mixed groups work too.
void ExpectEpEqualsLocal(int members, int64_t layer, unsigned device_members = 0) {
  auto full = Checkpoint::Open(Tiny());
  ASSERT_TRUE(full.ok()) << full.status().ToString();
  const ModelConfig& cfg = (*full)->config();
  const int64_t H = cfg.hidden_size, k = cfg.num_experts_per_tok, E = cfg.n_routed_experts;
  const std::string prefix = "layers." + std::to_string(layer) + ".ffn.";
  auto all = BindMoe(**full, prefix, layer);
  ASSERT_TRUE(all.ok()) << all.status().ToString();
  ThreadPool pool(1);
  std::vector<const MoeWeights*> all_layers(cfg.num_hidden_layers + 1, nullptr);
  all_layers[layer] = &*all;
  LocalExpertExecutor local(cfg, all_layers, &pool);

  std::vector<int64_t> begin;
  for (int r = 0; r <= members; ++r) begin.push_back(E * r / members);
  std::vector<std::unique_ptr<Checkpoint>> ck(members);
  std::vector<MoeWeights> moe(members);
  for (int r = 0; r < members; ++r) {
    ShardSelection sel;
    for (int64_t e = begin[r]; e < begin[r + 1]; ++e) sel.experts.push_back(e);
    auto c = Checkpoint::Open(Tiny(), sel);
    ASSERT_TRUE(c.ok());
    ck[r] = std::move(c).value();
    auto m = BindMoe(*ck[r], prefix, layer);
    ASSERT_TRUE(m.ok());
    moe[r] = std::move(m).value();
  }
  CommGroup g(members);
  ASSERT_TRUE(g.comms[members - 1]);
  uint64_t remote_bytes = 0;
  g.All([&](int r) {
    ThreadPool mpool(1);
    std::vector<const MoeWeights*> layers(cfg.num_hidden_layers + 1, nullptr);
    layers[layer] = &moe[r];
    CpuExpertRunner cpu(cfg, layers, &mpool);
    HostDeviceRows dev(&cpu, H);
    const bool on_device = (device_members >> r) & 1;
    EpExpertExecutor ep(cfg, on_device ? static_cast<ExpertRunner*>(&dev) : &cpu,
                        g.comms[r].get(), begin, 5000ms, 64);
    for (uint64_t step = 1; step <= 3; ++step) {
      ep.SetStep(step);
      const int64_t T = (r + step) % 3 == 0 ? 0 : 1 + 3 * r + step;  // some members idle
      std::vector<float> x = RandomRows(T, H, 100 * r + step);
      std::vector<int32_t> tokens(T), ids(T * k);
      for (int64_t t = 0; t < T; ++t) tokens[t] = static_cast<int32_t>((t * 13 + r) % cfg.vocab_size);
      std::vector<float> w(T * k), want(T * H), got(T * H);
      ASSERT_TRUE(RouteMoe(cfg, *all, x.data(), tokens.data(), T, ids.data(), w.data(), &mpool).ok());
      ASSERT_TRUE(local.RunRouted(layer, x.data(), T, ids.data(), w.data(), want.data()).ok());
      Status st;
      if (on_device) {
        std::vector<float> slots(T * k * H);
        st = ep.RunSlotsOnDevice(layer, x.data(), T, ids.data(), slots.data());
        CombineRouted(slots.data(), w.data(), T, k, H, got.data());
      } else {
        st = ep.RunRouted(layer, x.data(), T, ids.data(), w.data(), got.data());
      }
      ASSERT_TRUE(st.ok()) << st.ToString();
      // T may be 0 (a member without rows): no memcmp of null pointers then.
      EXPECT_TRUE(want.empty() || std::memcmp(want.data(), got.data(), want.size() * 4) == 0)
          << "member " << r << " step " << step << ": EP differs from one process";
    }
    if (r == 0) remote_bytes = ep.stats().dispatch_bytes + ep.stats().combine_bytes;
    // Over TCP the device path copies exactly what it sends out of device memory and what it
    // receives in: its rows and outputs, not the pairs (host memory from the start).
    if (on_device) {
      EXPECT_GT(dev.to_host, 0u) << "member " << r;
      EXPECT_LT(dev.to_host, ep.stats().dispatch_bytes + ep.stats().combine_bytes) << "member " << r;
    } else {
      EXPECT_EQ(dev.to_host + dev.from_host, 0u);
    }
  });
  EXPECT_GT(remote_bytes, 0u) << "rank 0 never used another member's experts";
}

TEST(EpExpertExecutor, TwoMembersEqualOneProcessBitForBit) { ExpectEpEqualsLocal(2, 3); }
TEST(EpExpertExecutor, ThreeMembersEqualOneProcessBitForBit) { ExpectEpEqualsLocal(3, 4); }
TEST(EpExpertExecutor, HashRoutedLayerToo) { ExpectEpEqualsLocal(3, 0); }
TEST(EpExpertExecutor, DevicePathEqualsOneProcessBitForBit) { ExpectEpEqualsLocal(3, 4, 0b111); }
TEST(EpExpertExecutor, DeviceAndHostMembersMixInOneGroup) { ExpectEpEqualsLocal(3, 3, 0b101); }

// What a peer sends is checked before it is used: pairs naming another member's expert or a row
// it did not send, a pairs frame of the wrong shape, more pairs than a step's rows x k, more rows
// than pairs (on the device path already by the room its pairs made) are errors naming the peer,
// on both paths; the member then runs its next step as usual.
TEST(EpExpertExecutor, MalformedDispatchFromAPeerIsAnErrorNamingIt) {
  auto full = Checkpoint::Open(Tiny());
  ASSERT_TRUE(full.ok()) << full.status().ToString();
  const ModelConfig& cfg = (*full)->config();
  const int64_t H = cfg.hidden_size, E = cfg.n_routed_experts, layer = 3;
  const std::vector<int64_t> begin = {0, E / 2, E};
  ShardSelection sel;
  for (int64_t e = 0; e < E / 2; ++e) sel.experts.push_back(e);
  auto ck = Checkpoint::Open(Tiny(), sel);
  ASSERT_TRUE(ck.ok());
  auto moe = BindMoe(**ck, "layers." + std::to_string(layer) + ".ffn.", layer);
  ASSERT_TRUE(moe.ok()) << moe.status().ToString();
  ThreadPool pool(1);
  std::vector<const MoeWeights*> layers(cfg.num_hidden_layers + 1, nullptr);
  layers[layer] = &*moe;
  CpuExpertRunner cpu(cfg, layers, &pool);
  HostDeviceRows dev(&cpu, H);
  struct Case {
    std::vector<int32_t> pairs;   // [p, 2] as sent (shape {p, pair_width})
    uint32_t pair_width;
    int64_t rows;
    int only;   // 0: both paths, 1: the host path only, 2: the device path only
    std::string want;
  };
  const int64_t k = cfg.num_experts_per_tok, too_many = 4 * k + 1;   // max_rows 4 below
  std::vector<int32_t> many;
  for (int64_t i = 0; i < too_many; ++i) many.insert(many.end(), {0, 0});
  const std::vector<Case> cases = {
      {{0, static_cast<int32_t>(E - 1)}, 2, 1, 0,
       "pair 0 from rank 1 (m1): row 0, expert " + std::to_string(E - 1) + " is not this member's"},
      {{5, 0}, 2, 1, 0, "pair 0 from rank 1 (m1): row 5, expert 0"},
      {{0, 0, 1}, 3, 1, 0, "malformed dispatch pairs from rank 1 (m1)"},
      {many, 2, 1, 0, "rank 1 (m1) sends " + std::to_string(too_many) +
                          " pairs, more than a step's rows x k (" + std::to_string(4 * k) + ")"},
      {{0, 0}, 2, 3, 1, "rank 1 (m1) sends 3 rows for 1 pairs"},
      {{0, 0}, 2, 3, 2, "a payload of " + std::to_string(3 * H * 4) + " bytes for a buffer of " +
                            std::to_string(H * 4)},
  };
  uint64_t step = 0;
  for (const bool on_device : {false, true}) {
    CommGroup g(2);
    ASSERT_TRUE(g.comms[1]);
    EpExpertExecutor ep(cfg, on_device ? static_cast<ExpertRunner*>(&dev) : &cpu,
                        g.comms[0].get(), begin, 3000ms, 4);
    for (const Case& c : cases) {
      if (c.only == (on_device ? 1 : 2)) continue;
      ++step;
      Status got;
      std::thread member([&] {
        ep.SetStep(step);
        got = on_device ? ep.RunSlotsOnDevice(layer, nullptr, 0, nullptr, nullptr)
                        : ep.RunSlots(layer, nullptr, 0, nullptr, nullptr);
      });
      // The peer: its pairs, then its rows, with the executor's tags (layer * 4 + part).
      const uint32_t p = static_cast<uint32_t>(c.pairs.size() / c.pair_width);
      std::vector<net::CommBuffer> send(2);
      send[0] = {net::FrameDType::kI32, {p, c.pair_width}, c.pairs.data(), c.pairs.size() * 4};
      auto in = g.comms[1]->AllToAllV(net::FrameKind::kEpDispatch, step, layer * 4 + 0, send, 3000ms);
      EXPECT_TRUE(in.ok()) << in.status().ToString();
      const std::vector<float> rows = RandomRows(c.rows, H, 3);
      send[0] = {net::FrameDType::kF32, {static_cast<uint32_t>(c.rows), static_cast<uint32_t>(H)},
                 rows.data(), rows.size() * 4};
      // Malformed or too many pairs end the step before the rows.
      if (c.pair_width == 2 && static_cast<int64_t>(p) <= 4 * k) {
        EXPECT_TRUE(g.comms[1]->AllToAllV(net::FrameKind::kEpDispatch, step, layer * 4 + 1, send,
                                          3000ms).ok());
      }
      member.join();
      EXPECT_EQ(got.code(), Code::kInvalidArgument) << got.ToString();
      EXPECT_NE(got.message().find(c.want), std::string::npos)
          << (on_device ? "device" : "host") << ": " << got.ToString();
    }
  }
}

// Data-parallel attention makes members wait for each other (one's long prefill): an exchange
// waits until the step's deadline, not the executor's fixed timeout (here 200 ms); without a
// deadline the timeout still bounds it.
TEST(EpExpertExecutor, AnExchangeWaitsUntilTheStepsDeadline) {
  auto full = Checkpoint::Open(Tiny());
  ASSERT_TRUE(full.ok()) << full.status().ToString();
  const ModelConfig& cfg = (*full)->config();
  const std::vector<int64_t> begin = {0, cfg.n_routed_experts / 2, cfg.n_routed_experts};
  for (const bool with_deadline : {true, false}) {
    CommGroup g(2);
    ASSERT_TRUE(g.comms[1]);
    EpExpertExecutor ep(cfg, nullptr, g.comms[0].get(), begin, 200ms, 4);
    if (with_deadline) ep.SetStep(1, std::chrono::steady_clock::now() + 10s);
    else ep.SetStep(1);
    Result<int64_t> rounds = Internal("not run");
    std::atomic<bool> waiting{false};
    std::thread member([&] {
      waiting = true;
      rounds = ep.AgreeRounds(1);
    });
    if (with_deadline) {   // the peer comes 600 ms after the member started waiting
      while (!waiting) std::this_thread::yield();
      std::this_thread::sleep_for(600ms);
      std::vector<net::CommBuffer> send(2);
      const int32_t three = 3;
      send[0] = {net::FrameDType::kI32, {1}, &three, sizeof three};
      (void)g.comms[1]->AllToAllV(net::FrameKind::kControl, 1, 0xFFFFFFFEu, send, 2000ms);
    }   // else the peer never comes: the timeout ends the wait
    member.join();
    if (with_deadline) {
      ASSERT_TRUE(rounds.ok()) << rounds.status().ToString();
      EXPECT_EQ(*rounds, 3);   // the busiest member's rounds
    } else {
      EXPECT_EQ(rounds.status().code(), Code::kDeadlineExceeded) << rounds.status().ToString();
    }
  }
}

}  // namespace
}  // namespace fm
