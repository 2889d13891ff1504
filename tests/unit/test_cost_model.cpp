// Cost model: hand-computed predictions on a two-layer toy shape (numbers in the comments),
// the real model's tensor-parallel split, and auto's choice by speed.
#include <cmath>
#include <filesystem>
#include <string>

#include <gtest/gtest.h>

#include "config/cluster_config.h"
#include "coordinator/cost_model.h"
#include "coordinator/planner.h"
#include "model/config.h"
#include "model/tensor_schema.h"

namespace fm {
namespace {

const std::filesystem::path kConfigs = std::filesystem::path(FM_SOURCE_DIR) / "configs";

// E = 8 experts, top-2, H = 16, hc = 4, head_dim 16, 4 heads, window-only layers.
ModelConfig ToyConfig() {
  ModelConfig c;
  c.num_hidden_layers = 2;
  c.hidden_size = 16;
  c.hc_mult = 4;
  c.n_routed_experts = 8;
  c.num_experts_per_tok = 2;
  c.o_groups = 2;
  c.o_lora_rank = 8;
  c.moe_intermediate_size = 32;
  c.n_shared_experts = 1;
  c.num_attention_heads = 4;
  c.head_dim = 16;
  c.sliding_window = 128;
  c.compress_ratios = {0, 0};
  return c;
}

// Per layer: 1 MB replicated, 2 MB split, 0.1 MB an expert; a 1 kB embedding row, 1 MB head.
// No multiply-adds in the matrices, so every phase is memory-bound.
ModelShape ToyShape() {
  ModelShape m;
  m.layers.assign(2, LayerShape{1000000, 2000000, 100000, 0, 0, 0});
  m.embed_row_bytes = 1000;
  m.head_bytes = 1000000;
  return m;
}

// 1 GB/s memory (efficiency 1), 1 GB/s link (8 Gb/s), 10 us latency, ample compute.
HardwareProfile ToyProfile() {
  HardwareProfile p;
  p.name = "toy";
  p.mem_bw_gbps = 1;
  p.decode_efficiency = 1;
  p.compute_tflops = 1000;
  p.link_gbps = 8;
  p.link_latency_us = 10;
  return p;
}

ClusterConfig ToyCluster(int nodes, bool same_host = false) {
  ClusterConfig c;
  for (int i = 0; i < nodes; ++i) {
    NodeConfig n;
    n.name = "n" + std::to_string(i);
    n.data.host = same_host ? "127.0.0.1" : "10.0.0." + std::to_string(i + 1);
    n.profile = ToyProfile();
    c.nodes.push_back(n);
  }
  return c;
}

// stages x group workers; layer l on stage l * stages / 2.
Plan ToyPlan(int stages, int ep, int tp) {
  Plan p;
  p.pipeline_stages = stages;
  p.expert_parallel = ep;
  p.tensor_parallel = tp;
  for (int s = 0; s < stages; ++s)
    for (int r = 0; r < ep * tp; ++r) {
      WorkerPlan w;
      w.node_index = s * ep * tp + r;
      w.stage = s;
      w.layer_begin = stages == 1 ? 0 : s;
      w.layer_end = stages == 1 ? 2 : s + 1;
      w.embed = s == 0;
      w.head = s == stages - 1;
      p.workers.push_back(w);
    }
  return p;
}

Prediction Predict(const Plan& plan, const ClusterConfig& cl, int64_t batch = 1,
                   int64_t prompt = 8) {
  CostQuery q;
  q.batch = batch;
  q.prompt = prompt;
  q.context = 1;
  auto p = PredictPlan(ToyConfig(), ToyShape(), plan, cl, q);
  EXPECT_TRUE(p.ok()) << p.status().ToString();
  return p.ok() ? *p : Prediction{};
}

void ExpectRel(double actual, double expected) {
  EXPECT_NEAR(actual, expected, std::abs(expected) * 1e-9) << "expected " << expected;
}

TEST(CostModel, OneWorkerReadsEverythingOnce) {
  const Prediction p = Predict(ToyPlan(1, 1, 1), ToyCluster(1), 4, 8);
  // Layer: 3,000,000 dense + one 16 x 4-byte KV row (64) + 2 experts (8 x (1 - 0.75)) x 0.1 MB
  // = 3,200,064; x 2 layers + 1000 embed row + 1,000,000 head = 7,401,128 B at 1 GB/s.
  ExpectRel(p.read_s, 7.401128e-3);
  ExpectRel(p.wire_s, 20e-6);   // the coordinator's round trip: 2 x 10 us
  ExpectRel(p.step_s, 7.421128e-3);
  ExpectRel(p.tok_s, 1 / 7.421128e-3);
  EXPECT_EQ(p.busiest_read_bytes, 7401128u);
  EXPECT_EQ(p.wire_bytes(), 0);
  EXPECT_EQ(p.exchanges, 2);
  // Batch 4: 4 KV rows (256 B) and 8 x (1 - 0.75^4) = 5.46875 experts a layer:
  // 2 x (3,000,256 + 546,875) + 4000 + 1,000,000 = 8,098,262 B, + 20 us, for 4 tokens.
  ExpectRel(p.tok_s_batch, 4 / 8.118262e-3);
  // Prompt of 8: no KV read, 8 x (1 - 0.75^8) = 7.19909668 experts a layer:
  // 2 x (3,000,000 + 719,909.668...) + 8000 + 1,000,000 B, + 20 us.
  const double experts = 8 * (1 - std::pow(0.75, 8));
  ExpectRel(p.ttft_s, (2 * (3e6 + experts * 1e5) + 8000 + 1e6) / 1e9 + 20e-6);
}

TEST(CostModel, PipelineAddsOneHopPerStageBoundary) {
  const Prediction p = Predict(ToyPlan(2, 1, 1), ToyCluster(2));
  // Same bytes, split over two stages, plus one hop: 10 us + (64 + 4 x 16 x 4) B / 1 GB/s.
  ExpectRel(p.read_s, 7.401128e-3);
  ExpectRel(p.wire_s, 20e-6 + 10e-6 + 320e-9);
  EXPECT_EQ(p.hop_bytes, 320);
  EXPECT_EQ(p.busiest_read_bytes, 4200064u);   // stage 1: layer 1 + the head
  EXPECT_EQ(p.exchanges, 3);
}

// A prompt of 16 in chunks of 8 (limits.max_step_tokens): one stage runs the chunks one after
// the other, a step's round trip each; two stages overlap them (chunk 1 on stage 0 while chunk 0
// is on stage 1). Only the last chunk reads the head, and it reads the 8 positions before it
// once (window rows of 16 f32: 512 B a layer).
TEST(CostModel, ChunkedPrefillOverlapsAPipelinesStages) {
  CostQuery q;
  q.batch = 1;
  q.prompt = 16;
  q.context = 1;
  q.step_tokens = 8;
  const double layer = (3e6 + 8 * (1 - std::pow(0.75, 8)) * 1e5) / 1e9;   // a chunk of 8 rows
  const double embed = 8000 / 1e9, head = 1e6 / 1e9, rpc = 20e-6, kv = 512 / 1e9;
  auto one = PredictPlan(ToyConfig(), ToyShape(), ToyPlan(1, 1, 1), ToyCluster(1), q);
  ASSERT_TRUE(one.ok()) << one.status().ToString();
  ExpectRel(one->ttft_s, 2 * (rpc + 2 * layer + embed) + 2 * kv + head);
  auto two = PredictPlan(ToyConfig(), ToyShape(), ToyPlan(2, 1, 1), ToyCluster(2), q);
  ASSERT_TRUE(two.ok()) << two.status().ToString();
  const double hop = 10e-6 + (64 + 8 * 4 * 16 * 4) / 1e9;
  // Stage 0 runs and sends both chunks back to back (a send holds its stage); the second then
  // runs on stage 1, free by then (its first chunk took `layer`, less than layer + embed + hop).
  ExpectRel(two->ttft_s, rpc + 2 * (layer + embed + hop) + kv + layer + kv + head);
  // One step of 16 rows instead: every stage waits for the whole prompt.
  q.step_tokens = 16;
  auto whole = PredictPlan(ToyConfig(), ToyShape(), ToyPlan(2, 1, 1), ToyCluster(2), q);
  ASSERT_TRUE(whole.ok());
  const double layer16 = (3e6 + 8 * (1 - std::pow(0.75, 16)) * 1e5) / 1e9;
  ExpectRel(whole->ttft_s, rpc + 2 * layer16 + 2 * embed + 10e-6 + (64 + 16 * 256) / 1e9 + head);
}

TEST(CostModel, ExpertParallelSplitsTheExpertsAndPaysThreeExchangesALayer) {
  const Prediction p = Predict(ToyPlan(1, 2, 1), ToyCluster(2));
  // Layer: the row's member reads 3,000,064; then each member 4 x (1 - 0.75) = 1 expert.
  // 2 x 3,100,064 + 1000 + 1,000,000 = 7,201,128 B.
  ExpectRel(p.read_s, 7.201128e-3);
  // Per layer and row: the other owner is hit with P = 1 - (4/8)(3/7) = 11/14 and gets the row
  // (64 B); 1 remote pair on average: 8 B of ids and 64 B of output back.
  const double ep = 11.0 / 14 * 64 + 8 + 64;
  ExpectRel(p.ep_bytes, 2 * ep);
  ExpectRel(p.wire_s, 20e-6 + 2 * (30e-6 + ep / 1e9));
  EXPECT_EQ(p.exchanges, 2 + 2 * 3);
  // The same two workers on one host share its bandwidth: every read takes twice as long.
  const Prediction shared = Predict(ToyPlan(1, 2, 1), ToyCluster(2, true));
  ExpectRel(shared.read_s, 2 * 7.201128e-3);
}

TEST(CostModel, TensorParallelHalvesTheSplitPartAndPaysFourAllGathersALayer) {
  const Prediction p = Predict(ToyPlan(1, 1, 2), ToyCluster(2));
  // Each member: 1,000,000 replicated + 1,000,000 of the split + 1 expert + 64 KV = 2,100,064
  // a layer; 2 x 2,100,064 + 1000 + 1,000,000 = 5,201,128 B.
  ExpectRel(p.read_s, 5.201128e-3);
  EXPECT_EQ(p.busiest_read_bytes, 5201128u);
  // All-gathered per token: 4 x (2 x 8 o_lora + 16 + 32 shared mid + 16 + 2 x 16 experts) =
  // 448 B; each member sends its half to the other: 448 B a layer on the wire, 224 B a link.
  ExpectRel(p.tp_bytes, 2 * 448);
  ExpectRel(p.wire_s, 20e-6 + 2 * (40e-6 + 224e-9));
  EXPECT_GT(p.tok_s, Predict(ToyPlan(1, 2, 1), ToyCluster(2)).tok_s);
}

TEST(CostModel, RequestHopBytesMatchTheDataPlaneFrames) {
  // pp3, prompt 3, 4 new tokens, f32: per hop 4 frames of 64 B + (3 + 3) rows x 256 B.
  const Plan plan = [] {
    Plan p;
    p.pipeline_stages = 3;
    return p;
  }();
  EXPECT_EQ(RequestHopBytes(ToyConfig(), plan, 3, 4, 2048, 4, false), 2 * (4 * 64 + 6 * 256));
  EXPECT_EQ(RequestHopBytes(ToyConfig(), plan, 3, 4, 2048, 2, false), 2 * (4 * 64 + 6 * 128));
  // With a cluster secret every frame carries its 16-byte tag.
  EXPECT_EQ(RequestHopBytes(ToyConfig(), plan, 3, 4, 2048, 4, true), 2 * (4 * 80 + 6 * 256));
  // A prompt of 5 in chunks of 2: three prefill frames, then 3 decode frames.
  EXPECT_EQ(RequestHopBytes(ToyConfig(), plan, 5, 4, 2, 4, false), 2 * (6 * 64 + 8 * 256));
  EXPECT_EQ(RequestTpFrameBytes(ToyConfig(), plan, 3, 4, 2048, false), 0);
}

TEST(CostModel, RequestTpFrameBytesCountEveryGathersFrames) {
  Plan tp2;
  tp2.tensor_parallel = 2;
  // 2 layers; prompt 3 (one pass: 4 gathers) and 3 decode steps (4 each): 16 gathers a layer,
  // 2 frames each of 64 B.
  EXPECT_EQ(RequestTpFrameBytes(ToyConfig(), tp2, 3, 4, 2048, false), 2 * 16 * 2 * 64);
  // A 300-row prompt takes two attention passes: 6 gathers; tagged frames are 80 B.
  EXPECT_EQ(RequestTpFrameBytes(ToyConfig(), tp2, 300, 1, 2048, true), 2 * 6 * 2 * 80);
  // In chunks of 150: two steps of one pass each, 4 gathers each.
  EXPECT_EQ(RequestTpFrameBytes(ToyConfig(), tp2, 300, 1, 150, true), 2 * 8 * 2 * 80);
  Plan tp4 = tp2;
  tp4.tensor_parallel = 4;
  EXPECT_EQ(RequestTpFrameBytes(ToyConfig(), tp4, 3, 1, 2048, false), 2 * 4 * 12 * 64);
}

TEST(CostModel, ErrorsNameTheNodeAndTheQuery) {
  ClusterConfig cl = ToyCluster(1);
  cl.nodes[0].profile.mem_bw_gbps = 0;
  cl.nodes[0].profile.name = "cpu";
  auto p = PredictPlan(ToyConfig(), ToyShape(), ToyPlan(1, 1, 1), cl, CostQuery{});
  ASSERT_FALSE(p.ok());
  EXPECT_NE(p.status().message().find("node 'n0': profile 'cpu' has no memory bandwidth"),
            std::string::npos) << p.status().message();
  CostQuery bad;
  bad.batch = 0;
  EXPECT_FALSE(PredictPlan(ToyConfig(), ToyShape(), ToyPlan(1, 1, 1), ToyCluster(1), bad).ok());
}

ModelConfig RealModel() {
  auto m = LoadModelConfig((kConfigs / "models/deepseek-v4-flash/config.json").string());
  EXPECT_TRUE(m.ok()) << m.status().ToString();
  return *m;
}

TEST(CostModel, RealModelShapeMatchesTheCheckpointBytes) {
  const ModelConfig m = RealModel();
  const ModelShape s = ComputeModelShape(m);
  const ModelBytes mb = ComputeModelBytes(m);
  ASSERT_EQ(s.layers.size(), 43u);
  // Split part of every layer: wq_b [32768, 1024], wo_a [8192, 4096], wo_b [4096, 8192] in FP8
  // (32 MiB + 2048 B of scales each) and the shared expert's three [2048 x 4096] FP8 matrices
  // (8 MiB + 512 B each).
  for (size_t l = 0; l < s.layers.size(); ++l) {
    EXPECT_EQ(s.layers[l].split_bytes, 3u * (33554432 + 2048) + 3u * (8388608 + 512)) << l;
    EXPECT_EQ(s.layers[l].replicated_bytes + s.layers[l].split_bytes, mb.layer_dense[l]) << l;
    EXPECT_EQ(s.layers[l].expert_bytes, mb.expert[l]) << l;
    // One FP4 expert: 3 x 2048 x 4096 weights, one multiply-add each.
    EXPECT_EQ(s.layers[l].expert_macs, 3u * 2048 * 4096) << l;
  }
  EXPECT_EQ(s.embed_row_bytes, 4096u * 2);   // BF16
  EXPECT_EQ(s.head_bytes, mb.head);
  // Bytes a batch-1 token reads (inspect's figure): 11.24 GB.
  double per_token = s.embed_row_bytes + s.head_bytes;
  for (const LayerShape& l : s.layers)
    per_token += l.replicated_bytes + l.split_bytes + 6.0 * l.expert_bytes;
  EXPECT_NEAR(per_token / 1e9, 11.24, 0.01);
}

TEST(CostModel, TensorParallelPlanHoldsHalfTheSplitPart) {
  const ModelConfig m = RealModel();
  auto cluster = LoadClusterConfig((kConfigs / "gb10x2.yaml").string());
  ASSERT_TRUE(cluster.ok()) << cluster.status().ToString();
  auto ep = PlanLayout(m, *cluster, 1, 2, 1);
  auto tp = PlanLayout(m, *cluster, 1, 1, 2);
  ASSERT_TRUE(ep.ok() && tp.ok()) << tp.status().ToString();
  EXPECT_EQ(tp->tensor_parallel, 2);
  EXPECT_EQ(tp->at(0, 1).tp_rank, 1);
  EXPECT_EQ(tp->at(0, 1).expert_begin, 128);
  uint64_t halved = 0;
  for (const LayerShape& l : ComputeModelShape(m).layers) halved += l.split_bytes / 2;
  EXPECT_EQ(tp->at(0, 0).weight_bytes, ep->at(0, 0).weight_bytes - halved);
  // Every tp member keeps every sequence's KV: twice the EP member's 4 of the 8.
  EXPECT_EQ(tp->at(0, 0).kv_bytes, 2 * ep->at(0, 0).kv_bytes);
  EXPECT_EQ(tp->at(0, 0).max_sequences, 8);
  auto bad = PlanLayout(m, *cluster, 1, 1, 3);
  EXPECT_FALSE(bad.ok());
  EXPECT_NE(FormatPlanTable(*tp).find("2-way tensor parallel"), std::string::npos);
}

TEST(CostModel, AutoPicksTheFastestLayout) {
  const ModelConfig m = RealModel();
  auto cluster = LoadClusterConfig((kConfigs / "gb10x2.yaml").string());
  ASSERT_TRUE(cluster.ok()) << cluster.status().ToString();
  const auto all = PlanCandidates(m, *cluster, QueryFor(*cluster));
  ASSERT_EQ(all.size(), 3u);
  EXPECT_EQ(all[0].expert_parallel, 2);
  EXPECT_EQ(all[1].tensor_parallel, 2);
  EXPECT_EQ(all[2].pipeline_stages, 2);
  for (const auto& c : all) ASSERT_TRUE(c.prediction.ok()) << c.prediction.status().ToString();
  // tp2 reads least a token, then ep2 (dense on one box, experts halved), then pp2 (all 11 GB).
  EXPECT_GT(all[1].prediction->tok_s, all[0].prediction->tok_s);
  EXPECT_GT(all[0].prediction->tok_s, all[2].prediction->tok_s);
  // The device shard splits heads too (model/cuda/tp_step.h): auto takes tp2 on the cuda nodes.
  auto t = PlanShards(m, *cluster);
  ASSERT_TRUE(t.ok()) << t.status().ToString();
  EXPECT_EQ(t->tensor_parallel, 2);
  EXPECT_EQ(t->expert_parallel, 1);
  // A fixed tensor_parallel on cuda nodes is planned as written.
  ClusterConfig fixed = *cluster;
  fixed.parallel.automatic = false;
  fixed.parallel.pipeline_stages = 1;
  fixed.parallel.tensor_parallel = 2;
  auto tp2 = PlanShards(m, fixed);
  ASSERT_TRUE(tp2.ok()) << tp2.status().ToString();
  EXPECT_EQ(tp2->tensor_parallel, 2);
  // A slow network (2 ms a message) makes EP's 3 exchanges a layer dearer than one hop: pp2.
  ClusterConfig slow = *cluster;
  for (auto& n : slow.nodes) n.profile.link_latency_us = 2000;
  auto q = PlanShards(m, slow);
  ASSERT_TRUE(q.ok());
  EXPECT_EQ(q->pipeline_stages, 2);
}

TEST(CostModel, CpuProfilesAreProbedAndOverridesKept) {
  ClusterConfig cl = ToyCluster(3);
  cl.nodes[0].profile = *BuiltinHardwareProfile("cpu");
  cl.nodes[1].profile = *BuiltinHardwareProfile("cpu");
  cl.nodes[1].profile.mem_bw_gbps = 12.5;   // as a YAML override sets it
  cl.nodes[2].profile = *BuiltinHardwareProfile("gb10");
  const ClusterConfig probed = WithProbedProfiles(cl);
  EXPECT_TRUE(probed.nodes[0].profile.probed);
  EXPECT_GT(probed.nodes[0].profile.mem_bw_gbps, 0);
  EXPECT_GT(probed.nodes[0].profile.compute_tflops, 0);
  EXPECT_EQ(probed.nodes[1].profile.mem_bw_gbps, 12.5);
  EXPECT_EQ(probed.nodes[1].profile.compute_tflops, probed.nodes[0].profile.compute_tflops);
  EXPECT_FALSE(probed.nodes[2].profile.probed);
  EXPECT_EQ(probed.nodes[2].profile.mem_bw_gbps, 270);
  // The probe runs once: a second call gives the same figure.
  EXPECT_EQ(WithProbedProfiles(cl).nodes[0].profile.mem_bw_gbps,
            probed.nodes[0].profile.mem_bw_gbps);
}

}  // namespace
}  // namespace fm
