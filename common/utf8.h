// UTF-8 validation for text that arrives from the network (api.proto carries user text as
// bytes, so that invalid UTF-8 reaches the server and gets an error naming the field and byte).
#pragma once
#include <cstddef>
#include <string_view>

namespace fm {

// Byte offset of the first sequence that is not well-formed UTF-8 (a stray continuation byte,
// a truncated sequence, an overlong form, a surrogate, a code point past U+10FFFF), or
// std::string_view::npos when all of `s` is well formed.
size_t FirstInvalidUtf8(std::string_view s);

}  // namespace fm
