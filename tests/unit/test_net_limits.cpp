// Data-plane limits against a hostile peer (issue 17): a length over the plan's maximum, a
// header or payload that trickles, unknown names, a name from the wrong address, a flood of
// unread frames. Each drops that connection at once, memory stays bounded, and a good peer on
// the same transport is never disturbed.
#include <string>
#include <vector>

#include <gtest/gtest.h>

#include "tests/unit/test_net_util.h"

namespace fm::net {
namespace {

std::unique_ptr<Transport> MakeListener(const std::string& name, Millis frame_timeout) {
  TransportOptions o;
  o.self_name = name;
  o.secret = "k";
  o.frame_timeout = frame_timeout;
  auto t = MakeTcpTransport(o);
  EXPECT_TRUE(t.ok()) << t.status().ToString();
  EXPECT_TRUE((*t)->Listen("127.0.0.1:0").ok());
  return std::move(*t);
}

// The reason the transport gives for the last close of `peer`'s connection.
std::string CloseReason(Transport& t, const std::string& peer) {
  auto r = t.Recv(peer, 2000ms);
  EXPECT_FALSE(r.ok());
  return r.status().message();
}

// After an attack: a good peer still connects and its frame arrives.
void ExpectGoodPeerServed(Transport& a) {
  auto good = MakeNode("good", "k", false);
  ASSERT_TRUE(good->Connect("a", a.listen_address(), 2000ms).ok());
  ASSERT_TRUE(SendFloats(*good, "a", {5.f, 6.f}, {2}, 99).ok());
  auto f = a.Recv("good", 2000ms);
  ASSERT_TRUE(f.ok()) << f.status().ToString();
  EXPECT_EQ(f->header.step_id, 99u);
}

TEST(DataPlaneLimits, LengthOverThePlanMaximumDropsBeforeAllocating) {
  auto a = MakeListener("a", 2000ms);
  a->SetLimits(/*max_payload=*/4096, /*max_queued_bytes=*/16384);
  asio::io_context io;
  tcp::socket evil(io);
  evil.connect(EndpointOf(a->listen_address()));
  RawHandshake(evil, "evil", "a", "k");
  if (HasFatalFailure()) return;
  asio::write(evil, asio::buffer(HeaderClaiming(uint64_t{1} << 30)));
  EXPECT_TRUE(ClosedByServer(evil, 1000ms));
  EXPECT_NE(CloseReason(*a, "evil").find("exceeds the limit of 4096"), std::string::npos);
  EXPECT_EQ(a->stats().connections_dropped, 1u);
  ExpectGoodPeerServed(*a);
}

TEST(DataPlaneLimits, ClaimedGigabytesHoldOnlyTheBytesSentAndTimeOut) {
  // Default 1 GiB limit: three connections each claim just under it, send 1 MiB and stall.
  auto a = MakeListener("a", 700ms);
  ASSERT_TRUE(ResetPeakResident()) << "cannot write /proc/self/clear_refs";
  const uint64_t before = PeakResidentBytes();
  asio::io_context io;
  std::vector<tcp::socket> evil;
  for (int i = 0; i < 3; ++i) {
    evil.emplace_back(io);
    evil.back().connect(EndpointOf(a->listen_address()));
    RawHandshake(evil.back(), "evil" + std::to_string(i), "a", "k");
    if (HasFatalFailure()) return;
    asio::write(evil.back(), asio::buffer(HeaderClaiming(kDefaultMaxFramePayload - 1)));
    asio::write(evil.back(), asio::buffer(std::vector<uint8_t>(1 << 20, 7)));
  }
  std::this_thread::sleep_for(300ms);
  EXPECT_LT(PeakResidentBytes(), before + (uint64_t{64} << 20)) << "3 claims of 1 GiB were allocated";
  for (auto& s : evil) EXPECT_TRUE(ClosedByServer(s, 2000ms));
  const std::string reason = CloseReason(*a, "evil0");
  EXPECT_NE(reason.find("payload stalled"), std::string::npos) << reason;
  EXPECT_TRUE(Eventually([&] { return a->stats().connections_dropped == 3; }));
  ExpectGoodPeerServed(*a);
}

TEST(DataPlaneLimits, SlowLorisHeaderIsDroppedAtTheFrameTimeout) {
  auto a = MakeListener("a", 300ms);
  asio::io_context io;
  tcp::socket evil(io);
  evil.connect(EndpointOf(a->listen_address()));
  RawHandshake(evil, "evil", "a", "k");
  if (HasFatalFailure()) return;
  const auto t0 = Clock::now();
  asio::write(evil, asio::buffer(HeaderClaiming(16).data(), 10));  // 10 of 64 header bytes
  EXPECT_TRUE(ClosedByServer(evil, 2000ms));
  EXPECT_LT(Clock::now() - t0, 1500ms);
  EXPECT_NE(CloseReason(*a, "evil").find("frame header not complete within 300 ms"),
            std::string::npos);
  ExpectGoodPeerServed(*a);
}

TEST(DataPlaneLimits, IdleConnectionBetweenFramesIsKept) {
  auto a = MakeListener("a", 200ms);
  auto b = MakeNode("b", "k", false);
  ASSERT_TRUE(b->Connect("a", a->listen_address(), 2000ms).ok());
  std::this_thread::sleep_for(600ms);   // three frame timeouts without a byte
  ASSERT_TRUE(SendFloats(*b, "a", {1.f}, {1}, 4).ok());
  auto f = a->Recv("b", 2000ms);
  ASSERT_TRUE(f.ok()) << f.status().ToString();
  EXPECT_EQ(f->header.step_id, 4u);
}

// A flood of connections that never say hello holds at most 64 descriptors (each until its
// handshake times out): the 65th and later are closed at once; once the flood goes, a good
// peer connects as before.
TEST(DataPlaneLimits, AtMost64ConnectionsWaitInTheHandshake) {
  auto a = MakeListener("a", 2000ms);
  asio::io_context io;
  std::vector<tcp::socket> idle;
  for (int i = 0; i < 70; ++i) {
    idle.emplace_back(io);
    idle.back().connect(EndpointOf(a->listen_address()));
  }
  EXPECT_TRUE(Eventually([&] { return a->stats().connections_rejected == 6; }))
      << a->stats().connections_rejected;
  EXPECT_TRUE(ClosedByServer(idle.back(), 1000ms));
  for (auto& s : idle) s.close();
  ExpectGoodPeerServed(*a);
}

TEST(DataPlaneLimits, UnknownPeerNameIsRefusedInTheHandshake) {
  auto a = MakeListener("a", 2000ms);
  ASSERT_TRUE(a->SetAllowedPeers({{"b", ""}, {"good", "127.0.0.1"}}).ok());
  auto stranger = MakeNode("stranger", "k", false);
  Status s = stranger->Connect("a", a->listen_address(), 2000ms);
  EXPECT_EQ(s.code(), Code::kUnauthenticated) << s.ToString();
  EXPECT_TRUE(Eventually([&] { return a->stats().connections_rejected == 1; }));
  EXPECT_TRUE(a->ConnectedPeers().empty());
  EXPECT_EQ(a->Recv("stranger", 100ms).status().code(), Code::kDeadlineExceeded);  // nothing kept
  auto b = MakeNode("b", "k", false);
  EXPECT_TRUE(b->Connect("a", a->listen_address(), 2000ms).ok());
  ExpectGoodPeerServed(*a);
  // Dropping a peer from the list closes its connection.
  ASSERT_TRUE(a->SetAllowedPeers({{"good", ""}}).ok());
  EXPECT_TRUE(Eventually([&] { return !a->IsConnected("b"); }));
  EXPECT_EQ(b->Connect("a", a->listen_address(), 2000ms).code(), Code::kUnauthenticated);
}

TEST(DataPlaneLimits, PeerNameIsBoundToItsAddressInThePlan) {
  auto a = MakeListener("a", 2000ms);
  ASSERT_TRUE(a->SetAllowedPeers({{"b", "127.0.0.2"}}).ok());
  auto impostor = MakeNode("b", "k", false);   // dials from 127.0.0.1
  Status s = impostor->Connect("a", a->listen_address(), 2000ms);
  EXPECT_EQ(s.code(), Code::kUnauthenticated) << s.ToString();
  // The real "b" connects from 127.0.0.2.
  asio::io_context io;
  tcp::socket real(io);
  real.open(tcp::v4());
  real.bind(tcp::endpoint(asio::ip::make_address("127.0.0.2"), 0));
  real.connect(EndpointOf(a->listen_address()));
  RawHandshake(real, "b", "a", "k");
  if (HasFatalFailure()) return;
  EXPECT_TRUE(Eventually([&] { return a->IsConnected("b"); }));
}

// A transport that listens on a given address dials from it too: the kernel would pick
// 127.0.0.1 (or an interface's first address), which the peer refuses as not b's.
TEST(DataPlaneLimits, APeerListeningOnItsPlanAddressDialsFromIt) {
  auto a = MakeListener("a", 2000ms);
  ASSERT_TRUE(a->SetAllowedPeers({{"b", "127.0.0.2"}}).ok());
  auto b = MakeNode("b", "k", false);
  ASSERT_TRUE(b->Listen("127.0.0.2:0").ok());
  const Status s = b->Connect("a", a->listen_address(), 2000ms);
  EXPECT_TRUE(s.ok()) << s.ToString();
  EXPECT_TRUE(Eventually([&] { return a->IsConnected("b"); }));
}

// A peer's host that does not resolve when the plan comes (a pod not scheduled yet) is no
// error then: it is resolved when that peer connects, and refused naming the host while it
// still does not resolve.
TEST(DataPlaneLimits, APeerHostIsResolvedWhenThePeerConnects) {
  auto a = MakeListener("a", 2000ms);
  ASSERT_TRUE(a->SetAllowedPeers({{"x", "no-such-host.invalid"}}).ok());
  auto x = MakeNode("x", "k", false);
  EXPECT_EQ(x->Connect("a", a->listen_address(), 2000ms).code(), Code::kUnauthenticated);
  EXPECT_TRUE(Eventually([&] { return a->stats().connections_rejected == 1; }));
  EXPECT_FALSE(a->IsConnected("x"));
}

TEST(DataPlaneLimits, UnreadFramesAreBoundedPerPeer) {
  auto a = MakeListener("a", 2000ms);
  a->SetLimits(/*max_payload=*/64 << 10, /*max_queued_bytes=*/128 << 10);
  auto b = MakeNode("b", "k", false);
  ASSERT_TRUE(b->Connect("a", a->listen_address(), 2000ms).ok());
  const std::vector<float> v(15 << 10, 1.f);   // 60 KiB
  for (uint64_t step = 1; step <= 3; ++step) (void)SendFloats(*b, "a", v, {15 << 10}, step);
  EXPECT_TRUE(Eventually([&] { return a->stats().connections_dropped == 1; }));
  for (uint64_t step = 1; step <= 2; ++step) {   // the two that fitted stay readable
    auto f = a->Recv("b", 1000ms);
    ASSERT_TRUE(f.ok()) << f.status().ToString();
    EXPECT_EQ(f->header.step_id, step);
  }
  EXPECT_NE(CloseReason(*a, "b").find("over the limit of 131072"), std::string::npos);
  ExpectGoodPeerServed(*a);
}

// Empty frames count too (each holds ~100 bytes of memory unread): 2M of them used to grow the
// process by ~180 MB without a drop. At 128 bytes a frame, 16 KiB holds 128 of them.
TEST(DataPlaneLimits, AFloodOfEmptyFramesIsBoundedToo) {
  auto a = MakeListener("a", 2000ms);
  a->SetLimits(/*max_payload=*/64 << 10, /*max_queued_bytes=*/16 << 10);
  auto b = MakeNode("b", "k", false);
  ASSERT_TRUE(b->Connect("a", a->listen_address(), 2000ms).ok());
  for (uint64_t step = 1; step <= 200; ++step) (void)SendFloats(*b, "a", {}, {0}, step);
  EXPECT_TRUE(Eventually([&] { return a->stats().connections_dropped == 1; }));
  for (uint64_t step = 1; step <= 128; ++step) {   // those that fitted stay readable
    auto f = a->Recv("b", 1000ms);
    ASSERT_TRUE(f.ok()) << step << ": " << f.status().ToString();
    EXPECT_EQ(f->header.step_id, step);
  }
  EXPECT_NE(CloseReason(*a, "b").find("over the limit of 16384"), std::string::npos);
}

}  // namespace
}  // namespace fm::net
