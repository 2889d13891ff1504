// Frame tags of the data plane (net/frame_auth.h): the sealer's MAC and AES-256-GCM modes byte
// for byte, and on real connections a tampered, replayed or relayed-and-altered frame closes
// the connection, while an encrypted connection carries no plaintext.
#include <atomic>
#include <string>
#include <thread>
#include <vector>

#include <gtest/gtest.h>

#include "common/crc32c.h"
#include "tests/unit/test_net_util.h"

namespace fm::net {
namespace {

SessionKeyBytes Key(uint8_t fill) {
  SessionKeyBytes k;
  k.fill(fill);
  return k;
}

struct Sealed {
  std::vector<uint8_t> frame;   // header + payload as sent (ciphertext when encrypted)
  FrameTag tag;
};

Sealed Seal(FrameSealer& s, const std::vector<float>& v, uint64_t step) {
  FrameHeader h = ActivationHeader({static_cast<uint32_t>(v.size())});
  h.step_id = step;
  auto bytes = EncodeFrame(h, v.data(), v.size() * 4);
  EXPECT_TRUE(bytes.ok());
  Sealed out{*bytes, {}};
  std::vector<uint8_t> cipher;
  EXPECT_TRUE(s.Seal(bytes->data(), bytes->data() + kFrameHeaderSize, v.size() * 4, &cipher,
                     &out.tag).ok());
  if (s.encrypt()) std::copy(cipher.begin(), cipher.end(), out.frame.begin() + kFrameHeaderSize);
  return out;
}

Status Open(FrameSealer& s, Sealed f) {
  return s.Open(f.frame.data(), f.frame.data() + kFrameHeaderSize,
                f.frame.size() - kFrameHeaderSize, f.tag);
}

TEST(FrameSealer, EveryAlterationReplayAndReorderFailsInBothModes) {
  for (bool encrypt : {false, true}) {
    SCOPED_TRACE(encrypt ? "AES-256-GCM" : "HMAC-SHA256");
    FrameSealer tx(Key(7), encrypt);
    const Sealed f0 = Seal(tx, {1.f, 2.f, 3.f}, 10), f1 = Seal(tx, {4.f, 5.f, 6.f}, 11);
    EXPECT_EQ(tx.seq(), 2u);
    {
      FrameSealer rx(Key(7), encrypt);
      ASSERT_TRUE(Open(rx, f0).ok());
      auto replay = Open(rx, f0);   // the same frame again: seq 1 wants another tag
      EXPECT_EQ(replay.code(), Code::kUnauthenticated);
      EXPECT_NE(replay.message().find("frame 1: tag does not verify"), std::string::npos)
          << replay.message();
    }
    {
      FrameSealer rx(Key(7), encrypt);
      EXPECT_FALSE(Open(rx, f1).ok()) << "reordered";
    }
    for (size_t at : {size_t{8}, kFrameHeaderSize + 1, size_t{0}}) {   // header, payload, tag
      FrameSealer rx(Key(7), encrypt);
      Sealed bad = f0;
      if (at == 0) bad.tag[3] ^= 1;
      else bad.frame[at] ^= 0x40;
      EXPECT_FALSE(Open(rx, bad).ok()) << "flip at " << at;
    }
    FrameSealer other(Key(8), encrypt);
    EXPECT_FALSE(Open(other, f0).ok()) << "another session's key";
    FrameSealer rx(Key(7), encrypt);   // opening decrypts in place: the CRC-checked frame
    Sealed plain = f0;
    ASSERT_TRUE(rx.Open(plain.frame.data(), plain.frame.data() + kFrameHeaderSize,
                        plain.frame.size() - kFrameHeaderSize, plain.tag).ok());
    auto decoded = DecodeFrame(plain.frame.data(), plain.frame.size());
    ASSERT_TRUE(decoded.ok()) << decoded.status().ToString();
    EXPECT_EQ(decoded->header.step_id, 10u);
    EXPECT_EQ(*FramePayloadAsF32(*decoded), (std::vector<float>{1.f, 2.f, 3.f}));
  }
  // The modes differ on the wire: GCM hides the payload, HMAC does not.
  FrameSealer mac(Key(1), false), gcm(Key(1), true);
  const std::vector<float> v = {1.f, 2.f, 3.f, 4.f};
  const Sealed m = Seal(mac, v, 1), g = Seal(gcm, v, 1);
  EXPECT_EQ(std::memcmp(m.frame.data() + kFrameHeaderSize, v.data(), 16), 0);
  EXPECT_NE(std::memcmp(g.frame.data() + kFrameHeaderSize, v.data(), 16), 0);
  EXPECT_NE(m.tag, g.tag);
}

TEST(FrameSealer, SessionKeysDifferPerDirectionAndConnection) {
  Nonce n1{}, n2{};
  n2[0] = 1;
  const Mac d2a = SessionKey("s", HandshakeRole::kDialer, n1, n2, "a", "b");
  EXPECT_NE(d2a, SessionKey("s", HandshakeRole::kAcceptor, n1, n2, "a", "b"));
  EXPECT_NE(d2a, SessionKey("s", HandshakeRole::kDialer, n2, n1, "a", "b"));
  EXPECT_NE(d2a, SessionKey("t", HandshakeRole::kDialer, n1, n2, "a", "b"));
  EXPECT_NE(d2a, HandshakeMac("s", HandshakeRole::kDialer, n1, n2, "a", "b"))
      << "the key must not be the MAC the wire carries";
}

// A man in the middle without the secret: relays the handshake of "b" (dialing it as if it
// were "a") to "a" verbatim, then hands one frame on, optionally altered with both CRCs
// recomputed, and captures what b sent. A relay that fails (b never dials within 5 s, a peer
// hangs up early) fails the test instead of throwing in its thread or blocking in accept.
class Relay {
 public:
  Relay(const std::string& target, bool alter) : acceptor_(io_, {asio::ip::make_address("127.0.0.1"), 0}) {
    thread_ = std::thread([this, target, alter] {
      try {
        Run(target, alter);
      } catch (const std::exception& e) {
        error_ = e.what();
      }
    });
  }
  ~Relay() {
    thread_.join();
    if (!error_.empty()) ADD_FAILURE() << "relay: " << error_;
  }
  std::string address() const { return "127.0.0.1:" + std::to_string(acceptor_.local_endpoint().port()); }
  std::vector<uint8_t> captured;   // b's first frame as it crossed (header + payload + tag)

