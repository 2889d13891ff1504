// libFuzzer target: config.json (model/config.cpp) must turn any file into a model config or an
// error naming the field, never a crash or an exception; what it accepts satisfies the checks
// the loader relies on (positive sizes, top-k within the experts).
#include <cstdint>
#include <cstdlib>
#include <string>

#include "model/config.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  const std::string text(reinterpret_cast<const char*>(data), size);
  auto c = fm::ParseModelConfig(text, "fuzz.json");
  if (!c.ok()) return 0;
  if (c->hidden_size <= 0 || c->num_hidden_layers < 0 || c->vocab_size <= 0) std::abort();
  if (c->num_experts_per_tok > c->n_routed_experts) std::abort();
  for (int64_t l = 0; l < c->num_hidden_layers; ++l) (void)c->compress_ratio(l);
  return 0;
}
