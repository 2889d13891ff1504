// Helpers of the data-plane tests (test_net*.cpp, test_security.cpp): frames, transports on
// 127.0.0.1 with ephemeral ports, and a hand-driven peer that can send arbitrary bytes.
#pragma once
#include <utility>  // before Boost 1.74's awaitable.hpp (std::exchange)

#include <boost/asio.hpp>

#include <sys/types.h>

#include <chrono>
#include <cstring>
#include <fstream>
#include <limits>
#include <memory>
#include <random>
#include <string>
#include <thread>
#include <vector>

#include <gtest/gtest.h>

#include "common/crc32c.h"
#include "net/frame.h"
#include "net/frame_auth.h"
#include "net/handshake.h"
#include "net/tcp_transport.h"

namespace fm::net {

using Clock = std::chrono::steady_clock;
using namespace std::chrono_literals;

inline FrameHeader ActivationHeader(std::vector<uint32_t> shape,
                                    FrameDType dtype = FrameDType::kF32) {
  FrameHeader h;
  h.kind = FrameKind::kActivation;
  h.dtype = dtype;
  h.step_id = 0x0102030405060708ull;
  h.micro_batch = 3;
  h.tag = 17;
  h.set_shape(shape);
  return h;
}

inline std::vector<float> TestValues(size_t n) {
  std::mt19937 rng(42);
  std::normal_distribution<float> nd(0.f, 3.f);
  std::vector<float> v(n);
  for (auto& x : v) x = nd(rng);
  if (n >= 4) {
    v[0] = -0.0f;
    v[1] = std::numeric_limits<float>::denorm_min();
    v[2] = std::numeric_limits<float>::infinity();
    v[3] = 1e-30f;
  }
  return v;
}

inline std::vector<uint8_t> GoodFrame(const std::vector<float>& v, std::vector<uint32_t> shape) {
  auto bytes = EncodeFrame(ActivationHeader(shape), v.data(), v.size() * 4);
  EXPECT_TRUE(bytes.ok()) << bytes.status().ToString();
  return *bytes;
}

inline std::unique_ptr<Transport> MakeNode(const std::string& name, const std::string& secret,
                                    bool listen = true, Millis handshake_timeout = 5000ms) {
  TransportOptions o;
  o.self_name = name;
  o.secret = secret;
  o.handshake_timeout = handshake_timeout;
  auto t = MakeTcpTransport(o);
  EXPECT_TRUE(t.ok()) << t.status().ToString();
  if (listen) {
    Status s = (*t)->Listen("127.0.0.1:0");
    EXPECT_TRUE(s.ok()) << s.ToString();
  }
  return std::move(*t);
}

// Polls `cond` for up to 2 s (connection bookkeeping on the accepting side is asynchronous).
template <typename F>
bool Eventually(F cond) {
  for (int i = 0; i < 200; ++i) {
    if (cond()) return true;
    std::this_thread::sleep_for(10ms);
  }
  return cond();
}

inline Status SendFloats(Transport& t, const std::string& peer, const std::vector<float>& v,
                  std::vector<uint32_t> shape, uint64_t step = 1) {
  FrameHeader h = ActivationHeader(shape);
  h.step_id = step;
  return t.Send(peer, h, v.data(), v.size() * 4, 2000ms);
}

namespace asio = boost::asio;
using tcp = asio::ip::tcp;

inline tcp::endpoint EndpointOf(const std::string& address) {
  const size_t colon = address.rfind(':');
  return {asio::ip::make_address(address.substr(0, colon)),
          static_cast<uint16_t>(std::stoi(address.substr(colon + 1)))};
}

// What a hand-driven dialer needs to send frames the acceptor takes: with a secret, the sealer
// of the dialer->acceptor direction (frame_auth.h); none without.
struct RawSession {
  std::unique_ptr<FrameSealer> tx;
};

// A hand-driven dialer (handshake.h) so that the test can send arbitrary bytes afterwards.
inline void RawHandshake(tcp::socket& s, const std::string& me, const std::string& peer,
                         const std::string& secret, RawSession* session = nullptr) {
  Nonce mine{};
  mine[0] = 42;
  asio::write(s, asio::buffer(EncodeHello({me, mine})));
  std::vector<uint8_t> fixed(kHelloFixedSize);
  asio::read(s, asio::buffer(fixed));
  Nonce theirs{};
  auto len = DecodeHelloFixed(fixed.data(), fixed.size(), &theirs);
  ASSERT_TRUE(len.ok());
  std::vector<uint8_t> rest(*len + kMacSize);
  asio::read(s, asio::buffer(rest));
  const Mac mac = HandshakeMac(secret, HandshakeRole::kDialer, mine, theirs, me, peer);
  asio::write(s, asio::buffer(mac));
  std::array<uint8_t, 4> ok{};
  asio::read(s, asio::buffer(ok));
  ASSERT_EQ(std::memcmp(ok.data(), kHandshakeOk, 4), 0);
  if (session && !secret.empty())
    session->tx = std::make_unique<FrameSealer>(
        SessionKey(secret, HandshakeRole::kDialer, mine, theirs, me, peer), false);
}

// Writes an encoded frame (header + payload) as the session's next frame: followed by its tag
// when the session has one.
inline void WriteFrame(tcp::socket& s, RawSession& session, const std::vector<uint8_t>& frame) {
  asio::write(s, asio::buffer(frame));
  if (!session.tx) return;
  std::vector<uint8_t> cipher;
  FrameTag tag{};
  ASSERT_TRUE(session.tx->Seal(frame.data(), frame.data() + kFrameHeaderSize,
                               frame.size() - kFrameHeaderSize, &cipher, &tag).ok());
  asio::write(s, asio::buffer(tag));
}

// Reads until the server closes the socket; true if that happens within `limit`.
inline bool ClosedByServer(tcp::socket& s, Millis limit) {
  s.non_blocking(true);
  const auto end = Clock::now() + limit;
  uint8_t buf[256];
  while (Clock::now() < end) {
    boost::system::error_code ec;
    s.read_some(asio::buffer(buf), ec);
    if (ec == asio::error::would_block) {
      std::this_thread::sleep_for(5ms);
      continue;
    }
    if (ec) return true;  // eof or reset
  }
  return false;
}

// A 64-byte header claiming `payload_bytes` of u8 (the header CRC recomputed, the payload CRC
// of nothing): valid in every field but the length.
inline std::vector<uint8_t> HeaderClaiming(uint64_t payload_bytes) {
  auto b = EncodeFrame(ActivationHeader({1}, FrameDType::kU8), "x", 1);
  EXPECT_TRUE(b.ok());
  b->resize(kFrameHeaderSize);
  for (int i = 0; i < 4; ++i) (*b)[28 + i] = static_cast<uint8_t>(payload_bytes >> (8 * i));
  for (int i = 0; i < 8; ++i) (*b)[44 + i] = static_cast<uint8_t>(payload_bytes >> (8 * i));
  const uint32_t crc = Crc32c(b->data(), 60);
  for (int i = 0; i < 4; ++i) (*b)[60 + i] = static_cast<uint8_t>(crc >> (8 * i));
  return *b;
}

// Peak resident memory of process `pid` (0: this one) since ResetPeakResident: Linux resets
// VmHWM to the present resident set when "5" is written to /proc/PID/clear_refs, so a buffer
// allocated, touched and freed in between still shows (the present resident set would not).
inline std::string ProcPath(pid_t pid, const char* file) {
  return "/proc/" + (pid ? std::to_string(pid) : std::string("self")) + "/" + file;
}
inline bool ResetPeakResident(pid_t pid = 0) {
  std::ofstream out(ProcPath(pid, "clear_refs"));
  out << "5";
  out.flush();
  return static_cast<bool>(out);
}
inline uint64_t PeakResidentBytes(pid_t pid = 0) {
  std::ifstream in(ProcPath(pid, "status"));
  std::string key;
  for (uint64_t kb = 0; in >> key;)
    if (key == "VmHWM:" && in >> kb) return kb << 10;
  ADD_FAILURE() << "no VmHWM in " << ProcPath(pid, "status");
  return 0;
}

}  // namespace fm::net
