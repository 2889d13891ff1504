// libFuzzer target: the safetensors header parser must never crash on any file, and whatever it
// accepts must satisfy the invariants the loader relies on (every tensor inside the data section,
// spans matching dtype * shape, no two tensors overlapping).
#include <cstdint>
#include <cstdlib>

#include "model/safetensors.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  auto h = fm::ParseSafetensorsHeader(data, size, size, "fuzz.safetensors");
  if (!h.ok()) return 0;
  if (h->data_offset < 8 || h->data_offset > size) std::abort();
  const uint64_t data_size = size - h->data_offset;
  uint64_t prev_end = 0;
  for (const auto& t : h->tensors) {
    uint64_t n = 0;
    if (!fm::TensorNbytes(t.dtype, t.shape, &n) || t.end - t.begin != n) std::abort();
    if (t.begin > t.end || t.end > data_size) std::abort();
    if (n > 0 && t.begin < prev_end) std::abort();
    if (n > 0) prev_end = t.end;
    if (h->Find(t.name) == nullptr) std::abort();
  }
  return 0;
}
