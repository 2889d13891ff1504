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

  // The fuzzed bytes as received: they open only if they are exactly what was sealed.
  {
    FrameSealer rx(key, encrypt);
    std::vector<uint8_t> got = frame;
    const bool opened = rx.Open(got.data(), got.data() + kFrameHeaderSize, n, tag).ok();
    // Sealed bytes on the wire: the plaintext (HMAC) or the ciphertext (GCM) of this payload.
    const uint8_t* sealed_payload = encrypt ? cipher.data() : frame.data() + kFrameHeaderSize;
    const bool is_sealed = tag == sealed_tag &&
                           std::memcmp(frame.data() + kFrameHeaderSize, sealed_payload, n) == 0;
    if (opened != is_sealed) std::abort();
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
