// Frame codec: explicit little-endian byte packing (no struct casts), every field validated.
#include "net/frame.h"

#include <algorithm>
#include <cstdio>
#include <cstring>

#include "common/numfmt.h"
#include "common/crc32c.h"

namespace fm::net {
namespace {

constexpr size_t kHeaderCrcOffset = 60;

void PutU16(uint8_t* p, uint16_t v) { p[0] = v & 0xFF; p[1] = v >> 8; }
void PutU32(uint8_t* p, uint32_t v) {
  for (int i = 0; i < 4; ++i) p[i] = (v >> (8 * i)) & 0xFF;
}
void PutU64(uint8_t* p, uint64_t v) {
  for (int i = 0; i < 8; ++i) p[i] = (v >> (8 * i)) & 0xFF;
}
uint16_t GetU16(const uint8_t* p) { return static_cast<uint16_t>(p[0] | p[1] << 8); }
uint32_t GetU32(const uint8_t* p) {
  uint32_t v = 0;
  for (int i = 3; i >= 0; --i) v = v << 8 | p[i];
  return v;
}
uint64_t GetU64(const uint8_t* p) {
  uint64_t v = 0;
  for (int i = 7; i >= 0; --i) v = v << 8 | p[i];
  return v;
}

std::string Hex32(uint32_t v) {
  char b[16];
  std::snprintf(b, sizeof b, "0x%08x", v);
  return b;
}

Status HeaderError(const std::string& field, const std::string& what) {
  return InvalidArgument("frame header: " + field + ": " + what);
}

bool KnownKind(uint8_t k) { return k >= 1 && k <= 6; }
bool KnownDType(uint8_t d) { return d >= 1 && d <= 4; }

}  // namespace

const char* FrameKindName(FrameKind k) {
  switch (k) {
    case FrameKind::kActivation: return "ACTIVATION";
    case FrameKind::kEpDispatch: return "EP_DISPATCH";
    case FrameKind::kEpCombine: return "EP_COMBINE";
    case FrameKind::kTokens: return "TOKENS";
    case FrameKind::kControl: return "CONTROL";
    case FrameKind::kTpGather: return "TP_GATHER";
  }
  return "?";
}

const char* FrameDTypeName(FrameDType t) {
  switch (t) {
    case FrameDType::kF32: return "f32";
    case FrameDType::kBF16: return "bf16";
    case FrameDType::kI32: return "i32";
    case FrameDType::kU8: return "u8";
  }
  return "?";
}

size_t FrameDTypeSize(FrameDType t) {
  switch (t) {
    case FrameDType::kF32: return 4;
    case FrameDType::kBF16: return 2;
    case FrameDType::kI32: return 4;
    case FrameDType::kU8: return 1;
  }
  return 0;
}

uint64_t FrameHeader::numel() const {
  uint64_t n = 1;
  for (int i = 0; i < rank && i < kFrameMaxRank; ++i) n *= dims[i];
  return n;
}

void FrameHeader::set_shape(const std::vector<uint32_t>& shape) {
  rank = static_cast<uint8_t>(shape.size());
  dims.fill(0);
  for (size_t i = 0; i < shape.size() && i < dims.size(); ++i) dims[i] = shape[i];
}

std::vector<uint32_t> FrameHeader::shape() const {
  return std::vector<uint32_t>(dims.begin(), dims.begin() + std::min<int>(rank, kFrameMaxRank));
}

Status ValidateFrameHeader(const FrameHeader& h, uint64_t max_payload) {
  if (!KnownKind(static_cast<uint8_t>(h.kind)))
    return HeaderError("kind", "unknown value " + std::to_string(static_cast<int>(h.kind)));
  if (!KnownDType(static_cast<uint8_t>(h.dtype)))
    return HeaderError("dtype", "unknown value " + std::to_string(static_cast<int>(h.dtype)));
  if (h.rank < 1 || h.rank > kFrameMaxRank)
    return HeaderError("rank", std::to_string(h.rank) + " not in 1..4");
  for (int i = h.rank; i < kFrameMaxRank; ++i)
    if (h.dims[i] != 0)
      return HeaderError("dims[" + std::to_string(i) + "]",
                         std::to_string(h.dims[i]) + " beyond rank " + std::to_string(h.rank) +
                             " (must be 0)");
  if (h.payload_bytes > max_payload)
    return HeaderError("payload_length", std::to_string(h.payload_bytes) +
                                             " bytes exceeds the limit of " +
                                             std::to_string(max_payload));
  // Four u32 dims times an element size of at most 4 can overflow u64: check per step.
  const uint64_t elem = FrameDTypeSize(h.dtype);
  uint64_t bytes = elem;
  for (int i = 0; i < h.rank; ++i) {
    if (h.dims[i] != 0 && bytes > max_payload / h.dims[i])
      return HeaderError("dims", "shape needs more than the payload limit of " +
                                     std::to_string(max_payload) + " bytes");
    bytes *= h.dims[i];
  }
  if (h.payload_bytes != bytes)
    return HeaderError("payload_length",
                       std::to_string(h.payload_bytes) + " != " + std::to_string(h.numel()) +
                           " elements x " + std::to_string(elem) + " bytes (" +
                           FrameDTypeName(h.dtype) + ")");
  return Status::Ok();
}

namespace {

// The 64 bytes of a validated header whose payload_bytes and payload_crc are set.
void WriteFrameHeader(const FrameHeader* h, uint8_t out[kFrameHeaderSize]) {
  std::memset(out, 0, kFrameHeaderSize);
  std::memcpy(out, kFrameMagic, 4);
  PutU16(out + 4, kFrameVersion);
  out[6] = static_cast<uint8_t>(h->kind);
  out[7] = static_cast<uint8_t>(h->dtype);
  PutU64(out + 8, h->step_id);
  PutU32(out + 16, h->micro_batch);
  PutU32(out + 20, h->tag);
  out[24] = h->rank;
  for (int i = 0; i < kFrameMaxRank; ++i) PutU32(out + 28 + 4 * i, h->dims[i]);
  PutU64(out + 44, h->payload_bytes);
  PutU32(out + 52, h->payload_crc);
  PutU32(out + kHeaderCrcOffset, Crc32c(out, kHeaderCrcOffset));
}

}  // namespace

Status EncodeFrameHeader(FrameHeader* h, const void* payload, size_t nbytes,
                         uint8_t out[kFrameHeaderSize]) {
  h->payload_bytes = nbytes;
  FM_RETURN_IF_ERROR(ValidateFrameHeader(*h, ~uint64_t{0}));
  h->payload_crc = Crc32c(payload, nbytes);
  WriteFrameHeader(h, out);
  return Status::Ok();
}

Status EncodeFrameHeaderWithoutPayloadCrc(FrameHeader* h, size_t nbytes,
                                          uint8_t out[kFrameHeaderSize]) {
  h->payload_bytes = nbytes;
  FM_RETURN_IF_ERROR(ValidateFrameHeader(*h, ~uint64_t{0}));
  h->payload_crc = 0;
  WriteFrameHeader(h, out);
  return Status::Ok();
}

Result<std::vector<uint8_t>> EncodeFrame(FrameHeader header, const void* payload, size_t nbytes) {
  std::vector<uint8_t> out(kFrameHeaderSize + nbytes);
  FM_RETURN_IF_ERROR(EncodeFrameHeader(&header, payload, nbytes, out.data()));
  if (nbytes) std::memcpy(out.data() + kFrameHeaderSize, payload, nbytes);
  return out;
}

Result<FrameHeader> DecodeFrameHeader(const uint8_t* p, size_t nbytes, uint64_t max_payload) {
  if (nbytes < kFrameHeaderSize)
    return HeaderError("length", "truncated: " + std::to_string(nbytes) + " of " +
                                     std::to_string(kFrameHeaderSize) + " bytes");
  if (std::memcmp(p, kFrameMagic, 4) != 0)
    return HeaderError("magic", Hex32(GetU32(p)) + " (want \"FMSH\")");
  const uint16_t version = GetU16(p + 4);
  if (version != kFrameVersion)
    return HeaderError("version", std::to_string(version) + " unsupported (want " +
                                      std::to_string(kFrameVersion) + ")");
  for (size_t off : {25, 26, 27, 56, 57, 58, 59})
    if (p[off] != 0)
      return HeaderError("reserved", "byte " + std::to_string(off) + " is " +
                                         std::to_string(p[off]) + " (must be 0)");
  FrameHeader h;
  h.kind = static_cast<FrameKind>(p[6]);
  h.dtype = static_cast<FrameDType>(p[7]);
  h.step_id = GetU64(p + 8);
  h.micro_batch = GetU32(p + 16);
  h.tag = GetU32(p + 20);
  h.rank = p[24];
  for (int i = 0; i < kFrameMaxRank; ++i) h.dims[i] = GetU32(p + 28 + 4 * i);
  h.payload_bytes = GetU64(p + 44);
  h.payload_crc = GetU32(p + 52);
  FM_RETURN_IF_ERROR(ValidateFrameHeader(h, max_payload));
  const uint32_t stored = GetU32(p + kHeaderCrcOffset);
  const uint32_t computed = Crc32c(p, kHeaderCrcOffset);
  if (stored != computed)
    return HeaderError("header_crc", "stored " + Hex32(stored) + ", computed " + Hex32(computed));
  return h;
}

Status VerifyFramePayload(const FrameHeader& h, const uint8_t* payload, size_t nbytes) {
  if (nbytes != h.payload_bytes)
    return InvalidArgument("frame payload: length " + std::to_string(nbytes) +
                           " != header payload_length " + std::to_string(h.payload_bytes));
  const uint32_t computed = Crc32c(payload, nbytes);
  if (computed != h.payload_crc)
    return InvalidArgument("frame payload: payload_crc mismatch (header " + Hex32(h.payload_crc) +
                           ", computed " + Hex32(computed) + ")");
  return Status::Ok();
}

Result<Frame> DecodeFrame(const uint8_t* data, size_t nbytes, uint64_t max_payload) {
  FM_ASSIGN_OR_RETURN(FrameHeader h, DecodeFrameHeader(data, nbytes, max_payload));
  const size_t have = nbytes - kFrameHeaderSize;
  if (have < h.payload_bytes)
    return InvalidArgument("frame payload: truncated: " + std::to_string(have) + " of " +
                           std::to_string(h.payload_bytes) + " bytes");
  if (have > h.payload_bytes)
    return InvalidArgument("frame payload: " + std::to_string(have - h.payload_bytes) +
                           " trailing bytes after payload_length " +
                           std::to_string(h.payload_bytes));
  const uint8_t* payload = data + kFrameHeaderSize;
  FM_RETURN_IF_ERROR(VerifyFramePayload(h, payload, have));
  Frame f;
  f.header = h;
  f.payload.assign(payload, payload + have);
  return f;
}

void F32ToBf16Payload(const float* src, size_t n, uint16_t* dst) {
  for (size_t i = 0; i < n; ++i) dst[i] = F32ToBf16(src[i]);
}

void Bf16ToF32Payload(const uint16_t* src, size_t n, float* dst) {
  for (size_t i = 0; i < n; ++i) dst[i] = Bf16ToF32(src[i]);
}

Result<std::vector<float>> FramePayloadAsF32(const Frame& f) {
  const size_t n = f.header.numel();
  std::vector<float> out(n);
  if (f.header.dtype == FrameDType::kF32 && f.payload.size() == n * 4) {
    if (n) std::memcpy(out.data(), f.payload.data(), n * 4);
    return out;
  }
  if (f.header.dtype == FrameDType::kBF16 && f.payload.size() == n * 2) {
    // Bytes are little-endian u16s; assemble explicitly (payload alignment is not assumed).
    for (size_t i = 0; i < n; ++i)
      out[i] = Bf16ToF32(static_cast<uint16_t>(f.payload[2 * i] | f.payload[2 * i + 1] << 8));
    return out;
  }
  return InvalidArgument(std::string("frame payload: dtype ") + FrameDTypeName(f.header.dtype) +
                         " with " + std::to_string(f.payload.size()) + " bytes is not " +
                         std::to_string(n) + " f32/bf16 values");
}

}  // namespace fm::net
