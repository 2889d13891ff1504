#include "common/utf8.h"

#include <cstdint>

namespace fm {

size_t FirstInvalidUtf8(std::string_view s) {
  size_t i = 0;
  while (i < s.size()) {
    const uint8_t b = static_cast<uint8_t>(s[i]);
    // Length and the allowed range of the second byte (RFC 3629 table), per lead byte.
    size_t len;
    uint8_t lo = 0x80, hi = 0xBF;
    if (b < 0x80) {
      ++i;
      continue;
    } else if (b >= 0xC2 && b <= 0xDF) {
      len = 2;
    } else if (b >= 0xE0 && b <= 0xEF) {
      len = 3;
      if (b == 0xE0) lo = 0xA0;        // no overlong 3-byte forms
      if (b == 0xED) hi = 0x9F;        // no surrogates
    } else if (b >= 0xF0 && b <= 0xF4) {
      len = 4;
      if (b == 0xF0) lo = 0x90;        // no overlong 4-byte forms
      if (b == 0xF4) hi = 0x8F;        // nothing past U+10FFFF
    } else {
      return i;                        // continuation byte, C0/C1, F5..FF
    }
    if (i + len > s.size()) return i;  // truncated
    for (size_t k = 1; k < len; ++k) {
      const uint8_t c = static_cast<uint8_t>(s[i + k]);
      if (k == 1 ? (c < lo || c > hi) : (c < 0x80 || c > 0xBF)) return i;
    }
    i += len;
  }
  return std::string_view::npos;
}

}  // namespace fm
