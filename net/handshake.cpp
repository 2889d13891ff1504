// Handshake messages and MACs (handshake.h). HMAC-SHA256 and the nonces come from libcrypto.
#include "net/handshake.h"

#include <openssl/crypto.h>
#include <openssl/evp.h>
#include <openssl/hmac.h>
#include <openssl/rand.h>

#include <cstring>

#include "net/frame.h"

namespace fm::net {
namespace {
constexpr uint8_t kHelloType = 'H';
}  // namespace

Status ValidatePeerName(const std::string& name) {
  if (name.empty() || name.size() > kMaxPeerName)
    return InvalidArgument("peer name: length " + std::to_string(name.size()) + " not in 1..255");
  for (unsigned char c : name)
    if (c <= 0x20 || c >= 0x7F)
      return InvalidArgument("peer name: byte " + std::to_string(c) +
                             " is not printable ASCII without spaces");
  return Status::Ok();
}

Result<Nonce> RandomNonce() {
  Nonce n;
  if (RAND_bytes(n.data(), static_cast<int>(n.size())) != 1)
    return Internal("handshake: RAND_bytes failed to produce a nonce");
  return n;
}

std::vector<uint8_t> EncodeHello(const Hello& h) {
  std::vector<uint8_t> out(kHelloFixedSize + h.name.size());
  std::memcpy(out.data(), kFrameMagic, 4);
  out[4] = kFrameVersion & 0xFF;
  out[5] = kFrameVersion >> 8;
  out[6] = kHelloType;
  out[7] = 0;
  out[8] = h.name.size() & 0xFF;
  out[9] = (h.name.size() >> 8) & 0xFF;
  std::memcpy(out.data() + 10, h.nonce.data(), kNonceSize);
  std::memcpy(out.data() + kHelloFixedSize, h.name.data(), h.name.size());
  return out;
}

Result<size_t> DecodeHelloFixed(const uint8_t* p, size_t nbytes, Nonce* nonce) {
  if (nbytes < kHelloFixedSize)
    return InvalidArgument("handshake hello: truncated: " + std::to_string(nbytes) + " of " +
                           std::to_string(kHelloFixedSize) + " bytes");
  if (std::memcmp(p, kFrameMagic, 4) != 0)
    return InvalidArgument("handshake hello: magic: not \"FMSH\" (not a flashmesh data peer)");
  const unsigned version = p[4] | p[5] << 8;
  if (version != kFrameVersion)
    return InvalidArgument("handshake hello: version " + std::to_string(version) +
                           " unsupported (want " + std::to_string(kFrameVersion) + ")");
  if (p[6] != kHelloType)
    return InvalidArgument("handshake hello: type " + std::to_string(p[6]) + " is not HELLO");
  if (p[7] != 0) return InvalidArgument("handshake hello: reserved byte 7 is not 0");
  const size_t name_len = p[8] | p[9] << 8;
  if (name_len < 1 || name_len > kMaxPeerName)
    return InvalidArgument("handshake hello: name_len " + std::to_string(name_len) +
                           " not in 1..255");
  std::memcpy(nonce->data(), p + 10, kNonceSize);
  return name_len;
}

Result<std::string> DecodeHelloName(const uint8_t* data, size_t nbytes) {
  std::string name(reinterpret_cast<const char*>(data), nbytes);
  Status s = ValidatePeerName(name);
  if (!s.ok()) return s.Wrap("handshake hello");
  return name;
}

namespace {

Mac LabeledMac(const std::string& secret, const char* label, const Nonce& dialer_nonce,
               const Nonce& acceptor_nonce, const std::string& dialer_name,
               const std::string& acceptor_name) {
  // Names are length-prefixed so ("ab","c") and ("a","bc") give different messages.
  std::string msg = label;
  msg.append(reinterpret_cast<const char*>(dialer_nonce.data()), kNonceSize);
  msg.append(reinterpret_cast<const char*>(acceptor_nonce.data()), kNonceSize);
  for (const std::string* n : {&dialer_name, &acceptor_name}) {
    msg.push_back(static_cast<char>(n->size() & 0xFF));
    msg.push_back(static_cast<char>((n->size() >> 8) & 0xFF));
    msg += *n;
  }
  static const uint8_t kEmptyKey = 0;
  const void* key = secret.empty() ? static_cast<const void*>(&kEmptyKey) : secret.data();
  Mac mac{};
  unsigned int len = 0;
  HMAC(EVP_sha256(), key, static_cast<int>(secret.size()),
       reinterpret_cast<const uint8_t*>(msg.data()), msg.size(), mac.data(), &len);
  return mac;
}

}  // namespace

Mac HandshakeMac(const std::string& secret, HandshakeRole role, const Nonce& dialer_nonce,
                 const Nonce& acceptor_nonce, const std::string& dialer_name,
                 const std::string& acceptor_name) {
  return LabeledMac(secret, role == HandshakeRole::kDialer ? "FMSH-dialer" : "FMSH-acceptor",
                    dialer_nonce, acceptor_nonce, dialer_name, acceptor_name);
}

Mac SessionKey(const std::string& secret, HandshakeRole from, const Nonce& dialer_nonce,
               const Nonce& acceptor_nonce, const std::string& dialer_name,
               const std::string& acceptor_name) {
  return LabeledMac(secret,
                    from == HandshakeRole::kDialer ? "FMSH-session-dialer->acceptor"
                                                   : "FMSH-session-acceptor->dialer",
                    dialer_nonce, acceptor_nonce, dialer_name, acceptor_name);
}

bool MacEqual(const Mac& a, const Mac& b) { return CRYPTO_memcmp(a.data(), b.data(), kMacSize) == 0; }

}  // namespace fm::net
