// Data plane: CRC32C vectors, frame codec (round trips, every invalid field), handshake, and the
// TCP transport on 127.0.0.1 with ephemeral ports.
#include <cmath>
#include <cstring>
#include <string>
#include <thread>
#include <vector>

#include <gtest/gtest.h>

#include "common/numfmt.h"
#include "common/crc32c.h"
#include "tests/unit/test_net_util.h"

namespace fm::net {
namespace {

// ---- CRC32C ------------------------------------------------------------------------------

TEST(Crc32c, StandardVectors) {
  EXPECT_EQ(Crc32c("123456789", 9), 0xE3069283u);
  EXPECT_EQ(Crc32c("", 0), 0u);
  const std::vector<uint8_t> zeros(32, 0x00), ones(32, 0xFF);  // RFC 3720 B.4
  EXPECT_EQ(Crc32c(zeros.data(), zeros.size()), 0x8A9136AAu);
  EXPECT_EQ(Crc32c(ones.data(), ones.size()), 0x62A8AB43u);
}

TEST(Crc32c, ChainingEqualsOneShotAtEveryLength) {
  std::vector<uint8_t> data(300);
  for (size_t i = 0; i < data.size(); ++i) data[i] = static_cast<uint8_t>(i * 7 + 3);
  for (size_t cut = 0; cut <= data.size(); cut += 13)
    EXPECT_EQ(Crc32c(data.data() + cut, data.size() - cut, Crc32c(data.data(), cut)),
              Crc32c(data.data(), data.size()))
        << "cut " << cut;
}

// ---- frames ------------------------------------------------------------------------------

TEST(Frame, F32RoundTripIsBitExact) {
  const auto v = TestValues(2 * 4 * 16);
  const auto bytes = GoodFrame(v, {2, 4, 16});
  ASSERT_EQ(bytes.size(), kFrameHeaderSize + v.size() * 4);
  EXPECT_EQ(std::memcmp(bytes.data(), "FMSH", 4), 0);
  auto f = DecodeFrame(bytes.data(), bytes.size());
  ASSERT_TRUE(f.ok()) << f.status().ToString();
  EXPECT_EQ(f->header.kind, FrameKind::kActivation);
  EXPECT_EQ(f->header.step_id, 0x0102030405060708ull);
  EXPECT_EQ(f->header.micro_batch, 3u);
  EXPECT_EQ(f->header.tag, 17u);
  EXPECT_EQ(f->header.shape(), (std::vector<uint32_t>{2, 4, 16}));
  ASSERT_EQ(f->payload.size(), v.size() * 4);
  EXPECT_EQ(std::memcmp(f->payload.data(), v.data(), v.size() * 4), 0);
  auto back = FramePayloadAsF32(*f);
  ASSERT_TRUE(back.ok());
  EXPECT_EQ(std::memcmp(back->data(), v.data(), v.size() * 4), 0);
}

TEST(Frame, HeaderBytesAreLittleEndianAtDocumentedOffsets) {
  const std::vector<float> v(6, 1.f);
  const auto b = GoodFrame(v, {2, 3});
  EXPECT_EQ(b[4], 1);  // version
  EXPECT_EQ(b[5], 0);
  EXPECT_EQ(b[6], 1);  // ACTIVATION
  EXPECT_EQ(b[7], 1);  // f32
  EXPECT_EQ(b[8], 0x08);  // step id, low byte first
  EXPECT_EQ(b[15], 0x01);
  EXPECT_EQ(b[16], 3);   // micro-batch
  EXPECT_EQ(b[20], 17);  // tag
  EXPECT_EQ(b[24], 2);   // rank
  EXPECT_EQ(b[28], 2);   // dims[0]
  EXPECT_EQ(b[32], 3);   // dims[1]
  EXPECT_EQ(b[44], 24);  // payload length
  const uint32_t crc = Crc32c(v.data(), 24);
  EXPECT_EQ(b[52] | b[53] << 8 | b[54] << 16 | static_cast<uint32_t>(b[55]) << 24, crc);
}

TEST(Frame, Bf16RoundTripRoundsToNearestEven) {
  // 1 + 2^-8 is halfway between bf16 1.0 and 1.0078125: ties to the even mantissa (1.0);
  // 1 + 3*2^-8 is halfway between 1.0078125 and 1.015625: ties to 1.015625.
  const std::vector<float> v = {1.00390625f, 1.01171875f, -2.5f, 3.14159265f};
  std::vector<uint16_t> b16(v.size());
  F32ToBf16Payload(v.data(), v.size(), b16.data());
  EXPECT_EQ(b16[0], 0x3F80);
  EXPECT_EQ(b16[1], 0x3F82);
  auto bytes = EncodeFrame(ActivationHeader({4}, FrameDType::kBF16), b16.data(), 8);
  ASSERT_TRUE(bytes.ok());
  auto f = DecodeFrame(bytes->data(), bytes->size());
  ASSERT_TRUE(f.ok()) << f.status().ToString();
  auto back = FramePayloadAsF32(*f);
  ASSERT_TRUE(back.ok());
  std::vector<float> expect(v.size());
  Bf16ToF32Payload(b16.data(), b16.size(), expect.data());
  EXPECT_EQ(*back, expect);
  EXPECT_EQ((*back)[0], 1.0f);
  EXPECT_EQ((*back)[2], -2.5f);
  EXPECT_NEAR((*back)[3], 3.14159265f, 3.14159265f / 128);
}

TEST(Frame, PayloadAsF32RefusesIntegerFrames) {
  const std::vector<int32_t> ids = {1, 2, 3};
  FrameHeader h = ActivationHeader({3}, FrameDType::kI32);
  h.kind = FrameKind::kTokens;
  auto bytes = EncodeFrame(h, ids.data(), 12);
  ASSERT_TRUE(bytes.ok());
  auto f = DecodeFrame(bytes->data(), bytes->size());
  ASSERT_TRUE(f.ok());
  auto r = FramePayloadAsF32(*f);
  ASSERT_FALSE(r.ok());
  EXPECT_NE(r.status().message().find("i32"), std::string::npos);
}

// Decodes `bytes` and expects an error whose message contains `field`.
void ExpectRejected(const std::vector<uint8_t>& bytes, const std::string& field,
                    uint64_t max_payload = kDefaultMaxFramePayload) {
  auto f = DecodeFrame(bytes.data(), bytes.size(), max_payload);
  ASSERT_FALSE(f.ok()) << "accepted a frame with a bad " << field;
  EXPECT_EQ(f.status().code(), Code::kInvalidArgument);
  EXPECT_NE(f.status().message().find(field), std::string::npos)
      << "message '" << f.status().message() << "' does not name " << field;
}

TEST(Frame, EveryInvalidHeaderFieldIsRejectedByName) {
  const std::vector<float> v(8, 0.5f);
  const auto good = GoodFrame(v, {2, 4});
  auto mutate = [&](size_t off, uint8_t value) {
    auto b = good;
    b[off] = value;
    return b;
  };
  ExpectRejected(mutate(0, 'X'), "magic");
  ExpectRejected(mutate(3, 'h'), "magic");
  ExpectRejected(mutate(4, 2), "version");
  ExpectRejected(mutate(5, 1), "version");
  ExpectRejected(mutate(6, 0), "kind");
  ExpectRejected(mutate(6, 7), "kind");
  ExpectRejected(mutate(7, 0), "dtype");
  ExpectRejected(mutate(7, 5), "dtype");
  ExpectRejected(mutate(24, 0), "rank");
  ExpectRejected(mutate(24, 5), "rank");
  ExpectRejected(mutate(36, 1), "dims[2]");   // a dim beyond rank 2
  ExpectRejected(mutate(40, 9), "dims[3]");
  for (size_t off : {25, 26, 27, 56, 59}) ExpectRejected(mutate(off, 1), "reserved");
  ExpectRejected(mutate(28, 3), "payload_length");  // dims 3x4 f32 = 48 != 32
  ExpectRejected(mutate(44, 31), "payload_length");
  ExpectRejected(mutate(51, 0x80), "payload_length");  // absurd length
  ExpectRejected(good, "payload_length", /*max_payload=*/16);
  // Fields that stay self-consistent are caught by the header CRC.
  ExpectRejected(mutate(8, 0x09), "header_crc");
  ExpectRejected(mutate(16, 4), "header_crc");
  ExpectRejected(mutate(61, good[61] ^ 1), "header_crc");
  // Payload corruption.
  ExpectRejected(mutate(kFrameHeaderSize + 5, good[kFrameHeaderSize + 5] ^ 0x10), "payload_crc");
  ExpectRejected(mutate(52, good[52] ^ 1), "header_crc");  // the payload CRC field itself
}

TEST(Frame, HugeDimsDoNotOverflow) {
  std::vector<uint8_t> b = GoodFrame(std::vector<float>(8, 1.f), {2, 4});
  b[24] = 4;
  std::memset(b.data() + 28, 0xFF, 16);
  ExpectRejected(b, "dims");
}

TEST(Frame, TruncatedAndTrailingBytesAreRejected) {
  const auto good = GoodFrame(std::vector<float>(8, 2.f), {8});
  for (size_t n = 0; n < kFrameHeaderSize; ++n) {
    auto f = DecodeFrame(good.data(), n);
    ASSERT_FALSE(f.ok());
    EXPECT_NE(f.status().message().find("truncated"), std::string::npos) << n;
  }
  for (size_t n = kFrameHeaderSize; n < good.size(); ++n) {
    auto f = DecodeFrame(good.data(), n);
    ASSERT_FALSE(f.ok());
    EXPECT_NE(f.status().message().find("truncated"), std::string::npos) << n;
  }
  auto longer = good;
  longer.push_back(0);
  ExpectRejected(longer, "trailing");
}

TEST(Frame, EncoderRefusesInconsistentHeaders) {
  const std::vector<float> v(8, 1.f);
  FrameHeader h = ActivationHeader({2, 4});
  EXPECT_FALSE(EncodeFrame(h, v.data(), 28).ok());  // 7 floats for a [2,4] shape
  h.rank = 5;
  auto r = EncodeFrame(h, v.data(), 32);
  ASSERT_FALSE(r.ok());
  EXPECT_NE(r.status().message().find("rank"), std::string::npos);
  FrameHeader empty = ActivationHeader({0}, FrameDType::kU8);
  empty.kind = FrameKind::kControl;
  auto e = EncodeFrame(empty, nullptr, 0);
  ASSERT_TRUE(e.ok());
  auto d = DecodeFrame(e->data(), e->size());
  ASSERT_TRUE(d.ok()) << d.status().ToString();
  EXPECT_TRUE(d->payload.empty());
}

// ---- handshake ---------------------------------------------------------------------------

TEST(Handshake, MacDependsOnEveryInput) {
  Nonce a{}, b{};
  b[0] = 1;
  const Mac base = HandshakeMac("s", HandshakeRole::kDialer, a, b, "x", "y");
  EXPECT_TRUE(MacEqual(base, HandshakeMac("s", HandshakeRole::kDialer, a, b, "x", "y")));
  EXPECT_FALSE(MacEqual(base, HandshakeMac("t", HandshakeRole::kDialer, a, b, "x", "y")));
  EXPECT_FALSE(MacEqual(base, HandshakeMac("s", HandshakeRole::kAcceptor, a, b, "x", "y")));
  EXPECT_FALSE(MacEqual(base, HandshakeMac("s", HandshakeRole::kDialer, b, a, "x", "y")));
  EXPECT_FALSE(MacEqual(base, HandshakeMac("s", HandshakeRole::kDialer, a, b, "xy", "")));
  EXPECT_FALSE(MacEqual(base, HandshakeMac("", HandshakeRole::kDialer, a, b, "x", "y")));
}

TEST(Handshake, HelloRoundTripAndBadNames) {
  Hello h{"worker-1", {}};
  h.nonce[31] = 0xAB;
  auto bytes = EncodeHello(h);
  Nonce n{};
  auto len = DecodeHelloFixed(bytes.data(), bytes.size(), &n);
  ASSERT_TRUE(len.ok());
  EXPECT_EQ(*len, 8u);
  EXPECT_EQ(n[31], 0xAB);
  auto name = DecodeHelloName(bytes.data() + kHelloFixedSize, *len);
  ASSERT_TRUE(name.ok());
  EXPECT_EQ(*name, "worker-1");
  EXPECT_FALSE(ValidatePeerName("").ok());
  EXPECT_FALSE(ValidatePeerName("has space").ok());
  EXPECT_FALSE(ValidatePeerName(std::string(256, 'a')).ok());
  bytes[0] = 'G';
  EXPECT_FALSE(DecodeHelloFixed(bytes.data(), bytes.size(), &n).ok());
}

// ---- TCP transport -----------------------------------------------------------------------

TEST(TcpTransport, OneMegabyteActivationRoundTrip) {
  auto a = MakeNode("a", "s3cret");
  auto b = MakeNode("b", "s3cret", /*listen=*/false);
  ASSERT_TRUE(b->Connect("a", a->listen_address(), 2000ms).ok());
  const auto v = TestValues(64 * 4 * 1024);  // 1 MiB of f32
  ASSERT_TRUE(SendFloats(*b, "a", v, {64, 4, 1024}, 7).ok());
  auto f = a->Recv("b", 2000ms);
  ASSERT_TRUE(f.ok()) << f.status().ToString();
  EXPECT_EQ(f->header.step_id, 7u);
  ASSERT_EQ(f->payload.size(), v.size() * 4);
  EXPECT_EQ(std::memcmp(f->payload.data(), v.data(), f->payload.size()), 0);
  // The connection is symmetric: the acceptor answers on it.
  ASSERT_TRUE(a->IsConnected("b"));
  ASSERT_TRUE(SendFloats(*a, "b", {1.f, 2.f}, {2}, 8).ok());
  auto back = b->Recv("a", 2000ms);
  ASSERT_TRUE(back.ok()) << back.status().ToString();
  EXPECT_EQ(back->header.step_id, 8u);
  EXPECT_EQ(a->stats().frames_received, 1u);
  EXPECT_EQ(a->stats().bytes_received, kFrameHeaderSize + v.size() * 4 + kFrameTagSize);
}

TEST(TcpTransport, WaitForPeerSeesTheDialerOrTimesOut) {
  auto a = MakeNode("a", "k");
  const auto t0 = Clock::now();
  Status late = a->WaitForPeer("b", 200ms);
  EXPECT_EQ(late.code(), Code::kDeadlineExceeded);
  EXPECT_NE(late.message().find("'b'"), std::string::npos);
  EXPECT_LT(Clock::now() - t0, 700ms);
  auto b = MakeNode("b", "k", false);
  std::thread dial([&] { EXPECT_TRUE(b->Connect("a", a->listen_address(), 2000ms).ok()); });
  EXPECT_TRUE(a->WaitForPeer("b", 2000ms).ok());
  dial.join();
  EXPECT_TRUE(SendFloats(*a, "b", {1.f}, {1}, 3).ok());  // the acceptor can send first
  auto f = b->Recv("a", 2000ms);
  ASSERT_TRUE(f.ok()) << f.status().ToString();
  EXPECT_EQ(f->header.step_id, 3u);
}

TEST(TcpTransport, FramesFromOnePeerArriveInOrder) {
  auto a = MakeNode("a", "");  // empty secret on both sides: no authentication
  auto b = MakeNode("b", "", false);
  ASSERT_TRUE(b->Connect("a", a->listen_address(), 2000ms).ok());
  for (uint64_t i = 0; i < 200; ++i)
    ASSERT_TRUE(SendFloats(*b, "a", {static_cast<float>(i)}, {1}, i).ok());
  for (uint64_t i = 0; i < 200; ++i) {
    auto f = a->Recv("b", 2000ms);
    ASSERT_TRUE(f.ok()) << f.status().ToString();
    EXPECT_EQ(f->header.step_id, i);
  }
}

TEST(TcpTransport, WrongSecretIsRejectedOnBothSides) {
  auto a = MakeNode("a", "right");
  auto b = MakeNode("b", "wrong", false);
  Status s = b->Connect("a", a->listen_address(), 2000ms);
  EXPECT_EQ(s.code(), Code::kUnauthenticated) << s.ToString();
  EXPECT_NE(s.message().find("'a'"), std::string::npos) << s.message();
  EXPECT_TRUE(Eventually([&] { return a->stats().connections_rejected == 1; }));
  EXPECT_TRUE(a->ConnectedPeers().empty());
  EXPECT_FALSE(b->IsConnected("a"));
  // A missing secret on one side is a mismatch too.
  auto c = MakeNode("c", "", false);
  EXPECT_EQ(c->Connect("a", a->listen_address(), 2000ms).code(), Code::kUnauthenticated);
}

TEST(TcpTransport, PeerMustPresentTheDialedName) {
  auto a = MakeNode("a", "k");
  auto b = MakeNode("b", "k", false);
  Status s = b->Connect("not-a", a->listen_address(), 2000ms);
  EXPECT_EQ(s.code(), Code::kUnauthenticated);
  EXPECT_NE(s.message().find("presents itself as 'a'"), std::string::npos) << s.message();
}

TEST(TcpTransport, ConnectToClosedPortIsUnavailable) {
  std::string dead_addr;
  {
    auto dead = MakeNode("dead", "k");
    dead_addr = dead->listen_address();
  }
  auto b = MakeNode("b", "k", false);
  Status s = b->Connect("dead", dead_addr, 2000ms);
  EXPECT_EQ(s.code(), Code::kUnavailable) << s.ToString();
  EXPECT_NE(s.message().find("'dead'"), std::string::npos);
  EXPECT_EQ(b->Send("dead", ActivationHeader({1}), "abcd", 4, 100ms).code(), Code::kUnavailable);
}

TEST(TcpTransport, GarbagePeersAreDroppedWhileAGoodPeerKeepsWorking) {
  auto a = MakeNode("a", "k");
  auto good = MakeNode("good", "k", false);
  ASSERT_TRUE(good->Connect("a", a->listen_address(), 2000ms).ok());
  asio::io_context io;

  // 1. Not a flashmesh peer at all.
  tcp::socket junk(io);
  junk.connect(EndpointOf(a->listen_address()));
  const std::string http = "GET / HTTP/1.1\r\nHost: x\r\n\r\n" + std::string(64, 'z');
  asio::write(junk, asio::buffer(http));
  EXPECT_TRUE(ClosedByServer(junk, 2000ms));

  // 2. An authenticated peer that then sends a corrupt frame.
  tcp::socket evil(io);
  evil.connect(EndpointOf(a->listen_address()));
  RawSession session;
  RawHandshake(evil, "evil", "a", "k", &session);
  if (HasFatalFailure()) return;
  ASSERT_TRUE(Eventually([&] { return a->IsConnected("evil"); }));
  auto bytes = GoodFrame({1.f, 2.f, 3.f, 4.f}, {4});
  WriteFrame(evil, session, bytes);  // one valid frame first
  bytes[kFrameHeaderSize] ^= 0xFF;   // a corrupt payload under a valid tag: the CRC catches it
  WriteFrame(evil, session, bytes);
  EXPECT_TRUE(ClosedByServer(evil, 2000ms));
  auto first = a->Recv("evil", 1000ms);
  ASSERT_TRUE(first.ok()) << first.status().ToString();  // queued before the bad one
  auto gone = a->Recv("evil", 1000ms);
  EXPECT_EQ(gone.status().code(), Code::kUnavailable);
  EXPECT_NE(gone.status().message().find("payload_crc"), std::string::npos)
      << gone.status().message();
  EXPECT_EQ(a->stats().connections_dropped, 1u);
  EXPECT_EQ(a->stats().connections_rejected, 1u);

  // 3. The good peer was never disturbed.
  ASSERT_TRUE(SendFloats(*good, "a", {5.f, 6.f}, {2}, 99).ok());
  auto f = a->Recv("good", 2000ms);
  ASSERT_TRUE(f.ok()) << f.status().ToString();
  EXPECT_EQ(f->header.step_id, 99u);
  EXPECT_EQ(a->ConnectedPeers(), std::vector<std::string>{"good"});
}

TEST(TcpTransport, SilentUnauthenticatedConnectionTimesOut) {
  auto a = MakeNode("a", "k", true, /*handshake_timeout=*/300ms);
  asio::io_context io;
  tcp::socket idle(io);
  idle.connect(EndpointOf(a->listen_address()));
  EXPECT_TRUE(ClosedByServer(idle, 1500ms));
  EXPECT_TRUE(Eventually([&] { return a->stats().connections_rejected == 1; }));
}

TEST(TcpTransport, RecvOnASilentPeerReturnsWithinTheDeadline) {
  auto a = MakeNode("a", "k");
  auto b = MakeNode("b", "k", false);
  ASSERT_TRUE(b->Connect("a", a->listen_address(), 2000ms).ok());
  for (auto deadline : {200ms, 500ms}) {
    const auto t0 = Clock::now();
    auto f = a->Recv("b", deadline);
    const auto took = Clock::now() - t0;
    EXPECT_EQ(f.status().code(), Code::kDeadlineExceeded);
    EXPECT_NE(f.status().message().find("'b'"), std::string::npos);
    EXPECT_GE(took, deadline);
    EXPECT_LT(took, deadline + 1500ms);  // a hang is the fault; the slack is a loaded sanitizer run's
  }
  // A peer that never connected: same deadline, and the message says so.
  const auto t0 = Clock::now();
  auto f = a->Recv("nobody", 200ms);
  EXPECT_EQ(f.status().code(), Code::kDeadlineExceeded);
  EXPECT_NE(f.status().message().find("never connected"), std::string::npos);
  EXPECT_LT(Clock::now() - t0, 700ms);
}

TEST(TcpTransport, KilledPeerBecomesUnavailable) {
  auto a = MakeNode("a", "k");
  auto b = MakeNode("b", "k", false);
  ASSERT_TRUE(b->Connect("a", a->listen_address(), 2000ms).ok());
  ASSERT_TRUE(Eventually([&] { return a->IsConnected("b"); }));
  b.reset();  // closes its sockets, as a killed process would
  const auto t0 = Clock::now();
  auto f = a->Recv("b", 5000ms);
  EXPECT_EQ(f.status().code(), Code::kUnavailable) << f.status().ToString();
  EXPECT_NE(f.status().message().find("'b'"), std::string::npos);
  EXPECT_LT(Clock::now() - t0, 2000ms);
  EXPECT_FALSE(a->IsConnected("b"));
  EXPECT_EQ(SendFloats(*a, "b", {1.f}, {1}).code(), Code::kUnavailable);
}

TEST(TcpTransport, ReconnectReplacesTheOldConnection) {
  auto a = MakeNode("a", "k");
  auto b1 = MakeNode("b", "k", false);
  ASSERT_TRUE(b1->Connect("a", a->listen_address(), 2000ms).ok());
  auto b2 = MakeNode("b", "k", false);  // "b" restarted
  ASSERT_TRUE(b2->Connect("a", a->listen_address(), 2000ms).ok());
  ASSERT_TRUE(SendFloats(*b2, "a", {3.f}, {1}, 5).ok());
  auto f = a->Recv("b", 2000ms);
  ASSERT_TRUE(f.ok()) << f.status().ToString();
  EXPECT_EQ(f->header.step_id, 5u);
  EXPECT_TRUE(Eventually([&] { return !b1->IsConnected("a"); }));
}

TEST(TcpTransport, BadOptionsAndAddressesAreNamed) {
  TransportOptions o;
  o.self_name = "bad name";
  auto t = MakeTcpTransport(o);
  ASSERT_FALSE(t.ok());
  EXPECT_NE(t.status().message().find("self_name"), std::string::npos);
  auto a = MakeNode("a", "k", false);
  EXPECT_EQ(a->Listen("no-port").code(), Code::kInvalidArgument);
  EXPECT_EQ(a->Connect("x", "127.0.0.1:abc", 100ms).code(), Code::kInvalidArgument);
}

}  // namespace
}  // namespace fm::net
