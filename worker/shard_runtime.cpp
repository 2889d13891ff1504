#include "worker/shard_runtime.h"

#include <algorithm>
#include <unordered_set>

#include "common/device_transfers.h"
#include "common/log.h"
#include "model/config.h"
#include "model/cuda/shard_model.h"
#include "model/kv_cache.h"

namespace fm {

ShardRuntime::ShardRuntime(int threads) : pool_(threads) {}
ShardRuntime::~ShardRuntime() = default;

namespace {
// An EP exchange or TP gather outside a step with a deadline (Forward passes the step's); a
// dead member fails it sooner.
constexpr net::Millis kEpTimeout{30000};
}  // namespace

Status ShardRuntime::Load(const ShardPlacement& p, net::Communicator* ep_group) {
  ShardSelection sel;
  sel.layer_begin = p.layer_begin;
  sel.layer_end = p.layer_end;
  sel.embed = p.embed;
  sel.head = p.head;
  sel.mtp = kServeMtp;
  sel.experts = p.experts;
  if (p.tensor_parallel > 1) {   // only this member's rows of the split weights in memory
    sel.tp_rank = p.ep_rank;
    sel.tp_size = p.tensor_parallel;
  }
  // A device shard reads its weights once, to upload them: mapped, their host copy is page
  // cache the kernel may reclaim (a GB10's memory is the GPU's too). A CPU shard streams its
  // weights every step: private memory (TensorBytes).
  FM_ASSIGN_OR_RETURN(auto ckpt, Checkpoint::Open(p.model_dir, sel,
                                                  p.cuda_device >= 0 ? TensorBytes::kMapped
                                                                     : TensorBytes::kPrivate));
  // Before the model is built (the weights read): a bad list costs nothing.
  if (!p.ep_expert_begin.empty()) {
    // Each member's first expert, then the expert count: EP routes by it, TP splits by it.
    const auto& b = p.ep_expert_begin;
    const bool rises = std::is_sorted(b.begin(), b.end()) && b.front() == 0 &&
                       b.back() == ckpt->config().n_routed_experts;
    if (!rises) {
      std::string got;
      for (int64_t v : b) got += (got.empty() ? "" : ", ") + std::to_string(v);
      return InvalidArgument("shard.ep_expert_begin: [" + got + "] must rise from 0 to the model's " +
                             std::to_string(ckpt->config().n_routed_experts) + " routed experts");
    }
  }
  // A device shard's weights are uploaded while it is built: the old one's device memory goes
  // first, or a reload of a shard over half the GPU would not fit beside it. (A failed load
  // leaves the worker unloaded either way.)
  if (p.cuda_device >= 0) Unload();
  Result<std::unique_ptr<ShardModel>> made = p.cuda_device >= 0
                                                  ? CreateCudaShardModel(*ckpt, p.cuda_device)
                                                  : ShardModel::Create(*ckpt, &pool_);
  if (!made.ok()) return made.status();
  std::unique_ptr<ShardModel> model = std::move(made).value();
  FM_ASSIGN_OR_RETURN(std::unique_ptr<Activations> x, model->NewActivations());
  FM_ASSIGN_OR_RETURN(std::unique_ptr<Activations> last_rows, model->NewActivations());
  const ModelConfig& cfg = ckpt->config();
  // The spec's 0s resolved against the model, once: every reader of placement() sees them so.
  ShardPlacement resolved = p;
  if (resolved.layer_end < 0) resolved.layer_end = cfg.num_hidden_layers;
  if (resolved.max_context <= 0)
    resolved.max_context = cfg.max_position_embeddings > 0 ? cfg.max_position_embeddings : 8192;
  if (resolved.max_step_rows <= 0) resolved.max_step_rows = resolved.max_context;
  std::unique_ptr<EpExpertExecutor> ep;
  std::unique_ptr<CommTpGroup> tp;
  if (p.tensor_parallel > 1) {
    if (!ep_group || ep_group->size() != p.tensor_parallel ||
        p.ep_expert_begin.size() != static_cast<size_t>(p.tensor_parallel) + 1)
      return Internal("tensor-parallel shard without its group of " +
                      std::to_string(p.tensor_parallel));
    tp = std::make_unique<CommTpGroup>(ep_group, p.ep_expert_begin, kEpTimeout);
    FM_RETURN_IF_ERROR(model->SetTensorParallel(tp.get()));
  } else if (p.expert_parallel()) {
    if (!ep_group) return Internal("expert-parallel shard without an EP group");
    // The shard's own experts serve the group: a CPU shard's on the pool, a device shard's on
    // its GPU (uploaded with the shard).
    // A member sends at most a step's rows a round, each to at most k experts here.
    ep = std::make_unique<EpExpertExecutor>(cfg, model->LocalExperts(), ep_group,
                                            p.ep_expert_begin, kEpTimeout, resolved.max_step_rows);
    model->SetExpertExecutor(ep.get());
  }
  std::lock_guard<std::mutex> lock(mu_);
  seqs_.clear();
  RetireGroupStats();
  {
    std::lock_guard<std::mutex> groups(groups_mu_);
    tp_ = std::move(tp);
    ep_ = std::move(ep);
  }
  model_ = std::move(model);
  x_ = std::move(x);
  last_rows_ = std::move(last_rows);
  ckpt_ = std::move(ckpt);
  device_lost_.clear();
  placement_ = resolved;
  FM_LOG(kInfo, "worker") << "loaded " << p.model_dir << " stage " << p.stage << "/"
                          << p.num_stages << " layers [" << placement_.layer_begin << ", "
                          << placement_.layer_end << ")" << (p.embed ? " +embed" : "")
                          << (p.head ? " +head" : "") << ", " << ckpt_->selected_bytes()
                          << " weight bytes";
  return Status::Ok();
}

bool ShardRuntime::loaded() const {
  std::lock_guard<std::mutex> lock(mu_);
  return model_ != nullptr && device_lost_.empty();
}

void ShardRuntime::Unload() {
  std::lock_guard<std::mutex> lock(mu_);
  device_lost_.clear();
  seqs_.clear();
  RetireGroupStats();
  {
    std::lock_guard<std::mutex> groups(groups_mu_);
    ep_.reset();
  }
  x_.reset();
  last_rows_.reset();
  model_.reset();
  {
    std::lock_guard<std::mutex> groups(groups_mu_);
    tp_.reset();
  }
  ckpt_.reset();
}

bool ShardRuntime::MarkIfDeviceLost() {
  int device = -1;
  {
    std::lock_guard<std::mutex> lock(mu_);
    if (!model_ || placement_.cuda_device < 0) return false;
    device = placement_.cuda_device;
  }
  const Status health = CudaDeviceHealth(device);
  if (health.ok()) return false;
  FM_LOG(kError, "worker") << "dropping the shard: " << health.ToString()
                           << " (restart this worker to use the device again)";
  // Marked, not torn down: a Reset may be reading the EP/TP groups now. The next LoadShard
  // replaces the model under the load lock (and fails on this device).
  std::lock_guard<std::mutex> lock(mu_);
  device_lost_ = health.ToString();
  return true;
}

void ShardRuntime::Uncharge(const std::vector<uint64_t>& seq_ids) {
  std::lock_guard<std::mutex> lock(mu_);
  for (uint64_t id : seq_ids)
    if (auto it = seqs_.find(id); it != seqs_.end()) it->second.kv_charge = 0;
}

const ModelConfig& ShardRuntime::config() const { return model_->config(); }

uint64_t ShardRuntime::weight_bytes() const {
  std::lock_guard<std::mutex> lock(mu_);
  return ckpt_ ? ckpt_->selected_bytes() : 0;
}

ShardPlacement ShardRuntime::placement() const {
  std::lock_guard<std::mutex> lock(mu_);
  return placement_;
}

bool ShardRuntime::first_stage() const {
  std::lock_guard<std::mutex> lock(mu_);
  return model_ != nullptr && placement_.stage == 0;
}

int64_t ShardRuntime::row_floats() const {
  std::lock_guard<std::mutex> lock(mu_);   // the data plane asks while LoadShard swaps the model
  return model_ ? model_->config().hc_mult * model_->config().hidden_size : 0;
}

Status ShardRuntime::StartSequence(uint64_t seq_id, int64_t max_context,
                                   const SamplerConfig& sampling) {
  std::lock_guard<std::mutex> lock(mu_);
  if (!model_) return Unavailable("no shard loaded");
  if (!device_lost_.empty()) return Unavailable("the shard's device is lost: " + device_lost_);
  if (seqs_.count(seq_id)) return InvalidArgument("sequence " + std::to_string(seq_id) + " exists");
  if (max_context <= 0 || max_context > placement_.max_context)
    return InvalidArgument("max_context " + std::to_string(max_context) + " outside (0, " +
                           std::to_string(placement_.max_context) + "]");
  // The budget charges every sequence its bytes at max_context, checked before anything is
  // allocated: a young CPU cache holds almost nothing, and sequences admitted by what they hold
  // now would outgrow the budget later.
  const ModelConfig& cfg = model_->config();
  uint64_t charge = 0, held = 0;
  for (int64_t l = placement_.layer_begin; l < placement_.layer_end; ++l)
    charge += KvBytesPerSequence(cfg, l, max_context);
  if (model_->has_mtp()) charge += KvBytesPerSequence(cfg, cfg.num_hidden_layers, max_context);
  for (const auto& [id, q] : seqs_) held += q.kv_charge;
  auto over = [&](uint64_t need) -> Status {
    if (placement_.kv_cache_bytes == 0 || held + need <= placement_.kv_cache_bytes) return Status::Ok();
    // "KV cache budget": the HTTP API tells this refusal from a full queue by it (ErrorFromStatus).
    return ResourceExhausted("KV cache budget of " + std::to_string(placement_.kv_cache_bytes) +
                             " bytes is full: " + std::to_string(seqs_.size()) +
                             " sequences hold " + std::to_string(held) + " at their max_context, " +
                             "this one needs " + std::to_string(need) + " at " +
                             std::to_string(max_context));
  };
  FM_RETURN_IF_ERROR(over(charge));
  Sequence s;
  FM_ASSIGN_OR_RETURN(s.cache, model_->NewSequence(max_context));
  s.max_context = max_context;
  s.cache_bytes = s.cache->bytes();
  s.kv_charge = std::max<uint64_t>(charge, s.cache_bytes);
  FM_RETURN_IF_ERROR(over(s.kv_charge));   // a device cache larger than the estimate
  if (placement_.head) {
    FM_ASSIGN_OR_RETURN(Sampler sampler, Sampler::Create(sampling));
    s.sampler = std::make_unique<Sampler>(std::move(sampler));
  }
  seqs_.emplace(seq_id, std::move(s));
  return Status::Ok();
}

void ShardRuntime::FreeSequence(uint64_t seq_id) {
  std::lock_guard<std::mutex> lock(mu_);
  seqs_.erase(seq_id);
}

bool ShardRuntime::HasSequence(uint64_t seq_id) const {
  std::lock_guard<std::mutex> lock(mu_);
  return seqs_.count(seq_id) > 0;
}

void ShardRuntime::FreeAll() {
  std::lock_guard<std::mutex> lock(mu_);
  seqs_.clear();
}

void ShardRuntime::PublishCacheBytes(Sequence* seq) {
  const uint64_t bytes = seq->cache->bytes();   // the executor's own cache: no lock to read it
  std::lock_guard<std::mutex> lock(mu_);
  seq->cache_bytes = bytes;
}

uint64_t ShardRuntime::kv_bytes() const {
  std::lock_guard<std::mutex> lock(mu_);
  uint64_t total = 0;
  for (const auto& [id, s] : seqs_) total += s.cache_bytes;
  return total;
}

std::vector<uint64_t> ShardRuntime::sequence_ids() const {
  std::lock_guard<std::mutex> lock(mu_);
  std::vector<uint64_t> ids;
  for (const auto& [id, s] : seqs_) ids.push_back(id);
  return ids;
}

int ShardRuntime::active_sequences() const {
  std::lock_guard<std::mutex> lock(mu_);
  return static_cast<int>(seqs_.size());
}

Result<ShardRuntime::Sequence*> ShardRuntime::Find(uint64_t seq_id) {
  std::lock_guard<std::mutex> lock(mu_);
  auto it = seqs_.find(seq_id);
  if (it == seqs_.end()) return NotFound("sequence " + std::to_string(seq_id) + " not started");
  return &it->second;
}

Status ShardRuntime::CheckSlices(std::span<const StepSlice> slices) {
  // Each slice fits its sequence, a sequence comes once, and all together fit the plan's
  // largest step: nothing else bounds the rows X is sized to (one sequence listed 16,000
  // times fits a 64 MiB request).
  std::unordered_set<uint64_t> seen;
  int64_t rows = 0, max_rows = 0;
  {
    std::lock_guard<std::mutex> lock(mu_);
    max_rows = placement_.max_step_rows;
  }
  std::unordered_set<uint64_t> forked;
  for (const auto& s : slices)
    if (s.fork_from != 0) forked.insert(s.seq_id);
  for (const auto& s : slices) {
    FM_ASSIGN_OR_RETURN(Sequence * seq, Find(s.seq_id));
    const std::string name = "sequence " + std::to_string(s.seq_id);
    if (!seen.insert(s.seq_id).second) return InvalidArgument(name + " appears twice in the step");
    if (s.tokens.empty()) return InvalidArgument(name + ": no tokens");
    int64_t position = seq->position;
    if (s.fork_from != 0) {
      const std::string from = "sequence " + std::to_string(s.fork_from);
      if (s.fork_from == s.seq_id) return InvalidArgument(name + " is forked from itself");
      if (seq->position != 0)
        return InvalidArgument(name + " is forked at position " + std::to_string(seq->position) +
                               " (only a sequence that has run nothing can be)");
      Result<Sequence*> src = Find(s.fork_from);
      if (!src.ok()) return InvalidArgument(from + ", which " + name + " is forked from, is not held here");
      if (forked.count(s.fork_from))
        return InvalidArgument(from + ", which " + name + " is forked from, is forked in the same step");
      if (seq->sampler && (*src)->sampler)   // the last stage: refused here, not half forked
        if (Status st = seq->sampler->CanAdoptPrompt(*(*src)->sampler); !st.ok())
          return st.Wrap(name + " cannot be forked from " + from);
      position = (*src)->position;
    }
    if (position + static_cast<int64_t>(s.tokens.size()) > seq->max_context)
      return OutOfRange(name + ": context beyond " + std::to_string(seq->max_context));
    rows += static_cast<int64_t>(s.tokens.size());
  }
  if (rows > max_rows)
    return InvalidArgument("the step's " + std::to_string(rows) + " tokens exceed the " +
                           std::to_string(max_rows) + " a step may carry (max_step_rows)");
  return Status::Ok();
}

Status ShardRuntime::Fork(std::span<const StepSlice> slices) {
  for (const auto& s : slices) {
    if (s.fork_from == 0) continue;
    FM_ASSIGN_OR_RETURN(Sequence * seq, Find(s.seq_id));
    FM_ASSIGN_OR_RETURN(Sequence * src, Find(s.fork_from));
    const std::string what = "forking sequence " + std::to_string(s.seq_id) + " from " + std::to_string(s.fork_from);
    Status st = model_->CopySequence(*src->cache, seq->cache.get());
    if (!st.ok()) return st.Wrap(what);
    seq->position = src->position;
    PublishCacheBytes(seq);
    if (seq->sampler && src->sampler) FM_RETURN_IF_ERROR(seq->sampler->AdoptPrompt(*src->sampler).Wrap(what));
  }
  return Status::Ok();
}

Status ShardRuntime::Embed(std::span<const StepSlice> slices, Activations* x) const {
  if (!model_->has_embed()) return Internal("this shard has no embedding");
  std::vector<int32_t> tokens;
  for (const auto& s : slices) tokens.insert(tokens.end(), s.tokens.begin(), s.tokens.end());
  FM_RETURN_IF_ERROR(x->Resize(static_cast<int64_t>(tokens.size())));
  if (tokens.empty()) return Status::Ok();   // an EP member without sequences this step
  return model_->Embed(tokens, x->data());
}

DeviceStepTraffic ShardRuntime::device_traffic() const {
  std::lock_guard<std::mutex> lock(mu_);
  if (!model_ || placement_.cuda_device < 0) return {};
  const TransferBytes step = TransfersOf(placement_.cuda_device).step;
  return {step.host_to_device, step.device_to_host, device_tokens_.load()};
}

EpStats ShardRuntime::ep_stats() const {
  std::lock_guard<std::mutex> lock(mu_);
  EpStats s = retired_group_stats_;
  AddGroupStats(&s);
  return s;
}

void ShardRuntime::AddGroupStats(EpStats* to) const {
  EpStats now;
  if (tp_) now.dispatch_bytes = tp_->bytes_sent();
  else if (ep_) now = ep_->stats();
  to->dispatch_bytes += now.dispatch_bytes;
  to->combine_bytes += now.combine_bytes;
  if (to->tokens_per_expert.size() < now.tokens_per_expert.size())
    to->tokens_per_expert.resize(now.tokens_per_expert.size(), 0);
  for (size_t e = 0; e < now.tokens_per_expert.size(); ++e) to->tokens_per_expert[e] += now.tokens_per_expert[e];
}

void ShardRuntime::RetireGroupStats() { AddGroupStats(&retired_group_stats_); }

void ShardRuntime::AbortStep(uint64_t step) {
  // Under groups_mu_: a reset or shutdown calls this beside a LoadShard, which replaces ep_
  // and tp_.
  std::lock_guard<std::mutex> groups(groups_mu_);
  if (ep_) ep_->AbortStep(step);
  if (tp_) tp_->AbortStep(step);
}

Status ShardRuntime::Forward(uint64_t step, std::chrono::steady_clock::time_point deadline,
                             std::span<const StepSlice> slices, float* x) {
  // The group's exchanges wait until the step's deadline: a member may wait out another's
  // long prefill (data-parallel attention), which a fixed timeout would cut short.
  if (ep_) ep_->SetStep(step, deadline);
  if (tp_) tp_->SetStep(step, deadline);
  if (slices.empty()) {
    if (!ep_) return Status::Ok();
    // No rows here, but the other members' rows may need this member's experts: as many
    // rounds as the busiest member runs.
    FM_ASSIGN_OR_RETURN(const int64_t rounds, ep_->AgreeRounds(0));
    return RunEmptyRounds(ep_.get(), 0, rounds, placement_.layer_begin, placement_.layer_end);
  }
  std::vector<BatchItem> items;
  items.reserve(slices.size());
  for (const auto& s : slices) {
    FM_ASSIGN_OR_RETURN(Sequence * seq, Find(s.seq_id));
    items.push_back({seq->cache.get(), s.tokens});
  }
  FM_RETURN_IF_ERROR(model_->ForwardLayers(items, x));
  if (placement_.cuda_device >= 0) {
    for (const auto& s : slices) device_tokens_ += s.tokens.size();
  }
  for (const auto& s : slices) {
    FM_ASSIGN_OR_RETURN(Sequence * seq, Find(s.seq_id));
    seq->position += static_cast<int64_t>(s.tokens.size());
    PublishCacheBytes(seq);
  }
  return Status::Ok();
}

Result<std::vector<PromptScores>> ShardRuntime::ScorePrompts(std::span<const StepSlice> slices,
                                                             const Activations& x) {
  if (!model_->has_head()) return Internal("this shard has no head");
  const int64_t V = model_->config().vocab_size, row = row_floats();
  std::vector<PromptScores> out;
  int64_t at = 0;   // x's row of the slice's first token
  for (const auto& s : slices) {
    const int64_t n = static_cast<int64_t>(s.tokens.size());
    at += n;
    FM_ASSIGN_OR_RETURN(Sequence * seq, Find(s.seq_id));
    if (!seq->sampler || seq->generated || seq->sampler->config().prompt_logprobs < 0) continue;
    const int32_t top = seq->sampler->config().prompt_logprobs;
    const std::string name = "sequence " + std::to_string(s.seq_id);
    if (!s.sample && s.next_token < 0)
      return InvalidArgument(name + ": a prompt chunk with more to come is scored, but has no next_token");
    if (s.next_token >= V)
      return InvalidArgument(name + ": next_token " + std::to_string(s.next_token) +
                             " is outside the vocabulary of " + std::to_string(V));
    // Row i scores the token after it: tokens[i + 1], and past the slice's end next_token.
    const int64_t scored = s.sample ? n - 1 : n, first_row = at - n;
    PromptScores ps{s.seq_id, seq->position - n + 1, {}, Status::Ok()};
    if (scored > 0) {
      std::vector<int32_t> targets(s.tokens.begin() + 1, s.tokens.end());
      if (!s.sample) targets.push_back(s.next_token);
      FM_ASSIGN_OR_RETURN(ps.tokens, model_->ScoreNext(x.data() + first_row * row, targets, top));
      for (size_t r = 0; r < ps.tokens.size(); ++r) {
        if (ps.tokens[r].error.ok()) continue;
        ps.error = ps.tokens[r].error.Wrap("prompt position " + std::to_string(ps.first + static_cast<int64_t>(r)));
        ps.tokens.clear();
        break;
      }
    }
    if (!ps.tokens.empty() || !ps.error.ok()) out.push_back(std::move(ps));
  }
  return out;
}

Result<std::vector<SampledId>> ShardRuntime::Sample(std::span<const StepSlice> slices,
                                                    const Activations& x) {
  if (!model_->has_head()) return Internal("this shard has no head");
  // Only the last row of each sampled slice reaches the head: [B, hc, H] -> [B, vocab]. In a
  // decode step (one row a slice, every slice sampled) those are x's rows as they are;
  // otherwise they are gathered where x is (on the device for a device shard).
  std::vector<int64_t> rows;       // x's row of each sampled slice
  std::vector<Sampler*> samplers;
  std::vector<uint64_t> ids;
  int64_t end = 0;
  std::vector<Sequence*> sampled;
  for (const auto& s : slices) {
    end += static_cast<int64_t>(s.tokens.size());
    FM_ASSIGN_OR_RETURN(Sequence * seq, Find(s.seq_id));
    // The penalties' history: the prompt's tokens, then each sampled token as it comes back.
    if (seq->sampler) seq->sampler->Observe(s.tokens, seq->generated);
    if (!s.sample) continue;
    sampled.push_back(seq);
    rows.push_back(end - 1);
    samplers.push_back(seq->sampler.get());
    ids.push_back(s.seq_id);
  }
  const int64_t B = static_cast<int64_t>(rows.size());
  if (B == 0) return std::vector<SampledId>{};
  const float* last = x.data();
  if (x.rows() != B) {
    FM_RETURN_IF_ERROR(last_rows_->Resize(B));
    for (int64_t i = 0; i < B; ++i) FM_RETURN_IF_ERROR(last_rows_->CopyRows(i, x, rows[i], 1));
    last = last_rows_->data();
  }
  FM_ASSIGN_OR_RETURN(std::vector<SampledToken> picked,
                      model_->SampleNext(last, B, samplers));
  for (Sequence* seq : sampled) seq->generated = true;
  std::vector<SampledId> out;
  out.reserve(ids.size());
  for (size_t i = 0; i < ids.size(); ++i)
    out.push_back({ids[i], picked[i].id, picked[i].logprob, std::move(picked[i].top), std::move(picked[i].error)});
  return out;
}

}  // namespace fm
