// Planner: balance, contiguity, EP ranges, memory refusal, and the real model on 2 and 4 GB10s
// (config.json from configs/models/deepseek-v4-flash; no weights).
#include <cmath>
#include <filesystem>
#include <map>
#include <vector>
#include <string>

#include <gtest/gtest.h>
#include <nlohmann/json.hpp>

#include "config/cluster_config.h"
#include "coordinator/planner.h"
#include "model/config.h"
#include "model/tensor_schema.h"

namespace fm {
namespace {

const std::filesystem::path kConfigs = std::filesystem::path(FM_SOURCE_DIR) / "configs";

ModelConfig RealModel() {
  auto m = LoadModelConfig((kConfigs / "models/deepseek-v4-flash/config.json").string());
  EXPECT_TRUE(m.ok()) << m.status().ToString();
  return *m;
}

// A real-shaped model shrunk in width so that byte totals stay small but layers differ
// (hash layers, ratio 0 / 4 / 128), as in the official layout.
ModelConfig SmallModel(int64_t layers = 12, int64_t experts = 16) {
  ModelConfig m = RealModel();
  m.vocab_size = 1024;
  m.hidden_size = 256;
  m.num_hidden_layers = layers;
  m.num_attention_heads = 8;
  m.head_dim = 128;
  m.q_lora_rank = 128;
  m.o_lora_rank = 128;
  m.o_groups = 2;
  m.n_routed_experts = experts;
  m.moe_intermediate_size = 128;
  m.index_n_heads = 4;
  m.index_head_dim = 64;
  m.compress_ratios.assign(layers + 1, 0);
  for (int64_t l = 2; l < layers; ++l) m.compress_ratios[l] = l % 2 == 0 ? 4 : 128;
  return m;
}

ClusterConfig Cluster(int nodes, int stages, int ep, double memory_gib) {
  ClusterConfig c;
  c.parallel.automatic = stages == 0;
  c.parallel.pipeline_stages = stages;
  c.parallel.expert_parallel = ep;
  for (int i = 0; i < nodes; ++i) {
    NodeConfig n;
    n.name = "n" + std::to_string(i);
    n.memory_gib = memory_gib;
    c.nodes.push_back(n);
  }
  c.limits.max_batch = 4;
  c.limits.max_context = 1024;
  return c;
}

// Every plan: stages tile [0, L) contiguously, each non-empty; EP ranges tile [0, E).
void ExpectWellFormed(const Plan& p, const ModelConfig& m) {
  ASSERT_EQ(p.workers.size(), static_cast<size_t>(p.pipeline_stages * p.group()));
  int64_t next = 0;
  for (int s = 0; s < p.pipeline_stages; ++s) {
    const WorkerPlan& first = p.at(s, 0);
    EXPECT_EQ(first.layer_begin, next) << "stage " << s;
    EXPECT_LT(first.layer_begin, first.layer_end) << "stage " << s;
    next = first.layer_end;
    int64_t expert = 0;
    for (int r = 0; r < p.group(); ++r) {
      const WorkerPlan& w = p.at(s, r);
      EXPECT_EQ(w.node_index, s * p.group() + r);
      EXPECT_EQ(w.layer_begin, first.layer_begin);
      EXPECT_EQ(w.layer_end, first.layer_end);
      EXPECT_EQ(w.expert_begin, expert);
      expert = w.expert_end;
      EXPECT_EQ(w.embed, s == 0);
      EXPECT_EQ(w.head, s == p.pipeline_stages - 1);
      EXPECT_LE(w.need_gib(), w.memory_gib);
    }
    EXPECT_EQ(expert, m.n_routed_experts);
  }
  EXPECT_EQ(next, m.num_hidden_layers);
}

TEST(Planner, SingleWorkerHoldsEverything) {
  const ModelConfig m = SmallModel();
  auto p = PlanShards(m, Cluster(1, 1, 1, 100));
  ASSERT_TRUE(p.ok()) << p.status().ToString();
  ExpectWellFormed(*p, m);
  const ModelBytes mb = ComputeModelBytes(m);
  // All of it, once, but the MTP block: workers do not load it (model/checkpoint.h kServeMtp).
  uint64_t mtp = 0;
  for (int64_t l = m.num_hidden_layers; l < m.num_hidden_layers + m.num_nextn_predict_layers; ++l)
    mtp += mb.layer_total(l, m.n_routed_experts);
  ASSERT_GT(mtp, 0u);
  EXPECT_EQ(p->workers[0].weight_bytes, mb.total - mtp);
  EXPECT_EQ(p->total_weight_bytes, mb.total - mtp);
}

TEST(Planner, StagesAreBalancedAndTheOptimumIsExact) {
  const ModelConfig m = SmallModel(12);
  const ModelBytes mb = ComputeModelBytes(m);
  for (int stages : {2, 3, 4, 6, 12}) {
    ClusterConfig c = Cluster(stages, stages, 1, 100);
    auto p = PlanShards(m, c);
    ASSERT_TRUE(p.ok()) << p.status().ToString();
    ExpectWellFormed(*p, m);
    uint64_t total = 0, largest = 0;
    for (const auto& w : p->workers) {
      total += w.weight_bytes + w.kv_bytes;
      largest = std::max(largest, w.weight_bytes + w.kv_bytes);
    }
    // Brute force over all cut positions for 2 stages: the planner's max equals the optimum.
    if (stages == 2) {
      uint64_t best = ~uint64_t{0};
      for (int64_t cut = 1; cut < m.num_hidden_layers; ++cut) {
        uint64_t a = mb.embed, b = mb.head;
        for (int64_t l = 0; l < m.num_hidden_layers; ++l) {   // no MTP layer: not loaded
          const uint64_t bytes = mb.layer_total(l, m.n_routed_experts) +
                                 4 * KvBytesPerSequence(m, l, 1024);
          (l < cut ? a : b) += bytes;
        }
        best = std::min(best, std::max(a, b));
      }
      EXPECT_EQ(largest, best);
    }
    // No stage carries more than its fair share plus one layer.
    uint64_t biggest_layer = mb.embed + mb.head;
    for (int64_t l = 0; l <= m.num_hidden_layers; ++l)
      biggest_layer = std::max(biggest_layer, mb.layer_total(l, m.n_routed_experts));
    EXPECT_LE(largest, total / stages + 2 * biggest_layer) << stages << " stages";
  }
}

TEST(Planner, ExpertParallelRangesAndDenseOnEveryMember) {
  const ModelConfig m = SmallModel(8, 16);
  const ModelBytes mb = ComputeModelBytes(m);
  auto p = PlanShards(m, Cluster(4, 2, 2, 100));
  ASSERT_TRUE(p.ok()) << p.status().ToString();
  ExpectWellFormed(*p, m);
  EXPECT_EQ(p->at(0, 0).expert_begin, 0);
  EXPECT_EQ(p->at(0, 0).expert_end, 8);
  EXPECT_EQ(p->at(0, 1).expert_begin, 8);
  EXPECT_EQ(p->at(0, 1).expert_end, 16);
  EXPECT_EQ(p->at(1, 1).expert_begin, 8);
  // Members of one stage hold the same bytes: dense parts + half the experts each.
  EXPECT_EQ(p->at(0, 0).weight_bytes, p->at(0, 1).weight_bytes);
  uint64_t expect = mb.embed;
  for (int64_t l = p->at(0, 0).layer_begin; l < p->at(0, 0).layer_end; ++l)
    expect += mb.layer_dense[l] + 8 * mb.expert[l];
  EXPECT_EQ(p->at(0, 0).weight_bytes, expect);
  // Sequences split over the EP group: ceil(4 / 2).
  EXPECT_EQ(p->at(0, 0).max_sequences, 2);

  // Uneven groups: contiguous ranges whose sizes differ by at most one.
  auto three = PlanShards(m, Cluster(3, 1, 3, 100));
  ASSERT_TRUE(three.ok()) << three.status().ToString();
  EXPECT_EQ(three->at(0, 0).expert_end, 5);
  EXPECT_EQ(three->at(0, 1).expert_begin, 5);
  EXPECT_EQ(three->at(0, 1).expert_end, 10);
  EXPECT_EQ(three->at(0, 2).expert_end, 16);
  EXPECT_LT(three->at(0, 0).weight_bytes, three->at(0, 2).weight_bytes);

  auto bad = PlanShards(SmallModel(12, 2), Cluster(3, 1, 3, 100));
  ASSERT_FALSE(bad.ok());
  EXPECT_NE(bad.status().message().find("expert_parallel 3 exceeds n_routed_experts 2"),
            std::string::npos)
      << bad.status().message();
}

TEST(Planner, LayoutErrorsAreNamed) {
  const ModelConfig m = SmallModel(4);
  auto mismatch = PlanShards(m, Cluster(3, 2, 1, 100));
  ASSERT_FALSE(mismatch.ok());
  EXPECT_NE(mismatch.status().message().find("2 workers, but the cluster has 3 nodes"),
            std::string::npos);
  auto too_many = PlanShards(m, Cluster(5, 5, 1, 100));
  ASSERT_FALSE(too_many.ok());
  EXPECT_NE(too_many.status().message().find("exceeds num_hidden_layers 4"), std::string::npos);
  // Tensor parallel 3 divides the heads and groups but not hidden_size 256: the loader would
  // refuse it on every worker, so the planner does.
  ModelConfig odd = SmallModel(4);
  odd.num_attention_heads = 6, odd.o_groups = 3;
  ClusterConfig three = Cluster(3, 1, 1, 100);
  three.parallel.tensor_parallel = 3;
  auto tp3 = PlanShards(odd, three);
  ASSERT_FALSE(tp3.ok());
  EXPECT_NE(tp3.status().message().find("parallel: tensor_parallel 3 does not divide hidden_size 256"),
            std::string::npos) << tp3.status().message();
}

TEST(Planner, RefusesAPlanThatDoesNotFitNamingNodeAndNumbers) {
  const ModelConfig m = RealModel();
  ClusterConfig c = Cluster(1, 1, 1, 121);
  c.nodes[0].name = "spark-a";
  auto p = PlanShards(m, c);
  ASSERT_FALSE(p.ok());
  EXPECT_EQ(p.status().code(), Code::kResourceExhausted);
  const std::string& msg = p.status().message();
  EXPECT_NE(msg.find("node 'spark-a' (stage 0, ep 0, layers [0, 43)): needs "), std::string::npos)
      << msg;
  EXPECT_NE(msg.find("but has 121.0 GiB (memory_gib)"), std::string::npos) << msg;
}

TEST(Planner, ATinyMemoryIsPrintedWithItsDigitsNotAsZero) {
  ClusterConfig c = Cluster(1, 1, 1, 0.001);
  auto p = PlanShards(SmallModel(), c);
  ASSERT_FALSE(p.ok());
  EXPECT_NE(p.status().message().find("but has 0.001 GiB (memory_gib)"), std::string::npos)
      << p.status().message();
}

TEST(Planner, FixedKvPoolReplacesTheComputedKv) {
  const ModelConfig m = SmallModel();
  ClusterConfig c = Cluster(2, 2, 1, 100);
  c.limits.kv_cache_gib = 1.5;
  auto p = PlanShards(m, c);
  ASSERT_TRUE(p.ok()) << p.status().ToString();
  for (const auto& w : p->workers) EXPECT_EQ(w.kv_bytes, uint64_t{3} << 29);
}

// A fixed pool that cannot hold max_batch sequences at max_context (what each worker charges a
// sequence) is refused by name, not left to refuse requests at run time.
TEST(Planner, AFixedKvPoolTooSmallForMaxBatchIsRefused) {
  const ModelConfig m = RealModel();
  ClusterConfig c = Cluster(1, 1, 1, 1000);
  c.limits.max_batch = 8;
  c.limits.max_context = 65536;
  uint64_t per_sequence = 0;
  for (int64_t l = 0; l < m.num_hidden_layers; ++l)   // no MTP layer: not served
    per_sequence += KvBytesPerSequence(m, l, 65536);
  c.limits.kv_cache_gib = 7.5 * per_sequence / double(uint64_t{1} << 30);
  auto p = PlanShards(m, c);
  ASSERT_FALSE(p.ok());
  EXPECT_NE(p.status().message().find("holds 7 sequence(s) of limits.max_context 65536"),
            std::string::npos) << p.status().message();
  EXPECT_NE(p.status().message().find("serves up to 8 (limits.max_batch)"), std::string::npos)
      << p.status().message();
  c.limits.kv_cache_gib = 8.5 * per_sequence / double(uint64_t{1} << 30);
  EXPECT_TRUE(PlanShards(m, c).ok());
}

TEST(Planner, KvBytesFollowTheDecodeState) {
  const ModelConfig m = RealModel();
  const uint64_t ring = 128 * 512 * 4;
  EXPECT_EQ(KvBytesPerSequence(m, 0, 65536), ring);   // window only
  EXPECT_EQ(KvBytesPerSequence(m, 0, 10), 10 * 512 * 4u);
  // Ratio 4: entries D and indexer dI per 4 tokens, plus two windows of pending rows.
  EXPECT_EQ(KvBytesPerSequence(m, 2, 65536),
            ring + 16384 * 512 * 4 + 2 * 4 * 2 * 2 * 512 * 4 + 16384 * 128 * 4 +
                2 * 4 * 2 * 2 * 128 * 4);
  // Ratio 128: one entry per 128 tokens plus one window of pending rows.
  EXPECT_EQ(KvBytesPerSequence(m, 3, 65536), ring + 512 * 512 * 4 + 128 * 2 * 512 * 4);
  EXPECT_EQ(KvBytesPerSequence(m, 43, 65536), ring);  // MTP layer: ratio 0
}

// The real model from config.json alone. Weights: ~149 GB on disk = ~139 GiB.
TEST(Planner, RealModelOnTwoGb10s) {
  const ModelConfig m = RealModel();
  const ModelBytes mb = ComputeModelBytes(m);
  EXPECT_GT(mb.total / 1e9, 140.0);
  EXPECT_LT(mb.total / 1e9, 160.0);
  auto cluster = LoadClusterConfig((kConfigs / "gb10x2.yaml").string());
  ASSERT_TRUE(cluster.ok()) << cluster.status().ToString();
  auto p = PlanShards(m, *cluster);
  ASSERT_TRUE(p.ok()) << p.status().ToString();
  ExpectWellFormed(*p, m);
  // auto: one stage, 2-way tensor parallel (the cost model's fastest; docs/performance.md).
  EXPECT_EQ(p->pipeline_stages, 1);
  EXPECT_EQ(p->tensor_parallel, 2);
  EXPECT_EQ(p->at(0, 1).expert_begin, 128);
  for (const auto& w : p->workers) {
    EXPECT_GT(w.need_gib(), 60.0) << w.node;
    EXPECT_LT(w.need_gib(), 100.0) << w.node;
  }
  // Explicit 2 stages x 1: the layers split near the middle, both fit in 121 GiB.
  ClusterConfig pp = *cluster;
  pp.parallel = {false, 2, 1};
  auto p2 = PlanShards(m, pp);
  ASSERT_TRUE(p2.ok()) << p2.status().ToString();
  ExpectWellFormed(*p2, m);
  EXPECT_GE(p2->at(0, 0).layer_end, 20);
  EXPECT_LE(p2->at(0, 0).layer_end, 23);
  std::printf("%s", FormatPlanTable(*p).c_str());
  std::printf("%s", FormatPlanTable(*p2).c_str());
}

TEST(Planner, RealModelOnFourGb10s) {
  const ModelConfig m = RealModel();
  auto cluster = LoadClusterConfig((kConfigs / "gb10x4.yaml").string());
  ASSERT_TRUE(cluster.ok()) << cluster.status().ToString();
  auto p = PlanShards(m, *cluster);
  ASSERT_TRUE(p.ok()) << p.status().ToString();
  ExpectWellFormed(*p, m);
  EXPECT_EQ(p->expert_parallel, 4);
  EXPECT_EQ(p->at(0, 3).expert_begin, 192);
  EXPECT_EQ(p->at(0, 3).expert_end, 256);
  for (const auto& w : p->workers) EXPECT_LT(w.need_gib(), 60.0) << w.node;
  ClusterConfig pp = *cluster;
  pp.parallel = {false, 4, 1};
  auto p4 = PlanShards(m, pp);
  ASSERT_TRUE(p4.ok()) << p4.status().ToString();
  ExpectWellFormed(*p4, m);
  std::printf("%s", FormatPlanTable(*p).c_str());
  std::printf("%s", FormatPlanTable(*p4).c_str());
  const std::string json = PlanToJson(*p);
  EXPECT_NE(json.find("\"expert_parallel\": 4"), std::string::npos);
  EXPECT_NE(json.find("\"node\": \"spark-d\""), std::string::npos);
}

TEST(Planner, AutoFallsBackToMoreStagesWhenDenseCopiesDoNotFit) {
  // Per-member need with 1 x 2 (all dense + half the experts) vs 2 x 1 (half of everything):
  // pick a memory between the two so that only the pipeline layout fits.
  const ModelConfig m = SmallModel(12, 16);
  auto ep = PlanShards(m, Cluster(2, 1, 2, 100));
  auto pp = PlanShards(m, Cluster(2, 2, 1, 100));
  ASSERT_TRUE(ep.ok() && pp.ok());
  const double ep_need = ep->workers[0].need_gib();
  double pp_need = 0;
  for (const auto& w : pp->workers) pp_need = std::max(pp_need, w.need_gib());
  ASSERT_LT(pp_need, ep_need);
  auto p = PlanShards(m, Cluster(2, 0, 0, (pp_need + ep_need) / 2));
  ASSERT_TRUE(p.ok()) << p.status().ToString();
  EXPECT_EQ(p->pipeline_stages, 2);
  auto none = PlanShards(m, Cluster(2, 0, 0, pp_need / 4));
  ASSERT_FALSE(none.ok());
  EXPECT_NE(none.status().message().find("parallel auto: no layout"), std::string::npos);
  EXPECT_NE(none.status().message().find("pp1 x ep2: node 'n0'"), std::string::npos)
      << none.status().message();
  EXPECT_NE(none.status().message().find("pp1 x tp2: node 'n0'"), std::string::npos)
      << none.status().message();
}

}  // namespace
}  // namespace fm

