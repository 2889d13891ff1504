// ShardModel on CPU (model/forward.h): embedding, the shard's layers over the hyper-connection
// manifold, hc_head + norm + head, and the MTP draft block (HF DeepseekV4Model.forward).
#include "model/forward.h"

#include <algorithm>
#include <string>
#include <unordered_set>

#include "common/log.h"
#include "model/kv_cache.h"
#include "model/layer.h"
#include "model/moe.h"
#include "model/mtp.h"
#include "model/tp.h"

namespace fm {

Result<TensorView> BindEmbed(const Checkpoint& ckpt) {
  const int64_t V = ckpt.config().vocab_size, H = ckpt.config().hidden_size;
  FM_ASSIGN_OR_RETURN(TensorView e, ckpt.Get("embed.weight"));
  if (e.shape != std::vector<int64_t>{V, H} || (e.dtype != DType::kBF16 && e.dtype != DType::kF32))
    return InvalidArgument("embed.weight: expected BF16 or F32 [" + std::to_string(V) + "," +
                           std::to_string(H) + "], got " + DTypeName(e.dtype));
  return e;
}

Result<QWeight> BindHeadWeight(const Checkpoint& ckpt) {
  const int64_t V = ckpt.config().vocab_size, H = ckpt.config().hidden_size;
  FM_ASSIGN_OR_RETURN(QWeight head, ckpt.Weight("head"));
  if (head.rows != V || head.cols != H)
    return InvalidArgument("head.weight: shape [" + std::to_string(head.rows) + "," +
                           std::to_string(head.cols) + "], expected [" + std::to_string(V) + "," +
                           std::to_string(H) + "]");
  return head;
}

Status CheckTokenIds(const ModelConfig& cfg, std::span<const int32_t> tokens,
                     const std::string& what) {
  if (tokens.empty()) return InvalidArgument(what + ": empty token list");
  for (size_t i = 0; i < tokens.size(); ++i)
    if (tokens[i] < 0 || tokens[i] >= cfg.vocab_size)
      return InvalidArgument(what + ": token id " + std::to_string(tokens[i]) + " at position " +
                             std::to_string(i) + " outside vocab [0, " +
                             std::to_string(cfg.vocab_size) + ")");
  return Status::Ok();
}

Result<std::vector<SampledToken>> ShardModel::SampleNext(const float* x, int64_t rows,
                                                         std::span<Sampler* const> samplers) const {
  if (rows != static_cast<int64_t>(samplers.size()))
    return InvalidArgument("SampleNext: " + std::to_string(rows) + " rows but " +
                           std::to_string(samplers.size()) + " samplers");
  const int64_t V = config().vocab_size;
  std::vector<float> logits(static_cast<size_t>(rows * V));
  FM_RETURN_IF_ERROR(Logits(x, rows, logits.data()));
  std::vector<SampledToken> out;
  out.reserve(rows);
  for (int64_t r = 0; r < rows; ++r) {
    Result<SampledToken> t = samplers[r]->Sample(std::span(&logits[r * V], V));
    out.push_back(t.ok() ? std::move(*t) : SampledToken::Failed(t.status()));
  }
  return out;
}

Status ShardModel::CheckScoreNext(int32_t top) const {
  if (!has_head()) return InvalidArgument("ScoreNext: this shard does not hold the head");
  if (top < 0 || top > kMaxTopLogprobs)
    return InvalidArgument("ScoreNext: top " + std::to_string(top) + " outside [0, " +
                           std::to_string(kMaxTopLogprobs) + "]");
  return Status::Ok();
}

Status RunEmptyRounds(ExpertExecutor* exec, int64_t from, int64_t to, int64_t layer_begin,
                      int64_t layer_end) {
  for (int64_t r = from; r < to; ++r)
    for (int64_t l = layer_begin; l < layer_end; ++l)
      FM_RETURN_IF_ERROR(exec->RunSlots(l, nullptr, 0, nullptr, nullptr)
                             .Wrap("layer " + std::to_string(l) + " (a round without rows)"));
  return Status::Ok();
}

Result<std::vector<int32_t>> CheckBatchItems(const ModelConfig& cfg, int64_t layer_begin,
                                             int64_t layer_end, std::span<const BatchItem> items,
                                             bool mtp) {
  if (items.empty()) return InvalidArgument("empty batch");
  std::vector<int32_t> tokens;
  std::unordered_set<const SequenceCache*> seen;
  for (size_t i = 0; i < items.size(); ++i) {
    const std::string what = "batch item " + std::to_string(i);
    const SequenceCache* c = items[i].cache;
    if (!c) return InvalidArgument(what + ": no sequence cache");
    if (!seen.insert(c).second) return InvalidArgument(what + ": sequence appears twice");
    if (c->layer_begin() != layer_begin || c->num_layers() != layer_end - layer_begin ||
        (mtp && !c->mtp()))
      return InvalidArgument(what + ": sequence cache was made for another shard (layers [" +
                             std::to_string(c->layer_begin()) + ", " +
                             std::to_string(c->layer_begin() + c->num_layers()) + "))");
    FM_RETURN_IF_ERROR(CheckTokenIds(cfg, items[i].tokens, what));
    const int64_t T = static_cast<int64_t>(items[i].tokens.size());
    const int64_t pos = mtp ? c->mtp_next_pos() : c->next_pos();
    if (pos + T > c->max_context())
      return OutOfRange(what + ": context " + std::to_string(pos) + " + " + std::to_string(T) +
                        " tokens = " + std::to_string(pos + T) + " exceeds max_context " +
                        std::to_string(c->max_context()));
    tokens.insert(tokens.end(), items[i].tokens.begin(), items[i].tokens.end());
  }
  return tokens;
}

namespace {

class ShardModelImpl : public ShardModel {
 public:
  ShardModelImpl(const ModelConfig& cfg, ThreadPool* pool) : cfg_(cfg), pool_(pool) {}

