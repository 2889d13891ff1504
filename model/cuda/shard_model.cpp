// ShardModel on a CUDA device (model/cuda/shard_model.h). The layer step mirrors the CPU one
// (model/layer.cpp, attention.cpp, compressor.cpp, moe.cpp) op for op, each op the CUDA twin of
// the CPU kernel; the weights are bound by the same Bind* functions and then uploaded.
#include "model/cuda/shard_model_impl.h"

#include "model/cuda/tp_step.h"

#include <algorithm>
#include <cmath>
#include <cstddef>
#include <mutex>
#include <string>
#include <utility>
#include <vector>

#include "common/log.h"
#include "kernels/cuda/device.h"
#include "kernels/cuda/fused_ops.h"
#include "kernels/cuda/ops.h"
#include "kernels/cuda/sample_ops.h"
#include "model/kv_cache.h"
#include "model/layer.h"

namespace fm {

using cuda::DeviceBuffer;
using cuda::DeviceWeight;

Result<DevCompressorState> NewCompressorState(int64_t ratio, int64_t width, size_t* bytes) {
  DevCompressorState s;
  FM_ASSIGN_OR_RETURN(s.pend_a, AllocFloats(2 * ratio * width));
  FM_ASSIGN_OR_RETURN(s.pend_z, AllocFloats(2 * ratio * width));
  *bytes += 4 * static_cast<size_t>(ratio * width) * sizeof(float);
  return s;
}

Status CudaShardModel::Bind(const Checkpoint& ckpt) {
  FM_RETURN_IF_ERROR(cuda::SetDevice(device_));
  FM_ASSIGN_OR_RETURN(const cuda::DeviceMemory mem, cuda::MemoryInfo());
  FM_RETURN_IF_ERROR(CheckShardFits(ckpt.selected_bytes(), mem.free, mem.total, device_));
  const ShardSelection& sel = ckpt.selection();
  const int64_t L = cfg_.num_hidden_layers, H = cfg_.hidden_size;
  begin_ = sel.layer_begin;
  tp_rank_ = sel.tp_size > 1 ? sel.tp_rank : 0;
  tp_size_ = std::max(sel.tp_size, 1);
  end_ = sel.layer_end < 0 ? L : sel.layer_end;
  if (begin_ < 0 || begin_ > end_ || end_ > L)
    return InvalidArgument("shard selection: layers [" + std::to_string(begin_) + ", " +
                           std::to_string(end_) + ") outside [0, " + std::to_string(L) + "]");
  if (sel.embed) {
    FM_ASSIGN_OR_RETURN(const TensorView embed, BindEmbed(ckpt));
    FM_ASSIGN_OR_RETURN(embed_, cuda::Upload(embed.data, embed.nbytes));
    embed_bf16_ = embed.dtype == DType::kBF16;
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
    Result<std::unique_ptr<DevLayer>> dl = UploadLayer(cfg_, *lw, sel.tp_size > 1 ? sel.tp_rank : 0,
                                                       std::max(sel.tp_size, 1));
    if (!dl.ok()) return dl.status().Wrap("layer " + std::to_string(l) + " to cuda:" +
                                          std::to_string(device_));
    layers_.push_back(std::move(dl).value());
    const int64_t r = cfg_.compress_ratio(l);
    if (r > 1 && std::find(ratios_.begin(), ratios_.end(), r) == ratios_.end()) {
      if (ratios_.size() == kMaxRatios)
        return InvalidArgument("layer " + std::to_string(l) + ": more than " +
                               std::to_string(kMaxRatios) + " distinct compress ratios");
      ratios_.push_back(r);
    }
  }
  index_grid_positions_ = cfg_.max_position_embeddings > 0 ? cfg_.max_position_embeddings
                                                           : int64_t{1} << 20;
  std::vector<const DevLayer*> uploaded;
  for (const auto& l : layers_) uploaded.push_back(l.get());
  FM_ASSIGN_OR_RETURN(experts_, DeviceExpertRunner::Create(cfg_, device_, begin_, uploaded));
  FM_ASSIGN_OR_RETURN(stream_, cuda::Stream::Create());
  FM_RETURN_IF_ERROR(AllocScratch());
  if (mode_ == CudaStepMode::kGraph && !layers_.empty()) {
    // The padding rows' caches: at position 0 a row writes ring row 0 and compressor slot 0 and
    // reads one window row; a context of the largest ratio gives every cache kind an entry row.
    int64_t ctx = 1;
    for (const int64_t r : ratios_) ctx = std::max(ctx, r);
    std::vector<std::unique_ptr<AttentionCache>> caches;
    for (int64_t l = begin_; l < end_; ++l) {
      FM_ASSIGN_OR_RETURN(std::unique_ptr<AttentionCache> c,
                          NewCache(cfg_.compress_ratio(l), ctx));
      caches.push_back(std::move(c));
    }
    pad_ = std::make_unique<SequenceCache>(begin_, std::move(caches), nullptr, ctx);
  }
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
  DeviceStepScratch& s = s_;
  // Shared-expert width: from the first layer's weight (every layer has the same config).
  const int64_t Is = layers_.empty() ? I : layers_[0]->s1.whole_rows;
  struct Want { DeviceBuffer* b; int64_t floats; };
  const int64_t C = kMaxStepRows;
  const Want wants[] = {
      {&s.x, C * n * H}, {&s.x_new, C * n * H}, {&s.mix, C * (2 + n) * n}, {&s.y, C * H},
      {&s.post, C * n}, {&s.comb, C * n * n}, {&s.out, C * H},
      {&s.hc_part, cuda::HcFusedPartials(C, n, H)}, {&s.cq, C * QL},
      {&s.q, C * nH * D}, {&s.kv, C * D}, {&s.ca, C * 2 * D}, {&s.cz, C * 2 * D},
      {&s.ia, C * 2 * dI}, {&s.iz, C * 2 * dI}, {&s.iq, C * nI * dI}, {&s.iw, C * nI},
      {&s.picks, C * std::max<int64_t>(cfg_.index_topk, 1)}, {&s.o, C * nH * D}, {&s.u, C * G * R},
      {&s.gl, C * E}, {&s.ids, C * k}, {&s.rw, C * k}, {&s.h, C * (k + 1) * std::max(I, Is)},
      {&s.contrib, C * (k + 1) * H}, {&s.routed, C * H},
      {&s.head_y, C * H}, {&s.logits, C * cfg_.vocab_size}};
  for (const Want& w : wants) {
    FM_ASSIGN_OR_RETURN(*w.b, AllocFloats(w.floats));
  }
  // Block counters start at 0; each kernel's last block resets its own.
  const std::vector<int32_t> zeros(kMaxStepRows, 0);
  FM_ASSIGN_OR_RETURN(s.hc_count, cuda::Upload(zeros.data(), zeros.size() * sizeof(int32_t)));
  FM_ASSIGN_OR_RETURN(s.index_count, cuda::Upload(zeros.data(), zeros.size() * sizeof(int32_t)));
  FM_ASSIGN_OR_RETURN(s.route_count, cuda::Upload(zeros.data(), sizeof(int32_t)));
  FM_ASSIGN_OR_RETURN(s.table, DeviceBuffer::Alloc(layers_.size() * C * sizeof(cuda::RowCache)));
  FM_ASSIGN_OR_RETURN(s.inputs, DeviceBuffer::Alloc(sizeof(StepInputs)));
  FM_ASSIGN_OR_RETURN(s.embed_ids, DeviceBuffer::Alloc(C * sizeof(int32_t)));
  if (tp_size_ > 1) {  // the gathers of a group that takes device memory (tp_step.h)
    const int64_t pieces = std::max({G * R, (k + 1) * H, Is});
    FM_ASSIGN_OR_RETURN(s.tp_all, AllocFloats(C * pieces));
    FM_ASSIGN_OR_RETURN(s.tp_rows, DeviceBuffer::Alloc(C * k * sizeof(int32_t)));
  }
  if (has_head_) {
    FM_ASSIGN_OR_RETURN(s.sample_params, DeviceBuffer::Alloc(C * sizeof(cuda::SampleParams)));
    FM_ASSIGN_OR_RETURN(s.sample_out, DeviceBuffer::Alloc(C * sizeof(cuda::SampleResult)));
    FM_ASSIGN_OR_RETURN(s.sample_top, DeviceBuffer::Alloc(C * sizeof(cuda::SampleTop)));
    FM_ASSIGN_OR_RETURN(s.sample_scratch,
                        DeviceBuffer::Alloc(cuda::SampleScratchBytes(C, cfg_.vocab_size)));
    FM_ASSIGN_OR_RETURN(s.adjust_rows, DeviceBuffer::Alloc(C * sizeof(cuda::AdjustRow)));
    FM_ASSIGN_OR_RETURN(s.adjust_edits, DeviceBuffer::Alloc(C * kMaxRowEdits * sizeof(cuda::LogitEdit)));
    FM_ASSIGN_OR_RETURN(s.adjust_biases, DeviceBuffer::Alloc(C * kMaxRowBiases * sizeof(float)));
  }
  return Status::Ok();
}

Result<std::unique_ptr<AttentionCache>> CudaShardModel::NewCache(int64_t ratio,
                                                                 int64_t max_context) const {
  auto c = std::make_unique<DeviceAttentionCache>();
  const int64_t W = cfg_.sliding_window, D = cfg_.head_dim, dI = cfg_.index_head_dim;
  c->ratio = ratio;
  c->window = W;
  c->dim = D;
  c->index_dim = dI;
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

Status DeviceAttentionCache::CopyFrom(const AttentionCache& other) {
  const auto* src = dynamic_cast<const DeviceAttentionCache*>(&other);
  if (!src || src->ratio != ratio || src->window != window || src->dim != dim ||
      src->index_dim != index_dim)
    return InvalidArgument("copying the device attention cache of another kind of layer");
  // An entry is written when its window of `ratio` positions completes.
  const int64_t entries = ratio > 1 ? src->pos / ratio : 0;
  if (entries > max_entries || entries > src->max_entries)
    return OutOfRange("copying a device attention cache of " + std::to_string(src->pos) +
                      " positions into one of " + std::to_string(max_entries) + " entries");
  auto copy = [](const cuda::DeviceBuffer& from, cuda::DeviceBuffer* to, int64_t floats) {
    return cuda::CopyOnDevice(to->data(), from.data(), static_cast<size_t>(floats) * sizeof(float));
  };
  FM_RETURN_IF_ERROR(copy(src->keys, &keys, (window + entries) * dim));
  if (ratio > 1) {
    FM_RETURN_IF_ERROR(copy(src->comp.pend_a, &comp.pend_a, static_cast<int64_t>(comp.pend_a.size() / sizeof(float))));
    FM_RETURN_IF_ERROR(copy(src->comp.pend_z, &comp.pend_z, static_cast<int64_t>(comp.pend_z.size() / sizeof(float))));
  }
  if (ratio == 4) {
    FM_RETURN_IF_ERROR(copy(src->ikeys, &ikeys, entries * index_dim));
    FM_RETURN_IF_ERROR(copy(src->index_comp.pend_a, &index_comp.pend_a,
                            static_cast<int64_t>(index_comp.pend_a.size() / sizeof(float))));
    FM_RETURN_IF_ERROR(copy(src->index_comp.pend_z, &index_comp.pend_z,
                            static_cast<int64_t>(index_comp.pend_z.size() / sizeof(float))));
  }
  pos = src->pos;
  return Status::Ok();
}

Status CudaShardModel::CopySequence(const SequenceCache& src, SequenceCache* dst) const {
  std::lock_guard<std::mutex> lock(mu_);
  FM_RETURN_IF_ERROR(cuda::SetDevice(device_));
  cuda::StreamScope on_stream(stream_);
  FM_RETURN_IF_ERROR(dst->CopyFrom(src));
  return stream_.Synchronize();
}

// Without mu_: it only allocates (no stream work) and reads the constant config, so a new
// request does not wait for a step in flight (which holds mu_ for its EP/TP exchanges too), nor
// does the worker's Health behind it; only a graph capture (brief: nothing runs) excludes it.
// Called from any thread: the shard's device first.
Result<std::unique_ptr<SequenceCache>> CudaShardModel::NewSequence(int64_t max_context) const {
  std::lock_guard<std::mutex> no_capture(capture_mu_);
  FM_RETURN_IF_ERROR(cuda::SetDevice(device_));
  std::vector<std::unique_ptr<AttentionCache>> caches;
  for (int64_t l = begin_; l < end_; ++l) {
    Result<std::unique_ptr<AttentionCache>> c = NewCache(cfg_.compress_ratio(l), max_context);
    if (c.status().code() == Code::kResourceExhausted)
      return ResourceExhausted("cuda:" + std::to_string(device_) + " has no memory for the KV cache of a " +
                               std::to_string(max_context) + "-position sequence (layer " +
                               std::to_string(l) + "): " + c.status().message());
    if (!c.ok()) return c.status().Wrap("cuda:" + std::to_string(device_) + " sequence cache");
    caches.push_back(std::move(c).value());
  }
  return std::make_unique<SequenceCache>(begin_, std::move(caches), nullptr, max_context);
}

Status CudaShardModel::Embed(std::span<const int32_t> tokens, float* x) const {
  if (!has_embed()) return InvalidArgument("Embed: this shard does not hold embed.weight");
  FM_RETURN_IF_ERROR(CheckTokenIds(cfg_, tokens, "Embed"));
  std::lock_guard<std::mutex> lock(mu_);
  FM_RETURN_IF_ERROR(cuda::SetDevice(device_));
  cuda::StreamScope on_stream(stream_);
  const int64_t n = cfg_.hc_mult, H = cfg_.hidden_size;
  // Only the ids cross; the rows are looked up on the device, kMaxStepRows tokens a launch (the
  // next chunk's ids are copied in stream order, after the launch that reads the previous ones).
  for (size_t t0 = 0; t0 < tokens.size(); t0 += kMaxStepRows) {
    const int64_t T = std::min<int64_t>(kMaxStepRows, tokens.size() - t0);
    FM_RETURN_IF_ERROR(s_.embed_ids.CopyFromHostAsync(tokens.data() + t0, T * sizeof(int32_t)));
    FM_RETURN_IF_ERROR(cuda::EmbedRows(embed_.data(), embed_bf16_, cfg_.vocab_size, H,
                                       s_.embed_ids.as<int32_t>(), T, n, x + t0 * n * H));
  }
  return stream_.Synchronize();
}

Status CudaShardModel::SetTensorParallel(TpGroup* tp) {
  const int t = tp ? tp->size() : 1, r = tp ? tp->rank() : 0;
  if (t != tp_size_ || r != tp_rank_)
    return InvalidArgument("tensor_parallel: a group member " + std::to_string(r) + " of " +
                           std::to_string(t) + " for a cuda shard uploaded for member " +
                           std::to_string(tp_rank_) + " of " + std::to_string(tp_size_));
  tp_ = t > 1 ? tp : nullptr;
  return Status::Ok();
}

Status CudaShardModel::HcPreNorm(const DevHc& hc, const DeviceBuffer& norm, int64_t T,
                                 const cuda::HcPostInput& post) const {
  const int64_t n = cfg_.hc_mult, H = cfg_.hidden_size;
  const float eps = static_cast<float>(cfg_.rms_norm_eps), eh = static_cast<float>(cfg_.hc_eps);
  FM_RETURN_IF_ERROR(cuda::HcPostPre(
      s_.x.as<float>(), post, s_.x_new.as<float>(),
      hc.fn.data.as<float>(), hc.base.as<float>(), hc.scale.as<float>(), norm.as<float>(), T, n,
      H, cfg_.hc_sinkhorn_iters, eh, eps, s_.post.as<float>(), s_.comb.as<float>(),
      s_.y.as<float>(), s_.hc_part.as<float>(), s_.hc_count.as<int32_t>()));
  if (post.present()) std::swap(s_.x, s_.x_new);
  return Status::Ok();
}

Status CudaShardModel::HcPostUpdate(int64_t T, const cuda::HcPostInput& post) const {
  const int64_t n = cfg_.hc_mult, H = cfg_.hidden_size;
  FM_RETURN_IF_ERROR(cuda::HcPost(s_.x.as<float>(), post, s_.post.as<float>(),
                                  s_.comb.as<float>(), T, n, H, s_.x_new.as<float>()));
  std::swap(s_.x, s_.x_new);
  return Status::Ok();
}

Status CudaShardModel::Attention(const DevLayer& l, int64_t T, bool distinct,
                                 const DevStepInputs& in, const cuda::RowCache* table) const {
  const int64_t nH = cfg_.num_attention_heads, D = cfg_.head_dim, rd = cfg_.qk_rope_head_dim;
  const int64_t G = cfg_.o_groups, R = cfg_.o_lora_rank, W = cfg_.sliding_window;
  const int64_t nI = cfg_.index_n_heads, dI = cfg_.index_head_dim, QL = cfg_.q_lora_rank;
  const int64_t H = cfg_.hidden_size;
  const float eps = static_cast<float>(cfg_.rms_norm_eps);
  const int ri = RatioIndex(l.ratio);
  const float* y = s_.y.as<float>();
  const float* freq = l.freq.as<float>();
  const int32_t* p = in.pos();
  // Tensor parallel: this member's heads [h0, h0 + nh) and nG output groups (their wo_a rows).
  const TpRange heads = TpShare(nH, tp_rank_, tp_size_), groups = TpShare(G, tp_rank_, tp_size_);
  const int64_t h0 = heads.begin, nh = heads.size(), nG = groups.size();
  float* cq = s_.cq.as<float>();
  float* q = s_.q.as<float>();
  float* kv = s_.kv.as<float>();
  float* hw = s_.iw.as<float>();
  // Every row's output of w over x (rows of xs floats) into out, rows of w.rows floats.
  auto task = [](const DeviceWeight& w, const float* x, int64_t xs, float* out) {
    return cuda::GemvTask{w.view(), x, xs, out, w.rows};
  };
  // 1-2: queries and the shared kv of every row: the products of y in one launch, those of cq
  // (through q_norm, in the same launch) in another.
  std::vector<cuda::GemvTask> of_y = {task(l.wq_a, y, H, cq), task(l.wkv, y, H, kv)};
  std::vector<cuda::GemvTask> of_cq = {l.wq_b.Task(cq, QL, q, nh * D)};
  if (l.ratio > 1) {
    of_y.push_back(task(l.comp.wkv, y, H, s_.ca.as<float>()));
    of_y.push_back(task(l.comp.wgate, y, H, s_.cz.as<float>()));
  }
  if (l.ratio == 4) {
    of_y.push_back(task(l.index_comp.wkv, y, H, s_.ia.as<float>()));
    of_y.push_back(task(l.index_comp.wgate, y, H, s_.iz.as<float>()));
    of_y.push_back(task(l.index_proj, y, H, hw));
    of_cq.push_back(task(l.index_wq_b, cq, QL, s_.iq.as<float>()));
  }
  FM_RETURN_IF_ERROR(cuda::GemmMany(of_y.data(), static_cast<int64_t>(of_y.size()), T));
  FM_RETURN_IF_ERROR(cuda::GemmMany(of_cq.data(), static_cast<int64_t>(of_cq.size()), T,
                                    l.q_norm.as<float>(), eps));
  // 3-6: the norms and RoPE with the cache updates, the indexer and the attention core, each one
  // launch over the rows (their caches from the row table); when a sequence has several rows in
  // the step, the cache updates, indexer and core go row by row in order after the norms (each
  // of its queries sees its caches after its own token).
  const cuda::RowSteps steps{in.ring_row(0), in.window(0), in.visible(0, ri), in.entries(0, ri),
                             l.ratio > 1 ? in.keys(0, ri) : in.nwin(0), in.comp(0, ri),
                             sizeof(RowScalars)};
  const cuda::CompressorRowArgs comp{s_.ca.as<float>(), s_.cz.as<float>(), l.comp.ape.as<float>(),
                                     l.comp.norm.as<float>(), l.comp.ratio, l.comp.dim,
                                     l.comp.overlap};
  const cuda::CompressorRowArgs index_comp{s_.ia.as<float>(), s_.iz.as<float>(),
                                           l.index_comp.ape.as<float>(),
                                           l.index_comp.norm.as<float>(), l.index_comp.ratio,
                                           l.index_comp.dim, l.index_comp.overlap};
  const cuda::CacheRowsArgs cache{table, W, steps, l.ratio > 1 ? &comp : nullptr,
                                  l.ratio == 4 ? &index_comp : nullptr};
  const cuda::AttnPrepArgs prep{q, nh, D, kv, l.kv_norm.as<float>(),
                                l.ratio == 4 ? s_.iq.as<float>() : nullptr, hw, nI, dI,
                                1.0f / std::sqrt(static_cast<float>(nI)), p, freq, rd, eps};
  FM_RETURN_IF_ERROR(cuda::AttnPrep(prep, T, distinct ? &cache : nullptr));
  const int64_t topk = l.ratio == 4 ? cfg_.index_topk : 0;
  int32_t* picks = s_.picks.as<int32_t>();
  const cuda::AttentionArgs attn{q, nh, D, table, W, l.ratio > 1, topk, picks, steps,
                                 l.sink.as<float>() + h0, 1.0f / std::sqrt(static_cast<float>(D)), p,
                                 freq, rd, s_.o.as<float>()};
  auto core = [&](int64_t row0, int64_t n) -> Status {
    if (!distinct) FM_RETURN_IF_ERROR(cuda::CacheRows(cache, row0, n, kv, D, freq, rd, eps));
    if (topk > 0)
      FM_RETURN_IF_ERROR(cuda::IndexerTopK(table, row0, n, s_.iq.as<float>(), hw, nI, dI,
                                           1.0f / std::sqrt(static_cast<float>(dI)), steps,
                                           index_grid_positions_ / l.ratio, topk, picks,
                                           s_.index_count.as<int32_t>()));
    return cuda::SinkAttentionRows(attn, row0, n);
  };
  if (distinct) {
    FM_RETURN_IF_ERROR(core(0, T));
  } else {
    for (int64_t t = 0; t < T; ++t) FM_RETURN_IF_ERROR(core(t, 1));
  }
  float* o = s_.o.as<float>();
  // 8: grouped output projection: group g's rows [g R, (g + 1) R) of wo_a over its slice of o
  // (a row slice may start inside an FP8 scale block), kMaxGemvTasks groups a launch; then wo_b.
  // Tensor parallel: this member's groups, all-gathered; its rows of wo_b, all-gathered.
  const int64_t gin = nH * D / G;
  float* u = s_.u.as<float>();
  std::vector<cuda::GemvTask> tasks;
  for (int64_t g = 0; g < nG; ++g)
    tasks.push_back({l.wo_a.w.view(), o + g * gin, nh * D, u + g * R, nG * R,
                     l.wo_a.first + g * R, R});
  for (size_t t0 = 0; t0 < tasks.size(); t0 += cuda::kMaxGemvTasks) {
    const int64_t n = std::min<int64_t>(cuda::kMaxGemvTasks, tasks.size() - t0);
    FM_RETURN_IF_ERROR(cuda::GemmMany(tasks.data() + t0, n, T));
  }
  if (!tp_) {
    const cuda::GemvTask wo_b = l.wo_b.Task(u, G * R, s_.out.as<float>(), H);
    return cuda::GemmMany(&wo_b, 1, T);
  }
  FM_RETURN_IF_ERROR(GatherColumnsOnDevice(tp_, s_.u, T, nG * R, &s_.u, &s_.tp_all));
  const cuda::GemvTask wo_b = l.wo_b.Task(u, G * R, s_.routed.as<float>(), l.wo_b.rows);
  FM_RETURN_IF_ERROR(cuda::GemmMany(&wo_b, 1, T));
  return GatherColumnsOnDevice(tp_, s_.routed, T, l.wo_b.rows, &s_.out, &s_.tp_all);
}

Result<cuda::HcPostInput> CudaShardModel::Moe(const DevLayer& l, int64_t T,
                                               const DevStepInputs& in) const {
  const int64_t H = cfg_.hidden_size, k = cfg_.num_experts_per_tok;
  const float limit = DeviceSwigluLimit(cfg_);
  const float* y = s_.y.as<float>();
  int32_t* ids = s_.ids.as<int32_t>();
  float* rw = s_.rw.as<float>();
  FM_RETURN_IF_ERROR(cuda::GateRouterTopK(
      l.gate.view(), y, H, T, s_.gl.as<float>(), l.hash ? nullptr : l.bias.as<float>(),
      l.hash ? l.tid2eid.as<int64_t>() : nullptr, in.tokens(), cfg_.vocab_size, k,
      static_cast<float>(cfg_.routed_scaling_factor), ids, rw, s_.route_count.as<int32_t>()));
  // The shared expert is slot k of each token in the expert launches (slot 0 of k = 0 under EP).
  const cuda::SharedExpert shared{l.s1.w.view(), l.s3.w.view(), l.s2.w.view()};
  const int64_t hs = std::max(l.w1.rows, l.s1.whole_rows);
  float* h = s_.h.as<float>();
  float* contrib = s_.contrib.as<float>();
  float* out = s_.out.as<float>();
  if (tp_) {
    FM_RETURN_IF_ERROR(MoeTpOnDevice(
        cfg_, l, tp_, T, {y, &s_.ids, rw, &s_.h, hs, &s_.contrib, out, &s_.tp_all, &s_.tp_rows}));
    return cuda::HcPostInput(out);
  }
  if (exec_ || !l.all_experts) {
    // Expert parallelism: the executor brings every (row, k) pair's unweighted output (this
    // member's experts run on this GPU through LocalExperts(), for every member); they are
    // summed here as the whole shard's step sums them (MoeCombine's order, then the shared row).
    if (!exec_) return InvalidArgument("layer " + std::to_string(l.layer) +
                                          ": not every routed expert is on this device and no "
                                          "expert executor is set");
    // Only the expert ids cross to the host (the routing is planned there); y and the slots
    // stay in device memory (the copy waits for the router, so y is ready too).
    std::vector<int32_t> idh(T * k);
    FM_RETURN_IF_ERROR(s_.ids.CopyToHost(idh.data(), idh.size() * sizeof(int32_t)));
    FM_RETURN_IF_ERROR(exec_->RunSlotsOnDevice(l.layer, y, T, idh.data(), contrib));
    float* shared_out = contrib + T * k * H;
    const cuda::DevExperts none;
    FM_RETURN_IF_ERROR(cuda::ExpertsUpGate(none, none, nullptr, T, 0, y, H, limit, &shared, h, hs));
    FM_RETURN_IF_ERROR(cuda::ExpertsDown(none, nullptr, T, 0, h, hs, &shared, shared_out));
    FM_RETURN_IF_ERROR(cuda::MoeCombine(contrib, rw, T, k, H, s_.routed.as<float>()));
    FM_RETURN_IF_ERROR(cuda::AddVectors(s_.routed.as<float>(), shared_out, out, T * H));
    return cuda::HcPostInput(out);
  }
  FM_RETURN_IF_ERROR(
      cuda::ExpertsUpGate(l.w1.view(), l.w3.view(), ids, T, k, y, H, limit, &shared, h, hs));
  FM_RETURN_IF_ERROR(cuda::ExpertsDown(l.w2.view(), ids, T, k, h, hs, &shared, contrib));
  return cuda::HcPostInput::Slots(contrib, rw, k);
}

Status CudaShardModel::LayerStep(const DevLayer& l, const DevLayer* next, int64_t T,
                                 bool distinct, const DevStepInputs& in,
                                 const cuda::RowCache* table) const {
  FM_RETURN_IF_ERROR(Attention(l, T, distinct, in, table));
  FM_RETURN_IF_ERROR(HcPreNorm(l.hc_ffn, l.ffn_norm, T, s_.out.as<float>()));
  FM_ASSIGN_OR_RETURN(const cuda::HcPostInput ffn, Moe(l, T, in));
  if (next) return HcPreNorm(next->hc_attn, next->attn_norm, T, ffn);
  return HcPostUpdate(T, ffn);
}

std::vector<cuda::RowCache> CudaShardModel::RowTable(Rows rows) const {
  std::vector<cuda::RowCache> table;
  for (int64_t l = begin_; l < end_; ++l) {
    for (const SequenceCache* row : rows) {
      auto* c = static_cast<DeviceAttentionCache*>(row->layer(l));
      table.push_back({c->keys.as<float>(), c->ikeys.as<float>(), c->score.as<float>(),
                       c->comp.pend_a.as<float>(), c->comp.pend_z.as<float>(),
                       c->index_comp.pend_a.as<float>(), c->index_comp.pend_z.as<float>(),
                       static_cast<int32_t>(c->max_entries), 0});
    }
  }
  return table;
}

Status CudaShardModel::Step(int64_t T, bool distinct, const DevStepInputs& in,
                            const cuda::RowCache* table) const {
  FM_RETURN_IF_ERROR(HcPreNorm(layers_[0]->hc_attn, layers_[0]->attn_norm, T, {}));
  for (size_t i = 0; i < layers_.size(); ++i) {
    const DevLayer& l = *layers_[i];
    const DevLayer* next = i + 1 < layers_.size() ? layers_[i + 1].get() : nullptr;
    Status st = LayerStep(l, next, T, distinct, in, table + i * T);
    if (!st.ok()) return st.Wrap("layer " + std::to_string(l.layer) + " on cuda:" +
                                 std::to_string(device_));
  }
  return Status::Ok();
}

int CudaShardModel::RatioIndex(int64_t ratio) const {
  for (size_t i = 0; i < ratios_.size(); ++i)
    if (ratios_[i] == ratio) return static_cast<int>(i);
  return 0;  // ratio <= 1: no compressed values are read
}

Status CudaShardModel::ForwardLayers(std::span<const BatchItem> items, float* x) const {
  FM_ASSIGN_OR_RETURN(std::vector<int32_t> tokens, CheckBatchItems(cfg_, begin_, end_, items, false));
  std::lock_guard<std::mutex> lock(mu_);
  FM_RETURN_IF_ERROR(cuda::SetDevice(device_));
  cuda::StreamScope on_stream(stream_);
  for (const BatchItem& item : items) {
    for (int64_t l = begin_; l < end_; ++l) {
      auto* c = dynamic_cast<DeviceAttentionCache*>(item.cache->layer(l));
      if (!c) return InvalidArgument("sequence cache was not made by this cuda shard");
    }
  }
  if (layers_.empty()) {   // a stage of no layers passes X through; its positions advance (CPU's)
    for (const BatchItem& item : items) item.cache->Advance(static_cast<int64_t>(item.tokens.size()));
    return Status::Ok();
  }
  const size_t row_floats = static_cast<size_t>(cfg_.hc_mult * cfg_.hidden_size);
  auto first = [&](const BatchItem& item) {
    return static_cast<DeviceAttentionCache*>(item.cache->layer(begin_));
  };
  auto advance = [&](const SequenceCache* seq) {
    for (int64_t l = begin_; l < end_; ++l)
      ++static_cast<DeviceAttentionCache*>(seq->layer(l))->pos;
  };
  // Every token of the batch, in order, in steps of up to kMaxStepRows rows: each projection one
  // Gemm over the step's rows, the attention side one launch over them (row by row when a
  // sequence has several rows in the step). A decode step (one token of each of distinct
  // sequences: CheckBatchItems' rule) replays its bucket's graph, the rows past the real ones
  // padding rows over pad_ (row 0's token and X, position 0) whose results are dropped.
  if (tp_size_ > 1 && !tp_)
    return FailedPrecondition("this cuda shard holds tensor-parallel member " +
                              std::to_string(tp_rank_) + " of " + std::to_string(tp_size_) +
                              "'s rows: set its group (SetTensorParallel) before a step");
  const bool graph = mode_ == CudaStepMode::kGraph && !exec_ && !tp_ &&
                     std::all_of(items.begin(), items.end(),
                                 [](const BatchItem& i) { return i.tokens.size() == 1; });
  std::vector<const SequenceCache*> rows;
  std::vector<int64_t> pos;
  for (const BatchItem& item : items) {
    const int64_t p0 = first(item)->pos;
    for (size_t t = 0; t < item.tokens.size(); ++t) {
      rows.push_back(item.cache);
      pos.push_back(p0 + static_cast<int64_t>(t));
    }
  }
  const DevStepInputs dev(s_.inputs);
  // Under expert parallelism every member runs as many steps as the busiest (AgreeRounds).
  const int64_t steps = static_cast<int64_t>((rows.size() + kMaxStepRows - 1) / kMaxStepRows);
  int64_t rounds = steps;
  if (exec_) {
    FM_ASSIGN_OR_RETURN(rounds, exec_->AgreeRounds(steps));
  }
  for (size_t r0 = 0; r0 < rows.size(); r0 += kMaxStepRows) {
    const size_t T = std::min<size_t>(kMaxStepRows, rows.size() - r0);
    const size_t S = graph ? StepBucket(T) : T;  // the step's rows, padding included
    std::vector<const SequenceCache*> step_rows(rows.begin() + r0, rows.begin() + r0 + T);
    StepInputs in{};
    const size_t row_bytes = row_floats * sizeof(float);
    // The real rows' X from the caller's device buffer; a padding row takes row 0's.
    float* xr = x + r0 * row_floats;
    FM_RETURN_IF_ERROR(cuda::CopyOnDevice(s_.x.data(), xr, T * row_bytes));
    for (size_t t = 0; t < S; ++t) {
      const bool real = t < T;
      SetStepRow(cfg_, ratios_, static_cast<int>(t), real ? pos[r0 + t] : 0,
                 tokens[r0 + (real ? t : 0)], &in);
      if (real) continue;
      step_rows.push_back(pad_.get());
      FM_RETURN_IF_ERROR(cuda::CopyOnDevice(s_.x.as<char>() + t * row_bytes, xr, row_bytes));
    }
    const std::vector<cuda::RowCache> table = RowTable(step_rows);
    FM_RETURN_IF_ERROR(s_.inputs.CopyFromHostAsync(&in, sizeof in));
    FM_RETURN_IF_ERROR(s_.table.CopyFromHost(table.data(), table.size() * sizeof table[0]));
    // A sequence's rows are adjacent; the padding rows share pad_ but their results are dropped.
    const bool distinct = graph || std::adjacent_find(step_rows.begin(), step_rows.end()) ==
                                       step_rows.end();
    // A whole step exchanges s_.x and s_.x_new twice a layer, so X ends where it began, which
    // every captured graph has baked in; a step that fails midway is put back the same way.
    auto step = [&]() -> Status {
      const void* x0 = s_.x.data();
      Status st = Step(static_cast<int64_t>(S), distinct, dev, s_.table.as<const cuda::RowCache>());
      if (s_.x.data() != x0) std::swap(s_.x, s_.x_new);
      return st;
    };
    const size_t bucket = StepBucketIndex(S);
    cuda::Graph* g = graph ? &graphs_[bucket] : nullptr;  // captured on first use
    if (g && g->empty() && capture_failures_[bucket] >= kMaxCaptureFailures) g = nullptr;
    if (g && g->empty()) {
      std::lock_guard<std::mutex> capturing(capture_mu_);
      // A capture that fails (no memory left to instantiate it, say) costs only the graph:
      // this step runs eagerly, and the bucket's next step tries again, a few times.
      Result<cuda::Graph> captured = cuda::Graph::Capture(stream_, step);
      if (captured.ok()) {
        *g = std::move(captured).value();
      } else {
        const bool last = ++capture_failures_[bucket] == kMaxCaptureFailures;
        FM_LOG(kWarn, "forward") << "cuda:" << device_ << ": a " << S << "-row step ran without its "
                                 << "graph" << (last ? " (and will from now on)" : "") << ": "
                                 << captured.status().ToString();
        g = nullptr;
      }
    }
    FM_RETURN_IF_ERROR(g ? g->Launch(stream_) : step());
    FM_RETURN_IF_ERROR(cuda::CopyOnDevice(xr, s_.x.data(), T * row_bytes));
    for (size_t t = 0; t < T; ++t) advance(rows[r0 + t]);
  }
  for (const BatchItem& item : items) item.cache->Advance(static_cast<int64_t>(item.tokens.size()));
  if (rounds > steps) FM_RETURN_IF_ERROR(RunEmptyRounds(exec_, steps, rounds, begin_, end_));
  return stream_.Synchronize();
}


Result<std::unique_ptr<ShardModel>> CreateCudaShardModel(const Checkpoint& ckpt, int device,
                                                         CudaStepMode mode) {
  auto m = std::make_unique<CudaShardModel>(ckpt.config(), device, mode);
  Status st = m->Bind(ckpt);
  if (!st.ok()) return st.Wrap("device cuda:" + std::to_string(device));
  return std::unique_ptr<ShardModel>(std::move(m));
}

Status SetCudaWeightCore(CudaWeightCore core) {
  cuda::SetWeightPath(core == CudaWeightCore::kTensorCore ? cuda::WeightPath::kTensorCore
                                                          : cuda::WeightPath::kFma);
  return Status::Ok();
}

Status SetCudaLaunchOverlap(bool on) {
  cuda::SetLaunchOverlap(on);
  return Status::Ok();
}

Status CudaDeviceHealth(int device) { return cuda::DeviceHealth(device); }

Result<double> CudaReadBandwidthGbps(int device) {
  FM_RETURN_IF_ERROR(cuda::SetDevice(device));
  return cuda::MeasureReadBandwidth(size_t{1} << 30, 10);
}

}  // namespace fm