 private:
  void Run(const std::string& target, bool alter) {
    tcp::socket b(io_), a(io_);
    acceptor_.non_blocking(true);
    boost::system::error_code ec;
    for (const auto end = Clock::now() + 5s;
         acceptor_.accept(b, ec), ec == asio::error::would_block && Clock::now() < end;)
      std::this_thread::sleep_for(5ms);
    if (ec) throw boost::system::system_error(ec, "accept b");
    a.connect(EndpointOf(target));
    auto pump = [](tcp::socket& from, tcp::socket& to, size_t n) {
      std::vector<uint8_t> buf(n);
      asio::read(from, asio::buffer(buf));
      asio::write(to, asio::buffer(buf));
      return buf;
    };
    auto hello = pump(b, a, kHelloFixedSize);
    pump(b, a, hello[8] | hello[9] << 8);                 // b's name
    auto reply = pump(a, b, kHelloFixedSize);
    pump(a, b, (reply[8] | reply[9] << 8) + kMacSize);    // a's name + MAC
    pump(b, a, kMacSize);
    pump(a, b, sizeof kHandshakeOk);
    std::vector<uint8_t> frame(kFrameHeaderSize);
    asio::read(b, asio::buffer(frame));
    const uint64_t n = frame[44] | uint64_t{frame[45]} << 8 | uint64_t{frame[46]} << 16;
    frame.resize(kFrameHeaderSize + n + kFrameTagSize);
    asio::read(b, asio::buffer(frame.data() + kFrameHeaderSize, n + kFrameTagSize));
    captured = frame;
    if (alter) {   // flip an activation, recompute the payload CRC and the header CRC
      frame[kFrameHeaderSize + 3] ^= 0x80;
      const uint32_t pcrc = Crc32c(frame.data() + kFrameHeaderSize, n);
      for (int i = 0; i < 4; ++i) frame[52 + i] = static_cast<uint8_t>(pcrc >> (8 * i));
      const uint32_t hcrc = Crc32c(frame.data(), 60);
      for (int i = 0; i < 4; ++i) frame[60 + i] = static_cast<uint8_t>(hcrc >> (8 * i));
    }
    asio::write(a, asio::buffer(frame));
    std::this_thread::sleep_for(300ms);   // let a judge the frame before the relay hangs up
  }

