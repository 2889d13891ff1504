// Generate: the single-sequence generation loop over a whole-model ShardModel: prefill the
// prompt, then decode one token at a time, sampling each, until EOS or max_tokens. Used by
// `flashmesh generate --model`; the daemons decode through the scheduler and workers instead.
#pragma once
#include <cstdint>
#include <functional>
#include <span>
#include <string>
#include <vector>

#include "common/status.h"
#include "model/forward.h"
#include "model/sampler.h"

namespace fm {

struct GenerateOptions {
  SamplerConfig sampling;
  int64_t max_tokens = 64;   // >= 1 generated tokens at most (the EOS token counts)
  int32_t eos_id = -1;       // generation stops after sampling it; -1: only max_tokens stops
  std::vector<int32_t> stop_token_ids;   // and after one of these (vLLM's)
  // No stop (eos_id, stop_token_ids) before this many tokens: the sampler holds them back.
  int64_t min_tokens = 0;
  int64_t max_context = 0;   // KV capacity; 0 = prompt + max_tokens
  // The prompt goes through in chunks of this many tokens, as a server's does with
  // limits.max_step_tokens (on the CPU the bits are those of one whole prefill either way).
  int64_t prefill_chunk = 2048;
};

enum class FinishReason { kStop, kLength, kCancelled };
const char* FinishReasonName(FinishReason r);  // "stop" | "length" | "cancelled"

struct GenerateResult {
  std::vector<int32_t> tokens;  // every sampled token, the EOS included
  FinishReason finish = FinishReason::kLength;
  int64_t prompt_tokens = 0;
  double prefill_seconds = 0.0;  // prompt forward + first sample
  double decode_seconds = 0.0;   // all later tokens
};

// Called once per sampled token, in order, the EOS included; returning false cancels.
using TokenCallback = std::function<bool(const SampledToken&)>;

// The model must hold every layer, the embedding and the head (single-process mode).
// Errors: empty prompt, max_tokens < 1, bad sampling config (field named), forward errors.
Result<GenerateResult> Generate(const ShardModel& model, std::span<const int32_t> prompt,
                                const GenerateOptions& opt, const TokenCallback& on_token);

}  // namespace fm
