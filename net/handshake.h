// Connection authentication of the data plane (docs/wire-format.md "Handshake").
//   dialer   -> acceptor: HELLO(dialer name, nonce_d)
//   acceptor -> dialer:   HELLO(acceptor name, nonce_a) + MAC_a
//   dialer   -> acceptor: MAC_d
//   acceptor -> dialer:   "FMOK"   (only after MAC_d verified; otherwise the socket is closed)
// MAC_x = HMAC-SHA256(secret, role_x | nonce_d | nonce_a | dialer name | acceptor name), role_a =
// "FMSH-acceptor", role_d = "FMSH-dialer". Fresh 32-byte nonces from both sides make every MAC
// single-use; the names are bound into the MACs so a peer cannot claim another's name. With a
// secret, the frames that follow carry tags under per-direction session keys (frame_auth.h).
// Pure byte functions (no sockets) so that tests and fuzzers drive them directly.
#pragma once
#include <array>
#include <cstddef>
#include <cstdint>
#include <string>
#include <vector>

#include "common/status.h"

namespace fm::net {

inline constexpr size_t kNonceSize = 32;
inline constexpr size_t kMacSize = 32;
inline constexpr size_t kHelloFixedSize = 42;  // magic 4, version 2, type 1, 0, name_len 2, nonce 32
inline constexpr size_t kMaxPeerName = 255;
inline constexpr uint8_t kHandshakeOk[4] = {'F', 'M', 'O', 'K'};

using Nonce = std::array<uint8_t, kNonceSize>;
using Mac = std::array<uint8_t, kMacSize>;

struct Hello {
  std::string name;
  Nonce nonce{};
};

enum class HandshakeRole { kDialer, kAcceptor };

// Peer names: 1..255 bytes of printable ASCII without spaces.
Status ValidatePeerName(const std::string& name);
Result<Nonce> RandomNonce();  // OpenSSL RAND_bytes

std::vector<uint8_t> EncodeHello(const Hello& h);
// Parses the 42 fixed bytes; returns the name length still to read.
Result<size_t> DecodeHelloFixed(const uint8_t* data, size_t nbytes, Nonce* nonce);
// Validates the name bytes read after the fixed part.
Result<std::string> DecodeHelloName(const uint8_t* data, size_t nbytes);

Mac HandshakeMac(const std::string& secret, HandshakeRole role, const Nonce& dialer_nonce,
                 const Nonce& acceptor_nonce, const std::string& dialer_name,
                 const std::string& acceptor_name);
// Constant-time comparison.
bool MacEqual(const Mac& a, const Mac& b);

// The session key of one direction of an authenticated connection (frame_auth.h): the same
// HMAC over the nonces and names as the handshake MACs, under the label
// "FMSH-session-dialer->acceptor" or "FMSH-session-acceptor->dialer" (`from` = the sender).
// A relay that passed the handshake through cannot compute it without the secret.
Mac SessionKey(const std::string& secret, HandshakeRole from, const Nonce& dialer_nonce,
               const Nonce& acceptor_nonce, const std::string& dialer_name,
               const std::string& acceptor_name);

}  // namespace fm::net
