// libFuzzer target: the acceptor's view of a handshake. The input is the dialer's bytes (HELLO
// fixed part, name, then its MAC); the hello parsers must never crash, a name they accept is
// valid, and a MAC verifies only when it is the one the secret gives (so a fuzzed MAC never
// authenticates, and the one computed from the parsed fields always does).
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <string>

#include "net/handshake.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  using namespace fm::net;
  const std::string secret = "fuzz-secret";
  Nonce dialer_nonce{};
  auto name_len = DecodeHelloFixed(data, size, &dialer_nonce);
  if (!name_len.ok()) return 0;
  if (*name_len < 1 || *name_len > kMaxPeerName) std::abort();
  if (size < kHelloFixedSize + *name_len) return 0;
  auto name = DecodeHelloName(data + kHelloFixedSize, *name_len);
  if (!name.ok()) return 0;
  if (!ValidatePeerName(*name).ok() || name->size() != *name_len) std::abort();
  // The hello re-encodes to the bytes it came from.
  const std::vector<uint8_t> again = EncodeHello({*name, dialer_nonce});
  if (std::memcmp(again.data(), data, again.size()) != 0) std::abort();
  const Nonce acceptor_nonce{};
  const Mac want =
      HandshakeMac(secret, HandshakeRole::kDialer, dialer_nonce, acceptor_nonce, *name, "acceptor");
  const size_t at = kHelloFixedSize + *name_len;
  if (size >= at + kMacSize) {
    Mac theirs;
    std::memcpy(theirs.data(), data + at, kMacSize);
    if (MacEqual(theirs, want) != (std::memcmp(theirs.data(), want.data(), kMacSize) == 0))
      std::abort();
  }
  if (!MacEqual(want, want)) std::abort();
  // The session keys never equal the MACs on the wire, and differ per direction.
  const Mac d2a = SessionKey(secret, HandshakeRole::kDialer, dialer_nonce, acceptor_nonce, *name,
                             "acceptor");
  const Mac a2d = SessionKey(secret, HandshakeRole::kAcceptor, dialer_nonce, acceptor_nonce, *name,
                             "acceptor");
  if (d2a == want || d2a == a2d) std::abort();
  return 0;
}
