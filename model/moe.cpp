#include "model/moe.h"

#include <algorithm>
#include <atomic>
#include <cstring>
#include <string>

#include "kernels/cpu/matvec.h"
#include "kernels/cpu/router.h"
#include "kernels/cpu/swiglu.h"

namespace fm {

// Rows per pass of the local executor: bounds the [rows, k, H] contribution buffer.
static constexpr int64_t kRoutedChunkRows = 256;

static Result<ExpertWeights> BindExpert(const Checkpoint& ckpt, const std::string& prefix,
                                        int64_t H) {
  ExpertWeights e;
  FM_ASSIGN_OR_RETURN(e.w1, ckpt.Weight(prefix + "w1"));
  FM_ASSIGN_OR_RETURN(e.w2, ckpt.Weight(prefix + "w2"));
  FM_ASSIGN_OR_RETURN(e.w3, ckpt.Weight(prefix + "w3"));
  if (e.w1.cols != H || e.w3.cols != H || e.w3.rows != e.w1.rows || e.w2.rows != H ||
      e.w2.cols != e.w1.rows)
    return InvalidArgument(prefix + "{w1,w2,w3}: shapes [" + std::to_string(e.w1.rows) + "," +
                           std::to_string(e.w1.cols) + "], [" + std::to_string(e.w2.rows) + "," +
                           std::to_string(e.w2.cols) + "], [" + std::to_string(e.w3.rows) + "," +
                           std::to_string(e.w3.cols) + "] do not form an FFN of hidden " +
                           std::to_string(H));
  e.loaded = true;
  return e;
}

Result<MoeWeights> BindMoe(const Checkpoint& ckpt, const std::string& prefix, int64_t layer) {
  const ModelConfig& cfg = ckpt.config();
  const int64_t E = cfg.n_routed_experts, k = cfg.num_experts_per_tok, H = cfg.hidden_size;
  if (k <= 0 || k > E)
    return InvalidArgument("config: num_experts_per_tok " + std::to_string(k) +
                           " must be in [1, n_routed_experts " + std::to_string(E) + "]");
  MoeWeights w;
  w.layer = layer;
  w.hash = cfg.is_hash_layer(layer);
  FM_ASSIGN_OR_RETURN(w.gate, ckpt.Weight(prefix + "gate"));
  if (w.gate.rows != E || w.gate.cols != H)
    return InvalidArgument(prefix + "gate.weight: shape [" + std::to_string(w.gate.rows) + "," +
                           std::to_string(w.gate.cols) + "], expected [" + std::to_string(E) +
                           "," + std::to_string(H) + "]");
  if (w.hash) {
    FM_ASSIGN_OR_RETURN(w.tid2eid, ckpt.GetI64(prefix + "gate.tid2eid"));
    if (static_cast<int64_t>(w.tid2eid.size()) != cfg.vocab_size * k)
      return InvalidArgument(prefix + "gate.tid2eid: " + std::to_string(w.tid2eid.size()) +
                             " entries, expected vocab_size * num_experts_per_tok = " +
                             std::to_string(cfg.vocab_size * k));
    for (size_t i = 0; i < w.tid2eid.size(); ++i)
      if (w.tid2eid[i] < 0 || w.tid2eid[i] >= E)
        return InvalidArgument(prefix + "gate.tid2eid: token " + std::to_string(i / k) +
                               " maps to expert " + std::to_string(w.tid2eid[i]) +
                               ", outside [0, " + std::to_string(E) + ")");
  } else {
    FM_ASSIGN_OR_RETURN(w.bias, ckpt.GetF32(prefix + "gate.bias"));
    if (static_cast<int64_t>(w.bias.size()) != E)
      return InvalidArgument(prefix + "gate.bias: " + std::to_string(w.bias.size()) +
                             " entries, expected n_routed_experts " + std::to_string(E));
  }
  w.experts.resize(E);
  std::vector<int64_t> wanted = ckpt.selection().experts;
  if (wanted.empty())
    for (int64_t e = 0; e < E; ++e) wanted.push_back(e);
  for (int64_t e : wanted) {
    if (e < 0 || e >= E)
      return InvalidArgument("shard selection: expert " + std::to_string(e) + " outside [0, " +
                             std::to_string(E) + ")");
    FM_ASSIGN_OR_RETURN(w.experts[e],
                        BindExpert(ckpt, prefix + "experts." + std::to_string(e) + ".", H));
  }
  FM_ASSIGN_OR_RETURN(w.shared, BindExpert(ckpt, prefix + "shared_experts.", H));
  return w;
}

Status RouteMoe(const ModelConfig& cfg, const MoeWeights& w, const float* x,
                const int32_t* tokens, int64_t T, int32_t* ids, float* weights, ThreadPool* pool) {
  const int64_t E = cfg.n_routed_experts, k = cfg.num_experts_per_tok;
  const float scale = static_cast<float>(cfg.routed_scaling_factor);
  if (w.hash)
    for (int64_t t = 0; t < T; ++t)
      if (tokens[t] < 0 || tokens[t] >= cfg.vocab_size)
        return InvalidArgument("token id " + std::to_string(tokens[t]) + " outside vocab [0, " +
                               std::to_string(cfg.vocab_size) + ")");
  std::vector<float> logits(T * E), scores(T * E);
  Matmul(w.gate, x, T, logits.data(), pool);
  for (int64_t t = 0; t < T; ++t) {
    float* s = scores.data() + t * E;
    RouterSqrtSoftplus_E(logits.data() + t * E, E, s);
    if (w.hash)
      RouterHash_k(s, w.tid2eid.data() + static_cast<int64_t>(tokens[t]) * k, k, scale,
                   ids + t * k, weights + t * k);
    else
      RouterTopkBias_E(s, w.bias.data(), E, k, scale, ids + t * k, weights + t * k);
  }
  return Status::Ok();
}

void RunExpertFfn(const ExpertWeights& e, float swiglu_limit, const float* x, int64_t T, float* y,
                  ThreadPool* pool) {
  const int64_t I = e.w1.rows;
  std::vector<float> gate(T * I), up(T * I);
  const MatmulJob w1_w3[] = {{&e.w1, x, T, gate.data()}, {&e.w3, x, T, up.data()}};
  MatmulMany(w1_w3, pool);   // one pass for both: one thread rendezvous
  SwigluClamp_n(gate.data(), up.data(), T * I, swiglu_limit, gate.data());
  Matmul(e.w2, gate.data(), T, y, pool);
}

namespace {

// RunExpertGroups for experts [e0, e1), gathered rows at offset[e] - offset[e0].
void RunExpertRange(const MoeWeights& w, float swiglu_limit,
                    const std::vector<std::vector<ExpertRowPair>>& by_expert,
                    const std::vector<int64_t>& offset, size_t e0, size_t e1, int64_t H,
                    const float* in, float* out, ThreadPool* pool) {
  const int64_t base = offset[e0], n = offset[e1] - base;
  int64_t I = 0;
  for (size_t e = e0; e < e1 && I == 0; ++e)
    if (!by_expert[e].empty()) I = w.experts[e].w1.rows;
  std::vector<float> xin(n * H), gate(n * I), up(n * I), yout(n * H);
  std::vector<MatmulJob> jobs;
  for (size_t e = e0; e < e1; ++e) {
    const int64_t m = offset[e + 1] - offset[e], o = offset[e] - base;
    if (m == 0) continue;
    for (int64_t i = 0; i < m; ++i)
      std::memcpy(&xin[(o + i) * H], in + by_expert[e][i].src * H, H * sizeof(float));
    jobs.push_back({&w.experts[e].w1, &xin[o * H], m, &gate[o * I]});
    jobs.push_back({&w.experts[e].w3, &xin[o * H], m, &up[o * I]});
  }
  MatmulMany(jobs, pool);
  SwigluClamp_n(gate.data(), up.data(), n * I, swiglu_limit, gate.data());
  jobs.clear();
  for (size_t e = e0; e < e1; ++e) {
    const int64_t m = offset[e + 1] - offset[e], o = offset[e] - base;
    if (m > 0) jobs.push_back({&w.experts[e].w2, &gate[o * I], m, &yout[o * H]});
  }
  MatmulMany(jobs, pool);
  for (size_t e = e0; e < e1; ++e)
    for (size_t i = 0; i < by_expert[e].size(); ++i)
      std::memcpy(out + by_expert[e][i].dst * H, &yout[(offset[e] - base + i) * H], H * sizeof(float));
}

}  // namespace

namespace {
std::atomic<int64_t> cpu_expert_group_runs{0};
}  // namespace

int64_t CpuExpertGroupRuns() { return cpu_expert_group_runs.load(); }

void RunExpertGroups(const MoeWeights& w, float swiglu_limit,
                     const std::vector<std::vector<ExpertRowPair>>& by_expert, int64_t H,
                     const float* in, float* out, ThreadPool* pool) {
  // Experts are taken in runs of at most kGroupRows gathered rows (one expert with more is a
  // run of its own), which bounds the scratch of a long prefill.
  constexpr int64_t kGroupRows = 1024;
  cpu_expert_group_runs.fetch_add(1, std::memory_order_relaxed);
  std::vector<int64_t> offset(by_expert.size() + 1, 0);
  for (size_t e = 0; e < by_expert.size(); ++e)
    offset[e + 1] = offset[e] + static_cast<int64_t>(by_expert[e].size());
  size_t e0 = 0;
  while (e0 < by_expert.size()) {
    size_t e1 = e0 + 1;
    while (e1 < by_expert.size() && offset[e1 + 1] - offset[e0] <= kGroupRows) ++e1;
    if (offset[e1] > offset[e0])
      RunExpertRange(w, swiglu_limit, by_expert, offset, e0, e1, H, in, out, pool);
    e0 = e1;
  }
}

Result<const MoeWeights*> RoutedLayer(const std::vector<const MoeWeights*>& layers, int64_t layer) {
  const MoeWeights* w =
      layer >= 0 && layer < static_cast<int64_t>(layers.size()) ? layers[layer] : nullptr;
  if (!w) return InvalidArgument("MoE: layer " + std::to_string(layer) + " is not on this shard");
  return w;
}

void CombineRouted(const float* contrib, const float* weights, int64_t T, int64_t k, int64_t H,
                   float* routed) {
  for (int64_t t = 0; t < T; ++t)
    MoeCombine_kH(contrib + t * k * H, weights + t * k, k, H, routed + t * H);
}

Status LocalExpertExecutor::Slots(const MoeWeights& w, const float* x, int64_t r0, int64_t rows,
                                  const int32_t* expert_ids, float* slots) {
  const int64_t E = cfg_.n_routed_experts, k = cfg_.num_experts_per_tok, H = cfg_.hidden_size;
  std::vector<std::vector<ExpertRowPair>> by_expert(E);  // row order within each expert
  for (int64_t i = 0; i < rows * k; ++i) {
    const int32_t e = expert_ids[r0 * k + i];
    if (e < 0 || e >= E || !w.experts[e].loaded)
      return InvalidArgument("MoE layer " + std::to_string(w.layer) + ": row " +
                             std::to_string(r0 + i / k) + " routes to expert " +
                             std::to_string(e) + ", which is not loaded on this shard");
    by_expert[e].push_back({r0 + i / k, i});
  }
  std::fill(slots, slots + rows * k * H, 0.0f);
  RunExpertGroups(w, static_cast<float>(cfg_.swiglu_limit), by_expert, H, x, slots, pool_);
  return Status::Ok();
}

Status LocalExpertExecutor::RunRouted(int64_t layer, const float* x, int64_t T,
                                      const int32_t* expert_ids, const float* weights,
                                      float* routed) {
  FM_ASSIGN_OR_RETURN(const MoeWeights* w, RoutedLayer(layers_, layer));
  const int64_t k = cfg_.num_experts_per_tok, H = cfg_.hidden_size;
  std::vector<float> contrib;
  for (int64_t r0 = 0; r0 < T; r0 += kRoutedChunkRows) {
    const int64_t rows = std::min(kRoutedChunkRows, T - r0);
    contrib.resize(rows * k * H);
    FM_RETURN_IF_ERROR(Slots(*w, x, r0, rows, expert_ids, contrib.data()));
    CombineRouted(contrib.data(), weights + r0 * k, rows, k, H, routed + r0 * H);
  }
  return Status::Ok();
}

Status LocalExpertExecutor::RunSlots(int64_t layer, const float* x, int64_t T,
                                     const int32_t* expert_ids, float* slots) {
  FM_ASSIGN_OR_RETURN(const MoeWeights* w, RoutedLayer(layers_, layer));
  return Slots(*w, x, 0, T, expert_ids, slots);
}

Status CpuExpertRunner::RunPairs(int64_t layer, const float* rows, int64_t n, const int32_t* pairs,
                                 int64_t p, float* out) {
  FM_ASSIGN_OR_RETURN(const MoeWeights* w, RoutedLayer(layers_, layer));
  const int64_t E = cfg_.n_routed_experts, H = cfg_.hidden_size;
  std::vector<std::vector<ExpertRowPair>> by_expert(E);
  for (int64_t i = 0; i < p; ++i) {
    const int32_t row = pairs[2 * i], e = pairs[2 * i + 1];
    if (row < 0 || row >= n || e < 0 || e >= E || !w->experts[e].loaded)
      return InvalidArgument("MoE layer " + std::to_string(layer) + ": pair " +
                             std::to_string(i) + " (row " + std::to_string(row) + " of " +
                             std::to_string(n) + ", expert " + std::to_string(e) +
                             ") is not loaded on this shard");
    by_expert[e].push_back({row, i});
  }
  std::fill(out, out + p * H, 0.0f);
  RunExpertGroups(*w, static_cast<float>(cfg_.swiglu_limit), by_expert, H, rows, out, pool_);
  return Status::Ok();
}

}  // namespace fm
