// Internals shared by tokenizer.cpp (load, encode, decode) and tokenizer_test_data.cpp (the
// test tokenizer writer): the GPT-2 byte <-> unicode map and the UTF-8 helpers.
#pragma once
#include <array>
#include <cstddef>
#include <cstdint>
#include <string>

namespace fm::tok {

// GPT-2's reversible byte -> code point map: printable Latin-1 bytes map to themselves, the
// other 68 bytes to U+0100.. in byte order, so every byte has a visible, non-space character.
const std::array<uint32_t, 256>& ByteToCodepoint();
// Byte of a mapped code point, -1 if the code point is not in the map.
int CodepointToByte(uint32_t cp);

void AppendUtf8(uint32_t cp, std::string* out);
// Decodes one UTF-8 character at s[i] (valid input assumed); returns its length.
int DecodeUtf8(const std::string& s, size_t i, uint32_t* cp);
// The byte-mapped form of raw bytes (what tokenizer.json stores as vocab keys).
std::string ByteMap(const std::string& raw);

// Appends the longest prefix of `in` made of complete characters to `out`, each maximal invalid
// subpart (a lead byte and the continuation bytes that fit it; a stray byte alone) replaced by
// one U+FFFD, as HF's ByteLevel decoder (Rust's from_utf8_lossy) does; returns how many bytes of
// `in` were consumed. When `final`, an incomplete character at the end is replaced too (one
// U+FFFD) and everything is consumed.
size_t AppendValidUtf8(const std::string& in, bool final, std::string* out);

}  // namespace fm::tok
