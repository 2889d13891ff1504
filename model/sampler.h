// Sampler: picks the next token from one row of logits: greedy, or temperature + min-p + top-k +
// top-p with an own seeded RNG (xoshiro256**), so a seed gives the same tokens on every machine
// and build; repetition / frequency / presence penalties from the sequence's tokens first. See
// docs/api.md "Sampling" for the exact rules.
#pragma once
#include <cstdint>
#include <span>
#include <string>
#include <unordered_map>
#include <unordered_set>
#include <utility>
#include <vector>

#include "common/status.h"

namespace fm {

struct SamplerConfig {
  bool greedy = false;       // argmax; also implied by temperature == 0
  float temperature = 1.0f;  // >= 0
  int32_t top_k = 0;         // 0 = no top-k; else keep the k largest logits
  float top_p = 1.0f;        // (0, 1]: keep the smallest prefix of probability >= top_p
  uint64_t seed = 0;
  int32_t top_logprobs = 0;  // [0, kMaxTopLogprobs]: alternatives reported with each token
  // Penalties on the logits of tokens the sequence holds (vLLM's rules, docs/api.md):
  float repetition_penalty = 1.0f;  // > 0: prompt or generated: l > 0 ? l / r : l * r (1 = off)
  float frequency_penalty = 0.0f;   // [-2, 2]: generated: l -= f * count
  float presence_penalty = 0.0f;    // [-2, 2]: generated: l -= p (once)
  float min_p = 0.0f;               // [0, 1]: drop tokens of probability < min_p * the largest
  // (token, bias in [-100, 100]): added to the logit before anything else (OpenAI's logit_bias).
  std::vector<std::pair<int32_t, float>> logit_bias = {};
  // Until min_tokens tokens are generated, min_tokens_ids (end-of-sentence, stop tokens) cannot
  // be drawn (their logits are -inf).
  int32_t min_tokens = 0;
  std::vector<int32_t> min_tokens_ids = {};
  // -1: off; else [0, kMaxTopLogprobs]: each prompt token after the first is scored
  // (ScoreToken) with this many alternatives: completions' echo with logprobs, vLLM's
  // prompt_logprobs.
  int32_t prompt_logprobs = -1;
};

// OpenAI's bound on top_logprobs (and on completions' logprobs).
constexpr int32_t kMaxTopLogprobs = 20;

// InvalidArgument naming the field: temperature < 0 (or NaN), top_p outside (0, 1], top_k < 0,
// top_logprobs outside [0, kMaxTopLogprobs], repetition_penalty not > 0, frequency_penalty or
// presence_penalty outside [-2, 2], min_p outside [0, 1] (NaN is outside every range), a
// logit_bias token < 0 or bias outside [-100, 100], min_tokens < 0, prompt_logprobs outside
// [-1, kMaxTopLogprobs].
Status ValidateSamplerConfig(const SamplerConfig& cfg);

// splitmix64-seeded xoshiro256** (Blackman & Vigna): fixed, portable sequence per seed.
class Rng {
 public:
  explicit Rng(uint64_t seed);
  uint64_t Next();
  double Uniform();  // [0, 1) with 53 random bits
 private:
  uint64_t s_[4];
};

struct TokenLogprob {
  int32_t id = -1;
  float logprob = 0.0f;
  bool operator==(const TokenLogprob&) const = default;
};

struct SampledToken {
  int32_t id = -1;
  // Log-probability of `id` under the distribution it was drawn from: softmax(logits / T)
  // restricted to the top-k/top-p set and renormalized; for greedy, log_softmax(logits)[id].
  float logprob = 0.0f;
  // The config's top_logprobs most likely tokens under that same distribution, most likely
  // first (equal logits: lower id first), each with its logprob computed as `logprob` is (so
  // the chosen token's entry, when it is among them, has its bits). Tokens of probability 0
  // (outside the top-k/top-p set) are left out, so there can be fewer.
  std::vector<TokenLogprob> top;
  // From ShardModel::SampleNext: why this row has no token (its logits hold a NaN or +inf, or
  // no finite value); id is then -1. One row's failure leaves the other rows' picks standing.
  Status error;
  // ScoreToken only: the ids whose logit is at least id's, id included (vLLM's rank: 1 = the
  // most likely; among equal logits each gets the group's last rank). 0 from the sampler.
  int64_t rank = 0;

