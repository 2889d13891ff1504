// Placement planner (docs/architecture.md "Startup"): pipeline_stages x expert_parallel workers from the model's
// config.json alone (model/tensor_schema.h byte math; no weights are read).
//
// - Worker w = stage * expert_parallel + ep_rank runs on nodes[w] (YAML order).
// - Stage s owns main layers [layer_begin, layer_end): contiguous, never splitting a layer,
//   non-empty. Stages are balanced by bytes (weights + KV for the stage's sequences): the
//   partition minimises the largest need / memory_gib ratio over the stage's nodes (with
//   equal nodes: the largest stage in bytes).
// - Stage 0 also holds the embedding; the last stage the final norm/head/hc_head and the MTP
//   layer(s).
// - In an EP group of k, every member holds the dense part of each of its layers (attention,
//   hc mixes, router, shared expert) and routed experts [r*E/k, (r+1)*E/k). Sequences are
//   split over members (data-parallel attention): each holds KV for ceil(max_batch / k).
// - Tensor parallel (tensor_parallel t, issue 20): the t members of a stage split each layer's
//   heads (wq_b, wo_a by groups, wo_b by rows) and the shared expert (ceil(bytes / t) each),
//   replicate the rest of the dense part, and hold routed experts like an EP group; every
//   member keeps the KV of all the stage's sequences. t divides the heads, o_groups, hidden_size
//   and moe_intermediate_size (CheckTensorParallel, the loader's rule).
// - parallel "auto": among the layouts of the nodes (S x ep and S x tp with S * k == nodes;
//   PlanCandidates in cost_model.h) that fit every node's memory_gib, the one the cost model
//   predicts fastest at batch 1; ties go to fewer stages. cpu profiles are probed first (ProbeHostProfile).
// - KV per worker = limits.kv_cache_gib when set, else the decode state (MODEL.md) of
//   ceil(max_batch / k) sequences at max_context for the worker's layers, f32.
#pragma once
#include <cstdint>
#include <string>
#include <vector>

#include "common/status.h"
#include "config/cluster_config.h"
#include "model/config.h"

namespace fm {

struct WorkerPlan {
  std::string node;                    // nodes[].name
  int node_index = 0;                  // index into ClusterConfig::nodes
  int stage = 0;
  int ep_rank = 0;                     // member index inside the stage's EP group
  int tp_rank = 0;                     // member index inside the stage's TP group
  int64_t layer_begin = 0, layer_end = 0;    // main layers [begin, end)
  int64_t expert_begin = 0, expert_end = 0;  // routed experts [begin, end) on every layer held
  bool embed = false;                  // embed.weight (stage 0)
  bool head = false;                   // norm, head, hc_head_* and MTP layers (last stage)
  uint64_t weight_bytes = 0;
  uint64_t kv_bytes = 0;
  int64_t max_sequences = 0;           // sequences whose KV this worker holds
  double memory_gib = 0;               // the node's memory_gib
  double need_gib() const;             // (weight_bytes + kv_bytes) / 2^30
  double free_gib() const { return memory_gib - need_gib(); }
};


struct Plan {
  int pipeline_stages = 1;
  int expert_parallel = 1;
  int tensor_parallel = 1;             // > 1: the stage's group splits heads (expert_parallel 1)
  std::vector<WorkerPlan> workers;     // stage-major: workers[stage * group() + member]
  uint64_t total_weight_bytes = 0;     // the whole model once (ModelBytes::total)
  int group() const { return expert_parallel * tensor_parallel; }   // workers of a stage
  const WorkerPlan& at(int stage, int member) const {
    return workers.at(static_cast<size_t>(stage) * group() + member);
  }
};

// Plans the cluster. Errors: stages * k != number of nodes, stages > num_hidden_layers, k above
// n_routed_experts, a tensor-parallel t the shapes do not split by, or a worker that does not fit: "node 'spark-a' (stage 0, ep 0):
// needs 130.2 GiB (weights 120.1 + KV 10.1) but memory_gib is 121.0".
Result<Plan> PlanShards(const ModelConfig& model, const ClusterConfig& cluster);
// One layout: `stages` x expert_parallel `ep` x tensor_parallel `tp` (ep or tp is 1), with the
// same errors. The layouts auto considers, with predictions: PlanCandidates (cost_model.h).
Result<Plan> PlanLayout(const ModelConfig& model, const ClusterConfig& cluster, int stages, int ep,
                        int tp);
// A layout's short name: "pp2 x ep4", "pp1 x tp2".
std::string LayoutName(int stages, int ep, int tp);
// The cluster with every cpu profile's unset figures measured on this host (ProbeHostProfile).
ClusterConfig WithProbedProfiles(ClusterConfig cluster);

// The table `flashmesh plan` prints: node, stage, ep (tp), layers, experts, weight/KV/free GiB.
std::string FormatPlanTable(const Plan& plan);
// The same as JSON text (one object: stages, expert_parallel, tensor_parallel, workers[...]).
std::string PlanToJson(const Plan& plan);

}  // namespace fm
