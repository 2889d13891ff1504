// libFuzzer target: the receive path of an authenticated connection. The input is what arrives
// after the handshake: a frame header, its payload and a 16-byte tag, in either mode (the first
// byte picks HMAC or AES-256-GCM). Decoding and opening must never crash; a fuzzed tag must
// never verify unless it is the one the session key gives; and a frame sealed by the sender
// opens to the same bytes, exactly once.
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <vector>

#include "net/frame.h"
#include "net/frame_auth.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  using namespace fm::net;
  if (size < 1) return 0;
  const bool encrypt = data[0] & 1;
  ++data;
  --size;
  SessionKeyBytes key;
  key.fill(0x5A);
  constexpr uint64_t kMaxPayload = 1 << 20;
  auto header = DecodeFrameHeader(data, size, kMaxPayload);
  if (!header.ok()) return 0;
  const size_t n = header->payload_bytes;
  if (size < kFrameHeaderSize + n + kFrameTagSize) return 0;
  std::vector<uint8_t> frame(data, data + kFrameHeaderSize + n);
  FrameTag tag;
  std::memcpy(tag.data(), data + kFrameHeaderSize + n, kFrameTagSize);

  // What the honest sender would have produced for this plaintext.
  FrameSealer tx(key, encrypt);
  std::vector<uint8_t> cipher;
  FrameTag sealed_tag;
  if (!tx.Seal(frame.data(), frame.data() + kFrameHeaderSize, n, &cipher, &sealed_tag).ok())
    std::abort();

  // The fuzzed bytes as received open only if they are exactly what the sender seals for some
  // plaintext. HMAC: the payload is that plaintext, so the tag must be this one. GCM: the payload
  // is a ciphertext, the sealing of plaintext payload ^ keystream (the keystream is the sealing
  // of zeros; key and sequence number are the same in every run, so the fuzzer can replay a
  // frame it saw sealed before, which is a genuine frame of another plaintext).
  FrameTag genuine_tag = sealed_tag;
  if (encrypt) {
    std::vector<uint8_t> zeros(kFrameHeaderSize + n, 0), keystream, plain(n);
    std::memcpy(zeros.data(), frame.data(), kFrameHeaderSize);
    FrameTag unused;
    FrameSealer ks(key, true);
    if (!ks.Seal(zeros.data(), zeros.data() + kFrameHeaderSize, n, &keystream, &unused).ok())
      std::abort();
    for (size_t i = 0; i < n; ++i) plain[i] = frame[kFrameHeaderSize + i] ^ keystream[i];
    std::vector<uint8_t> again;
    FrameSealer tx2(key, true);
    if (!tx2.Seal(frame.data(), plain.data(), n, &again, &genuine_tag).ok()) std::abort();
    if (n > 0 && std::memcmp(again.data(), frame.data() + kFrameHeaderSize, n) != 0) std::abort();
  }
  {
    FrameSealer rx(key, encrypt);
    std::vector<uint8_t> got = frame;
    const bool opened = rx.Open(got.data(), got.data() + kFrameHeaderSize, n, tag).ok();
    if (opened != (tag == genuine_tag)) std::abort();
    if (opened) {
      (void)VerifyFramePayload(*header, got.data() + kFrameHeaderSize, n);
      if (rx.seq() != 1) std::abort();
    }
  }
  // The sealed frame opens to the plaintext, and a replay of it does not.
  FrameSealer rx(key, encrypt);
  std::vector<uint8_t> wire = frame;
  if (encrypt) std::memcpy(wire.data() + kFrameHeaderSize, cipher.data(), n);
  std::vector<uint8_t> replay = wire;
  if (!rx.Open(wire.data(), wire.data() + kFrameHeaderSize, n, sealed_tag).ok()) std::abort();
  if (std::memcmp(wire.data(), frame.data(), frame.size()) != 0) std::abort();
  if (rx.Open(replay.data(), replay.data() + kFrameHeaderSize, n, sealed_tag).ok()) std::abort();
  return 0;
}