  Status Bind(const Checkpoint& ckpt);

  const ModelConfig& config() const override { return cfg_; }
  int64_t layer_begin() const override { return begin_; }
  int64_t layer_end() const override { return end_; }
  bool has_embed() const override { return has_embed_; }
  bool has_head() const override { return has_head_; }
  bool has_mtp() const override { return mtp_ != nullptr; }

  Result<std::unique_ptr<SequenceCache>> NewSequence(int64_t max_context) const override;
  Status Embed(std::span<const int32_t> tokens, float* x) const override;
  Status ForwardLayers(std::span<const BatchItem> items, float* x) const override;
  Status Logits(const float* x, int64_t rows, float* logits) const override;
  Result<std::vector<SampledToken>> ScoreNext(const float* x, std::span<const int32_t> targets,
                                              int32_t top) const override;
  Status MtpLogits(std::span<const BatchItem> items, const float* x,
                   float* logits) const override;
  void SetExpertExecutor(ExpertExecutor* exec) override { exec_ = exec ? exec : local_.get(); }
  ExpertRunner* LocalExperts() override { return experts_.get(); }
  Status SetTensorParallel(TpGroup* tp) override {
    if (tp) FM_RETURN_IF_ERROR(CheckTensorParallel(cfg_, tp->size()));
    tp_ = tp;
    return Status::Ok();
  }

 private:

