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

struct SampleResult {
  int32_t id = -1;
  float logprob = 0.0f;
  int32_t status = kSampleOk;
  int32_t top_count = 0;  // entries of top_id / top_logprob
  int64_t rank = 0;       // score rows: the ids whose logit is >= id's (vLLM's rank); else 0
  int32_t top_id[kSampleMaxTop] = {};
  float top_logprob[kSampleMaxTop] = {};
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
// scratch: SampleScratchBytes(rows, vocab) device bytes. Two launches.
Status SampleRows(const float* logits, int64_t rows, int64_t vocab, const SampleParams* params,
                  void* scratch, SampleResult* out);

}  // namespace fm::cuda
