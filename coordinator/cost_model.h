// Cost model (docs/performance.md "The cost model"): predicts decode tok/s, time to first token
// and the wire traffic of a placement plan from the model's shapes and each node's hardware
// profile. Pure functions: no I/O, no clock; the same inputs give the same numbers.
//
// A decode step is memory-bound: each worker reads the weights it holds that the step needs
// (dense parts once per step, each distinct routed expert once), at
// mem_bw x decode_efficiency, or is compute-bound at compute_tflops, whichever is slower
// (per layer). Wire time is latency + bytes / link bandwidth per exchange. Layouts:
// - pipeline stages run one after the other for a token; with B sequences up to one
//   micro-batch per stage is in flight (coordinator/scheduler.h);
// - an EP group of g: one member reads all dense parts for its rows, then every member reads
//   its experts that the step's rows selected; dispatch + combine are 3 exchanges a layer;
// - a TP group of t: every member reads the replicated parts, 1/t of the split parts (wq_b,
//   wo_a, wo_b, shared expert) and its experts; 4 all-gathers a layer.
// Members of a group on the same host (same data-plane host) share its memory bandwidth.
#pragma once
#include <cstdint>
#include <vector>

#include "common/status.h"
#include "config/cluster_config.h"
#include "coordinator/planner.h"
#include "model/config.h"

namespace fm {

// One main layer's weights as a tensor-parallel group divides them (official dtypes).
struct LayerShape {
  uint64_t replicated_bytes = 0;  // on every member: wq_a, wkv, norms, compressors, indexer, hc
                                  // mixes, router
  uint64_t split_bytes = 0;       // 1/t per member: wq_b, wo_a, wo_b, shared expert
  uint64_t expert_bytes = 0;      // one routed expert (w1, w2, w3 and scales)
  uint64_t replicated_macs = 0;   // multiply-adds per token of the matrices above
  uint64_t split_macs = 0;
  uint64_t expert_macs = 0;
};

struct ModelShape {
  std::vector<LayerShape> layers;  // main layers (MTP is not decoded)
  uint64_t embed_row_bytes = 0;    // one row of embed.weight
  uint64_t head_bytes = 0;         // norm, hc_head_*, head.weight
  uint64_t head_macs = 0;          // per token
};
ModelShape ComputeModelShape(const ModelConfig& cfg);

// Multiply-adds of one token's attention core in main layer `layer` at `context` tokens: each
// head scores and mixes the window and the selected compressed entries (2 x head_dim each);
// ratio-4 layers also score every indexer entry.
uint64_t AttentionMacs(const ModelConfig& cfg, int64_t layer, int64_t context);
// KV-cache bytes one decode token reads in `layer` at `context` (f32): the window ring, the
// compressed entries attended (top index_topk on ratio 4), and the indexer's keys.
uint64_t KvReadBytes(const ModelConfig& cfg, int64_t layer, int64_t context);
// Expected distinct routed experts of `experts` that `rows` tokens select, top_k each,
// uniform routing: experts x (1 - (1 - top_k / n_routed)^rows).
double DistinctExperts(const ModelConfig& cfg, double experts, int64_t rows);

struct CostQuery {
  int64_t batch = 8;         // sequences decoding together, for tok_s_batch
  int64_t prompt = 1024;     // prompt tokens, for ttft_s
  int64_t step_tokens = 2048;   // limits.max_step_tokens: the prompt goes in chunks of this many
  int64_t context = 1024;    // tokens in each sequence while decoding (KV read, attention)
  bool control_rpc = true;   // a coordinator round trip per step (false: a single process)
};

struct Prediction {
  double step_s = 0;         // one decode token at batch 1
  double read_s = 0;         //   of which memory / compute
  double wire_s = 0;         //   of which wire (latency + bytes / link)
  double tok_s = 0;          // batch 1: 1 / step_s
  double tok_s_batch = 0;    // aggregate at query.batch
  double ttft_s = 0;         // query.prompt tokens, one sequence
  // Batch-1 decode, bytes every worker sends per token:
  double hop_bytes = 0;      // stage-to-stage frames (64-byte headers + [hc, H] rows)
  double ep_bytes = 0;       // EP dispatch + combine payloads (expected, uniform routing)
  double tp_bytes = 0;       // tensor-parallel all-gather payloads
  int64_t exchanges = 0;     // latency-bearing exchanges on a token's path (hops, collectives, RPC)
  uint64_t busiest_read_bytes = 0;  // weight + KV bytes the busiest worker reads for one token
  double wire_bytes() const { return hop_bytes + ep_bytes + tp_bytes; }
};

// Predicts `plan` on `cluster`'s nodes (nodes[w.node_index].profile; a cpu profile must be
// probed first: ProbeHostProfile). Errors name a node whose profile lacks a figure.
Result<Prediction> PredictPlan(const ModelConfig& cfg, const ModelShape& shape, const Plan& plan,
                               const ClusterConfig& cluster, const CostQuery& q);

// The query `plan` and `parallel: auto` use for a cluster: batch limits.max_batch, a prompt
// and context of min(1024, limits.max_context) tokens, in chunks of limits.max_step_tokens.
CostQuery QueryFor(const ClusterConfig& cluster);

// One layout of the cluster's nodes, whether it fits memory, and its prediction.
struct PlanCandidate {
  int pipeline_stages = 1, expert_parallel = 1, tensor_parallel = 1;
  Result<Plan> plan = Plan{};             // or why it does not fit (PlanLayout's error)
  Result<Prediction> prediction = Prediction{};   // when the plan fits
};
// For every S dividing the node count (fewest stages first), k = nodes / S: S x ep k, then
// (k > 1) S x tp k. Profiles must be probed (WithProbedProfiles).
std::vector<PlanCandidate> PlanCandidates(const ModelConfig& cfg, const ClusterConfig& cluster,
                                          const CostQuery& q);

// Data-plane bytes of one request of `prompt` tokens and `new_tokens` generated, all hops and
// members (what `bench cluster` measures as wire bytes): a prefill step per chunk of
// `step_tokens` (limits.max_step_tokens), then one step per further token, each a frame per
// member and hop (with its 16-byte tag when `tagged`: the cluster has a secret). EP and TP
// payloads are not included.
double RequestHopBytes(const ModelConfig& cfg, const Plan& plan, int64_t prompt,
                       int64_t new_tokens, int64_t step_tokens, int activation_bytes, bool tagged);
// The frame headers (and tags when `tagged`) of the same request's tensor-parallel all-gathers
// (0 without tp): per step, stage and layer 4 gathers of t x (t - 1) frames, the attention's
// two once per pass of up to 256 rows of the step (model/attention.cpp kPassRows). Their
// payloads are the prediction's tp_bytes per row.
double RequestTpFrameBytes(const ModelConfig& cfg, const Plan& plan, int64_t prompt,
                           int64_t new_tokens, int64_t step_tokens, bool tagged);

}  // namespace fm
