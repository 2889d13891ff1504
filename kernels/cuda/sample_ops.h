// Sampling on the device (model/sampler.h's rules): the last stage draws each row's next token
// from its logits where they are, so only (id, logprob) per row, and its top logprobs when
// asked for, cross to the host instead of [vocab] floats; a known token is scored the same way
// (a prompt's logprobs: its log_softmax, rank and top ids). The RNG stays on the host
// (Sampler::DrawUniform): the host passes each row's uniform draw in, so a seed gives the same
// sequence of draws as the CPU sampler. Sums run in a fixed device order (per-chunk partials
// merged in chunk order), so results are deterministic run to run; they match the CPU
// sampler's exactly except where a double rounding difference moves a cumulative sum across
// the draw or the top-p target. No CUDA types: plain C++ includes it.
#pragma once
#include <cstddef>
#include <cstdint>

#include "common/status.h"

namespace fm::cuda {

// Alternatives a row can report (model/sampler.h's kMaxTopLogprobs).
constexpr int kSampleMaxTop = 20;

// One row's sampler (SamplerConfig) and its draw.
struct SampleParams {
  float temperature = 1.0f;  // > 0 unless greedy
  float top_p = 1.0f;        // (0, 1]
  int32_t top_k = 0;         // 0 = off
  int32_t greedy = 0;        // argmax with log_softmax's logprob
  double u = 0.0;            // the row's uniform draw in [0, 1); unused when greedy
  int32_t top_n = 0;         // [0, kSampleMaxTop]: the most likely ids to report (top logprobs)
  int32_t score_id = -1;     // >= 0: no draw; this known id is scored as greedy (ScoreToken)
};

enum SampleStatus : int32_t {
  kSampleOk = 0,
  kSampleNaN = 1,        // id: the first NaN logit
  kSampleNoFinite = 2,   // every logit is -inf
  kSamplePosInf = 3,     // id: the first +inf logit
  kSampleNeedsHost = 4,  // the candidate set exceeds kSampleMaxCandidates: sample on the host
  kSampleBadId = 5,      // score_id is not below vocab
};

// What every row sends to the host (24 bytes); its alternatives are a SampleTop of their own,
// copied only for a step with a row that asks for them.
struct SampleResult {
  int32_t id = -1;
  float logprob = 0.0f;
  int32_t status = kSampleOk;
  int32_t top_count = 0;  // entries of the row's SampleTop
  int64_t rank = 0;       // score rows: the ids whose logit is >= id's (vLLM's rank); else 0
};

struct SampleTop {
  int32_t id[kSampleMaxTop] = {};
  float logprob[kSampleMaxTop] = {};
};

// Top-k / top-p work on at most this many sorted candidates on the device (a top_k above it,
// or a top-p prefix longer than it, is kSampleNeedsHost).
constexpr int kSampleMaxCandidates = 4096;

// Bytes of the scratch SampleRows needs for `rows` rows of `vocab` logits.
size_t SampleScratchBytes(int64_t rows, int64_t vocab);

// For r < rows: out[r] = a token drawn from logits[r, :vocab] under params[r] (device arrays):
// greedy: the argmax (ties to the lower id), logprob = log_softmax; otherwise softmax(l / T)
// over the top_k largest (larger logit first, lower id among equal ones), then the shortest
// prefix of that order whose probability reaches top_p, renormalized; the pick is the first
// candidate whose cumulative weight exceeds u * total (in id order without truncation).
// score_id >= 0: the row is greedy's log_softmax with score_id in place of the argmax, and its
// rank. top_n > 0: the top_n best ids of the order above (at most kSampleMaxTop), with their
// logprobs under the pick's distribution; ids of probability 0 (-inf, outside the top-k/top-p
// set) left out, so there can be fewer: Sampler::SampleWith's and ScoreToken's `top`.
// top[r] holds them (written only when params[r].top_n > 0), out[r].top_count how many.
// scratch: SampleScratchBytes(rows, vocab) device bytes. Two launches.
Status SampleRows(const float* logits, int64_t rows, int64_t vocab, const SampleParams* params,
                  void* scratch, SampleResult* out, SampleTop* top);

// Logit adjustments on the device (model/sampler.cpp Sampler::Adjusted), applied in place before
// SampleRows, so that a row with a logit_bias, a min_tokens mask, penalties or min-p is drawn
// where its logits are. The host lists the ids a row's rules touch, each id once
// (model/cuda/logit_edits.h); every change is the CPU's double arithmetic rounded to float as the
// CPU rounds it, so the adjusted logits have Adjusted's bits.
struct LogitEdit {
  int32_t id = 0;
  int32_t bias_begin = 0, bias_end = 0;  // the id's logit_bias values, in the request's order
  uint8_t held = 0;       // a min_tokens id
  uint8_t seen = 0;       // the repetition penalty applies
  uint8_t generated = 0;  // `subtract` applies
  double subtract = 0.0;  // frequency * count + presence
};

struct AdjustRow {
  int32_t row = 0;                         // the row of logits
  int32_t edit_begin = 0, edit_end = 0;    // its edits
  int32_t mask = 0;                        // held ids -> -inf unless no other logit is finite
  double repetition = 1.0;                 // seen ids: l > 0 ? l / r : l * r
  int32_t min_p = 0;                       // last: (l - max) * inv_t < floor -> -inf
  double inv_t = 1.0, floor = 0.0;         // 1 / T, log(min_p)
};

// For i < n: logits[rows[i].row, :vocab] adjusted as Adjusted does: each edit's biases in order
// (l += b, clamped to +-FLT_MAX), then the mask, then the repetition penalty and the subtraction,
// then min-p; a change never touches a logit that is not finite (the model's NaN or +inf stay
// errors, -inf stays out). rows, edits, biases: device arrays. One launch, a block a row.
Status AdjustLogits(float* logits, int64_t vocab, const AdjustRow* rows, int64_t n,
                    const LogitEdit* edits, const float* biases);

}  // namespace fm::cuda
