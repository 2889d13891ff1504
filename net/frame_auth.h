// Per-frame authentication of the data plane (docs/wire-format.md "Frame tags"). After a
// handshake under a cluster secret, each direction of a connection has its own session key
// (handshake.h SessionKey); every frame is followed by a 16-byte tag:
//   MAC mode:        tag = HMAC-SHA256(key, u64 seq | header[64] | payload)[0, 16)
//   encrypted mode:  payload = AES-256-GCM(key, iv = u32 0 | u64 seq, aad = u64 seq | header),
//                    tag = the GCM tag
// seq counts the frames of that direction from 0, so a tampered, replayed, reordered or
// dropped-then-resumed frame fails to verify and the connection is closed.
// Pure byte functions (no sockets) so that tests and fuzzers drive them directly.
#pragma once
#include <array>
#include <cstddef>
#include <cstdint>
#include <memory>
#include <vector>

#include "common/status.h"
#include "net/frame.h"

struct evp_mac_ctx_st;
typedef struct evp_mac_ctx_st EVP_MAC_CTX;   // <openssl/types.h>, without OpenSSL's headers here

namespace fm::net {

using FrameTag = std::array<uint8_t, kFrameTagSize>;
using SessionKeyBytes = std::array<uint8_t, 32>;

// One direction of a connection: the sender's and the receiver's sealers of it agree on the
// key, the mode and the sequence number.
class FrameSealer {
 public:
  FrameSealer(const SessionKeyBytes& key, bool encrypt);

  // The tag of the next frame; with encryption the ciphertext goes to *cipher (payload is
  // left alone), otherwise *cipher stays empty and the payload travels as is.
  Status Seal(const uint8_t header[kFrameHeaderSize], const void* payload, size_t nbytes,
              std::vector<uint8_t>* cipher, FrameTag* tag);
  // Verifies the next frame's tag (and decrypts the payload in place). Unauthenticated on a
  // mismatch, naming the frame's sequence number.
  Status Open(const uint8_t header[kFrameHeaderSize], uint8_t* payload, size_t nbytes,
              const FrameTag& tag);
  bool encrypt() const { return encrypt_; }
  uint64_t seq() const { return seq_; }

 private:
  struct MacCtxFree {
    void operator()(EVP_MAC_CTX* c) const;
  };
  SessionKeyBytes key_;
  bool encrypt_;
  uint64_t seq_ = 0;
  std::unique_ptr<EVP_MAC_CTX, MacCtxFree> mac_;   // MAC mode: HMAC-SHA256 keyed with key_
};

}  // namespace fm::net
