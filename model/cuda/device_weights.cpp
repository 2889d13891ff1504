#include "model/cuda/device_weights.h"

#include <cstdio>
#include <string>
#include <utility>

namespace fm {

Status CheckShardFits(size_t weight_bytes, size_t free, size_t total, int device) {
  if (weight_bytes <= free) return Status::Ok();
  auto gib = [](size_t b) {
    char buf[32];
    std::snprintf(buf, sizeof buf, "%.1f", static_cast<double>(b) / double(1ull << 30));
    return std::string(buf);
  };
  return ResourceExhausted("cuda:" + std::to_string(device) + ": the shard's weights need " +
                           gib(weight_bytes) + " GiB but the device has " + gib(free) +
                           " GiB free (of " + gib(total) + " GiB); lower the node's memory_gib "
                           "to what CUDA can allocate or spread the model over more workers");
}

using cuda::DeviceBuffer;
using cuda::DeviceWeight;
namespace {

Result<DevCompressor> UploadCompressor(const CompressorWeights& w) {
  DevCompressor d;
  d.ratio = w.ratio;
  d.dim = w.dim;
  d.overlap = w.overlap;
  FM_ASSIGN_OR_RETURN(d.wkv, cuda::UploadWeight(w.wkv));
  FM_ASSIGN_OR_RETURN(d.wgate, cuda::UploadWeight(w.wgate));
  FM_ASSIGN_OR_RETURN(d.ape, UploadFloats(w.ape));
  FM_ASSIGN_OR_RETURN(d.norm, UploadFloats(w.norm));
  return d;
}

// Rows `r` of w as a DevShare (FP8: from the start of the scale block r.begin is in).
Result<DevShare> UploadShare(const QWeight& w, TpRange r) {
  DevShare d;
  const int64_t base = w.format == WeightFormat::kFP8Block ? r.begin / 128 * 128 : r.begin;
  QWeight rows;
  if (!SliceRows(w, base, r.end - base, &rows))
    return Internal("rows [" + std::to_string(r.begin) + ", " + std::to_string(r.end) +
                    ") of a [" + std::to_string(w.rows) + ", " + std::to_string(w.cols) +
                    "] weight");
  FM_ASSIGN_OR_RETURN(d.w, cuda::UploadWeight(rows));
  d.first = r.begin - base;
  d.rows = r.size();
  d.whole_rows = w.rows;
  return d;
}

Result<DevExpertSet> UploadExperts(const std::vector<ExpertWeights>& experts,
                                   QWeight ExpertWeights::*which, const std::string& what) {
  DevExpertSet s;
  std::vector<const void*> datas;
  std::vector<const uint8_t*> scales;
  int64_t first = -1;  // the first expert uploaded: its shape is every expert's
  for (size_t e = 0; e < experts.size(); ++e) {
    s.present.push_back(experts[e].loaded);
    if (!experts[e].loaded) {  // another member's: never read (its ids are masked)
      datas.push_back(nullptr);
      scales.push_back(nullptr);
      continue;
    }
    const QWeight& w = experts[e].*which;
    if (first < 0) {
      first = static_cast<int64_t>(e);
      s.format = w.format;
      s.rows = w.rows;
      s.cols = w.cols;
    } else if (w.format != s.format || w.rows != s.rows || w.cols != s.cols) {
      return InvalidArgument(what + ": expert " + std::to_string(e) +
                             " differs in format or shape from expert " + std::to_string(first));
    }
    FM_ASSIGN_OR_RETURN(DeviceWeight d, cuda::UploadWeight(w));
    datas.push_back(d.data.data());
    scales.push_back(d.scale.as<const uint8_t>());
    s.weights.push_back(std::move(d));
  }
  FM_ASSIGN_OR_RETURN(s.datas, cuda::Upload(datas.data(), datas.size() * sizeof(void*)));
  FM_ASSIGN_OR_RETURN(s.scales, cuda::Upload(scales.data(), scales.size() * sizeof(void*)));
  return s;
}

}  // namespace

Result<DeviceBuffer> UploadFloats(const std::vector<float>& v) {
  return cuda::Upload(v.data(), v.size() * sizeof(float));
}

Result<DeviceBuffer> AllocFloats(int64_t n) {
  return DeviceBuffer::Alloc(static_cast<size_t>(std::max<int64_t>(n, 1)) * sizeof(float));
}

Result<DevHc> UploadHc(const HcWeights& w) {
  DevHc d;
  FM_ASSIGN_OR_RETURN(d.fn, cuda::UploadWeight(w.fn_weight()));
  FM_ASSIGN_OR_RETURN(d.base, UploadFloats(w.base));
  FM_ASSIGN_OR_RETURN(d.scale, UploadFloats(w.scale));
  d.head_scale = w.scale.empty() ? 0.0f : w.scale[0];
  return d;
}

Result<std::unique_ptr<DevLayer>> UploadLayer(const ModelConfig& cfg, const LayerWeights& w,
                                              int tp_rank, int tp_size) {
  if (tp_size > 1) FM_RETURN_IF_ERROR(CheckTensorParallel(cfg, tp_size));
  auto d = std::make_unique<DevLayer>();
  const AttentionWeights& a = *w.attn;
  const MoeWeights& m = w.moe;
  const int64_t D = cfg.head_dim, R = cfg.o_lora_rank, H = cfg.hidden_size;
  auto share = [&](int64_t n, int64_t unit) {  // member tp_rank's share of n items of unit rows
    const TpRange r = TpShare(n, tp_rank, tp_size);
    return TpRange{r.begin * unit, r.end * unit};
  };
  d->layer = w.layer;
  d->ratio = w.ratio;
  FM_ASSIGN_OR_RETURN(d->hc_attn, UploadHc(w.hc_attn));
  FM_ASSIGN_OR_RETURN(d->hc_ffn, UploadHc(w.hc_ffn));
  FM_ASSIGN_OR_RETURN(d->attn_norm, UploadFloats(w.attn_norm));
  FM_ASSIGN_OR_RETURN(d->ffn_norm, UploadFloats(w.ffn_norm));
  FM_ASSIGN_OR_RETURN(d->wq_a, cuda::UploadWeight(a.wq_a));
  FM_ASSIGN_OR_RETURN(d->wq_b, UploadShare(a.wq_b, share(cfg.num_attention_heads, D)));
  FM_ASSIGN_OR_RETURN(d->wkv, cuda::UploadWeight(a.wkv));
  FM_ASSIGN_OR_RETURN(d->wo_a, UploadShare(a.wo_a, share(cfg.o_groups, R)));
  FM_ASSIGN_OR_RETURN(d->wo_b, UploadShare(a.wo_b, share(H, 1)));
  FM_ASSIGN_OR_RETURN(d->q_norm, UploadFloats(a.q_norm));
  FM_ASSIGN_OR_RETURN(d->kv_norm, UploadFloats(a.kv_norm));
  FM_ASSIGN_OR_RETURN(d->sink, UploadFloats(a.attn_sink));
  FM_ASSIGN_OR_RETURN(d->freq, UploadFloats(a.rope_inv_freq));
  if (w.ratio > 1) {
    FM_ASSIGN_OR_RETURN(d->comp, UploadCompressor(a.compressor));
  }
  if (w.ratio == 4) {
    FM_ASSIGN_OR_RETURN(d->index_comp, UploadCompressor(a.index_compressor));
    FM_ASSIGN_OR_RETURN(d->index_wq_b, cuda::UploadWeight(a.index_wq_b));
    FM_ASSIGN_OR_RETURN(d->index_proj, cuda::UploadWeight(a.index_weights_proj));
  }
  d->hash = m.hash;
  FM_ASSIGN_OR_RETURN(d->gate, cuda::UploadWeight(m.gate));
  if (m.hash) {
    FM_ASSIGN_OR_RETURN(d->tid2eid, cuda::Upload(m.tid2eid.data(), m.tid2eid.size() * 8));
  } else {
    FM_ASSIGN_OR_RETURN(d->bias, UploadFloats(m.bias));
  }
  bool any_experts = false;
  for (const ExpertWeights& e : m.experts) {
    d->all_experts = d->all_experts && e.loaded;
    any_experts = any_experts || e.loaded;
  }
  if (any_experts) {
    const std::string p = "layer " + std::to_string(w.layer) + " experts ";
    FM_ASSIGN_OR_RETURN(d->w1, UploadExperts(m.experts, &ExpertWeights::w1, p + "w1"));
    FM_ASSIGN_OR_RETURN(d->w2, UploadExperts(m.experts, &ExpertWeights::w2, p + "w2"));
    FM_ASSIGN_OR_RETURN(d->w3, UploadExperts(m.experts, &ExpertWeights::w3, p + "w3"));
  }
  const int64_t Is = m.shared.w1.rows;
  FM_ASSIGN_OR_RETURN(d->s1, UploadShare(m.shared.w1, share(Is, 1)));
  FM_ASSIGN_OR_RETURN(d->s2, UploadShare(m.shared.w2, share(H, 1)));
  FM_ASSIGN_OR_RETURN(d->s3, UploadShare(m.shared.w3, share(Is, 1)));
  return d;
}

}  // namespace fm
