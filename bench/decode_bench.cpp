#include "bench/decode_bench.h"

#include <algorithm>
#include <chrono>
#include <cstdint>
#include <cstdio>
#include <memory>
#include <random>
#include <set>
#include <string>
#include <utility>
#include <vector>

#include "common/device_transfers.h"
#include "common/membw.h"
#include "common/thread_pool.h"
#include "model/checkpoint.h"
#include "model/cuda/shard_model.h"
#include "model/forward.h"
#include "model/inspect.h"
#include "model/kv_cache.h"
#include "model/mkmodel.h"
#include "model/moe.h"

namespace fm::bench {
namespace {

constexpr size_t kProbeBytes = size_t{256} << 20;  // well beyond any CPU cache
constexpr int64_t kDecodeRounds = 8;   // decode rounds, each followed by a probe
constexpr int kProbePasses = 3;        // best of, per probe
constexpr int kHeadReps = 8;           // embed + logits timed alone, median of

double Median(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  const size_t n = v.size();
  return n == 0 ? 0.0 : n % 2 ? v[n / 2] : 0.5 * (v[n / 2 - 1] + v[n / 2]);
}

// Runs the routed experts locally, adding up the weight bytes of the distinct experts each
// call touches (for one decode row: its top-k).
class CountingExpertExecutor : public ExpertExecutor {
 public:
  // moe: the MoE weights of layers 0 .. moe.size()-1, in order.
  CountingExpertExecutor(const ModelConfig& cfg, std::vector<MoeWeights> moe, ThreadPool* pool)
      : moe_(std::move(moe)), local_(cfg, Pointers(cfg, moe_), pool),
        top_k_(cfg.num_experts_per_tok) {}
  Status RunRouted(int64_t layer, const float* x, int64_t T, const int32_t* expert_ids,
                   const float* weights, float* routed) override {
    FM_RETURN_IF_ERROR(local_.RunRouted(layer, x, T, expert_ids, weights, routed));
    Count(layer, T, expert_ids);  // local_ has checked layer and ids
    return Status::Ok();
  }
  Status RunSlots(int64_t layer, const float* x, int64_t T, const int32_t* expert_ids,
                  float* slots) override {
    FM_RETURN_IF_ERROR(local_.RunSlots(layer, x, T, expert_ids, slots));
    Count(layer, T, expert_ids);
    return Status::Ok();
  }
  size_t bytes() const { return bytes_; }
  void reset() { bytes_ = 0; }

