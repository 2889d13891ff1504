// libFuzzer target: the data-plane frame decoder must never crash, and whatever it accepts must
// re-encode to exactly the same bytes (nothing in a valid frame is ignored).
#include <cstdint>
#include <cstdlib>
#include <cstring>

#include "net/frame.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  constexpr uint64_t kMaxPayload = 1 << 20;  // keeps a fuzzed length from allocating much
  auto frame = fm::net::DecodeFrame(data, size, kMaxPayload);
  if (!frame.ok()) return 0;
  auto again = fm::net::EncodeFrame(frame->header, frame->payload.data(), frame->payload.size());
  if (!again.ok() || again->size() != size || std::memcmp(again->data(), data, size) != 0)
    std::abort();
  if (frame->header.dtype == fm::net::FrameDType::kF32 ||
      frame->header.dtype == fm::net::FrameDType::kBF16) {
    auto values = fm::net::FramePayloadAsF32(*frame);
    if (!values.ok() || values->size() != frame->header.numel()) std::abort();
  }
  return 0;
}
