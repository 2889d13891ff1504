#include "model/mtp.h"

#include <string>

#include "kernels/cpu/matvec.h"
#include "kernels/cpu/norm_rows.h"

namespace fm {

static Status CheckSquare(const QWeight& w, int64_t H, const std::string& name) {
  if (w.rows != H || w.cols != H)
    return InvalidArgument(name + ": shape [" + std::to_string(w.rows) + "," +
                           std::to_string(w.cols) + "], expected [" + std::to_string(H) + "," +
                           std::to_string(H) + "]");
  return Status::Ok();
}

Result<std::unique_ptr<MtpWeights>> BindMtp(const Checkpoint& ckpt) {
  const ModelConfig& cfg = ckpt.config();
  const int64_t H = cfg.hidden_size;
  const std::string p = "mtp.0.";
  auto w = std::make_unique<MtpWeights>();
  FM_ASSIGN_OR_RETURN(w->e_proj, ckpt.Weight(p + "e_proj"));
  FM_RETURN_IF_ERROR(CheckSquare(w->e_proj, H, p + "e_proj.weight"));
  FM_ASSIGN_OR_RETURN(w->h_proj, ckpt.Weight(p + "h_proj"));
  FM_RETURN_IF_ERROR(CheckSquare(w->h_proj, H, p + "h_proj.weight"));
  FM_ASSIGN_OR_RETURN(w->enorm, GetVector(ckpt, p + "enorm.weight", H));
  FM_ASSIGN_OR_RETURN(w->hnorm, GetVector(ckpt, p + "hnorm.weight", H));
  FM_ASSIGN_OR_RETURN(w->norm, GetVector(ckpt, p + "norm.weight", H));
  FM_ASSIGN_OR_RETURN(w->hc_head, BindHc(ckpt, p + "hc_head_", cfg.hc_mult, 1));
  FM_ASSIGN_OR_RETURN(w->block, BindLayer(ckpt, p, cfg.num_hidden_layers));
  return w;
}

Status MtpForward(const ModelConfig& cfg, const MtpWeights& w, std::span<const AttentionSeq> seqs,
                  const float* emb, const float* x_main, const int32_t* tokens, int64_t T,
                  ExpertExecutor* exec, const QWeight& head, float* logits, ThreadPool* pool) {
  const int64_t n = cfg.hc_mult, H = cfg.hidden_size;
  const float eps = static_cast<float>(cfg.rms_norm_eps);
  std::vector<float> en(T * H), e(T * H), hn(T * n * H), x(T * n * H);
  for (int64_t t = 0; t < T; ++t)
    RmsNormWeighted_H(emb + t * H, w.enorm.data(), H, eps, en.data() + t * H);
  for (int64_t r = 0; r < T * n; ++r)
    RmsNormWeighted_H(x_main + r * H, w.hnorm.data(), H, eps, hn.data() + r * H);
  Matmul(w.e_proj, en.data(), T, e.data(), pool);
  Matmul(w.h_proj, hn.data(), T * n, x.data(), pool);  // every stream is one row
  for (int64_t t = 0; t < T; ++t)
    for (int64_t k = 0; k < n; ++k)
      for (int64_t h = 0; h < H; ++h) x[(t * n + k) * H + h] = e[t * H + h] + x[(t * n + k) * H + h];
  FM_RETURN_IF_ERROR(RunLayer(cfg, *w.block, seqs, tokens, T, exec, x.data(), pool));
  HeadLogits(cfg, w.hc_head, w.norm, head, x.data(), T, logits, pool);
  return Status::Ok();
}

}  // namespace fm
