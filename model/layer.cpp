#include "model/layer.h"

#include <cstring>
#include <string>

#include "kernels/cpu/hc.h"
#include "kernels/cpu/matvec.h"
#include "kernels/cpu/norm_rows.h"
#include "model/tp.h"

namespace fm {

QWeight HcWeights::fn_weight() const {
  QWeight w;
  w.format = WeightFormat::kF32;
  w.rows = static_cast<int64_t>(base.size());
  w.cols = w.rows ? static_cast<int64_t>(fn.size()) / w.rows : 0;
  w.data = fn.data();
  return w;
}

Result<std::vector<float>> GetVector(const Checkpoint& ckpt, const std::string& name,
                                     int64_t len) {
  FM_ASSIGN_OR_RETURN(std::vector<float> v, ckpt.GetF32(name));
  if (static_cast<int64_t>(v.size()) != len)
    return InvalidArgument(name + ": " + std::to_string(v.size()) + " elements, expected " +
                           std::to_string(len));
  return v;
}

Result<HcWeights> BindHc(const Checkpoint& ckpt, const std::string& prefix, int64_t mix_rows,
                         int64_t scale_len) {
  const ModelConfig& cfg = ckpt.config();
  HcWeights w;
  FM_ASSIGN_OR_RETURN(w.fn, GetVector(ckpt, prefix + "fn", mix_rows * cfg.hc_mult * cfg.hidden_size));
  FM_ASSIGN_OR_RETURN(w.base, GetVector(ckpt, prefix + "base", mix_rows));
  FM_ASSIGN_OR_RETURN(w.scale, GetVector(ckpt, prefix + "scale", scale_len));
  return w;
}

Result<std::unique_ptr<LayerWeights>> BindLayer(const Checkpoint& ckpt, const std::string& prefix,
                                                int64_t layer) {
  const ModelConfig& cfg = ckpt.config();
  const int64_t n = cfg.hc_mult, H = cfg.hidden_size;
  if (layer < 0 || layer >= static_cast<int64_t>(cfg.compress_ratios.size()))
    return InvalidArgument("config: compress_ratios has no entry for layer " +
                           std::to_string(layer));
  auto w = std::make_unique<LayerWeights>();
  w->layer = layer;
  w->ratio = cfg.compress_ratio(layer);
  FM_ASSIGN_OR_RETURN(w->hc_attn, BindHc(ckpt, prefix + "hc_attn_", (2 + n) * n, 3));
  FM_ASSIGN_OR_RETURN(w->hc_ffn, BindHc(ckpt, prefix + "hc_ffn_", (2 + n) * n, 3));
  FM_ASSIGN_OR_RETURN(w->attn_norm, GetVector(ckpt, prefix + "attn_norm.weight", H));
  FM_ASSIGN_OR_RETURN(w->ffn_norm, GetVector(ckpt, prefix + "ffn_norm.weight", H));
  FM_ASSIGN_OR_RETURN(w->attn, BindAttention(ckpt, prefix + "attn.", w->ratio));
  FM_ASSIGN_OR_RETURN(w->moe, BindMoe(ckpt, prefix + "ffn.", layer));
  return w;
}

// y [T, H] = RMSNorm(hc_pre collapse of X; norm), with post [T, n] and comb [T, n*n] for hc_post.
static void HcPreRows(const ModelConfig& cfg, const HcWeights& hc, const std::vector<float>& norm,
                      const float* x, int64_t T, float* y, float* post, float* comb,
                      ThreadPool* pool) {
  const int64_t n = cfg.hc_mult, H = cfg.hidden_size, mix_rows = (2 + n) * n;
  std::vector<float> mix(T * mix_rows);
  Matmul(hc.fn_weight(), x, T, mix.data(), pool);
  const float eps = static_cast<float>(cfg.rms_norm_eps), eh = static_cast<float>(cfg.hc_eps);
  auto rows = [&](size_t begin, size_t end) {
    std::vector<float> pre(n);
    for (size_t t = begin; t < end; ++t) {
      const float* xt = x + t * n * H;
      const float rinv = RmsInv(xt, n * H, eps);
      HcPreWeights_n(mix.data() + t * mix_rows, rinv, hc.base.data(), hc.scale.data(), n,
                     cfg.hc_sinkhorn_iters, eh, pre.data(), post + t * n, comb + t * n * n);
      HcCollapse_nH(xt, pre.data(), n, H, y + t * H);
      RmsNormWeighted_H(y + t * H, norm.data(), H, eps, y + t * H);
    }
  };
  if (pool) pool->ParallelFor(T, 1, rows);
  else rows(0, T);
}

// X [T, n, H] <- hc_post(X, out) row by row.
static void HcPostRows(const ModelConfig& cfg, const float* out, const float* post,
                       const float* comb, int64_t T, float* x, ThreadPool* pool) {
  const int64_t n = cfg.hc_mult, H = cfg.hidden_size;
  auto rows = [&](size_t begin, size_t end) {
    std::vector<float> next(n * H);
    for (size_t t = begin; t < end; ++t) {
      float* xt = x + t * n * H;
      HcPost_nH(xt, out + t * H, post + t * n, comb + t * n * n, n, H, next.data());
      std::memcpy(xt, next.data(), n * H * sizeof(float));
    }
  };
  if (pool) pool->ParallelFor(T, 1, rows);
  else rows(0, T);
}

Status RunLayer(const ModelConfig& cfg, const LayerWeights& w, std::span<const AttentionSeq> seqs,
                const int32_t* tokens, int64_t T, ExpertExecutor* exec, float* x,
                ThreadPool* pool, TpGroup* tp) {
  const int64_t n = cfg.hc_mult, H = cfg.hidden_size, k = cfg.num_experts_per_tok;
  std::vector<float> xn(T * H), out(T * H), post(T * n), comb(T * n * n);
  HcPreRows(cfg, w.hc_attn, w.attn_norm, x, T, xn.data(), post.data(), comb.data(), pool);
  FM_RETURN_IF_ERROR(AttentionForward(cfg, *w.attn, seqs, xn.data(), out.data(), pool, tp));
  HcPostRows(cfg, out.data(), post.data(), comb.data(), T, x, pool);

  HcPreRows(cfg, w.hc_ffn, w.ffn_norm, x, T, xn.data(), post.data(), comb.data(), pool);
  std::vector<int32_t> ids(T * k);
  std::vector<float> weights(T * k), routed(T * H);
  FM_RETURN_IF_ERROR(RouteMoe(cfg, w.moe, xn.data(), tokens, T, ids.data(), weights.data(), pool));
  if (tp) {
    FM_RETURN_IF_ERROR(
        MoeForwardTp(cfg, w.moe, xn.data(), T, ids.data(), weights.data(), tp, out.data(), pool));
    HcPostRows(cfg, out.data(), post.data(), comb.data(), T, x, pool);
    return Status::Ok();
  }
  FM_RETURN_IF_ERROR(exec->RunRouted(w.layer, xn.data(), T, ids.data(), weights.data(),
                                     routed.data()));
  RunExpertFfn(w.moe.shared, static_cast<float>(cfg.swiglu_limit), xn.data(), T, out.data(), pool);
  for (int64_t i = 0; i < T * H; ++i) out[i] = routed[i] + out[i];
  HcPostRows(cfg, out.data(), post.data(), comb.data(), T, x, pool);
  return Status::Ok();
}

void HeadLogits(const ModelConfig& cfg, const HcWeights& hc_head, const std::vector<float>& norm,
                const QWeight& head, const float* x, int64_t rows, float* logits,
                ThreadPool* pool) {
  const int64_t n = cfg.hc_mult, H = cfg.hidden_size;
  const float eps = static_cast<float>(cfg.rms_norm_eps), eh = static_cast<float>(cfg.hc_eps);
  std::vector<float> mix(rows * n), y(rows * H);
  Matmul(hc_head.fn_weight(), x, rows, mix.data(), pool);
  auto each = [&](size_t begin, size_t end) {
    std::vector<float> pre(n);
    for (size_t t = begin; t < end; ++t) {
      const float* xt = x + t * n * H;
      HcHeadWeights_n(mix.data() + t * n, RmsInv(xt, n * H, eps), hc_head.base.data(),
                      hc_head.scale[0], n, eh, pre.data());
      HcCollapse_nH(xt, pre.data(), n, H, y.data() + t * H);
      RmsNormWeighted_H(y.data() + t * H, norm.data(), H, eps, y.data() + t * H);
    }
  };
  if (pool) pool->ParallelFor(rows, 1, each);
  else each(0, rows);
  Matmul(head, y.data(), rows, logits, pool);
}

}  // namespace fm
