// CRC32C (Castagnoli, reflected polynomial 0x82F63B78): the payload checksum of data-plane frames
// (net/frame.h) and of checkpoint fingerprints (model/checkpoint_fingerprint.h).
#pragma once
#include <cstddef>
#include <cstdint>

namespace fm {

// crc = CRC32C(data[0..n)), continuing from `crc` (pass the previous result to chain buffers;
// 0 starts a new checksum). Crc32c("123456789") == 0xE3069283.
uint32_t Crc32c(const void* data, size_t n, uint32_t crc = 0);

}  // namespace fm