  ModelConfig cfg_;
  ThreadPool* pool_;
  int64_t begin_ = 0, end_ = 0;
  bool has_embed_ = false, has_head_ = false;
  TensorView embed_;               // [V, H] BF16 or F32
  QWeight head_;                   // [V, H]
  std::vector<float> norm_;        // [H]
  HcWeights hc_head_;
  std::vector<std::unique_ptr<LayerWeights>> layers_;  // [begin_, end_)
  std::unique_ptr<MtpWeights> mtp_;
  std::unique_ptr<LocalExpertExecutor> local_;
  std::unique_ptr<CpuExpertRunner> experts_;   // the same experts, for an EP executor
  ExpertExecutor* exec_ = nullptr;
  TpGroup* tp_ = nullptr;
};

Status ShardModelImpl::Bind(const Checkpoint& ckpt) {
  const ShardSelection& sel = ckpt.selection();
  const int64_t L = cfg_.num_hidden_layers, H = cfg_.hidden_size;
  begin_ = sel.layer_begin;
  end_ = sel.layer_end < 0 ? L : sel.layer_end;
  if (begin_ < 0 || begin_ > end_ || end_ > L)
    return InvalidArgument("shard selection: layers [" + std::to_string(begin_) + ", " +
                           std::to_string(end_) + ") outside [0, " + std::to_string(L) + "]");
  bool want_mtp = sel.mtp && sel.head && end_ == L && cfg_.num_nextn_predict_layers > 0 &&
                  ckpt.Has("mtp.0.e_proj.weight");
  if (sel.embed || want_mtp) {
    Result<TensorView> embed = ckpt.Get("embed.weight");
    if (!embed.ok() && sel.embed) return embed.status();
    if (!embed.ok()) {
      // The MTP block embeds the next token: a last stage without embed.weight has no MTP.
      FM_LOG(kInfo, "forward") << "MTP block not bound: embed.weight is not in the selection";
      want_mtp = false;
    }
  }
  if (sel.embed || want_mtp) {
    FM_ASSIGN_OR_RETURN(embed_, BindEmbed(ckpt));
    has_embed_ = sel.embed;
  }
  if (sel.head) {
    FM_ASSIGN_OR_RETURN(head_, BindHeadWeight(ckpt));
    FM_ASSIGN_OR_RETURN(norm_, GetVector(ckpt, "norm.weight", H));
    FM_ASSIGN_OR_RETURN(hc_head_, BindHc(ckpt, "hc_head_", cfg_.hc_mult, 1));
    has_head_ = true;
  }
  std::vector<const MoeWeights*> moe(L + cfg_.num_nextn_predict_layers, nullptr);
  for (int64_t l = begin_; l < end_; ++l) {
    FM_ASSIGN_OR_RETURN(auto lw, BindLayer(ckpt, "layers." + std::to_string(l) + ".", l));
    moe[l] = &lw->moe;
    layers_.push_back(std::move(lw));
  }
  if (want_mtp) {
    FM_ASSIGN_OR_RETURN(mtp_, BindMtp(ckpt));
    moe[L] = &mtp_->block->moe;
  }
  experts_ = std::make_unique<CpuExpertRunner>(cfg_, moe, pool_);
  local_ = std::make_unique<LocalExpertExecutor>(cfg_, std::move(moe), pool_);
  exec_ = local_.get();
  FM_LOG(kInfo, "forward") << "shard: layers [" << begin_ << ", " << end_ << ")"
                           << (has_embed_ ? " +embed" : "") << (has_head_ ? " +head" : "")
                           << (mtp_ ? " +mtp" : "");
  return Status::Ok();
}

Result<std::unique_ptr<SequenceCache>> ShardModelImpl::NewSequence(int64_t max_context) const {
  std::vector<std::unique_ptr<AttentionCache>> caches;
  for (int64_t l = begin_; l < end_; ++l)
    caches.push_back(NewAttentionCache(cfg_, cfg_.compress_ratio(l), max_context));
  std::unique_ptr<AttentionCache> mtp;
  if (mtp_) mtp = NewAttentionCache(cfg_, mtp_->block->ratio, max_context);
  return std::make_unique<SequenceCache>(begin_, std::move(caches), std::move(mtp), max_context);
}

Status ShardModelImpl::Embed(std::span<const int32_t> tokens, float* x) const {
  if (!has_embed_) return InvalidArgument("Embed: this shard does not hold embed.weight");
  FM_RETURN_IF_ERROR(CheckTokenIds(cfg_, tokens, "Embed"));
  EmbedManifold(embed_, tokens, cfg_.hc_mult, cfg_.hidden_size, x);
  return Status::Ok();
}

Status ShardModelImpl::ForwardLayers(std::span<const BatchItem> items, float* x) const {
  FM_ASSIGN_OR_RETURN(std::vector<int32_t> tokens, CheckBatchItems(cfg_, begin_, end_, items, false));
  const int64_t T = static_cast<int64_t>(tokens.size());
  // All rows in one round (a RunRouted a layer); the group may run more (device members).
  int64_t rounds = 1;
  if (exec_ && !layers_.empty()) {
    FM_ASSIGN_OR_RETURN(rounds, exec_->AgreeRounds(1));
  }
  std::vector<AttentionSeq> seqs(items.size());
  for (const auto& lw : layers_) {
    for (size_t i = 0; i < items.size(); ++i)
      seqs[i] = {items[i].cache->layer(lw->layer), static_cast<int64_t>(items[i].tokens.size())};
    Status st = RunLayer(cfg_, *lw, seqs, tokens.data(), T, exec_, x, pool_, tp_);
    if (!st.ok()) return st.Wrap("layer " + std::to_string(lw->layer));
  }
  for (const auto& item : items) item.cache->Advance(static_cast<int64_t>(item.tokens.size()));
  if (rounds > 1) return RunEmptyRounds(exec_, 1, rounds, begin_, end_);
  return Status::Ok();
}

Status ShardModelImpl::Logits(const float* x, int64_t rows, float* logits) const {
  if (!has_head_) return InvalidArgument("Logits: this shard does not hold the head");
  if (rows <= 0) return InvalidArgument("Logits: rows " + std::to_string(rows) + " must be > 0");
  HeadLogits(cfg_, hc_head_, norm_, head_, x, rows, logits, pool_);
  return Status::Ok();
}

Result<std::vector<SampledToken>> ShardModelImpl::ScoreNext(const float* x,
                                                           std::span<const int32_t> targets,
                                                           int32_t top) const {
  FM_RETURN_IF_ERROR(CheckScoreNext(top));
  const int64_t rows = static_cast<int64_t>(targets.size()), V = cfg_.vocab_size;
  const int64_t row = cfg_.hc_mult * cfg_.hidden_size;
  // Logits of this many rows at a time: 32 MiB of them (the real vocabulary's 64 rows).
  const int64_t block = std::max<int64_t>(1, (int64_t{8} << 20) / V);
  std::vector<float> logits;
  std::vector<SampledToken> out(static_cast<size_t>(rows));
  for (int64_t r0 = 0; r0 < rows; r0 += block) {
    const int64_t n = std::min(block, rows - r0);
    logits.resize(static_cast<size_t>(n * V));
    FM_RETURN_IF_ERROR(Logits(x + r0 * row, n, logits.data()));
    // Rows apart on the pool (each a pass over the vocabulary).
    auto score = [&](size_t b, size_t e) {
      for (size_t r = b; r < e; ++r) {
        const size_t i = static_cast<size_t>(r0) + r;
        Result<SampledToken> t = ScoreToken({logits.data() + r * V, static_cast<size_t>(V)}, targets[i], top);
        out[i] = t.ok() ? std::move(*t) : SampledToken::Failed(t.status());
      }
    };
    if (pool_) pool_->ParallelFor(static_cast<size_t>(n), 1, score);
    else score(0, static_cast<size_t>(n));
  }
  return out;
}

Status ShardModelImpl::MtpLogits(std::span<const BatchItem> items, const float* x,
                                 float* logits) const {
  if (!mtp_) return InvalidArgument("MtpLogits: this shard holds no MTP block");
  FM_ASSIGN_OR_RETURN(std::vector<int32_t> tokens, CheckBatchItems(cfg_, begin_, end_, items, true));
  const int64_t T = static_cast<int64_t>(tokens.size()), H = cfg_.hidden_size;
  std::vector<float> emb(T * H);
  for (int64_t t = 0; t < T; ++t) EmbedRow(embed_, tokens[t], H, emb.data() + t * H);
  std::vector<AttentionSeq> seqs(items.size());
  for (size_t i = 0; i < items.size(); ++i)
    seqs[i] = {items[i].cache->mtp(), static_cast<int64_t>(items[i].tokens.size())};
  Status st = MtpForward(cfg_, *mtp_, seqs, emb.data(), x, tokens.data(), T, exec_, head_, logits,
                         pool_);
  return st.ok() ? st : st.Wrap("mtp.0");
}

}  // namespace

Status ShardModel::CopySequence(const SequenceCache& src, SequenceCache* dst) const {
  return dst->CopyFrom(src);
}

Result<std::unique_ptr<ShardModel>> ShardModel::Create(const Checkpoint& ckpt, ThreadPool* pool) {
  auto m = std::make_unique<ShardModelImpl>(ckpt.config(), pool);
  FM_RETURN_IF_ERROR(m->Bind(ckpt));
  return std::unique_ptr<ShardModel>(std::move(m));
}

}  // namespace fm