  static SampledToken Failed(Status why) {
    SampledToken t;
    t.error = std::move(why);
    return t;
  }
};

// A known token's score under the model: logprob = log_softmax(logits)[id] of the raw logits
// (no temperature, bias or penalty: vLLM's prompt logprobs), and the `top` most likely tokens
// with theirs, most likely first (equal logits: lower id first), -inf logits left out. The
// values have the bits a greedy Sampler gives the same ids. NaN, +inf or no finite logit, or an
// id outside the row, are InvalidArgument.
Result<SampledToken> ScoreToken(std::span<const float> logits, int32_t id, int32_t top);
// ScoreToken's check of the id against a row of n logits.
Status CheckScoredId(int32_t id, int64_t n);

class Sampler {
 public:
  static Result<Sampler> Create(const SamplerConfig& cfg);
  const SamplerConfig& config() const { return cfg_; }
  bool is_greedy() const { return cfg_.greedy || cfg_.temperature == 0.0f; }
  // Draws one token from logits [vocab]; advances the RNG by one draw when not greedy.
  // NaN logits or no finite logit are InvalidArgument.
  Result<SampledToken> Sample(std::span<const float> logits);
  // The draw Sample makes (advances the RNG): a device sampler takes it as its uniform, so the
  // RNG's sequence is the same wherever the pick runs.
  double DrawUniform() { return rng_.Uniform(); }
  // Sample with the draw given: Sample(l) == SampleWith(l, is_greedy() ? 0 : DrawUniform()).
  Result<SampledToken> SampleWith(std::span<const float> logits, double u) const;
  // SampleWith of logits already adjusted (a device applied Adjusted's rules to them).
  Result<SampledToken> SampleAdjustedWith(std::span<const float> adjusted, double u) const;
  // The tokens that enter the sequence, in order: the prompt's (generated false), then each
  // sampled token as it is fed back (generated true). The penalties read them; without
  // penalties nothing is kept.
  void Observe(std::span<const int32_t> tokens, bool generated);
  // This sampler (of a sequence forked from src at src's position, nothing generated by either)
  // takes the prompt tokens src observed. CanAdoptPrompt: InvalidArgument when this one's
  // penalties need them and src did not keep them, or when either has generated.
  Status CanAdoptPrompt(const Sampler& src) const;
  Status AdoptPrompt(const Sampler& src);
  // True when the next pick adjusts the logits first (logit_bias, the min_tokens mask, a penalty,
  // min-p when sampling): a device sampler applies Adjusted's rules where the logits are
  // (kernels/cuda/sample_ops.h AdjustLogits), from the state below.
  bool AdjustsLogits() const;
  // logits with the bias, the min_tokens mask, the penalties and min-p applied (min-p only when
  // sampling), as the next pick sees them.
  std::vector<float> Adjusted(std::span<const float> logits) const;
  bool masks_min_tokens() const;   // the min_tokens ids are still held back
  // What the frequency and presence penalties subtract from the logit of an id generated
  // `count` times, and min-p's cut (an id with (l - l_max) * inv_t < floor is out): Adjusted's
  // arithmetic, which a device applying it takes from here to have its bits.
  double penalty_subtraction(int32_t count) const;
  struct MinPCut {
    double inv_t, floor;
  };
  MinPCut min_p_cut() const;
  const std::unordered_set<int32_t>& seen() const { return seen_; }  // repetition's ids
  // Each generated id's count (frequency, presence); kept only with those penalties.
  const std::unordered_map<int32_t, int32_t>& generated() const { return generated_; }

 private:
  explicit Sampler(const SamplerConfig& cfg) : cfg_(cfg), rng_(cfg.seed) {}
  bool has_penalties() const;
  bool adjusts(bool sampling) const;
  SamplerConfig cfg_;
  Rng rng_;
  std::unordered_set<int32_t> seen_;                 // prompt and generated ids (repetition)
  std::unordered_map<int32_t, int32_t> generated_;   // generated id -> times (frequency, presence)
  int64_t generated_count_ = 0;                       // tokens generated so far (min_tokens)
};

}  // namespace fm
