// ShardModel on a CUDA device (model/cuda/shard_model.h). The layer step mirrors the CPU one
// (model/layer.cpp, attention.cpp, compressor.cpp, moe.cpp) op for op, each op the CUDA twin of
// the CPU kernel; the weights are bound by the same Bind* functions and then uploaded.
#include "model/cuda/shard_model.h"

#include "model/cuda/device_weights.h"

#include <algorithm>
#include <cmath>
#include <limits>
#include <mutex>
#include <numeric>
#include <string>
#include <utility>
#include <vector>

#include "common/log.h"
#include "kernels/cuda/device.h"
#include "kernels/cuda/ops.h"
#include "model/kv_cache.h"
#include "model/layer.h"

namespace fm {

using cuda::DeviceBuffer;
using cuda::DeviceWeight;
namespace {

// One compressor's state of one sequence on the device (model/compressor.h CompressorState).
struct DevCompressorState {
  DeviceBuffer pend_a, pend_z, prev_a, prev_z;  // [r, width]
  bool has_prev = false;
};

// One sequence's attention state of one layer on the device (the CPU AttentionCacheImpl's).
class DeviceAttentionCache final : public AttentionCache {
 public:
  int64_t next_pos() const override { return pos; }
  size_t bytes() const override { return bytes_held; }

  int64_t ratio = 0, pos = 0, entries = 0, max_entries = 0;
  DeviceBuffer keys;    // [W + max_entries, D]: ring row s % W, then compressed entry e at W + e
  DeviceBuffer ikeys;   // [max_entries, dI]: the indexer's entries (ratio 4)
  DeviceBuffer score;   // [max_entries]: indexer scores of the current query
  DevCompressorState comp, index_comp;
  size_t bytes_held = 0;
};

Result<DevCompressorState> NewCompressorState(int64_t ratio, int64_t width, size_t* bytes) {
  DevCompressorState s;
  FM_ASSIGN_OR_RETURN(s.pend_a, AllocFloats(ratio * width));
  FM_ASSIGN_OR_RETURN(s.pend_z, AllocFloats(ratio * width));
  FM_ASSIGN_OR_RETURN(s.prev_a, AllocFloats(ratio * width));
  FM_ASSIGN_OR_RETURN(s.prev_z, AllocFloats(ratio * width));
  *bytes += 4 * static_cast<size_t>(ratio * width) * sizeof(float);
  return s;
}

// Scratch of one step, sized once for the model.
struct Scratch {
  DeviceBuffer x, x_new, mix, y, post, comb, out;
  DeviceBuffer cq, q, kv, ca, cz, ia, iz, iq, iw, picks, idx, o, u, ug, pool_a, pool_z;
  DeviceBuffer gl, ids, rw, h1, h3, contrib, routed, sh1, sh3;
  DeviceBuffer head_y, logits;
};

class CudaShardModel final : public ShardModel {
 public:
  CudaShardModel(const ModelConfig& cfg, int device) : cfg_(cfg), device_(device) {}
  Status Bind(const Checkpoint& ckpt);

  const ModelConfig& config() const override { return cfg_; }
  int64_t layer_begin() const override { return begin_; }
  int64_t layer_end() const override { return end_; }
  bool has_embed() const override { return sel_embed_; }
  bool has_head() const override { return has_head_; }

  std::unique_ptr<SequenceCache> NewSequence(int64_t max_context) const override;
  Status Embed(std::span<const int32_t> tokens, float* x) const override;
  Status ForwardLayers(std::span<const BatchItem> items, float* x) const override;
  Status Logits(const float* x, int64_t rows, float* logits) const override;
  void SetExpertExecutor(ExpertExecutor* exec) override { exec_ = exec; }

 private:
  Status AllocScratch();
  Result<std::unique_ptr<AttentionCache>> NewCache(int64_t ratio, int64_t max_context) const;
  // One token through layer l at the cache's position; s.x holds X [hc, H] and is updated.
  Status LayerStep(const DevLayer& l, DeviceAttentionCache* c, int32_t token) const;
  Status HcPreNorm(const DevHc& hc, const DeviceBuffer& norm) const;  // s.x -> s.y, post, comb
  Status HcPostUpdate() const;                                        // s.x <- hc_post(s.x, s.out)
  Status Attention(const DevLayer& l, DeviceAttentionCache* c) const;  // s.y -> s.out
  Status PushCompressor(const DevCompressor& w, DevCompressorState* st, const float* a,
                        const float* z, int64_t pos, const float* freq, float* entry) const;
  Status Moe(const DevLayer& l, int32_t token) const;  // s.y -> s.out

