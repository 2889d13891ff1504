// Data-plane frames (docs/wire-format.md): a fixed 64-byte little-endian header
// followed by the payload. The decoder validates every header byte and the payload CRC and
// returns a Status naming the bad field; callers close the connection on any error.
//
// Header layout (offsets in bytes, all integers little-endian):
//    0  u8[4]  magic "FMSH"
//    4  u16    version (kFrameVersion)
//    6  u8     kind (FrameKind)
//    7  u8     dtype (FrameDType)
//    8  u64    step id
//   16  u32    micro-batch id
//   20  u32    tag (free for the sender's protocol: layer index for EP, 0 otherwise)
//   24  u8     rank (1..4)
//   25  u8[3]  reserved, zero
//   28  u32[4] dims (dims beyond rank are zero)
//   44  u64    payload length in bytes (== product(dims) * dtype size, <= max payload)
//   52  u32    CRC32C of the payload
//   56  u32    reserved, zero
//   60  u32    CRC32C of header bytes [0, 60)
#pragma once
#include <array>
#include <cstddef>
#include <cstdint>
#include <string>
#include <vector>

#include "common/status.h"
#include "net/wire_format.h"

namespace fm::net {

inline constexpr int kFrameMaxRank = 4;
// Default payload limit: 1 GiB, far above any activation (prefill of 8k tokens x 4 x 4096 f32
// is 512 MiB) and low enough that a corrupt length cannot make a receiver allocate wildly.
inline constexpr uint64_t kDefaultMaxFramePayload = uint64_t{1} << 30;

enum class FrameKind : uint8_t {
  kActivation = 1,   // [T, hc, H] manifold from stage s to stage s+1
  kEpDispatch = 2,   // MoE dispatch: token hiddens to expert owners
  kEpCombine = 3,    // MoE combine: expert outputs back to the token's owner
  kTokens = 4,       // sampled token ids / logprobs
  kControl = 5,      // small protocol messages (barrier, shutdown, ...)
  kTpGather = 6,     // tensor parallel: a member's finished piece of a layer, to every member
};
const char* FrameKindName(FrameKind k);  // "ACTIVATION", ...; "?" for an unknown value

enum class FrameDType : uint8_t {
  kF32 = 1,    // the default: bit-exact activations
  kBF16 = 2,   // optional: half the bytes, round-to-nearest-even
  kI32 = 3,    // token ids
  kU8 = 4,     // opaque bytes (control messages)
};
const char* FrameDTypeName(FrameDType t);  // "f32", ...; "?" for an unknown value
size_t FrameDTypeSize(FrameDType t);       // bytes per element; 0 for an unknown value

// The decoded header. payload_bytes and payload_crc are filled by the encoder from the payload;
// a caller building a header sets kind, dtype, ids and shape.
struct FrameHeader {
  FrameKind kind = FrameKind::kActivation;
  FrameDType dtype = FrameDType::kF32;
  uint64_t step_id = 0;
  uint32_t micro_batch = 0;
  uint32_t tag = 0;
  uint8_t rank = 1;
  std::array<uint32_t, kFrameMaxRank> dims{};  // dims[i] for i < rank; the rest 0
  uint64_t payload_bytes = 0;
  uint32_t payload_crc = 0;

  uint64_t numel() const;  // product of dims[0..rank)
  void set_shape(const std::vector<uint32_t>& shape);  // rank = shape.size() (caller keeps <= 4)
  std::vector<uint32_t> shape() const;
};

// A received frame: header plus its own copy of the payload.
struct Frame {
  FrameHeader header;
  std::vector<uint8_t> payload;
};

// Checks kind, dtype, rank, dims and that product(dims) * dtype size == payload_bytes <=
// max_payload. Used by the encoder (refuse to send a bad frame) and the decoder.
Status ValidateFrameHeader(const FrameHeader& h, uint64_t max_payload = kDefaultMaxFramePayload);

// Fills header.payload_bytes / payload_crc from the payload, validates, and writes the 64 header
// bytes to out. The payload itself is not copied (the transport writes it from the caller's
// buffer right after the header).
Status EncodeFrameHeader(FrameHeader* header, const void* payload, size_t nbytes,
                         uint8_t out[kFrameHeaderSize]);
// The same for a payload the encoder cannot read (device memory sent by NCCL, which delivers
// the bytes or fails the group): payload_crc is 0, and that backend does not check it.
Status EncodeFrameHeaderWithoutPayloadCrc(FrameHeader* header, size_t nbytes,
                                          uint8_t out[kFrameHeaderSize]);
// Header + payload as one byte string (tests, fuzz seeds, in-process loopback).
Result<std::vector<uint8_t>> EncodeFrame(FrameHeader header, const void* payload, size_t nbytes);

// Parses and validates the 64 header bytes (every field and the header CRC). Errors name the
// field, e.g. "frame header: bad magic 0x41414141 (want FMSH)".
Result<FrameHeader> DecodeFrameHeader(const uint8_t* data, size_t nbytes,
                                      uint64_t max_payload = kDefaultMaxFramePayload);
// Checks the payload against header.payload_bytes and header.payload_crc.
Status VerifyFramePayload(const FrameHeader& h, const uint8_t* payload, size_t nbytes);
// A whole frame from a byte string: header, payload length (truncated or trailing bytes are
// errors) and CRC.
Result<Frame> DecodeFrame(const uint8_t* data, size_t nbytes,
                          uint64_t max_payload = kDefaultMaxFramePayload);

// Payload conversion helpers (f32 <-> bf16 round-to-nearest-even, common/numfmt.h).
void F32ToBf16Payload(const float* src, size_t n, uint16_t* dst);
void Bf16ToF32Payload(const uint16_t* src, size_t n, float* dst);
// The payload of an f32 or bf16 frame as f32 values; any other dtype is an error naming it.
Result<std::vector<float>> FramePayloadAsF32(const Frame& f);

}  // namespace fm::net
