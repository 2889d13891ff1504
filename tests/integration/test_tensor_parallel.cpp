// Tensor (head) parallelism on real worker processes: pp1 x tp2 and pp2 x tp2 produce the
// single process's tokens and logprobs bit for bit for 32 concurrent streams, greedy and
// seeded, with prompts longer than the sliding window (so the compressed and indexed layers
// run), whole or (pp2 x tp2) in chunks of 16 pipelined over the stages; a killed member ends
// its stage's requests with UNAVAILABLE naming it within the heartbeat timeout, and after a
// restart the cluster serves again without a coordinator restart.
#include <gtest/gtest.h>
#include <signal.h>

#include <nlohmann/json.hpp>
#include <thread>

#include "tests/integration/cluster_fixture.h"

namespace fm::it {
namespace {

using namespace std::chrono_literals;

constexpr int kNewTokens = 6;
constexpr int kStreams = 32;

// The small preset's window is 32 tokens: prompts of 36 to 84.
flashmesh::v1::GenerateRequest Request(int i) {
  std::vector<int32_t> prompt;
  for (int k = 0; k < 36 + (i * 7) % 49; ++k) prompt.push_back(20 + (i * 41 + k * 7) % 230);
  auto req = TokensRequest(prompt, kNewTokens);
  if (i % 2) {   // seeded sampling on odd requests
    auto* s = req.mutable_sampling();
    s->set_greedy(false);
    s->set_temperature(0.9f);
    s->set_top_p(0.95f);
    s->set_seed(700 + i);
    s->set_has_seed(true);
  }
  return req;
}

void ExpectTpClusterEqualsSingle(int stages, int tp, int step_tokens) {
  ClusterSpec spec;
  spec.stages = stages;
  spec.tensor_parallel = tp;
  spec.max_batch = kStreams;
  spec.max_step_tokens = step_tokens;
  spec.http = true;   // n choices over HTTP fork from one prefill on every member
  std::vector<flashmesh::v1::GenerateRequest> requests;
  for (int i = 0; i < kStreams; ++i) requests.push_back(Request(i));
  flashmesh::v1::ClusterStatusResponse status;
  ExpectClusterEqualsSingle(spec, requests, kNewTokens, &status);
  if (::testing::Test::HasFatalFailure()) return;
  ASSERT_EQ(status.nodes_size(), stages * tp);
  EXPECT_EQ(status.tensor_parallel(), tp);
  EXPECT_EQ(status.pipeline_stages(), stages);
  for (int i = 0; i < status.nodes_size(); ++i) {
    const auto& n = status.nodes(i);
    EXPECT_EQ(n.stage(), i / tp) << n.name();
    // Each member holds its share of the routed experts, contiguous in rank order.
    EXPECT_LT(n.expert_begin(), n.expert_end()) << n.name();
    if (i % tp > 0) {
      EXPECT_EQ(n.expert_begin(), status.nodes(i - 1).expert_end()) << n.name();
    }
    EXPECT_GT(n.ep_bytes_sent(), 0u) << n.name() << ": never gathered with its group";
    EXPECT_EQ(n.kv_bytes(), 0u) << n.name() << ": finished sequences are freed";
  }
}

TEST(TensorParallel, OneStageByTwoMembersEqualsSingleProcess) { ExpectTpClusterEqualsSingle(1, 2, 2048); }
TEST(TensorParallel, TwoStagesByTwoMembersEqualSingleProcess) { ExpectTpClusterEqualsSingle(2, 2, 16); }

TEST(TensorParallel, KilledMemberEndsTheStagesRequestsUnavailableAndRestartRecovers) {
  ClusterSpec spec;
  spec.stages = 2;
  spec.tensor_parallel = 2;
  // w1: stage 0, member 1 (it computes half of every head of its layers for every sequence).
  ExpectKilledMemberFailsFastAndRestartRecovers(spec, 1, Request(2), kNewTokens);
}

// bench cluster on pp1 x tp2: tokens equal, decode_ratio reported, and the data-plane bytes
// per token exactly as predicted (the all-gathers' payloads and every frame's header and tag).
TEST(TensorParallel, BenchClusterReportsRatioAndTheExactGatherBytes) {
  ClusterSpec spec;   // only its YAML: bench cluster starts the processes itself
  spec.stages = 1;
  spec.tensor_parallel = 2;
  Cluster cluster(spec);
  nlohmann::json j;
  RunBenchCluster(cluster, &j);
  if (HasFatalFailure()) return;
  EXPECT_EQ(j.at("tensor_parallel").get<int>(), 2);
  EXPECT_TRUE(j.at("tokens_match").get<bool>());
  const double single = j.at("single").at("decode_tok_s").get<double>();
  const double tp = j.at("cluster").at("decode_tok_s").get<double>();
  EXPECT_GT(tp, 0);
  EXPECT_DOUBLE_EQ(j.at("decode_ratio").get<double>(), tp / single);
  const auto& predicted = j.at("predicted").at("cluster");
  const double wire = j.at("cluster").at("wire_bytes_per_token").get<double>();
  EXPECT_GT(wire, 0);
  EXPECT_DOUBLE_EQ(wire, predicted.at("wire_bytes_per_token").get<double>());
  EXPECT_DOUBLE_EQ(j.at("cluster").at("ep_bytes_per_token").get<double>(),
                   predicted.at("ep_bytes_per_token").get<double>());
}

}  // namespace
}  // namespace fm::it
