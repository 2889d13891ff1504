#include "model/generate.h"

#include <algorithm>
#include <chrono>

#include "model/kv_cache.h"

namespace fm {

const char* FinishReasonName(FinishReason r) {
  switch (r) {
    case FinishReason::kStop: return "stop";
    case FinishReason::kLength: return "length";
    case FinishReason::kCancelled: return "cancelled";
  }
  return "unknown";
}

namespace {

double SecondsSince(std::chrono::steady_clock::time_point t0) {
  return std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
}

// Runs tokens through the whole model on `cache`; with a sampler, draws the next token from the
// last row (a prompt chunk with more to come has none).
Result<SampledToken> Step(const ShardModel& model, SequenceCache* cache,
                          std::span<const int32_t> tokens, Sampler* sampler, Activations* x) {
  const int64_t T = static_cast<int64_t>(tokens.size());
  FM_RETURN_IF_ERROR(x->Resize(T));
  FM_RETURN_IF_ERROR(model.Embed(tokens, x->data()));
  BatchItem item{cache, tokens};
  FM_RETURN_IF_ERROR(model.ForwardLayers(std::span<const BatchItem>(&item, 1), x->data()));
  if (!sampler) return SampledToken{};
  Sampler* const samplers[] = {sampler};
  FM_ASSIGN_OR_RETURN(std::vector<SampledToken> next, model.SampleNext(x->row(T - 1), 1, samplers));
  if (!next[0].error.ok()) return next[0].error;
  return next[0];
}

}  // namespace

Result<GenerateResult> Generate(const ShardModel& model, std::span<const int32_t> prompt,
                                const GenerateOptions& opt, const TokenCallback& on_token) {
  const ModelConfig& cfg = model.config();
  if (!model.has_embed() || !model.has_head() || model.layer_begin() != 0 ||
      model.layer_end() != cfg.num_hidden_layers)
    return InvalidArgument("Generate: the model must hold all layers, the embedding and the head");
  if (prompt.empty()) return InvalidArgument("prompt: no tokens");
  if (opt.max_tokens < 1)
    return InvalidArgument("max_tokens: " + std::to_string(opt.max_tokens) + " (must be >= 1)");
  for (size_t i = 0; i < prompt.size(); ++i)
    if (prompt[i] < 0 || prompt[i] >= cfg.vocab_size)
      return InvalidArgument("prompt[" + std::to_string(i) + "]: token " +
                             std::to_string(prompt[i]) + " outside the vocabulary [0, " +
                             std::to_string(cfg.vocab_size) + ")");
  const int64_t need = static_cast<int64_t>(prompt.size()) + opt.max_tokens;
  const int64_t max_context = opt.max_context > 0 ? opt.max_context : need;
  if (need > max_context)
    return InvalidArgument("max_tokens: prompt (" + std::to_string(prompt.size()) + ") + " +
                           std::to_string(opt.max_tokens) + " exceeds max_context " +
                           std::to_string(max_context));
  if (opt.min_tokens < 0 || opt.min_tokens > opt.max_tokens)
    return InvalidArgument("min_tokens: " + std::to_string(opt.min_tokens) + " outside [0, max_tokens " +
                           std::to_string(opt.max_tokens) + "]");
  SamplerConfig sampling = opt.sampling;
  std::vector<int32_t> stops = opt.stop_token_ids;
  if (opt.eos_id >= 0) stops.push_back(opt.eos_id);
  if (opt.min_tokens > 0) {   // as the coordinator asks a server's last stage
    sampling.min_tokens = static_cast<int32_t>(opt.min_tokens);
    sampling.min_tokens_ids = stops;
  }
  FM_ASSIGN_OR_RETURN(Sampler sampler, Sampler::Create(sampling));
  sampler.Observe(prompt, false);

  GenerateResult res;
  res.prompt_tokens = static_cast<int64_t>(prompt.size());
  FM_ASSIGN_OR_RETURN(std::unique_ptr<SequenceCache> cache, model.NewSequence(max_context));
  FM_ASSIGN_OR_RETURN(std::unique_ptr<Activations> x, model.NewActivations());
  auto t0 = std::chrono::steady_clock::now();
  const size_t chunk = static_cast<size_t>(std::max<int64_t>(opt.prefill_chunk, 1));
  size_t sent = 0;
  for (; prompt.size() - sent > chunk; sent += chunk)
    FM_RETURN_IF_ERROR(Step(model, cache.get(), prompt.subspan(sent, chunk), nullptr, x.get()).status());
  FM_ASSIGN_OR_RETURN(SampledToken tok, Step(model, cache.get(), prompt.subspan(sent), &sampler, x.get()));
  while (true) {
    res.tokens.push_back(tok.id);
    if (res.tokens.size() == 1) {
      res.prefill_seconds = SecondsSince(t0);
      t0 = std::chrono::steady_clock::now();
    }
    if (on_token && !on_token(tok)) {
      res.finish = FinishReason::kCancelled;
      break;
    }
    const bool may_stop = static_cast<int64_t>(res.tokens.size()) >= opt.min_tokens;
    if (may_stop && std::find(stops.begin(), stops.end(), tok.id) != stops.end()) {
      res.finish = FinishReason::kStop;
      break;
    }
    if (static_cast<int64_t>(res.tokens.size()) >= opt.max_tokens) {
      res.finish = FinishReason::kLength;
      break;
    }
    sampler.Observe(std::span<const int32_t>(&tok.id, 1), true);
    FM_ASSIGN_OR_RETURN(tok, Step(model, cache.get(), std::span<const int32_t>(&tok.id, 1),
                                  &sampler, x.get()));
  }
  if (res.tokens.size() > 1) res.decode_seconds = SecondsSince(t0);
  return res;
}

}  // namespace fm
