// Placement planner (planner.h): byte math from model/tensor_schema.h, contiguous stages chosen
// by an exact min-max partition (dynamic programming over the layer boundaries).
#include "coordinator/planner.h"

#include <nlohmann/json.hpp>

#include <algorithm>
#include <cstdio>
#include <limits>

#include "coordinator/cost_model.h"
#include "model/tensor_schema.h"
#include "model/tp_split.h"

namespace fm {
namespace {

constexpr double kGiB = 1024.0 * 1024.0 * 1024.0;

// One decimal, or three significant digits below 1 GiB (0.001 GiB is not "0.0").
std::string Gib(double bytes) {
  char b[32];
  std::snprintf(b, sizeof b, bytes >= kGiB ? "%.1f" : "%.3g", bytes / kGiB);
  return b;
}

std::string Layers(int64_t a, int64_t b) {
  return "[" + std::to_string(a) + ", " + std::to_string(b) + ")";
}

// split: per main layer, the bytes a tensor-parallel group divides (empty when tp == 1).
Result<Plan> PlanFixed(const ModelConfig& m, const ClusterConfig& cl, const ModelBytes& mb,
                       const std::vector<uint64_t>& split, int stages, int ep, int tp) {
  const int64_t L = m.num_hidden_layers, E = m.n_routed_experts;
  const int k = ep * tp;   // workers of a stage
  const int64_t workers = int64_t{stages} * k;
  const std::string layout = tp > 1 ? " x tensor_parallel " + std::to_string(tp)
                                    : " x expert_parallel " + std::to_string(ep);
  if (workers != static_cast<int64_t>(cl.nodes.size()))
    return InvalidArgument("parallel: pipeline_stages " + std::to_string(stages) + layout + " = " +
                           std::to_string(workers) + " workers, but the cluster has " +
                           std::to_string(cl.nodes.size()) + " nodes");
  if (k > E)
    return InvalidArgument("parallel." + std::string(tp > 1 ? "tensor" : "expert") + "_parallel " +
                           std::to_string(k) + " exceeds n_routed_experts " + std::to_string(E) +
                           ": every member of a group needs at least one expert");
  // The loader's own rule (heads, o_groups, hidden_size, moe_intermediate_size): a plan it
  // would refuse on every worker is refused here.
  if (tp > 1) FM_RETURN_IF_ERROR(CheckTensorParallel(m, tp).Wrap("parallel"));
  if (stages > L)
    return InvalidArgument("parallel.pipeline_stages " + std::to_string(stages) +
                           " exceeds num_hidden_layers " + std::to_string(L) +
                           " (a stage owns at least one layer)");
  // Member r holds experts [r*E/k, (r+1)*E/k): contiguous, sizes differ by at most one. The
  // stages are balanced for the largest member.
  const int64_t per_member = (E + k - 1) / k;
  // EP spreads the sequences over the members; TP members each keep every sequence's KV.
  const int64_t seqs = tp > 1 ? cl.limits.max_batch : (cl.limits.max_batch + k - 1) / k;
  const bool fixed_kv = cl.limits.kv_cache_gib > 0;
  auto kv = [&](int64_t l) -> uint64_t {
    return fixed_kv ? 0 : seqs * KvBytesPerSequence(m, l, cl.limits.max_context);
  };
  // A member's weights of layer l with n experts: TP keeps 1/tp of the split part (MTP layers
  // whole).
  auto weights = [&](int64_t l, int64_t n) -> uint64_t {
    if (tp == 1 || l >= L) return mb.layer_total(l, n);
    const uint64_t part = split[static_cast<size_t>(l)];
    return mb.layer_total(l, n) - part + (part + tp - 1) / tp;
  };

  // cost[l]: bytes a member of the stage holding layer l needs for it; prefix sums.
  std::vector<uint64_t> prefix(L + 1, 0);
  for (int64_t l = 0; l < L; ++l) prefix[l + 1] = prefix[l] + weights(l, per_member) + kv(l);
  // The MTP layers a last stage loads (none while MTP is not served: model/checkpoint.h).
  const int64_t mtp_layers = kServeMtp ? m.num_nextn_predict_layers : 0;
  uint64_t tail = mb.head;  // last stage: norm/head/hc_head and the MTP layers
  for (int64_t l = L; l < L + mtp_layers; ++l)
    tail += weights(l, per_member) + kv(l);
  const uint64_t pool = fixed_kv ? static_cast<uint64_t>(cl.limits.kv_cache_gib * kGiB) : 0;
  auto stage_bytes = [&](int s, int64_t a, int64_t b) {
    return prefix[b] - prefix[a] + (s == 0 ? mb.embed : 0) + (s == stages - 1 ? tail : 0) + pool;
  };
  std::vector<double> capacity(stages);  // the smallest memory of the stage's members
  for (int s = 0; s < stages; ++s) {
    capacity[s] = std::numeric_limits<double>::infinity();
    for (int r = 0; r < k; ++r)
      capacity[s] = std::min(capacity[s], cl.nodes[s * k + r].memory_gib * kGiB);
  }

  // best[s][i]: the smallest achievable max(need / capacity) placing layers [0, i) on stages
  // [0, s]; cut[s][i]: where stage s begins in that optimum (ties: the earliest cut).
  const double inf = std::numeric_limits<double>::infinity();
  std::vector<std::vector<double>> best(stages, std::vector<double>(L + 1, inf));
  std::vector<std::vector<int64_t>> cut(stages, std::vector<int64_t>(L + 1, 0));
  for (int64_t i = 1; i <= L; ++i) best[0][i] = stage_bytes(0, 0, i) / capacity[0];
  for (int s = 1; s < stages; ++s)
    for (int64_t i = s + 1; i <= L; ++i)
      for (int64_t a = s; a < i; ++a) {
        const double v = std::max(best[s - 1][a], stage_bytes(s, a, i) / capacity[s]);
        if (v < best[s][i]) {
          best[s][i] = v;
          cut[s][i] = a;
        }
      }
  std::vector<int64_t> begin(stages + 1, 0);
  begin[stages] = L;
  for (int s = stages - 1; s > 0; --s) begin[s] = cut[s][begin[s + 1]];

  Plan plan;
  plan.pipeline_stages = stages;
  plan.expert_parallel = ep;
  plan.tensor_parallel = tp;
  plan.total_weight_bytes = mb.total;   // less the MTP layers no worker loads
  for (int64_t l = L + mtp_layers; l < L + m.num_nextn_predict_layers; ++l)
    plan.total_weight_bytes -= mb.layer_total(l, E);
  for (int s = 0; s < stages; ++s) {
    for (int r = 0; r < k; ++r) {
      WorkerPlan w;
      w.node_index = s * k + r;
      w.node = cl.nodes[w.node_index].name;
      w.memory_gib = cl.nodes[w.node_index].memory_gib;
      w.stage = s;
      (tp > 1 ? w.tp_rank : w.ep_rank) = r;
      w.layer_begin = begin[s];
      w.layer_end = begin[s + 1];
      w.expert_begin = r * E / k;
      w.expert_end = (r + 1) * E / k;
      const int64_t experts = w.expert_end - w.expert_begin;
      w.embed = s == 0;
      w.head = s == stages - 1;
      w.max_sequences = seqs;
      int64_t last = w.head ? L + mtp_layers : w.layer_end;
      uint64_t per_sequence = 0;   // KV bytes of one sequence at max_context on this worker
      for (int64_t l = w.layer_begin; l < last; ++l) {
        w.weight_bytes += weights(l, experts);
        per_sequence += KvBytesPerSequence(m, l, cl.limits.max_context);
      }
      if (w.embed) w.weight_bytes += mb.embed;
      if (w.head) w.weight_bytes += mb.head;
      w.kv_bytes = static_cast<uint64_t>(seqs) * per_sequence;
      if (fixed_kv) {
        // The worker charges each sequence its bytes at max_context (worker/shard_runtime.h):
        // a pool that cannot hold the sequences the scheduler admits would refuse requests.
        if (per_sequence > 0 && pool / per_sequence < static_cast<uint64_t>(seqs))
          return ResourceExhausted(
              "limits.kv_cache_gib: " + Gib(pool) + " GiB holds " +
              std::to_string(pool / per_sequence) + " sequence(s) of limits.max_context " +
              std::to_string(cl.limits.max_context) + " on node '" + w.node + "' (layers " +
              Layers(w.layer_begin, w.layer_end) + ", " + Gib(per_sequence) +
              " GiB each), but it serves up to " + std::to_string(seqs) +
              " (limits.max_batch): raise kv_cache_gib, or lower max_batch or max_context");
        w.kv_bytes = pool;
      }
      if (w.need_gib() > w.memory_gib)
        return ResourceExhausted(
            "node '" + w.node + "' (stage " + std::to_string(s) + (tp > 1 ? ", tp " : ", ep ") +
            std::to_string(r) +
            ", layers " + Layers(w.layer_begin, w.layer_end) + "): needs " +
            Gib(w.weight_bytes + w.kv_bytes) + " GiB (weights " + Gib(w.weight_bytes) +
            " + KV " + Gib(w.kv_bytes) + ") but has " + Gib(w.memory_gib * kGiB) +
            " GiB (memory_gib)");
      plan.workers.push_back(w);
    }
  }
  return plan;
}

Status CheckInputs(const ModelConfig& model, const ClusterConfig& cluster) {
  if (cluster.nodes.empty()) return InvalidArgument("plan: the cluster has no nodes");
  if (model.num_hidden_layers < 1 || model.n_routed_experts < 1)
    return InvalidArgument("plan: model config has no layers or no routed experts");
  if (static_cast<int64_t>(model.compress_ratios.size()) <
      model.num_hidden_layers + model.num_nextn_predict_layers)
    return InvalidArgument("plan: model config compress_ratios is shorter than the layer count");
  return Status::Ok();
}

}  // namespace

double WorkerPlan::need_gib() const {
  return static_cast<double>(weight_bytes + kv_bytes) / kGiB;
}

Result<Plan> PlanLayout(const ModelConfig& model, const ClusterConfig& cluster, int stages, int ep,
                        int tp) {
  FM_RETURN_IF_ERROR(CheckInputs(model, cluster));
  if (stages < 1 || ep < 1 || tp < 1 || (ep > 1 && tp > 1))
    return InvalidArgument("plan: want stages, expert_parallel, tensor_parallel >= 1 and not "
                           "both expert_parallel and tensor_parallel above 1");
  std::vector<uint64_t> split;
  if (tp > 1)
    for (const LayerShape& l : ComputeModelShape(model).layers) split.push_back(l.split_bytes);
  return PlanFixed(model, cluster, ComputeModelBytes(model), split, stages, ep, tp);
}

ClusterConfig WithProbedProfiles(ClusterConfig cluster) {
  for (NodeConfig& n : cluster.nodes) ProbeHostProfile(&n.profile);
  return cluster;
}

Result<Plan> PlanShards(const ModelConfig& model, const ClusterConfig& cluster) {
  FM_RETURN_IF_ERROR(CheckInputs(model, cluster));
  if (!cluster.parallel.automatic)
    return PlanLayout(model, cluster, cluster.parallel.pipeline_stages,
                      cluster.parallel.expert_parallel, cluster.parallel.tensor_parallel);
  const ClusterConfig probed = WithProbedProfiles(cluster);
  std::vector<PlanCandidate> all = PlanCandidates(model, probed, QueryFor(probed));
  const PlanCandidate* best = nullptr;
  std::string tried;
  for (const PlanCandidate& c : all) {
    if (!c.plan.ok()) {
      tried += "\n  " + LayoutName(c.pipeline_stages, c.expert_parallel, c.tensor_parallel) + ": " +
               c.plan.status().message();
      continue;
    }
    if (!c.prediction.ok()) return c.prediction.status();
    if (!best || c.prediction->tok_s > best->prediction->tok_s) best = &c;
  }
  if (best) return *best->plan;
  const int n = static_cast<int>(cluster.nodes.size());
  return ResourceExhausted("parallel auto: no layout of the " + std::to_string(n) +
                           " nodes fits:" + tried);
}

std::string LayoutName(int stages, int ep, int tp) {
  return "pp" + std::to_string(stages) + (tp > 1 ? " x tp" + std::to_string(tp)
                                                 : " x ep" + std::to_string(ep));
}

std::string FormatPlanTable(const Plan& plan) {
  const bool tp = plan.tensor_parallel > 1;
  std::string out = "plan: " + std::to_string(plan.pipeline_stages) + " stage(s) x " +
                    std::to_string(plan.group()) +
                    (tp ? "-way tensor parallel = " : "-way expert parallel = ") +
                    std::to_string(plan.workers.size()) + " worker(s); model weights " +
                    Gib(static_cast<double>(plan.total_weight_bytes)) + " GiB\n";
  char line[256];
  std::snprintf(line, sizeof line, "%-16s %5s %3s %-10s %-11s %9s %7s %8s  %s\n", "node", "stage",
                tp ? "tp" : "ep", "layers", "experts", "weights", "KV", "free", "also");
  out += line;
  for (const WorkerPlan& w : plan.workers) {
    const std::string experts = Layers(w.expert_begin, w.expert_end);
    std::string also = w.embed ? "embed" : "";
    if (w.head) also += std::string(also.empty() ? "" : ", ") + (kServeMtp ? "head, mtp" : "head");
    std::snprintf(line, sizeof line, "%-16s %5d %3d %-10s %-11s %9s %7s %8s  %s\n",
                  w.node.c_str(), w.stage, tp ? w.tp_rank : w.ep_rank,
                  Layers(w.layer_begin, w.layer_end).c_str(),
                  experts.c_str(), (Gib(w.weight_bytes) + "G").c_str(),
                  (Gib(w.kv_bytes) + "G").c_str(), (Gib(w.free_gib() * kGiB) + "G").c_str(),
                  also.c_str());
    out += line;
  }
  return out;
}

std::string PlanToJson(const Plan& plan) {
  nlohmann::json j;
  j["pipeline_stages"] = plan.pipeline_stages;
  j["expert_parallel"] = plan.expert_parallel;
  j["tensor_parallel"] = plan.tensor_parallel;
  j["total_weight_bytes"] = plan.total_weight_bytes;
  j["workers"] = nlohmann::json::array();
  for (const WorkerPlan& w : plan.workers)
    j["workers"].push_back({{"node", w.node},
                            {"node_index", w.node_index},
                            {"stage", w.stage},
                            {"ep_rank", w.ep_rank},
                            {"tp_rank", w.tp_rank},
                            {"layers", {w.layer_begin, w.layer_end}},
                            {"experts", {w.expert_begin, w.expert_end}},
                            {"embed", w.embed},
                            {"head", w.head},
                            {"weight_bytes", w.weight_bytes},
                            {"kv_bytes", w.kv_bytes},
                            {"max_sequences", w.max_sequences},
                            {"memory_gib", w.memory_gib},
                            {"free_gib", w.free_gib()}});
  return j.dump(2);
}

}  // namespace fm
