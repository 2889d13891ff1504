// The device ShardModel's head and sampling (model/cuda/shard_model_impl.h): hc_head, the final
// norm and the head over up to kMaxStepRows rows a step, then the logits out (Logits), or each
// row's sampler on the device (SampleNext) or a known token's score there (ScoreNext): a row's
// id, logprob, rank and top alternatives reach the host, not its [vocab] logits.
#include <algorithm>
#include <string>
#include <vector>

#include "kernels/cuda/ops.h"
#include "kernels/cuda/sample_ops.h"
#include "model/cuda/logit_edits.h"
#include "model/cuda/shard_model_impl.h"

namespace fm {
namespace {

// The CPU sampler's errors for a device result (model/sampler.cpp's words).
Status SampleError(const cuda::SampleResult& r, int64_t vocab) {
  switch (r.status) {
    case cuda::kSampleNaN: return InvalidArgument("logits[" + std::to_string(r.id) + "] is NaN");
    case cuda::kSampleNoFinite:
      return InvalidArgument("logits: no finite value among " + std::to_string(vocab));
    case cuda::kSamplePosInf: return InvalidArgument("logits[" + std::to_string(r.id) + "] is +inf");
    case cuda::kSampleBadId: return CheckScoredId(r.id, vocab);
  }
  return Internal("device sampler: status " + std::to_string(r.status));
}

// A device result and its alternatives as the CPU sampler's (ScoreToken's) SampledToken.
SampledToken FromDevice(const cuda::SampleResult& r, const cuda::SampleTop& top) {
  SampledToken t{r.id, r.logprob, {}, {}};
  t.rank = r.rank;
  const int n = std::clamp(r.top_count, 0, cuda::kSampleMaxTop);
  for (int j = 0; j < n; ++j) t.top.push_back({top.id[j], top.logprob[j]});
  return t;
}

static_assert(cuda::kSampleMaxTop >= kMaxTopLogprobs, "the device reports every top logprob");

}  // namespace

Status CudaShardModel::Head(const float* x, int64_t T) const {
  const int64_t n = cfg_.hc_mult, H = cfg_.hidden_size, V = cfg_.vocab_size;
  const float eps = static_cast<float>(cfg_.rms_norm_eps), eh = static_cast<float>(cfg_.hc_eps);
  FM_RETURN_IF_ERROR(
      cuda::Gemm(hc_head_.fn.view(), x, n * H, s_.mix.as<float>(), hc_head_.fn.rows, T));
  FM_RETURN_IF_ERROR(cuda::HcHead(x, s_.mix.as<float>(), hc_head_.base.as<float>(),
                                  hc_head_.head_scale, T, n, H, eh, eps, s_.head_y.as<float>()));
  FM_RETURN_IF_ERROR(cuda::RmsNorm(s_.head_y.as<float>(), norm_.as<float>(),
                                   s_.head_y.as<float>(), T, H, eps));
  return cuda::Gemm(head_.view(), s_.head_y.as<float>(), H, s_.logits.as<float>(), V, T);
}

Status CudaShardModel::SampleHeadRows(const cuda::SampleParams* params, int64_t T,
                                      cuda::SampleResult* res, cuda::SampleTop* top) const {
  FM_RETURN_IF_ERROR(s_.sample_params.CopyFromHostAsync(params, T * sizeof params[0]));
  FM_RETURN_IF_ERROR(cuda::SampleRows(s_.logits.as<float>(), T, cfg_.vocab_size,
                                      s_.sample_params.as<cuda::SampleParams>(),
                                      s_.sample_scratch.as<void>(),
                                      s_.sample_out.as<cuda::SampleResult>(),
                                      s_.sample_top.as<cuda::SampleTop>()));
  FM_RETURN_IF_ERROR(s_.sample_out.CopyToHost(res, T * sizeof res[0]));
  // The alternatives only when a row asked for them (160 bytes a row; a greedy decode's rows
  // send their 24 alone).
  const bool any = std::any_of(params, params + T, [](const cuda::SampleParams& p) { return p.top_n > 0; });
  return any ? s_.sample_top.CopyToHost(top, T * sizeof top[0]) : Status::Ok();
}

Status CudaShardModel::Logits(const float* x, int64_t rows, float* logits) const {
  if (!has_head_) return InvalidArgument("Logits: this shard does not hold the head");
  if (rows <= 0) return InvalidArgument("Logits: rows " + std::to_string(rows) + " must be > 0");
  std::lock_guard<std::mutex> lock(mu_);
  FM_RETURN_IF_ERROR(cuda::SetDevice(device_));
  cuda::StreamScope on_stream(stream_);
  const int64_t row = cfg_.hc_mult * cfg_.hidden_size, V = cfg_.vocab_size;
  for (int64_t r0 = 0; r0 < rows; r0 += kMaxStepRows) {
    const int64_t T = std::min<int64_t>(kMaxStepRows, rows - r0);
    FM_RETURN_IF_ERROR(Head(x + r0 * row, T));
    FM_RETURN_IF_ERROR(s_.logits.CopyToHost(logits + r0 * V, static_cast<size_t>(T * V) * sizeof(float)));
  }
  return stream_.Synchronize();
}

Status CudaShardModel::ForHeadSteps(int64_t rows,
                                    const std::function<Status(int64_t, int64_t)>& step) const {
  std::lock_guard<std::mutex> lock(mu_);
  FM_RETURN_IF_ERROR(cuda::SetDevice(device_));
  cuda::StreamScope on_stream(stream_);
  for (int64_t r0 = 0; r0 < rows; r0 += kMaxStepRows)
    FM_RETURN_IF_ERROR(step(r0, std::min<int64_t>(kMaxStepRows, rows - r0)));
  return Status::Ok();
}

Result<std::vector<SampledToken>> CudaShardModel::SampleNext(
    const float* x, int64_t rows, std::span<Sampler* const> samplers) const {
  if (!has_head_) return InvalidArgument("SampleNext: this shard does not hold the head");
  if (rows <= 0 || rows != static_cast<int64_t>(samplers.size()))
    return InvalidArgument("SampleNext: rows " + std::to_string(rows) + " with " +
                           std::to_string(samplers.size()) + " samplers");
  const int64_t row = cfg_.hc_mult * cfg_.hidden_size, V = cfg_.vocab_size;
  std::vector<SampledToken> out;
  out.reserve(rows);
  FM_RETURN_IF_ERROR(ForHeadSteps(rows, [&](int64_t r0, int64_t T) -> Status {
    cuda::SampleParams params[kMaxStepRows];
    for (int64_t t = 0; t < T; ++t) {  // the draws, in row order, as the CPU path makes them
      Sampler* s = samplers[r0 + t];
      const SamplerConfig& c = s->config();
      params[t] = cuda::SampleParams{c.temperature, c.top_p, c.top_k, s->is_greedy() ? 1 : 0,
                                     s->is_greedy() ? 0.0 : s->DrawUniform(), c.top_logprobs, -1};
    }
    // Rows whose sampler adjusts its logits (bias, min_tokens, penalties, min-p) are adjusted
    // where they are, unless their edits overflow the step's buffers: those are drawn on the
    // host from the raw logits.
    LogitEditBatch edits;
    bool raw_on_host[kMaxStepRows] = {};
    for (int64_t t = 0; t < T; ++t)
      if (samplers[r0 + t]->AdjustsLogits())
        raw_on_host[t] = !AppendLogitEdits(*samplers[r0 + t], static_cast<int32_t>(t), V,
                                           kMaxRowEdits, kMaxRowBiases, &edits);
    FM_RETURN_IF_ERROR(Head(x + r0 * row, T));
    if (!edits.rows.empty()) {
      FM_RETURN_IF_ERROR(s_.adjust_rows.CopyFromHostAsync(edits.rows.data(), edits.rows.size() * sizeof(cuda::AdjustRow)));
      if (!edits.edits.empty())
        FM_RETURN_IF_ERROR(s_.adjust_edits.CopyFromHostAsync(edits.edits.data(), edits.edits.size() * sizeof(cuda::LogitEdit)));
      if (!edits.biases.empty())
        FM_RETURN_IF_ERROR(s_.adjust_biases.CopyFromHostAsync(edits.biases.data(), edits.biases.size() * sizeof(float)));
      FM_RETURN_IF_ERROR(cuda::AdjustLogits(s_.logits.as<float>(), V, s_.adjust_rows.as<cuda::AdjustRow>(),
                                            static_cast<int64_t>(edits.rows.size()),
                                            s_.adjust_edits.as<cuda::LogitEdit>(), s_.adjust_biases.as<float>()));
    }
    cuda::SampleResult res[kMaxStepRows];
    cuda::SampleTop alts[kMaxStepRows];
    FM_RETURN_IF_ERROR(SampleHeadRows(params, T, res, alts));
    for (int64_t t = 0; t < T; ++t) {
      Sampler* s = samplers[r0 + t];
      if (raw_on_host[t] || res[t].status == cuda::kSampleNeedsHost) {
        // Edits past the step's buffers (raw logits), or a top-k / top-p set beyond the
        // device's candidates (logits adjusted, if at all, on the device): this row's logits on
        // the host, with the same draw, so that the token and its alternatives come from one
        // computation (docs/api.md "Sampling").
        std::vector<float> lg(V);
        FM_RETURN_IF_ERROR(s_.logits.CopyToHost(lg.data(), V * sizeof(float), t * V * sizeof(float)));
        Result<SampledToken> tok =
            raw_on_host[t] ? s->SampleWith(lg, params[t].u) : s->SampleAdjustedWith(lg, params[t].u);
        out.push_back(tok.ok() ? std::move(*tok) : SampledToken::Failed(tok.status()));
      } else if (res[t].status == cuda::kSampleOk) {
        out.push_back(FromDevice(res[t], alts[t]));
      } else {
        out.push_back(SampledToken::Failed(SampleError(res[t], V)));
      }
    }
    return Status::Ok();
  }));
  return out;
}

Result<std::vector<SampledToken>> CudaShardModel::ScoreNext(const float* x,
                                                            std::span<const int32_t> targets,
                                                            int32_t top) const {
  FM_RETURN_IF_ERROR(CheckScoreNext(top));
  const int64_t rows = static_cast<int64_t>(targets.size());
  const int64_t row = cfg_.hc_mult * cfg_.hidden_size, V = cfg_.vocab_size;
  std::vector<SampledToken> out;
  out.reserve(rows);
  FM_RETURN_IF_ERROR(ForHeadSteps(rows, [&](int64_t r0, int64_t T) -> Status {
    cuda::SampleParams params[kMaxStepRows];
    Status in_range[kMaxStepRows];
    for (int64_t t = 0; t < T; ++t) {  // a target outside the row is scored as 0, then refused
      in_range[t] = CheckScoredId(targets[r0 + t], V);
      params[t] = cuda::SampleParams{1.0f, 1.0f, 0, 1, 0.0, top, in_range[t].ok() ? targets[r0 + t] : 0};
    }
    FM_RETURN_IF_ERROR(Head(x + r0 * row, T));
    cuda::SampleResult res[kMaxStepRows];
    cuda::SampleTop alts[kMaxStepRows];
    FM_RETURN_IF_ERROR(SampleHeadRows(params, T, res, alts));
    for (int64_t t = 0; t < T; ++t) {
      if (!in_range[t].ok()) out.push_back(SampledToken::Failed(in_range[t]));
      else if (res[t].status == cuda::kSampleOk) out.push_back(FromDevice(res[t], alts[t]));
      else out.push_back(SampledToken::Failed(SampleError(res[t], V)));
    }
    return Status::Ok();
  }));
  return out;
}

}  // namespace fm
