// Frame tags (frame_auth.h): HMAC-SHA256 or AES-256-GCM from libcrypto.
#include "net/frame_auth.h"

#include <openssl/crypto.h>
#include <openssl/evp.h>
#include <openssl/params.h>

#include <algorithm>
#include <memory>

namespace fm::net {
namespace {

using CipherCtx = std::unique_ptr<EVP_CIPHER_CTX, decltype(&EVP_CIPHER_CTX_free)>;

void PutSeq(uint64_t seq, uint8_t out[8]) {
  for (int i = 0; i < 8; ++i) out[i] = (seq >> (8 * i)) & 0xFF;
}

// HMAC-SHA256(key, seq | header | payload), truncated to the tag size, on `ctx` keyed once by
// the sealer (re-initialising with no key restarts it under the same key: no allocation or
// digest lookup per frame; the payload is fed in place, never copied).
FrameTag MacTag(EVP_MAC_CTX* ctx, uint64_t seq, const uint8_t* header, const void* payload,
                size_t nbytes) {
  uint8_t s[8];
  PutSeq(seq, s);
  uint8_t full[32] = {0};
  size_t len = 0;
  // A failure leaves `full` zero: that tag never matches a real one, so the frame is refused.
  if (ctx && EVP_MAC_init(ctx, nullptr, 0, nullptr) == 1 && EVP_MAC_update(ctx, s, sizeof s) == 1 &&
      EVP_MAC_update(ctx, header, kFrameHeaderSize) == 1 &&
      (nbytes == 0 || EVP_MAC_update(ctx, static_cast<const uint8_t*>(payload), nbytes) == 1))
    EVP_MAC_final(ctx, full, &len, sizeof full);
  FrameTag tag;
  std::copy(full, full + kFrameTagSize, tag.begin());
  return tag;
}

// AES-256-GCM over `in` into `out` (same length; may alias), aad = seq | header. Sealing
// writes *tag; opening checks it (false on a mismatch).
bool Gcm(bool seal, const SessionKeyBytes& key, uint64_t seq, const uint8_t* header,
         const uint8_t* in, uint8_t* out, size_t nbytes, FrameTag* tag) {
  CipherCtx ctx(EVP_CIPHER_CTX_new(), EVP_CIPHER_CTX_free);
  uint8_t iv[12] = {0};
  PutSeq(seq, iv + 4);
  uint8_t aad[8];
  PutSeq(seq, aad);
  auto init = seal ? EVP_EncryptInit_ex : EVP_DecryptInit_ex;
  auto update = seal ? EVP_EncryptUpdate : EVP_DecryptUpdate;
  int len = 0;
  if (init(ctx.get(), EVP_aes_256_gcm(), nullptr, key.data(), iv) != 1) return false;
  if (update(ctx.get(), nullptr, &len, aad, sizeof aad) != 1) return false;
  if (update(ctx.get(), nullptr, &len, header, kFrameHeaderSize) != 1) return false;
  // EVP lengths are int: large payloads go through in slices.
  constexpr size_t kSlice = size_t{1} << 30;
  for (size_t done = 0; done < nbytes;) {
    const int n = static_cast<int>(std::min(kSlice, nbytes - done));
    if (update(ctx.get(), out + done, &len, in + done, n) != 1) return false;
    done += static_cast<size_t>(n);
  }
  if (seal) {
    if (EVP_EncryptFinal_ex(ctx.get(), out + nbytes, &len) != 1) return false;
    return EVP_CIPHER_CTX_ctrl(ctx.get(), EVP_CTRL_GCM_GET_TAG, kFrameTagSize, tag->data()) == 1;
  }
  if (EVP_CIPHER_CTX_ctrl(ctx.get(), EVP_CTRL_GCM_SET_TAG, kFrameTagSize, tag->data()) != 1)
    return false;
  return EVP_DecryptFinal_ex(ctx.get(), out + nbytes, &len) == 1;
}

}  // namespace

void FrameSealer::MacCtxFree::operator()(EVP_MAC_CTX* c) const { EVP_MAC_CTX_free(c); }

FrameSealer::FrameSealer(const SessionKeyBytes& key, bool encrypt) : key_(key), encrypt_(encrypt) {
  if (encrypt_) return;
  static EVP_MAC* const hmac = EVP_MAC_fetch(nullptr, "HMAC", nullptr);
  char digest[] = "SHA256";
  const OSSL_PARAM params[] = {OSSL_PARAM_construct_utf8_string("digest", digest, 0),
                               OSSL_PARAM_construct_end()};
  mac_.reset(EVP_MAC_CTX_new(hmac));
  // Without a keyed context every tag is zero and no frame verifies: fails closed.
  if (mac_ && EVP_MAC_init(mac_.get(), key_.data(), key_.size(), params) != 1) mac_.reset();
}

Status FrameSealer::Seal(const uint8_t header[kFrameHeaderSize], const void* payload,
                         size_t nbytes, std::vector<uint8_t>* cipher, FrameTag* tag) {
  cipher->clear();
  if (!encrypt_) {
    *tag = MacTag(mac_.get(), seq_, header, payload, nbytes);
  } else {
    cipher->resize(nbytes);
    if (!Gcm(true, key_, seq_, header, static_cast<const uint8_t*>(payload), cipher->data(),
             nbytes, tag))
      return Internal("frame seal: AES-256-GCM failed");
  }
  ++seq_;
  return Status::Ok();
}

Status FrameSealer::Open(const uint8_t header[kFrameHeaderSize], uint8_t* payload, size_t nbytes,
                         const FrameTag& tag) {
  bool ok;
  if (!encrypt_) {
    const FrameTag want = MacTag(mac_.get(), seq_, header, payload, nbytes);
    ok = CRYPTO_memcmp(want.data(), tag.data(), kFrameTagSize) == 0;
  } else {
    FrameTag t = tag;
    ok = Gcm(false, key_, seq_, header, payload, payload, nbytes, &t);
  }
  if (!ok)
    return Unauthenticated("frame " + std::to_string(seq_) +
                           ": tag does not verify (tampered, replayed or reordered, or the peers "
                           "disagree on security.encrypt_data_plane)");
  ++seq_;
  return Status::Ok();
}

}  // namespace fm::net
