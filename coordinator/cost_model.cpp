// Cost model (cost_model.h): per-stage step times from bytes and multiply-adds, plus the wire.
#include "coordinator/cost_model.h"

#include <algorithm>
#include <cmath>
#include <string>

#include "model/tensor_schema.h"
#include "net/wire_format.h"

namespace fm {
namespace {

constexpr double kHeaderBytes = net::kFrameHeaderSize;
constexpr double kTagBytes = net::kFrameTagSize;   // every frame, with a secret
constexpr int kEpExchanges = 3;       // per MoE layer: dispatch pairs, dispatch rows, combine
constexpr int kTpExchanges = 4;       // per layer: o_lora, wo_b rows, shared mid, expert outputs

bool IsSplit(const std::string& name) {
  return name.find(".attn.wq_b") != std::string::npos ||
         name.find(".attn.wo_a") != std::string::npos ||
         name.find(".attn.wo_b") != std::string::npos ||
         name.find(".shared_experts.") != std::string::npos;
}

// Multiply-adds per token of a matrix-vector product with this tensor (0 for non-matrices).
uint64_t Macs(const TensorSpec& s) {
  if (s.shape.size() != 2) return 0;
  const uint64_t n = static_cast<uint64_t>(s.shape[0]) * static_cast<uint64_t>(s.shape[1]);
  switch (s.role) {
    case TensorRole::kMatrix:
    case TensorRole::kFp8Weight:
    case TensorRole::kHcFn: return n;
    case TensorRole::kFp4Weight: return 2 * n;   // two weights a byte
    default: return 0;
  }
}

// The members of one stage and what bounds them.
struct Stage {
  int64_t layer_begin = 0, layer_end = 0;
  bool embed = false, head = false;
  int group = 1;           // workers of the stage
  bool tp = false;         // the group splits heads (else: EP when group > 1)
  double bytes_per_s = 0;  // the slowest member's effective read bandwidth (shared host split)
  double flops = 0;        // the slowest member's compute, FLOP/s
  double link = 0;         // the slowest member's link, bytes/s
  double latency = 0;      // the slowest member's link latency, s
};

struct StageTime {
  double read_s = 0, wire_s = 0;
  uint64_t read_bytes = 0;   // the busiest member's
  double ep_bytes = 0, tp_bytes = 0;
  int64_t exchanges = 0;
};

// Expected per-token EP payload: to each remote owner it routes to, the row [H] f32 once, 8
// bytes a pair, and each remote pair's output [H] f32 back.
double EpBytesPerRow(const ModelConfig& c, int g) {
  const double E = static_cast<double>(c.n_routed_experts);
  const double k = static_cast<double>(c.num_experts_per_tok);
  const double per_owner = E / g, H = static_cast<double>(c.hidden_size);
  double none = 1;   // P(one given owner holds none of the row's k distinct experts)
  for (int64_t i = 0; i < c.num_experts_per_tok; ++i)
    none *= std::max(0.0, (E - per_owner - i) / (E - i));
  const double owners = (g - 1) * (1 - none), pairs = k * (g - 1) / g;
  return owners * H * 4 + pairs * 8 + pairs * H * 4;
}

// All-gather payload of one token in one TP layer: o_lora outputs [G * o_lora], wo_b rows [H],
// shared expert mid [I * n_shared], its output rows [H] and the k routed outputs [k, H], f32.
double TpBytesPerToken(const ModelConfig& c) {
  const double H = static_cast<double>(c.hidden_size);
  const double shared = static_cast<double>(c.moe_intermediate_size) *
                        std::max<int64_t>(c.n_shared_experts, 1);
  return 4 * (static_cast<double>(c.o_groups * c.o_lora_rank) + H + shared + H +
              static_cast<double>(c.num_experts_per_tok) * H);
}

// One step of `rows` tokens through stage st. decode: one row per sequence, KV read at
// `context`; prefill: a chunk of one sequence's prompt after `context` positions, attention
// over context + rows / 2 positions on average, logits for its last row when `sampled` (the
// prompt's last chunk).
StageTime StepTime(const ModelConfig& c, const ModelShape& m, const Stage& st, int64_t rows,
                   int64_t context, bool prefill, bool sampled = true) {
  StageTime t;
  const int g = st.group;
  const double E = static_cast<double>(c.n_routed_experts);
  const double k = static_cast<double>(c.num_experts_per_tok);
  const int64_t attn_ctx = prefill ? std::max<int64_t>(context + rows / 2, 1) : context;
  // EP spreads sequences over the members (data-parallel attention): a prefill's rows all
  // live on one member, a decode step's on min(rows, g). pp and tp: every row on every member.
  const int64_t holders = st.tp || g == 1 || prefill ? 1 : std::min<int64_t>(rows, g);
  const int64_t own = (rows + holders - 1) / holders;   // rows on the busiest member
  auto phase = [&](double bytes, double macs) {   // memory or compute, whichever is slower
    return std::max(bytes / st.bytes_per_s, 2 * macs / st.flops);
  };
  for (int64_t l = st.layer_begin; l < st.layer_end; ++l) {
    const LayerShape& L = m.layers[static_cast<size_t>(l)];
    // KV read: each decode row its sequence's cache; a prefill chunk the positions before it,
    // once (counted as a decode token there reads them; none for the first chunk).
    const double kv_row = prefill ? 0 : static_cast<double>(KvReadBytes(c, l, context));
    const double kv_chunk =
        prefill && context > 0 ? static_cast<double>(KvReadBytes(c, l, context)) : 0;
    const double attn = static_cast<double>(AttentionMacs(c, l, attn_ctx));
    const double experts = DistinctExperts(c, E / g, rows);   // on each member
    const double rep = static_cast<double>(L.replicated_bytes);
    const double split = static_cast<double>(L.split_bytes);
    const double ex = static_cast<double>(L.expert_bytes);
    const double dense_macs = static_cast<double>(L.replicated_macs + L.split_macs);
    double bytes = 0;
    if (st.tp) {
      bytes = rep + split / g + experts * ex + kv_row * rows + kv_chunk;
      const double macs = static_cast<double>(L.replicated_macs) +
                          (static_cast<double>(L.split_macs) + attn + k * L.expert_macs) / g;
      t.read_s += phase(bytes, rows * macs);
      const double payload = TpBytesPerToken(c) * rows;
      t.tp_bytes += payload * (g - 1);
      t.wire_s += kTpExchanges * st.latency + payload * (g - 1) / g / st.link;
      t.exchanges += kTpExchanges;
    } else {
      // Attention and the shared expert on the member with the rows, then every member's
      // experts in parallel (for g == 1 the same sum).
      const double dense = rep + split + kv_row * own + kv_chunk;
      t.read_s += phase(dense, own * (dense_macs + attn));
      t.read_s += phase(experts * ex, rows * k / g * L.expert_macs);
      bytes = dense + experts * ex;
      if (g > 1) {
        const double payload = EpBytesPerRow(c, g) * rows;
        t.ep_bytes += payload;
        t.wire_s += kEpExchanges * st.latency + payload / holders / st.link;
        t.exchanges += kEpExchanges;
      }
    }
    t.read_bytes += static_cast<uint64_t>(std::llround(bytes));
  }
  if (st.embed) {
    const double b = static_cast<double>(m.embed_row_bytes) * own;
    t.read_s += b / st.bytes_per_s;
    t.read_bytes += static_cast<uint64_t>(b);
  }
  if (st.head && sampled) {
    const int64_t logits = prefill ? 1 : own;
    t.read_s += phase(static_cast<double>(m.head_bytes), static_cast<double>(logits * m.head_macs));
    t.read_bytes += m.head_bytes;
  }
  return t;
}

// Stage-to-stage hop of `rows` rows: every member sends its rows' [hc, H] manifold to the next
// stage's member of the same rank (TP: each member the full rows); one frame per member.
// tagged: the cluster has a secret, so each frame carries its tag.
double HopBytes(const ModelConfig& c, int group, bool tp, int64_t rows, int act_bytes, bool tagged) {
  const double payload = static_cast<double>(rows) * c.hc_mult * c.hidden_size * act_bytes;
  return group * (kHeaderBytes + (tagged ? kTagBytes : 0)) + (tp ? group : 1) * payload;
}

int ActivationBytes(const ClusterConfig& cl) { return cl.activation_dtype == "bf16" ? 2 : 4; }

}  // namespace

ModelShape ComputeModelShape(const ModelConfig& c) {
  ModelShape m;
  m.layers.resize(static_cast<size_t>(std::max<int64_t>(c.num_hidden_layers, 0)));
  for (const TensorSpec& s : ExpectedTensors(c)) {
    const uint64_t bytes = s.bytes();
    if (s.group == TensorGroup::kEmbed) {
      m.embed_row_bytes += bytes / static_cast<uint64_t>(std::max<int64_t>(c.vocab_size, 1));
      continue;
    }
    if (s.group == TensorGroup::kHead) {
      m.head_bytes += bytes;
      m.head_macs += Macs(s);
      continue;
    }
    if (s.group != TensorGroup::kLayer) continue;   // MTP
    LayerShape& L = m.layers[static_cast<size_t>(s.layer)];
    if (s.expert > 0) continue;
    if (s.expert == 0) {
      L.expert_bytes += bytes;
      L.expert_macs += Macs(s);
    } else if (IsSplit(s.name)) {
      L.split_bytes += bytes;
      L.split_macs += Macs(s);
    } else {
      L.replicated_bytes += bytes;
      L.replicated_macs += Macs(s);
    }
  }
  return m;
}

uint64_t AttentionMacs(const ModelConfig& c, int64_t layer, int64_t context) {
  const uint64_t ctx = static_cast<uint64_t>(std::max<int64_t>(context, 1));
  const uint64_t r = static_cast<uint64_t>(std::max<int64_t>(c.compress_ratio(layer), 0));
  uint64_t keys = std::min<uint64_t>(ctx, c.sliding_window);
  uint64_t index = 0;
  if (r == 4) {
    keys += std::min<uint64_t>(ctx / 4, c.index_topk);
    index = ctx / 4 * c.index_n_heads * c.index_head_dim;
  } else if (r > 0) {
    keys += ctx / r;
  }
  return keys * c.num_attention_heads * 2 * c.head_dim + index;
}

uint64_t KvReadBytes(const ModelConfig& c, int64_t layer, int64_t context) {
  const uint64_t ctx = static_cast<uint64_t>(std::max<int64_t>(context, 1));
  const uint64_t r = static_cast<uint64_t>(std::max<int64_t>(c.compress_ratio(layer), 0));
  uint64_t rows = std::min<uint64_t>(ctx, c.sliding_window) * c.head_dim;
  if (r == 4)
    rows += std::min<uint64_t>(ctx / 4, c.index_topk) * c.head_dim + ctx / 4 * c.index_head_dim;
  else if (r > 0) rows += ctx / r * c.head_dim;
  return rows * sizeof(float);
}

double DistinctExperts(const ModelConfig& c, double experts, int64_t rows) {
  const double p =
      static_cast<double>(c.num_experts_per_tok) / static_cast<double>(c.n_routed_experts);
  return experts * (1 - std::pow(1 - p, static_cast<double>(rows)));
}

// Calls fn(start, rows) for each prefill step of a `prompt`-token prompt in chunks of
// `step_tokens` (the scheduler's chunk edges: multiples of step_tokens from the start).
template <typename Fn>
void ForEachChunk(int64_t prompt, int64_t step_tokens, Fn fn) {
  const int64_t chunk = std::max<int64_t>(step_tokens, 1);
  for (int64_t start = 0; start < prompt; start += chunk) fn(start, std::min(chunk, prompt - start));
}

double RequestHopBytes(const ModelConfig& c, const Plan& plan, int64_t prompt, int64_t new_tokens,
                       int64_t step_tokens, int activation_bytes, bool tagged) {
  const int hops = plan.pipeline_stages - 1;
  const bool tp = plan.tensor_parallel > 1;
  const int group = plan.group();
  // The prefill steps carry the prompt; each later step one row (the first token comes from
  // the prefill).
  double prefill = 0;
  ForEachChunk(prompt, step_tokens, [&](int64_t, int64_t rows) {
    prefill += HopBytes(c, group, tp, rows, activation_bytes, tagged);
  });
  return hops * (prefill + (new_tokens - 1) * HopBytes(c, group, tp, 1, activation_bytes, tagged));
}

double RequestTpFrameBytes(const ModelConfig& c, const Plan& plan, int64_t prompt,
                           int64_t new_tokens, int64_t step_tokens, bool tagged) {
  const int t = plan.tensor_parallel;
  if (t <= 1) return 0;
  constexpr int64_t kPassRows = 256;   // model/attention.cpp: rows per attention pass
  auto gathers = [&](int64_t rows) { return 2 * ((rows + kPassRows - 1) / kPassRows) + 2; };
  const double frame = kHeaderBytes + (tagged ? kTagBytes : 0);
  double per_layer = static_cast<double>((new_tokens - 1) * gathers(1));
  ForEachChunk(prompt, step_tokens, [&](int64_t, int64_t rows) { per_layer += gathers(rows); });
  return static_cast<double>(c.num_hidden_layers) * per_layer * t * (t - 1) * frame;
}

Result<Prediction> PredictPlan(const ModelConfig& c, const ModelShape& m, const Plan& plan,
                               const ClusterConfig& cl, const CostQuery& q) {
  if (m.layers.size() != static_cast<size_t>(c.num_hidden_layers))
    return InvalidArgument("cost model: the model shape has " + std::to_string(m.layers.size()) +
                           " layers, the config " + std::to_string(c.num_hidden_layers));
  if (q.batch < 1 || q.prompt < 1 || q.context < 1)
    return InvalidArgument("cost model: batch, prompt and context must be >= 1");
  const int S = plan.pipeline_stages, g = plan.group();
  std::vector<Stage> stages(S);
  for (int s = 0; s < S; ++s) {
    Stage& st = stages[s];
    const WorkerPlan& first = plan.at(s, 0);
    st.layer_begin = first.layer_begin;
    st.layer_end = first.layer_end;
    st.embed = first.embed;
    st.head = first.head;
    st.group = g;
    st.tp = plan.tensor_parallel > 1;
    st.bytes_per_s = st.flops = st.link = 1e300;
    for (int r = 0; r < g; ++r) {
      const int node = plan.at(s, r).node_index;
      if (node < 0 || node >= static_cast<int>(cl.nodes.size()))
        return InvalidArgument("cost model: plan worker on node " + std::to_string(node) +
                               " but the cluster has " + std::to_string(cl.nodes.size()));
      const NodeConfig& n = cl.nodes[node];
      const HardwareProfile& p = n.profile;
      if (p.mem_bw_gbps <= 0 || p.compute_tflops <= 0 || p.link_gbps <= 0)
        return InvalidArgument("cost model: node '" + n.name + "': profile '" + p.name +
                               "' has no memory bandwidth, compute or link figure" +
                               (p.name == "cpu" ? " (the cpu profile is probed at start)" : ""));
      int sharers = 0;   // members of this group on the node's host read at the same time
      for (int o = 0; o < g; ++o)
        sharers += cl.nodes[plan.at(s, o).node_index].data.host == n.data.host;
      st.bytes_per_s = std::min(st.bytes_per_s, p.effective_bytes_per_s() / sharers);
      st.flops = std::min(st.flops, p.compute_tflops * 1e12 / sharers);
      st.link = std::min(st.link, p.link_bytes_per_s());
      st.latency = std::max(st.latency, p.link_latency_us * 1e-6);
    }
  }
  const int act = ActivationBytes(cl);
  const bool tagged = !cl.security.cluster_secret_file.empty();
  const double rpc = q.control_rpc ? 2 * stages[0].latency : 0;   // StepBatch round trip
  auto hop_s = [&](int s, int64_t rows) {   // stage s -> s + 1
    const Stage& a = stages[s];
    const Stage& b = stages[s + 1];
    return std::max(a.latency, b.latency) +
           HopBytes(c, g, a.tp, rows, act, tagged) / std::min(a.link, b.link) / (a.tp ? g : 1);
  };

  Prediction p;
  // Batch 1.
  for (int s = 0; s < S; ++s) {
    const StageTime t = StepTime(c, m, stages[s], 1, q.context, false);
    p.read_s += t.read_s;
    p.wire_s += t.wire_s;
    p.ep_bytes += t.ep_bytes;
    p.tp_bytes += t.tp_bytes;
    p.exchanges += t.exchanges;
    p.busiest_read_bytes = std::max(p.busiest_read_bytes, t.read_bytes);
    if (s + 1 < S) {
      p.wire_s += hop_s(s, 1);
      p.hop_bytes += HopBytes(c, g, stages[s].tp, 1, act, tagged);
      p.exchanges += 1;
    }
  }
  p.wire_s += rpc;
  p.exchanges += q.control_rpc ? 2 : 0;
  p.step_s = p.read_s + p.wire_s;
  p.tok_s = 1 / p.step_s;

  // Batch B: up to one micro-batch per stage in flight; a cycle advances every sequence once.
  const int64_t micro = std::min<int64_t>(q.batch, S);
  const int64_t rows = (q.batch + micro - 1) / micro;
  double round_trip = rpc, slowest = 0;
  for (int s = 0; s < S; ++s) {
    const StageTime t = StepTime(c, m, stages[s], rows, q.context, false);
    round_trip += t.read_s + t.wire_s + (s + 1 < S ? hop_s(s, rows) : 0);
    slowest = std::max(slowest, t.read_s + t.wire_s);
  }
  p.tok_s_batch = static_cast<double>(q.batch) / std::max(round_trip, micro * slowest);

  // Time to first token: the prompt in chunks of step_tokens rows, a step each, with up to S
  // steps in flight (the scheduler's chunked prefill). A chunk enters stage s once it left
  // stage s - 1 and the chunk before it left stage s, so a pipeline prefills one prompt on all
  // its stages at once. A stage sends its output inside its step (worker/stage_executor.cpp),
  // so the hop keeps the sender busy too.
  std::vector<double> stage_free(static_cast<size_t>(S), 0.0), done;
  ForEachChunk(q.prompt, q.step_tokens, [&](int64_t start, int64_t rows) {
    const size_t k = done.size();
    double t = (k >= static_cast<size_t>(S) ? done[k - S] : 0.0) + rpc / 2;   // a free step slot
    for (int s = 0; s < S; ++s) {
      const StageTime st = StepTime(c, m, stages[s], rows, start, true, start + rows == q.prompt);
      t = std::max(t, stage_free[s]) + st.read_s + st.wire_s;
      if (s + 1 < S) t += hop_s(s, rows);
      stage_free[s] = t;
    }
    done.push_back(t + rpc / 2);
  });
  p.ttft_s = done.back();   // q.prompt >= 1 (checked above): at least one chunk
  return p;
}

CostQuery QueryFor(const ClusterConfig& cl) {
  CostQuery q;
  q.batch = cl.limits.max_batch;
  q.prompt = q.context = std::min<int64_t>(1024, cl.limits.max_context);
  q.step_tokens = cl.limits.max_step_tokens;
  return q;
}

std::vector<PlanCandidate> PlanCandidates(const ModelConfig& c, const ClusterConfig& cl,
                                          const CostQuery& q) {
  std::vector<PlanCandidate> out;
  const int n = static_cast<int>(cl.nodes.size());
  const ModelShape shape = ComputeModelShape(c);
  for (int stages = 1; stages <= n; ++stages) {
    if (n % stages != 0) continue;
    const int k = n / stages;
    for (const bool tp : {false, true}) {
      if (tp && k == 1) continue;
      PlanCandidate cand;
      cand.pipeline_stages = stages;
      cand.expert_parallel = tp ? 1 : k;
      cand.tensor_parallel = tp ? k : 1;
      cand.plan = PlanLayout(c, cl, stages, cand.expert_parallel, cand.tensor_parallel);
      if (cand.plan.ok()) cand.prediction = PredictPlan(c, shape, *cand.plan, cl, q);
      out.push_back(std::move(cand));
    }
  }
  return out;
}

}  // namespace fm