  ModelConfig cfg_;
  int device_;
  int64_t begin_ = 0, end_ = 0;
  bool sel_embed_ = false, has_head_ = false;
  TensorView embed_;  // host view (the embedding row is looked up on the host, then uploaded)
  std::vector<std::unique_ptr<DevLayer>> layers_;
  DeviceWeight head_;
  DeviceBuffer norm_;
  DevHc hc_head_;
  DeviceBuffer positions_;  // int32 0, 1, ..., max_position_embeddings - 1 (RoPE's pos arrays)
  int64_t max_positions_ = 0;
  ExpertExecutor* exec_ = nullptr;  // null: routed experts on the device
  mutable std::mutex mu_;           // one step at a time: the scratch is shared
  mutable Scratch s_;
};

Status CudaShardModel::Bind(const Checkpoint& ckpt) {
  FM_RETURN_IF_ERROR(cuda::SetDevice(device_));
  const ShardSelection& sel = ckpt.selection();
  const int64_t L = cfg_.num_hidden_layers, H = cfg_.hidden_size;
  begin_ = sel.layer_begin;
  end_ = sel.layer_end < 0 ? L : sel.layer_end;
  if (begin_ < 0 || begin_ > end_ || end_ > L)
    return InvalidArgument("shard selection: layers [" + std::to_string(begin_) + ", " +
                           std::to_string(end_) + ") outside [0, " + std::to_string(L) + "]");
  if (sel.embed) {
    FM_ASSIGN_OR_RETURN(embed_, BindEmbed(ckpt));
    sel_embed_ = true;
  }
  if (sel.head) {
    FM_ASSIGN_OR_RETURN(QWeight head, BindHeadWeight(ckpt));
    FM_ASSIGN_OR_RETURN(head_, cuda::UploadWeight(head));
    FM_ASSIGN_OR_RETURN(std::vector<float> norm, GetVector(ckpt, "norm.weight", H));
    FM_ASSIGN_OR_RETURN(norm_, UploadFloats(norm));
    FM_ASSIGN_OR_RETURN(HcWeights hc, BindHc(ckpt, "hc_head_", cfg_.hc_mult, 1));
    FM_ASSIGN_OR_RETURN(hc_head_, UploadHc(hc));
    has_head_ = true;
  }
  for (int64_t l = begin_; l < end_; ++l) {
    FM_ASSIGN_OR_RETURN(auto lw, BindLayer(ckpt, "layers." + std::to_string(l) + ".", l));
    Result<std::unique_ptr<DevLayer>> dl = UploadLayer(*lw);
    if (!dl.ok()) return dl.status().Wrap("layer " + std::to_string(l) + " to cuda:" +
                                          std::to_string(device_));
    layers_.push_back(std::move(dl).value());
  }
  max_positions_ = cfg_.max_position_embeddings;
  std::vector<int32_t> iota(static_cast<size_t>(max_positions_));
  std::iota(iota.begin(), iota.end(), 0);
  FM_ASSIGN_OR_RETURN(positions_, cuda::Upload(iota.data(), iota.size() * sizeof(int32_t)));
  FM_RETURN_IF_ERROR(AllocScratch());
  FM_RETURN_IF_ERROR(cuda::Synchronize());
  FM_LOG(kInfo, "forward") << "cuda:" << device_ << " (" << cuda::DeviceDescription(device_)
                           << ") shard: layers [" << begin_ << ", " << end_ << ")"
                           << (sel_embed_ ? " +embed" : "") << (has_head_ ? " +head" : "");
  return Status::Ok();
}

Status CudaShardModel::AllocScratch() {
  const int64_t n = cfg_.hc_mult, H = cfg_.hidden_size, D = cfg_.head_dim;
  const int64_t nH = cfg_.num_attention_heads, QL = cfg_.q_lora_rank;
  const int64_t G = cfg_.o_groups, R = cfg_.o_lora_rank, k = cfg_.num_experts_per_tok;
  const int64_t nI = cfg_.index_n_heads, dI = cfg_.index_head_dim;
  const int64_t I = cfg_.moe_intermediate_size, E = cfg_.n_routed_experts;
  // Key rows of one query: the window plus the most entries any layer attends (ratio 4: the
  // indexer's top-k; other ratios: every entry of the longest context).
  int64_t max_ratio = 1, max_entries = 0;
  for (int64_t r : cfg_.compress_ratios) {
    max_ratio = std::max(max_ratio, r);
    if (r > 1)
      max_entries = std::max(max_entries, r == 4 ? cfg_.index_topk : cfg_.max_position_embeddings / r);
  }
  const int64_t max_keys = cfg_.sliding_window + max_entries;
  Scratch& s = s_;
  // Shared-expert width: from the first layer's weight (every layer has the same config).
  const int64_t Is = layers_.empty() ? I : layers_[0]->s1.rows;
  struct Want { DeviceBuffer* b; int64_t floats; };
  const Want wants[] = {
      {&s.x, n * H}, {&s.x_new, n * H}, {&s.mix, (2 + n) * n}, {&s.y, H}, {&s.post, n},
      {&s.comb, n * n}, {&s.out, H}, {&s.cq, QL}, {&s.q, nH * D}, {&s.kv, D}, {&s.ca, 2 * D},
      {&s.cz, 2 * D}, {&s.ia, 2 * dI}, {&s.iz, 2 * dI}, {&s.iq, nI * dI}, {&s.iw, nI},
      {&s.picks, std::max<int64_t>(cfg_.index_topk, 1)}, {&s.o, nH * D}, {&s.u, G * R},
      {&s.ug, G * R}, {&s.pool_a, 2 * max_ratio * std::max(D, dI)},
      {&s.pool_z, 2 * max_ratio * std::max(D, dI)}, {&s.gl, E}, {&s.ids, k}, {&s.rw, k},
      {&s.h1, k * I}, {&s.h3, k * I}, {&s.contrib, k * H}, {&s.routed, H}, {&s.sh1, Is},
      {&s.sh3, Is}, {&s.head_y, H}, {&s.logits, cfg_.vocab_size}};
  for (const Want& w : wants) {
    FM_ASSIGN_OR_RETURN(*w.b, AllocFloats(w.floats));
  }
  FM_ASSIGN_OR_RETURN(s.idx, DeviceBuffer::Alloc(static_cast<size_t>(max_keys) * 4));
  return Status::Ok();
}

Result<std::unique_ptr<AttentionCache>> CudaShardModel::NewCache(int64_t ratio,
                                                                 int64_t max_context) const {
  auto c = std::make_unique<DeviceAttentionCache>();
  const int64_t W = cfg_.sliding_window, D = cfg_.head_dim, dI = cfg_.index_head_dim;
  c->ratio = ratio;
  c->max_entries = ratio > 1 ? max_context / ratio : 0;
  FM_ASSIGN_OR_RETURN(c->keys, AllocFloats((W + c->max_entries) * D));
  c->bytes_held = static_cast<size_t>((W + c->max_entries) * D) * sizeof(float);
  if (ratio > 1) {
    FM_ASSIGN_OR_RETURN(c->comp, NewCompressorState(ratio, ratio == 4 ? 2 * D : D, &c->bytes_held));
  }
  if (ratio == 4) {
    FM_ASSIGN_OR_RETURN(c->ikeys, AllocFloats(c->max_entries * dI));
    FM_ASSIGN_OR_RETURN(c->score, AllocFloats(c->max_entries));
    FM_ASSIGN_OR_RETURN(c->index_comp, NewCompressorState(4, 2 * dI, &c->bytes_held));
    c->bytes_held += static_cast<size_t>(c->max_entries * (dI + 1)) * sizeof(float);
  }
  return std::unique_ptr<AttentionCache>(std::move(c));
}

std::unique_ptr<SequenceCache> CudaShardModel::NewSequence(int64_t max_context) const {
  std::lock_guard<std::mutex> lock(mu_);
  std::vector<std::unique_ptr<AttentionCache>> caches;
  const int64_t ctx = std::min(max_context, max_positions_);
  for (int64_t l = begin_; l < end_; ++l) {
    Result<std::unique_ptr<AttentionCache>> c = NewCache(cfg_.compress_ratio(l), ctx);
    if (!c.ok()) {
      // Out of device memory: a sequence that can hold nothing, so its first step says so.
      FM_LOG(kError, "forward") << "cuda:" << device_ << " sequence cache: " << c.status().ToString();
      return std::make_unique<SequenceCache>(begin_, std::vector<std::unique_ptr<AttentionCache>>(),
                                             nullptr, 0);
    }
    caches.push_back(std::move(c).value());
  }
  return std::make_unique<SequenceCache>(begin_, std::move(caches), nullptr, ctx);
}

Status CudaShardModel::Embed(std::span<const int32_t> tokens, float* x) const {
  if (!has_embed()) return InvalidArgument("Embed: this shard does not hold embed.weight");
  FM_RETURN_IF_ERROR(CheckTokenIds(cfg_, tokens, "Embed"));
  EmbedManifold(embed_, tokens, cfg_.hc_mult, cfg_.hidden_size, x);
  return Status::Ok();
}

Status CudaShardModel::HcPreNorm(const DevHc& hc, const DeviceBuffer& norm) const {
  const int64_t n = cfg_.hc_mult, H = cfg_.hidden_size;
  const float eps = static_cast<float>(cfg_.rms_norm_eps), eh = static_cast<float>(cfg_.hc_eps);
  FM_RETURN_IF_ERROR(cuda::Gemv(hc.fn.view(), s_.x.as<float>(), s_.mix.as<float>()));
  FM_RETURN_IF_ERROR(cuda::HcPre(s_.x.as<float>(), s_.mix.as<float>(), hc.base.as<float>(),
                                 hc.scale.as<float>(), 1, n, H, cfg_.hc_sinkhorn_iters, eh, eps,
                                 s_.y.as<float>(), s_.post.as<float>(), s_.comb.as<float>()));
  return cuda::RmsNorm(s_.y.as<float>(), norm.as<float>(), s_.y.as<float>(), 1, H, eps);
}

Status CudaShardModel::HcPostUpdate() const {
  const int64_t n = cfg_.hc_mult, H = cfg_.hidden_size;
  FM_RETURN_IF_ERROR(cuda::HcPost(s_.x.as<float>(), s_.out.as<float>(), s_.post.as<float>(),
                                  s_.comb.as<float>(), 1, n, H, s_.x_new.as<float>()));
  std::swap(s_.x, s_.x_new);
  return Status::Ok();
}

Status CudaShardModel::PushCompressor(const DevCompressor& w, DevCompressorState* st,
                                      const float* a, const float* z, int64_t pos,
                                      const float* freq, float* entry) const {
  const int64_t r = w.ratio, d = w.dim, width = w.width(), slot = pos % r;
  const float eps = static_cast<float>(cfg_.rms_norm_eps);
  FM_RETURN_IF_ERROR(cuda::CopyRows(a, width, st->pend_a.as<float>() + slot * width, width, 1,
                                    width));
  FM_RETURN_IF_ERROR(cuda::AddVectors(z, w.ape.as<float>() + slot * width,
                                      st->pend_z.as<float>() + slot * width, width));
  if (slot != r - 1) return Status::Ok();
  // The window's slots, gathered as rows of width d: the previous window's first-half channels
  // (overlap, once there is one), then this window's (second half when overlapping).
  float* ga = s_.pool_a.as<float>();
  float* gz = s_.pool_z.as<float>();
  int64_t n = 0;
  if (w.overlap && st->has_prev) {
    FM_RETURN_IF_ERROR(cuda::CopyRows(st->prev_a.as<float>(), width, ga, d, r, d));
    FM_RETURN_IF_ERROR(cuda::CopyRows(st->prev_z.as<float>(), width, gz, d, r, d));
    n = r;
  }
  const int64_t off = w.overlap ? d : 0;
  FM_RETURN_IF_ERROR(cuda::CopyRows(st->pend_a.as<float>() + off, width, ga + n * d, d, r, d));
  FM_RETURN_IF_ERROR(cuda::CopyRows(st->pend_z.as<float>() + off, width, gz + n * d, d, r, d));
  n += r;
  FM_RETURN_IF_ERROR(cuda::CompressorPool(ga, gz, n, d, entry));
  FM_RETURN_IF_ERROR(cuda::RmsNorm(entry, w.norm.as<float>(), entry, 1, d, eps));
  FM_RETURN_IF_ERROR(cuda::RopeInterleaved(entry, 1, 1, d, cfg_.qk_rope_head_dim,
                                           positions_.as<int32_t>() + (pos - slot), freq, false));
  if (w.overlap) {
    std::swap(st->prev_a, st->pend_a);
    std::swap(st->prev_z, st->pend_z);
    st->has_prev = true;
  }
  return Status::Ok();
}

Status CudaShardModel::Attention(const DevLayer& l, DeviceAttentionCache* c) const {
  const int64_t nH = cfg_.num_attention_heads, D = cfg_.head_dim, rd = cfg_.qk_rope_head_dim;
  const int64_t G = cfg_.o_groups, R = cfg_.o_lora_rank, W = cfg_.sliding_window;
  const int64_t nI = cfg_.index_n_heads, dI = cfg_.index_head_dim, QL = cfg_.q_lora_rank;
  const float eps = static_cast<float>(cfg_.rms_norm_eps);
  const int64_t pos = c->pos;
  const float* y = s_.y.as<float>();
  const float* freq = l.freq.as<float>();
  const int32_t* p = positions_.as<int32_t>() + pos;
  float* cq = s_.cq.as<float>();
  float* q = s_.q.as<float>();
  float* kv = s_.kv.as<float>();
  // 1-2: queries and the shared kv.
  FM_RETURN_IF_ERROR(cuda::Gemv(l.wq_a.view(), y, cq));
  FM_RETURN_IF_ERROR(cuda::RmsNorm(cq, l.q_norm.as<float>(), cq, 1, QL, eps));
  FM_RETURN_IF_ERROR(cuda::Gemv(l.wq_b.view(), cq, q));
  FM_RETURN_IF_ERROR(cuda::RmsNorm(q, nullptr, q, nH, D, eps));
  FM_RETURN_IF_ERROR(cuda::Gemv(l.wkv.view(), y, kv));
  FM_RETURN_IF_ERROR(cuda::RmsNorm(kv, l.kv_norm.as<float>(), kv, 1, D, eps));
  if (l.ratio > 1) {
    FM_RETURN_IF_ERROR(cuda::Gemv(l.comp.wkv.view(), y, s_.ca.as<float>()));
    FM_RETURN_IF_ERROR(cuda::Gemv(l.comp.wgate.view(), y, s_.cz.as<float>()));
  }
  if (l.ratio == 4) {
    FM_RETURN_IF_ERROR(cuda::Gemv(l.index_comp.wkv.view(), y, s_.ia.as<float>()));
    FM_RETURN_IF_ERROR(cuda::Gemv(l.index_comp.wgate.view(), y, s_.iz.as<float>()));
    FM_RETURN_IF_ERROR(cuda::Gemv(l.index_wq_b.view(), cq, s_.iq.as<float>()));
    FM_RETURN_IF_ERROR(cuda::Gemv(l.index_proj.view(), y, s_.iw.as<float>()));
  }
  FM_RETURN_IF_ERROR(cuda::RopeInterleaved(q, 1, nH, D, rd, p, freq, false));
  FM_RETURN_IF_ERROR(cuda::RopeInterleaved(kv, 1, 1, D, rd, p, freq, false));
  if (l.ratio == 4)
    FM_RETURN_IF_ERROR(cuda::RopeInterleaved(s_.iq.as<float>(), 1, nI, dI, rd, p, freq, false));
  // 4: the compressors; a completed window appends entry c->entries.
  const bool emits = l.ratio > 1 && pos % l.ratio == l.ratio - 1;
  if (emits && c->entries >= c->max_entries)
    return OutOfRange("compressed entries exceed the cache's max_context");
  if (l.ratio > 1) {
    FM_RETURN_IF_ERROR(PushCompressor(l.comp, &c->comp, s_.ca.as<float>(), s_.cz.as<float>(),
                                      pos, freq, c->keys.as<float>() + (W + c->entries) * D));
  }
  if (l.ratio == 4) {
    FM_RETURN_IF_ERROR(PushCompressor(l.index_comp, &c->index_comp, s_.ia.as<float>(),
                                      s_.iz.as<float>(), pos, freq,
                                      c->ikeys.as<float>() + c->entries * dI));
  }
  if (emits) ++c->entries;
  // 3: this token's kv into the ring (the window below reads it as its newest row).
  FM_RETURN_IF_ERROR(cuda::CopyRows(kv, D, c->keys.as<float>() + (pos % W) * D, D, 1, D));
  // 5-6: the key rows: the window, oldest first, then the chosen compressed entries.
  const int64_t nwin = std::min(pos + 1, W), win_start = pos + 1 - nwin;
  const int64_t visible = l.ratio > 1 ? (pos + 1) / l.ratio : 0;
  int64_t nent = visible;
  const int32_t* picks = nullptr;
  if (l.ratio == 4 && visible > cfg_.index_topk) {
    float* hw = s_.iw.as<float>();
    FM_RETURN_IF_ERROR(cuda::ScaleVector(hw, 1.0f / std::sqrt(static_cast<float>(nI)), hw, nI));
    FM_RETURN_IF_ERROR(cuda::IndexerScores(s_.iq.as<float>(), hw, nI, dI, c->ikeys.as<float>(),
                                           visible, 1.0f / std::sqrt(static_cast<float>(dI)),
                                           c->score.as<float>()));
    FM_RETURN_IF_ERROR(cuda::TopKAscending(c->score.as<float>(), visible, cfg_.index_topk,
                                           s_.picks.as<int32_t>()));
    picks = s_.picks.as<int32_t>();
    nent = cfg_.index_topk;
  }
  int32_t* idx = s_.idx.as<int32_t>();
  FM_RETURN_IF_ERROR(cuda::KeyIndex(win_start, nwin, W, nent, picks, W, idx));
  // 7: sink attention, then the inverse rope of the output.
  float* o = s_.o.as<float>();
  FM_RETURN_IF_ERROR(cuda::SinkAttention(q, nH, c->keys.as<float>(), idx, nwin + nent, D,
                                         l.sink.as<float>(),
                                         1.0f / std::sqrt(static_cast<float>(D)), o));
  FM_RETURN_IF_ERROR(cuda::RopeInterleaved(o, 1, nH, D, rd, p, freq, true));
  // 8: grouped output projection (as the CPU: all of wo_a when a group starts inside an FP8
  // scale block, keeping that group's rows).
  const int64_t gin = nH * D / G;
  float* u = s_.u.as<float>();
  for (int64_t g = 0; g < G; ++g) {
    QWeight wg;
    if (SliceRows(l.wo_a.view(), g * R, R, &wg)) {
      FM_RETURN_IF_ERROR(cuda::Gemv(wg, o + g * gin, u + g * R));
    } else {
      FM_RETURN_IF_ERROR(cuda::Gemv(l.wo_a.view(), o + g * gin, s_.ug.as<float>()));
      FM_RETURN_IF_ERROR(cuda::CopyRows(s_.ug.as<float>() + g * R, R, u + g * R, R, 1, R));
    }
  }
  FM_RETURN_IF_ERROR(cuda::Gemv(l.wo_b.view(), u, s_.out.as<float>()));
  c->pos = pos + 1;
  return Status::Ok();
}

Status CudaShardModel::Moe(const DevLayer& l, int32_t token) const {
  const int64_t H = cfg_.hidden_size, E = cfg_.n_routed_experts, k = cfg_.num_experts_per_tok;
  const float limit = cfg_.swiglu_limit > 0 ? static_cast<float>(cfg_.swiglu_limit)
                                            : std::numeric_limits<float>::infinity();
  const float* y = s_.y.as<float>();
  int32_t* ids = s_.ids.as<int32_t>();
  float* rw = s_.rw.as<float>();
  FM_RETURN_IF_ERROR(cuda::Gemv(l.gate.view(), y, s_.gl.as<float>()));
  const int64_t* eids = l.hash ? l.tid2eid.as<int64_t>() + static_cast<int64_t>(token) * k : nullptr;
  FM_RETURN_IF_ERROR(cuda::RouterTopK(s_.gl.as<float>(), l.hash ? nullptr : l.bias.as<float>(),
                                      eids, 1, E, k,
                                      static_cast<float>(cfg_.routed_scaling_factor), ids, rw));
  float* routed = s_.routed.as<float>();
  if (exec_ || !l.all_experts) {
    // Expert parallelism: the executor works on host rows (a copy each way per layer).
    if (!exec_) return InvalidArgument("layer " + std::to_string(l.layer) +
                                          ": not every routed expert is on this device and no "
                                          "expert executor is set");
    std::vector<float> xh(H), out(H), wh(k);
    std::vector<int32_t> idh(k);
    FM_RETURN_IF_ERROR(s_.y.CopyToHost(xh.data(), H * sizeof(float)));
    FM_RETURN_IF_ERROR(s_.ids.CopyToHost(idh.data(), k * sizeof(int32_t)));
    FM_RETURN_IF_ERROR(s_.rw.CopyToHost(wh.data(), k * sizeof(float)));
    FM_RETURN_IF_ERROR(exec_->RunRouted(l.layer, xh.data(), 1, idh.data(), wh.data(), out.data()));
    FM_RETURN_IF_ERROR(s_.routed.CopyFromHost(out.data(), H * sizeof(float)));
  } else {
    const int64_t I = l.w1.rows;
    float* h1 = s_.h1.as<float>();
    float* h3 = s_.h3.as<float>();
    auto experts = [&](const DevExpertSet& set, const float* x, int64_t stride, float* out) {
      return cuda::GemvExperts(set.format, set.rows, set.cols,
                               set.datas.as<const void* const>(),
                               set.scales.as<const uint8_t* const>(), E, ids, k, x, stride, out);
    };
    FM_RETURN_IF_ERROR(experts(l.w1, y, 0, h1));
    FM_RETURN_IF_ERROR(experts(l.w3, y, 0, h3));
    FM_RETURN_IF_ERROR(cuda::SwiGluClamped(h1, h3, h1, k * I, limit));
    FM_RETURN_IF_ERROR(experts(l.w2, h1, I, s_.contrib.as<float>()));
    FM_RETURN_IF_ERROR(cuda::MoeCombine(s_.contrib.as<float>(), rw, 1, k, H, routed));
  }
  // The shared expert, then out = routed + shared.
  const int64_t Is = l.s1.rows;
  float* out = s_.out.as<float>();
  FM_RETURN_IF_ERROR(cuda::Gemv(l.s1.view(), y, s_.sh1.as<float>()));
  FM_RETURN_IF_ERROR(cuda::Gemv(l.s3.view(), y, s_.sh3.as<float>()));
  FM_RETURN_IF_ERROR(cuda::SwiGluClamped(s_.sh1.as<float>(), s_.sh3.as<float>(),
                                         s_.sh1.as<float>(), Is, limit));
  FM_RETURN_IF_ERROR(cuda::Gemv(l.s2.view(), s_.sh1.as<float>(), out));
  return cuda::AddVectors(routed, out, out, H);
}

Status CudaShardModel::LayerStep(const DevLayer& l, DeviceAttentionCache* c, int32_t token) const {
  FM_RETURN_IF_ERROR(HcPreNorm(l.hc_attn, l.attn_norm));
  FM_RETURN_IF_ERROR(Attention(l, c));
  FM_RETURN_IF_ERROR(HcPostUpdate());
  FM_RETURN_IF_ERROR(HcPreNorm(l.hc_ffn, l.ffn_norm));
  FM_RETURN_IF_ERROR(Moe(l, token));
  return HcPostUpdate();
}

Status CudaShardModel::ForwardLayers(std::span<const BatchItem> items, float* x) const {
  FM_ASSIGN_OR_RETURN(std::vector<int32_t> tokens, CheckBatchItems(cfg_, begin_, end_, items, false));
  std::lock_guard<std::mutex> lock(mu_);
  FM_RETURN_IF_ERROR(cuda::SetDevice(device_));
  const size_t row_bytes = static_cast<size_t>(cfg_.hc_mult * cfg_.hidden_size) * sizeof(float);
  std::vector<DeviceAttentionCache*> caches;
  for (const BatchItem& item : items) {
    for (int64_t l = begin_; l < end_; ++l) {
      auto* c = dynamic_cast<DeviceAttentionCache*>(item.cache->layer(l));
      if (!c) return InvalidArgument("sequence cache was not made by this cuda shard");
    }
  }
  // Each row is one step through every layer of the shard: upload X, run, download X.
  size_t row = 0;
  for (const BatchItem& item : items) {
    for (size_t t = 0; t < item.tokens.size(); ++t, ++row) {
      FM_RETURN_IF_ERROR(s_.x.CopyFromHost(x + row * row_bytes / sizeof(float), row_bytes));
      for (const auto& l : layers_) {
        auto* c = static_cast<DeviceAttentionCache*>(item.cache->layer(l->layer));
        Status st = LayerStep(*l, c, item.tokens[t]);
        if (!st.ok()) return st.Wrap("layer " + std::to_string(l->layer) + " on cuda:" +
                                     std::to_string(device_));
      }
      FM_RETURN_IF_ERROR(s_.x.CopyToHost(x + row * row_bytes / sizeof(float), row_bytes));
    }
    item.cache->Advance(static_cast<int64_t>(item.tokens.size()));
  }
  return cuda::Synchronize();
}

Status CudaShardModel::Logits(const float* x, int64_t rows, float* logits) const {
  if (!has_head_) return InvalidArgument("Logits: this shard does not hold the head");
  if (rows <= 0) return InvalidArgument("Logits: rows " + std::to_string(rows) + " must be > 0");
  std::lock_guard<std::mutex> lock(mu_);
  FM_RETURN_IF_ERROR(cuda::SetDevice(device_));
  const int64_t n = cfg_.hc_mult, H = cfg_.hidden_size, V = cfg_.vocab_size;
  const float eps = static_cast<float>(cfg_.rms_norm_eps), eh = static_cast<float>(cfg_.hc_eps);
  for (int64_t r = 0; r < rows; ++r) {
    FM_RETURN_IF_ERROR(s_.x.CopyFromHost(x + r * n * H, n * H * sizeof(float)));
    FM_RETURN_IF_ERROR(cuda::Gemv(hc_head_.fn.view(), s_.x.as<float>(), s_.mix.as<float>()));
    FM_RETURN_IF_ERROR(cuda::HcHead(s_.x.as<float>(), s_.mix.as<float>(), hc_head_.base.as<float>(),
                                    hc_head_.head_scale, 1, n, H, eh, eps, s_.head_y.as<float>()));
    FM_RETURN_IF_ERROR(cuda::RmsNorm(s_.head_y.as<float>(), norm_.as<float>(),
                                     s_.head_y.as<float>(), 1, H, eps));
    FM_RETURN_IF_ERROR(cuda::Gemv(head_.view(), s_.head_y.as<float>(), s_.logits.as<float>()));
    FM_RETURN_IF_ERROR(s_.logits.CopyToHost(logits + r * V, V * sizeof(float)));
  }
  return cuda::Synchronize();
}

}  // namespace

Result<std::unique_ptr<ShardModel>> CreateCudaShardModel(const Checkpoint& ckpt, int device) {
  auto m = std::make_unique<CudaShardModel>(ckpt.config(), device);
  Status st = m->Bind(ckpt);
  if (!st.ok()) return st.Wrap("device cuda:" + std::to_string(device));
  return std::unique_ptr<ShardModel>(std::move(m));
}

Result<double> CudaReadBandwidthGbps(int device) {
  FM_RETURN_IF_ERROR(cuda::SetDevice(device));
  return cuda::MeasureReadBandwidth(size_t{1} << 30, 10);
}

}  // namespace fm