 private:
  static std::vector<const MoeWeights*> Pointers(const ModelConfig& cfg,
                                                 const std::vector<MoeWeights>& moe) {
    std::vector<const MoeWeights*> p(cfg.num_hidden_layers + cfg.num_nextn_predict_layers,
                                     nullptr);
    for (size_t l = 0; l < moe.size(); ++l) p[l] = &moe[l];
    return p;
  }
  void Count(int64_t layer, int64_t T, const int32_t* expert_ids) {
    for (int32_t e : std::set<int32_t>(expert_ids, expert_ids + T * top_k_)) {
      const ExpertWeights& ew = moe_[layer].experts[e];
      bytes_ += ew.w1.bytes() + ew.w2.bytes() + ew.w3.bytes();
    }
  }
  std::vector<MoeWeights> moe_;
  LocalExpertExecutor local_;
  int64_t top_k_;
  size_t bytes_ = 0;
};

// Reads one byte per page of every tensor, so the timed steps do not include first-touch
// page faults of the mapping (a serving worker has its weights resident).
Result<size_t> TouchWeights(const Checkpoint& ckpt) {
  size_t total = 0;
  unsigned sum = 0;
  for (const std::string& name : ckpt.tensor_names()) {
    FM_ASSIGN_OR_RETURN(TensorView t, ckpt.Get(name));
    for (size_t i = 0; i < t.nbytes; i += 4096) sum += t.data[i];
    total += t.nbytes;
  }
  volatile unsigned keep = sum;
  (void)keep;
  return total;
}

double Seconds(std::chrono::steady_clock::time_point a, std::chrono::steady_clock::time_point b) {
  return std::chrono::duration<double>(b - a).count();
}

// `streams` sequences decoding greedily on `shard`: each a random prompt of `context` tokens
// (Prefill, one sequence at a time), then steps of one token per sequence, all in one batch (the
// previous picks in, each row's greedy pick out through SampleNext, on the device for a device
// shard, as a serving last stage does). With context 0 a prompt's first token is the first input.
class GreedyDecode {
 public:
  GreedyDecode(ShardModel* shard, int64_t context, int64_t tokens, int64_t streams)
      : shard_(shard), cfg_(shard->config()), context_(context),
        greedy_(static_cast<size_t>(streams), *Sampler::Create(SamplerConfig{.greedy = true})),
        next_(static_cast<size_t>(streams)) {
    std::mt19937 rng(1234);
    for (int64_t b = 0; b < streams; ++b) {
      Result<std::unique_ptr<SequenceCache>> cache = shard->NewSequence(context + tokens + 1);
      if (!cache.ok()) {
        made_ = cache.status();
        break;
      }
      caches_.push_back(std::move(cache).value());
      prompts_.emplace_back(static_cast<size_t>(std::max<int64_t>(context, 1)));
      for (auto& t : prompts_.back())
        t = static_cast<int32_t>(rng() % static_cast<uint32_t>(cfg_.vocab_size));
      next_[b] = prompts_.back()[0];
    }
  }
  Status Prefill() {
    FM_RETURN_IF_ERROR(made_);   // every stream's cache
    for (size_t b = 0; context_ > 0 && b < caches_.size(); ++b) {
      BatchItem item{caches_[b].get(), prompts_[b]};
      FM_RETURN_IF_ERROR(Run({&item, 1}, prompts_[b], b));
    }
    return Status::Ok();
  }
  Status Step() {
    std::vector<BatchItem> items;
    for (size_t b = 0; b < caches_.size(); ++b) items.push_back({caches_[b].get(), {&next_[b], 1}});
    return Run(items, std::vector<int32_t>(next_), 0);
  }
  // Seconds of what a step does besides the layers for one token (embed it, the head and the
  // pick of the last row by `s`), timed alone after some steps: the median of `reps`. Leaves
  // the decode state as it was. A greedy pick must be the last stream's token of the last step;
  // another sampler observes its picks, as a sequence's penalties would see them.
  Result<double> HeadSeconds(int reps, Sampler* s) {
    if (!x_ || x_->rows() == 0) return Internal("bench decode: HeadSeconds before a step");
    FM_ASSIGN_OR_RETURN(std::unique_ptr<Activations> embedded, shard_->NewActivations());
    FM_RETURN_IF_ERROR(embedded->Resize(1));
    std::vector<double> secs;
    for (int i = 0; i < reps; ++i) {
      const auto t0 = std::chrono::steady_clock::now();
      FM_RETURN_IF_ERROR(shard_->Embed({&next_.back(), 1}, embedded->data()));
      Sampler* const one[] = {s};
      FM_ASSIGN_OR_RETURN(std::vector<SampledToken> pick,
                          shard_->SampleNext(x_->row(x_->rows() - 1), 1, one));
      secs.push_back(Seconds(t0, std::chrono::steady_clock::now()));
      FM_RETURN_IF_ERROR(pick[0].error);
      if (!s->is_greedy()) s->Observe({&pick[0].id, 1}, true);
      else if (pick[0].id != next_.back())  // the same row gave the last step's token
        return Internal("bench decode: the head of the last row gave token " +
                        std::to_string(pick[0].id) + ", the step gave " +
                        std::to_string(next_.back()));
    }
    return Median(secs);
  }
  Result<double> GreedyHeadSeconds(int reps) { return HeadSeconds(reps, &greedy_.back()); }
  // With a serving request's richer pick: sampling with the top 20 logprobs, repetition /
  // frequency / presence penalties over the last stream's prompt and picks, and min-p (on a
  // device: the alternatives and the logit adjustments on the device).
  Result<double> RichHeadSeconds(int reps) {
    FM_ASSIGN_OR_RETURN(Sampler rich, Sampler::Create(SamplerConfig{
                                          .temperature = 0.8f, .seed = 7, .top_logprobs = 20,
                                          .repetition_penalty = 1.1f, .frequency_penalty = 0.2f,
                                          .presence_penalty = 0.1f, .min_p = 0.05f}));
    rich.Observe(prompts_.back(), false);
    return HeadSeconds(reps, &rich);
  }