namespace fm::cli {
int CmdPlan(int argc, char** argv);
}  // namespace fm::cli

namespace fm {
namespace {

int RunPlan(std::vector<std::string> args, std::string* out) {
  std::vector<char*> argv;
  for (auto& a : args) argv.push_back(a.data());
  testing::internal::CaptureStdout();
  testing::internal::CaptureStderr();
  const int rc = cli::CmdPlan(static_cast<int>(argv.size()), argv.data());
  *out = testing::internal::GetCapturedStdout() + testing::internal::GetCapturedStderr();
  return rc;
}

TEST(PlanCommand, PrintsTheTableAndJsonAndNamesErrors) {
  std::string out;
  EXPECT_EQ(RunPlan({"plan", "--config", (kConfigs / "gb10x2.yaml").string()}, &out), 0) << out;
  EXPECT_NE(out.find("spark-b              0   1 [0, 43)    [128, 256)"), std::string::npos)
      << out;
  EXPECT_EQ(RunPlan({"plan", "--config", (kConfigs / "gb10x4.yaml").string(), "--json"}, &out), 0);
  EXPECT_NE(out.find("\"experts\": [\n        192,\n        256\n      ]"), std::string::npos)
      << out;
  // --model overrides the YAML's model directory.
  EXPECT_EQ(RunPlan({"plan", "--config", (kConfigs / "local-1.yaml").string(), "--model",
                     (kConfigs / "models/deepseek-v4-flash").string()},
                    &out),
            1);
  EXPECT_NE(out.find("node 'w0' (stage 0, ep 0, layers [0, 43)): needs"), std::string::npos)
      << out;
  EXPECT_EQ(RunPlan({"plan", "--config", "/nonexistent.yaml"}, &out), 1);
  EXPECT_NE(out.find("/nonexistent.yaml"), std::string::npos);
  EXPECT_EQ(RunPlan({"plan"}, &out), 2);
  EXPECT_EQ(RunPlan({"plan", "--config", "x", "--bogus"}, &out), 2);
}

TEST(PlanCommand, PrintsThePredictionOfEveryLayout) {
  std::string out;
  ASSERT_EQ(RunPlan({"plan", "--config", (kConfigs / "gb10x4.yaml").string()}, &out), 0) << out;
  EXPECT_NE(out.find("profiles: spark-a gb10 (270 GB/s x 0.85, 200 Gb/s, 10 us);"),
            std::string::npos) << out;
  EXPECT_NE(out.find("layout        fits  tok/s b1 tok/s b16   TTFT s"), std::string::npos) << out;
  // gb10x4 fixes 1 x 4 EP; every layout of the 4 nodes is listed with its prediction.
  for (const char* row : {"pp1 x ep4     yes", "pp1 x tp4     yes", "pp2 x ep2     yes",
                          "pp2 x tp2     yes", "pp4 x ep1     yes"})
    EXPECT_NE(out.find(row), std::string::npos) << row << "\n" << out;
  const size_t chosen = out.find("<- chosen");
  ASSERT_NE(chosen, std::string::npos) << out;
  EXPECT_EQ(out.rfind("pp1 x ep4", chosen), out.find("pp1 x ep4")) << out;

  ASSERT_EQ(RunPlan({"plan", "--config", (kConfigs / "gb10x2.yaml").string(), "--json"}, &out), 0);
  const size_t begin = out.find('{');
  ASSERT_NE(begin, std::string::npos) << out;
  auto j = nlohmann::json::parse(out.substr(begin));
  ASSERT_EQ(j.at("candidates").size(), 3u);
  EXPECT_EQ(j.at("query").at("batch").get<int>(), 8);
  EXPECT_EQ(j.at("candidates")[1].at("tensor_parallel").get<int>(), 2);
  // auto chooses the fastest, 1 x tp2 (the second candidate): its prediction is the plan's.
  EXPECT_EQ(j.at("tensor_parallel").get<int>(), 2);
  EXPECT_EQ(j.at("prediction"), j.at("candidates")[1].at("prediction"));
  EXPECT_GT(j.at("prediction").at("decode_tok_s").get<double>(),
            j.at("candidates")[0].at("prediction").at("decode_tok_s").get<double>());
}

// --prompt sets the TTFT column's prompt. A 32768-token prompt is 16 chunks of 2048: one
// process (here one stage of 4 EP members) runs them one after another, ~16x one chunk's time;
// 4 stages overlap them, ~(4 + 15) / 4 of one chunk's pass.
TEST(PlanCommand, PromptSetsTheTtftPromptAndPipelinesOverlapItsChunks) {
  auto ttft = [](const std::string& prompt) {
    std::string out;
    EXPECT_EQ(RunPlan({"plan", "--config", (kConfigs / "gb10x4.yaml").string(), "--prompt", prompt,
                       "--json"}, &out), 0) << out;
    auto j = nlohmann::json::parse(out.substr(out.find('{')));
    EXPECT_EQ(j.at("query").at("prompt").get<int64_t>(), std::stoll(prompt));
    EXPECT_EQ(j.at("query").at("step_tokens").get<int>(), 2048);
    std::map<std::string, double> by_layout;
    for (const auto& c : j.at("candidates"))
      by_layout["pp" + std::to_string(c.at("pipeline_stages").get<int>()) + "ep" +
                std::to_string(c.at("expert_parallel").get<int>()) + "tp" +
                std::to_string(c.at("tensor_parallel").get<int>())] =
          c.at("prediction").at("ttft_s").get<double>();
    return by_layout;
  };
  auto one_chunk = ttft("2048"), sixteen = ttft("32768");
  const double pp1 = sixteen.at("pp1ep4tp1") / one_chunk.at("pp1ep4tp1");
  const double pp4 = sixteen.at("pp4ep1tp1") / one_chunk.at("pp4ep1tp1");
  EXPECT_GT(pp1, 15) << pp1;
  EXPECT_LT(pp4, 6) << pp4;
  EXPECT_GT(pp4, 4) << pp4;
  for (const char* bad : {"200000", "0", "-5", "abc"}) {
    std::string out;
    EXPECT_EQ(RunPlan({"plan", "--config", (kConfigs / "gb10x4.yaml").string(), "--prompt", bad},
                      &out), 2) << bad;
    EXPECT_NE(out.find("--prompt: '" + std::string(bad) + "'"), std::string::npos) << out;
  }
}

}  // namespace
}  // namespace fm