  asio::io_context io_;
  tcp::acceptor acceptor_;
  std::string error_;
  std::thread thread_;
};

std::unique_ptr<Transport> Node(const std::string& name, bool encrypt, bool listen) {
  TransportOptions o;
  o.self_name = name;
  o.secret = "k";
  o.encrypt = encrypt;
  auto t = MakeTcpTransport(o);
  EXPECT_TRUE(t.ok()) << t.status().ToString();
  if (listen) {
    EXPECT_TRUE((*t)->Listen("127.0.0.1:0").ok());
  }
  return std::move(*t);
}

TEST(FrameTags, RelayedHandshakeCannotAlterAFrame) {
  auto a = Node("a", false, true);
  auto b = Node("b", false, false);
  Relay relay(a->listen_address(), /*alter=*/true);
  ASSERT_TRUE(b->Connect("a", relay.address(), 2000ms).ok()) << "the relay passes the handshake";
  ASSERT_TRUE(SendFloats(*b, "a", {1.f, 2.f, 3.f}, {3}, 5).ok());
  auto f = a->Recv("b", 2000ms);
  ASSERT_FALSE(f.ok()) << "an altered activation was delivered";
  EXPECT_NE(f.status().message().find("frame 0: tag does not verify"), std::string::npos)
      << f.status().message();
  EXPECT_EQ(a->stats().connections_dropped, 1u);
}

TEST(FrameTags, RelayedFrameUnalteredIsDeliveredAndEncryptionHidesIt) {
  for (bool encrypt : {false, true}) {
    auto a = Node("a", encrypt, true);
    auto b = Node("b", encrypt, false);
    Relay relay(a->listen_address(), /*alter=*/false);
    ASSERT_TRUE(b->Connect("a", relay.address(), 2000ms).ok());
    const std::vector<float> v = {1.5f, 2.5f, 3.5f, 4.5f};
    ASSERT_TRUE(SendFloats(*b, "a", v, {4}, 6).ok());
    auto f = a->Recv("b", 2000ms);
    ASSERT_TRUE(f.ok()) << f.status().ToString();
    EXPECT_EQ(std::memcmp(f->payload.data(), v.data(), 16), 0);
    const bool plaintext_on_wire =
        std::memcmp(relay.captured.data() + kFrameHeaderSize, v.data(), 16) == 0;
    EXPECT_EQ(plaintext_on_wire, !encrypt);
  }
}

TEST(FrameTags, ReplayedFrameDropsTheConnection) {
  auto a = Node("a", false, true);
  asio::io_context io;
  tcp::socket evil(io);
  evil.connect(EndpointOf(a->listen_address()));
  RawSession session;
  RawHandshake(evil, "b", "a", "k", &session);
  if (HasFatalFailure()) return;
  const auto frame = GoodFrame({1.f, 2.f}, {2});
  std::vector<uint8_t> cipher;
  FrameTag tag{};
  ASSERT_TRUE(session.tx->Seal(frame.data(), frame.data() + kFrameHeaderSize, 8, &cipher, &tag).ok());
  for (int i = 0; i < 2; ++i) {   // the same sealed frame twice
    asio::write(evil, asio::buffer(frame));
    asio::write(evil, asio::buffer(tag));
  }
  EXPECT_TRUE(ClosedByServer(evil, 2000ms));
  EXPECT_TRUE(a->Recv("b", 1000ms).ok()) << "the original arrives";
  auto replay = a->Recv("b", 1000ms);
  EXPECT_NE(replay.status().message().find("frame 1: tag does not verify"), std::string::npos)
      << replay.status().message();
}

TEST(FrameTags, PeersThatDisagreeOnEncryptionAreToldWhy) {
  auto a = Node("a", true, true);
  auto b = Node("b", false, false);
  ASSERT_TRUE(b->Connect("a", a->listen_address(), 2000ms).ok());
  ASSERT_TRUE(SendFloats(*b, "a", {1.f}, {1}, 1).ok());
  auto f = a->Recv("b", 2000ms);
  ASSERT_FALSE(f.ok());
  EXPECT_NE(f.status().message().find("disagree on security.encrypt_data_plane"), std::string::npos)
      << f.status().message();
  TransportOptions o;
  o.self_name = "c";
  o.encrypt = true;
  EXPECT_EQ(MakeTcpTransport(o).status().code(), Code::kInvalidArgument) << "encrypt needs a secret";
}

}  // namespace
}  // namespace fm::net