 private:
  // Embeds `toks` (the items' tokens in order), runs the layers, and picks the next token of each
  // item's last row into next_[first], next_[first + 1], ...
  Status Run(std::span<const BatchItem> items, const std::vector<int32_t>& toks, size_t first) {
    const int64_t n = static_cast<int64_t>(toks.size());
    // X stays in the shard's memory (the device's for a device shard), as on a worker.
    if (!x_) {
      FM_ASSIGN_OR_RETURN(x_, shard_->NewActivations());
      FM_ASSIGN_OR_RETURN(last_, shard_->NewActivations());
    }
    FM_RETURN_IF_ERROR(x_->Resize(n));
    FM_RETURN_IF_ERROR(shard_->Embed(toks, x_->data()));
    FM_RETURN_IF_ERROR(shard_->ForwardLayers(items, x_->data()));
    // Each item's last row, gathered when an item has several (a prefill).
    const float* rows = x_->data();
    if (static_cast<int64_t>(items.size()) != n) {
      FM_RETURN_IF_ERROR(last_->Resize(static_cast<int64_t>(items.size())));
      int64_t end = 0;
      for (size_t i = 0; i < items.size(); ++i) {
        end += static_cast<int64_t>(items[i].tokens.size());
        FM_RETURN_IF_ERROR(last_->CopyRows(static_cast<int64_t>(i), *x_, end - 1, 1));
      }
      rows = last_->data();
    }
    std::vector<Sampler*> s;
    for (size_t i = 0; i < items.size(); ++i) s.push_back(&greedy_[first + i]);
    FM_ASSIGN_OR_RETURN(std::vector<SampledToken> t,
                        shard_->SampleNext(rows, static_cast<int64_t>(items.size()), s));
    for (size_t i = 0; i < t.size(); ++i) {
      FM_RETURN_IF_ERROR(t[i].error);
      next_[first + i] = t[i].id;
    }
    return Status::Ok();
  }
  ShardModel* shard_;
  const ModelConfig& cfg_;
  int64_t context_;
  std::vector<std::unique_ptr<SequenceCache>> caches_;
  Status made_;   // the streams' caches: an error ends Prefill
  std::vector<std::vector<int32_t>> prompts_;
  std::vector<Sampler> greedy_;
  std::vector<int32_t> next_;
  std::unique_ptr<Activations> x_, last_;  // made on the first Run
};

// A decode run extrapolated to the full model (the header comment): the layers' share of a
// token spread evenly over the checkpoint's layers.
// head_rich_ms (RichHeadSeconds) is reported beside it, not in the prediction (greedy's).
struct FullModelPrediction {
  int64_t layers = 0, full_layers = 0;
  double head_ms = 0, head_rich_ms = 0, layer_ms = 0, full_ms = 0, full_bytes = 0, floor_ms = 0;
};

FullModelPrediction Predict(const ModelConfig& cfg, double token_s, double head_s,
                            double head_rich_s, double bw_gbps) {
  const ModelConfig full = FullModelConfig(cfg);
  FullModelPrediction p;
  p.layers = cfg.num_hidden_layers;
  p.full_layers = full.num_hidden_layers;
  p.head_ms = head_s * 1e3;
  p.head_rich_ms = head_rich_s * 1e3;
  p.layer_ms = (token_s - head_s) * 1e3 / static_cast<double>(p.layers);
  p.full_ms = p.layer_ms * static_cast<double>(p.full_layers) + p.head_ms;
  p.full_bytes = static_cast<double>(DecodeBytesPerToken(full));
  p.floor_ms = bw_gbps > 0 ? p.full_bytes / (bw_gbps * 1e9) * 1e3 : 0.0;
  return p;
}

// The prediction's JSON fields (after the others, before the closing brace).
std::string PredictionJson(const FullModelPrediction& p) {
  char buf[512];
  std::snprintf(buf, sizeof buf,
                ", \"layers\": %lld, \"head_ms\": %.4f, \"head_rich_ms\": %.4f, "
                "\"layer_ms\": %.4f, "
                "\"full_model_layers\": %lld, \"full_model_ms_per_token\": %.4f, "
                "\"full_model_tok_per_s\": %.4f, \"full_model_bytes_per_token\": %.0f, "
                "\"full_model_floor_ms\": %.4f",
                static_cast<long long>(p.layers), p.head_ms, p.head_rich_ms, p.layer_ms,
                static_cast<long long>(p.full_layers), p.full_ms, 1e3 / p.full_ms, p.full_bytes,
                p.floor_ms);
  return buf;
}

void PrintPrediction(const FullModelPrediction& p) {
  std::printf("head             %.3f ms a token (embed + head + greedy pick, timed alone)\n", p.head_ms);
  std::printf("head, rich pick  %.3f ms (sampling with 20 top logprobs, penalties, min-p)\n",
              p.head_rich_ms);
  std::printf("per layer        %.3f ms ((ms per token - head) / %lld layers)\n", p.layer_ms,
              static_cast<long long>(p.layers));
  std::printf("full model       %lld layers: %.2f ms a token predicted (%.2f tok/s); floor %.3f ms "
              "(%.2f GB a token at the measured bandwidth)\n",
              static_cast<long long>(p.full_layers), p.full_ms, 1e3 / p.full_ms, p.floor_ms,
              p.full_bytes / 1e9);
}

Status RunDecode(const DecodeOptions& o) {
  ShardSelection sel;
  sel.mtp = false;  // plain decode does not run the MTP block
  FM_ASSIGN_OR_RETURN(auto ckpt, Checkpoint::Open(o.model, sel));
  const ModelConfig& cfg = ckpt->config();
  ThreadPool pool(o.threads);
  FM_ASSIGN_OR_RETURN(auto shard, ShardModel::Create(*ckpt, &pool));
  if (!shard->has_embed() || !shard->has_head())
    return InvalidArgument(o.model + ": bench decode needs embed.weight and head.weight");

  std::vector<MoeWeights> moe;
  for (int64_t l = 0; l < cfg.num_hidden_layers; ++l) {
    FM_ASSIGN_OR_RETURN(MoeWeights m,
                        BindMoe(*ckpt, "layers." + std::to_string(l) + ".ffn.", l));
    moe.push_back(std::move(m));
  }
  CountingExpertExecutor counter(cfg, std::move(moe), &pool);
  shard->SetExpertExecutor(&counter);
  FM_ASSIGN_OR_RETURN(const InspectReport report, InspectCheckpoint(o.model));
  const size_t dense_bytes = report.unrouted_bytes_per_token();
  FM_ASSIGN_OR_RETURN(const size_t resident, TouchWeights(*ckpt));

  GreedyDecode decode(shard.get(), o.context, o.tokens, o.streams);
  const auto t0 = std::chrono::steady_clock::now();
  FM_RETURN_IF_ERROR(decode.Prefill());
  const auto t1 = std::chrono::steady_clock::now();
  // Decode in rounds, each followed by a bandwidth probe with the same threads: this machine's
  // bandwidth drifts within seconds, so each round's efficiency divides by the bandwidth
  // measured right after it, and the median round is reported.
  ReadBandwidthProbe probe(&pool, kProbeBytes);
  const int64_t rounds = std::min<int64_t>(o.tokens, kDecodeRounds);
  std::vector<double> effs, bws;
  double decode_s = 0.0, routed_bytes = 0.0;
  for (int64_t r = 0; r < rounds; ++r) {
    const int64_t n = o.tokens / rounds + (r < o.tokens % rounds ? 1 : 0);
    counter.reset();
    const auto t2 = std::chrono::steady_clock::now();
    for (int64_t i = 0; i < n; ++i) FM_RETURN_IF_ERROR(decode.Step());
    const auto t3 = std::chrono::steady_clock::now();
    const double bw = probe.Measure(kProbePasses);
    const double traffic = (static_cast<double>(dense_bytes) * n + counter.bytes()) / Seconds(t2, t3);
    effs.push_back(bw > 0 ? traffic / (bw * 1e9) : 0.0);
    bws.push_back(bw);
    decode_s += Seconds(t2, t3);
    routed_bytes += static_cast<double>(counter.bytes());
  }
  const double tok_per_s = static_cast<double>(o.tokens * o.streams) / decode_s;
  const double bytes_per_token = static_cast<double>(dense_bytes) + routed_bytes / o.tokens;
  const double eff = Median(effs), mem_bw = Median(bws);
  // The full-model prediction is of one stream's token time (as on a device, which times the
  // single stream first): a step of B rows is not a token, and the head was timed for one row.
  const bool predicts = o.streams == 1;
  FullModelPrediction pred;
  if (predicts) {
    FM_ASSIGN_OR_RETURN(const double head_s, decode.GreedyHeadSeconds(kHeadReps));
    FM_ASSIGN_OR_RETURN(const double rich_s, decode.RichHeadSeconds(kHeadReps));
    pred = Predict(cfg, decode_s / o.tokens, head_s, rich_s, mem_bw);
  }
  if (o.json) {
    std::printf("{\"tok_per_s\": %.4f, \"streams\": %lld, \"weight_bytes_per_token\": %.0f, "
                "\"mem_bw_gbps\": %.4f, \"bw_efficiency\": %.4f%s}\n",
                tok_per_s, static_cast<long long>(o.streams), bytes_per_token, mem_bw, eff,
                predicts ? PredictionJson(pred).c_str() : "");
  } else {
    std::printf("model            %s (%.2f GB resident)\n", o.model.c_str(), resident / 1e9);
    std::printf("threads          %d\n", pool.size());
    std::printf("prefill          %lld tokens in %.3f s\n", static_cast<long long>(o.context),
                Seconds(t0, t1));
    std::printf("decode           %lld steps of %lld streams in %.3f s: %.2f tok/s (%lld rounds)\n",
                static_cast<long long>(o.tokens), static_cast<long long>(o.streams), decode_s,
                tok_per_s, static_cast<long long>(rounds));
    std::printf("weight bytes     %.1f MB a step (dense %.1f MB + routed experts %.1f MB)\n",
                bytes_per_token / 1e6, dense_bytes / 1e6,
                routed_bytes / o.tokens / 1e6);
    std::printf("weight traffic   %.2f GB/s\n", o.tokens / decode_s * bytes_per_token / 1e9);
    std::printf("memory bandwidth %.2f GB/s (median of the probes after each round, same threads)\n", mem_bw);
    std::printf("bw_efficiency    %.3f (median round; rounds %.3f .. %.3f)\n", eff,
                *std::min_element(effs.begin(), effs.end()), *std::max_element(effs.begin(), effs.end()));
    if (predicts) PrintPrediction(pred);
    else std::printf("full model       predicted from one stream: run with --streams 1\n");
  }
  return Status::Ok();
}

// Steps per second of `decode` after its prefill and one warm-up step (first launches, lazy
// module loading); *prefill_s: the prefill's seconds; *crossed (when not null): the host<->device
// bytes the timed steps copied on CUDA device `device` (common/device_transfers.h).
Result<double> TimedSteps(GreedyDecode& decode, int64_t steps, int device, double* prefill_s,
                          TransferBytes* crossed) {
  const auto p0 = std::chrono::steady_clock::now();
  FM_RETURN_IF_ERROR(decode.Prefill());
  *prefill_s = Seconds(p0, std::chrono::steady_clock::now());
  FM_RETURN_IF_ERROR(decode.Step());
  const TransferBytes before = TransfersOf(device).step;
  const auto t0 = std::chrono::steady_clock::now();
  for (int64_t i = 0; i < steps; ++i) FM_RETURN_IF_ERROR(decode.Step());
  const double s = Seconds(t0, std::chrono::steady_clock::now());
  const TransferBytes after = TransfersOf(device).step;
  if (crossed) {
    *crossed = {after.host_to_device - before.host_to_device,
                after.device_to_host - before.device_to_host};
  }
  return static_cast<double>(steps) / s;
}

// The device shard: the same decode loop timed end to end, the weight bytes from inspect's
// per-token figure (top-k distinct experts a layer), the device's read bandwidth measured after
// the decode, the host<->device bytes of the single stream's decode steps per token; with
// --streams B, then B streams together on the same shard.
Status RunDecodeCuda(const DecodeOptions& o) {
  FM_ASSIGN_OR_RETURN(InspectReport report, InspectCheckpoint(o.model));
  ShardSelection sel;
  sel.mtp = false;
  FM_ASSIGN_OR_RETURN(auto ckpt, Checkpoint::Open(o.model, sel, TensorBytes::kMapped));  // uploaded once
  FM_RETURN_IF_ERROR(SetCudaWeightCore(o.tensor_cores ? CudaWeightCore::kTensorCore
                                                      : CudaWeightCore::kFma));
  FM_RETURN_IF_ERROR(SetCudaLaunchOverlap(o.launch_overlap));
  FM_ASSIGN_OR_RETURN(auto shard,
                      CreateCudaShardModel(*ckpt, o.cuda_device,
                                           o.eager ? CudaStepMode::kEager : CudaStepMode::kGraph));
  GreedyDecode decode(shard.get(), o.context, o.tokens, 1);
  double prefill_s = 0.0;
  TransferBytes crossed;
  FM_ASSIGN_OR_RETURN(const double tok_per_s,
                      TimedSteps(decode, o.tokens, o.cuda_device, &prefill_s, &crossed));
  const double h2d_per_token = static_cast<double>(crossed.host_to_device) / o.tokens;
  const double d2h_per_token = static_cast<double>(crossed.device_to_host) / o.tokens;
  const double prefill_tok_per_s = static_cast<double>(o.context) / prefill_s;
  FM_ASSIGN_OR_RETURN(const double bw, CudaReadBandwidthGbps(o.cuda_device));
  const double bytes = static_cast<double>(report.bytes_per_token());
  const double eff = bw > 0 ? tok_per_s * bytes / (bw * 1e9) : 0.0;
  FM_ASSIGN_OR_RETURN(const double head_s, decode.GreedyHeadSeconds(kHeadReps));
  FM_ASSIGN_OR_RETURN(const double rich_s, decode.RichHeadSeconds(kHeadReps));
  const FullModelPrediction pred = Predict(ckpt->config(), 1.0 / tok_per_s, head_s, rich_s, bw);
  double streams_tok_per_s = tok_per_s;
  if (o.streams > 1) {
    GreedyDecode batch(shard.get(), o.context, o.tokens, o.streams);
    FM_ASSIGN_OR_RETURN(const double steps_per_s,
                        TimedSteps(batch, o.tokens, o.cuda_device, &prefill_s, nullptr));
    streams_tok_per_s = steps_per_s * static_cast<double>(o.streams);
  }
  if (o.json) {
    std::printf("{\"tok_per_s\": %.4f, \"weight_bytes_per_token\": %.0f, \"mem_bw_gbps\": %.4f, "
                "\"bw_efficiency\": %.4f, \"prefill_tok_per_s\": %.4f, \"cuda_graph\": %s, "
                "\"weight_core\": \"%s\", \"launch_overlap\": %s, "
                "\"streams\": %lld, \"streams_tok_per_s\": %.4f, \"streams_speedup\": %.4f, "
                "\"h2d_bytes_per_token\": %.1f, \"d2h_bytes_per_token\": %.1f%s}\n",
                tok_per_s, bytes, bw, eff, prefill_tok_per_s, o.eager ? "false" : "true",
                o.tensor_cores ? "tc" : "fma", o.launch_overlap ? "true" : "false",
                static_cast<long long>(o.streams), streams_tok_per_s, streams_tok_per_s / tok_per_s,
                h2d_per_token, d2h_per_token, PredictionJson(pred).c_str());
  } else {
    std::printf("model            %s on cuda:%d (%s%s, FP8/FP4 on %s)\n", o.model.c_str(),
                o.cuda_device, o.eager ? "eager launches" : "CUDA graph per step",
                o.launch_overlap ? " with launch overlap" : "",
                o.tensor_cores ? "the tensor cores" : "f32 FMAs");
    std::printf("prefill          %lld tokens: %.2f tok/s\n", static_cast<long long>(o.context),
                prefill_tok_per_s);
    std::printf("decode           %lld tokens: %.2f tok/s\n", static_cast<long long>(o.tokens),
                tok_per_s);
    std::printf("weight bytes/tok %.1f MB\n", bytes / 1e6);
    std::printf("weight traffic   %.2f GB/s\n", tok_per_s * bytes / 1e9);
    std::printf("memory bandwidth %.2f GB/s (device read probe after the decode)\n", bw);
    std::printf("bw_efficiency    %.3f\n", eff);
    std::printf("host<->device    %.0f B a token to the device, %.0f B back (decode steps)\n",
                h2d_per_token, d2h_per_token);
    if (o.streams > 1)
      std::printf("%lld streams       %.2f tok/s together, %.2fx the single stream\n",
                  static_cast<long long>(o.streams), streams_tok_per_s, streams_tok_per_s / tok_per_s);
    PrintPrediction(pred);
  }
  return Status::Ok();
}

}  // namespace

Status RunDecodeBench(const DecodeOptions& o) {
  return o.cuda_device >= 0 ? RunDecodeCuda(o) : RunDecode(o);
}

}  // namespace fm::bench
