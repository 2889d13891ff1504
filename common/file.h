// Reading a whole small file (a config, a tokenizer, an index, a secret) with the checks a path
// from a request or a YAML needs: a regular file (a FIFO would block the reader forever, a
// device such as /dev/zero never ends) of at most `max_bytes`, read in one pass.
#pragma once
#include <cstdint>
#include <string>

#include "common/status.h"

namespace fm {

// The file's bytes. NotFound when it cannot be opened; InvalidArgument naming the path when it
// is not a regular file or holds more than max_bytes.
Result<std::string> ReadSmallFile(const std::string& path, uint64_t max_bytes);

}  // namespace fm
