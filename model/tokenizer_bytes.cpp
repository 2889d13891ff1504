// The byte-level half of the tokenizer (model/tokenizer_impl.h): GPT-2's byte <-> code point
// map and the UTF-8 helpers that decode and streaming decode use.
#include <array>
#include <cstdint>
#include <string>
#include <unordered_map>

#include "model/tokenizer_impl.h"

namespace fm::tok {

const std::array<uint32_t, 256>& ByteToCodepoint() {
  static const std::array<uint32_t, 256> map = [] {
    std::array<uint32_t, 256> m{};
    uint32_t next = 256;
    for (int b = 0; b < 256; ++b) {
      bool printable = (b >= '!' && b <= '~') || (b >= 0xA1 && b <= 0xAC) || b >= 0xAE;
      m[b] = printable ? static_cast<uint32_t>(b) : next++;
    }
    return m;
  }();
  return map;
}

int CodepointToByte(uint32_t cp) {
  static const std::unordered_map<uint32_t, int> inverse = [] {
    std::unordered_map<uint32_t, int> m;
    for (int b = 0; b < 256; ++b) m[ByteToCodepoint()[b]] = b;
    return m;
  }();
  auto it = inverse.find(cp);
  return it == inverse.end() ? -1 : it->second;
}

void AppendUtf8(uint32_t cp, std::string* out) {
  if (cp < 0x80) {
    out->push_back(static_cast<char>(cp));
  } else if (cp < 0x800) {
    out->push_back(static_cast<char>(0xC0 | (cp >> 6)));
    out->push_back(static_cast<char>(0x80 | (cp & 0x3F)));
  } else if (cp < 0x10000) {
    out->push_back(static_cast<char>(0xE0 | (cp >> 12)));
    out->push_back(static_cast<char>(0x80 | ((cp >> 6) & 0x3F)));
    out->push_back(static_cast<char>(0x80 | (cp & 0x3F)));
  } else {
    out->push_back(static_cast<char>(0xF0 | (cp >> 18)));
    out->push_back(static_cast<char>(0x80 | ((cp >> 12) & 0x3F)));
    out->push_back(static_cast<char>(0x80 | ((cp >> 6) & 0x3F)));
    out->push_back(static_cast<char>(0x80 | (cp & 0x3F)));
  }
}

std::string ByteMap(const std::string& raw) {
  std::string out;
  for (unsigned char c : raw) AppendUtf8(ByteToCodepoint()[c], &out);
  return out;
}

namespace {

// Length of the character led by byte b (0 = b cannot lead) and the allowed range of the
// second byte (excludes overlongs, surrogates and code points above U+10FFFF).
int Utf8Lead(unsigned char b, unsigned char* lo, unsigned char* hi) {
  *lo = 0x80;
  *hi = 0xBF;
  if (b < 0x80) return 1;
  if (b >= 0xC2 && b <= 0xDF) return 2;
  if (b >= 0xE0 && b <= 0xEF) {
    if (b == 0xE0) *lo = 0xA0;
    if (b == 0xED) *hi = 0x9F;
    return 3;
  }
  if (b >= 0xF0 && b <= 0xF4) {
    if (b == 0xF0) *lo = 0x90;
    if (b == 0xF4) *hi = 0x8F;
    return 4;
  }
  return 0;
}

}  // namespace

int DecodeUtf8(const std::string& s, size_t i, uint32_t* cp) {
  unsigned char lo, hi;
  unsigned char b = static_cast<unsigned char>(s[i]);
  int n = Utf8Lead(b, &lo, &hi);
  if (n <= 1 || i + n > s.size()) {
    *cp = b;
    return 1;
  }
  uint32_t v = b & (0x7F >> n);
  for (int k = 1; k < n; ++k) v = (v << 6) | (static_cast<unsigned char>(s[i + k]) & 0x3F);
  *cp = v;
  return n;
}

size_t AppendValidUtf8(const std::string& in, bool final, std::string* out) {
  static const char kReplacement[] = "\xEF\xBF\xBD";
  size_t i = 0;
  while (i < in.size()) {
    unsigned char lo, hi;
    int n = Utf8Lead(static_cast<unsigned char>(in[i]), &lo, &hi);
    if (n == 0) {
      out->append(kReplacement);
      ++i;
      continue;
    }
    size_t k = 1;
    bool bad = false;
    for (; k < static_cast<size_t>(n) && i + k < in.size(); ++k) {
      unsigned char c = static_cast<unsigned char>(in[i + k]);
      if (c < (k == 1 ? lo : 0x80) || c > (k == 1 ? hi : 0xBF)) {
        bad = true;
        break;
      }
    }
    if (!bad && k < static_cast<size_t>(n)) {  // truncated, so far valid
      if (!final) return i;
      bad = true;
    }
    if (bad) {   // one U+FFFD for the maximal subpart (lead + the continuations that fit)
      out->append(kReplacement);
      i += k;
      continue;
    }
    out->append(in, i, n);
    i += n;
  }
  return i;
}

}  // namespace fm::tok
