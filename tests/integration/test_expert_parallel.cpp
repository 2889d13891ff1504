// Expert parallelism on real worker processes: pp2 x ep2 (4 workers) and pp1 x ep3 produce the
// single process's tokens and logprobs bit for bit, greedy and seeded, with sequences spread
// over the members (data-parallel attention) and every member's experts used by the others;
// a killed member ends its group's requests with UNAVAILABLE naming it, and after a restart
// the cluster serves again. Prompts longer than kEpStepTokens go in chunks, pipelined over the
// stages (the single process prefills them whole: on the CPU the bits are the same).
#include <gtest/gtest.h>
#include <signal.h>

#include <thread>

#include "tests/integration/cluster_fixture.h"

namespace fm::it {
namespace {

using namespace std::chrono_literals;

constexpr int kEpNewTokens = 6;
constexpr int kEpStepTokens = 8;   // limits.max_step_tokens of the EP clusters


flashmesh::v1::GenerateRequest Request(int i) {
  std::vector<int32_t> prompt;
  const int length = i >= 4 ? 3 * kEpStepTokens + i : 3 + i % 4;   // 4 and 5: in 4 chunks
  for (int k = 0; k < length; ++k) prompt.push_back(20 + (i * 41 + k * 7) % 230);
  auto req = TokensRequest(prompt, kEpNewTokens);
  if (i % 2) {   // seeded sampling on odd requests
    auto* s = req.mutable_sampling();
    s->set_greedy(false);
    s->set_temperature(0.9f);
    s->set_top_p(0.95f);
    s->set_seed(500 + i);
    s->set_has_seed(true);
  }
  return req;
}

void ExpectEpClusterEqualsSingle(int stages, int ep, const std::string& transport = "tcp") {
  ClusterSpec spec;
  spec.stages = stages;
  spec.expert_parallel = ep;
  spec.transport = transport;
  spec.gpus = Gpus();
  spec.max_step_tokens = kEpStepTokens;
  spec.http = true;   // n choices over HTTP too, forked from a prefix on each member
  std::vector<flashmesh::v1::GenerateRequest> requests;
  for (int i = 0; i < 6; ++i) requests.push_back(Request(i));
  flashmesh::v1::ClusterStatusResponse status;
  ExpectClusterEqualsSingle(spec, requests, kEpNewTokens, &status);
  if (::testing::Test::HasFatalFailure()) return;
  EXPECT_EQ(status.expert_parallel(), ep);
  ASSERT_EQ(status.nodes_size(), stages * ep);
  for (int i = 0; i < status.nodes_size(); ++i) {
    const auto& n = status.nodes(i);
    EXPECT_EQ(n.stage(), i / ep) << n.name();
    EXPECT_LT(n.expert_begin(), n.expert_end()) << n.name();
    if (i % ep > 0) {
      EXPECT_EQ(n.expert_begin(), status.nodes(i - 1).expert_end()) << n.name();
    }
    EXPECT_GT(n.ep_bytes_sent(), 0u) << n.name() << ": never exchanged with its group";
    EXPECT_FALSE(n.top_experts().empty()) << n.name() << ": none of its rows were routed";
    EXPECT_LE(n.top_experts_size(), 5);
    EXPECT_EQ(n.kv_bytes(), 0u) << n.name() << ": finished sequences are freed";
  }
}

TEST(ExpertParallel, TwoStagesByTwoMembersEqualSingleProcess) { ExpectEpClusterEqualsSingle(2, 2); }
TEST(ExpertParallel, OneStageByThreeMembersEqualSingleProcess) { ExpectEpClusterEqualsSingle(1, 3); }

// transport nccl: the EP all-to-all goes through NCCL on each member's GPU. With a GPU per
// member the cluster equals one cuda worker (the device's kernels, not the CPU's: within 1e-3 of
// the single process, not its bits); without a GPU the group's load fails with an
// error naming the transport and the device (NCCL puts one rank per GPU, so one GPU cannot
// hold a group of two).
TEST(ExpertParallel, NcclTransportEqualsOneCudaWorkerOrSaysWhyItCannotLoad) {
  const int gpus = Gpus();
  if (gpus == 1) GTEST_SKIP() << "one GPU: NCCL needs a GPU per member of the EP group";
  ClusterSpec spec;
  spec.stages = 1;
  spec.expert_parallel = 2;
  spec.transport = "nccl";
  spec.gpus = gpus;
  Cluster cluster(spec);
  cluster.StartAll();
  if (gpus >= 2) return ExpectEqualsOneCudaWorker(cluster);
  const std::string error = NodeErrorContaining(cluster.api(), "shard.ep_transport nccl", 60s);
  EXPECT_NE(error.find("shard.ep_transport nccl"), std::string::npos) << error << cluster.Logs();
#if FM_TEST_NCCL
  EXPECT_NE(error.find("cuda:0 but this host has 0 CUDA device(s)"), std::string::npos) << error;
#else
  EXPECT_NE(error.find("built without NCCL"), std::string::npos) << error;
#endif
  std::string out;
  EXPECT_EQ(RunFlashmesh({"health", "--server", cluster.api()}, &out, 5s), 1) << out;   // degraded
  EXPECT_EQ(out.rfind("degraded: node w0 (", 0), 0u) << out;
  EXPECT_NE(out.find(") is down: LoadShard failed"), std::string::npos) << out;
  auto stub = Connect(cluster.api());
  Generation g = Generate(stub.get(), Request(0));
  EXPECT_EQ(g.status.error_code(), grpc::StatusCode::UNAVAILABLE) << g.status.error_message();
}

// A worker's exchange counters run from its process's start, as its data-plane counters do:
// a new coordinator (a failover) reloads every shard, and that takes none of them back
// (Prometheus reads a counter that drops as a restart, and the increments since its last
// scrape are lost).
TEST(ExpertParallel, ExchangeCountersHoldAcrossACoordinatorFailover) {
  ClusterSpec spec;
  spec.stages = 1;
  spec.expert_parallel = 2;
  spec.max_step_tokens = kEpStepTokens;
  Cluster cluster(spec);
  cluster.StartAll();
  ASSERT_TRUE(WaitHealthy(cluster.api(), 60s)) << cluster.Logs();
  auto stub = Connect(cluster.api());
  ASSERT_TRUE(Generate(stub.get(), Request(2)).status.ok()) << cluster.Logs();
  const flashmesh::v1::ClusterStatusResponse before = Status(stub.get());
  ASSERT_EQ(before.nodes_size(), 2);
  cluster.coordinator()->Signal(SIGKILL);
  cluster.coordinator()->Wait(10s);
  std::string api_b;
  const std::unique_ptr<Process> b = cluster.StartNextCoordinator(&api_b);
  ASSERT_TRUE(WaitHealthy(api_b, 60s)) << b->Log() << cluster.Logs();
  auto stub_b = Connect(api_b);
  const flashmesh::v1::ClusterStatusResponse after = Status(stub_b.get());
  ASSERT_EQ(after.nodes_size(), 2);
  for (int i = 0; i < 2; ++i) {
    EXPECT_GT(before.nodes(i).ep_bytes_sent(), 0u) << before.nodes(i).name();
    EXPECT_EQ(after.nodes(i).ep_bytes_sent(), before.nodes(i).ep_bytes_sent()) << after.nodes(i).name();
    EXPECT_EQ(after.nodes(i).top_experts_size(), before.nodes(i).top_experts_size()) << after.nodes(i).name();
  }
}

TEST(ExpertParallel, KilledMemberEndsTheGroupsRequestsUnavailableAndRestartRecovers) {
  ClusterSpec spec;
  spec.stages = 2;
  spec.expert_parallel = 2;
  // The only sequence lives on member 0; w1 (stage 0, member 1) only serves its experts.
  ExpectKilledMemberFailsFastAndRestartRecovers(spec, 1, Request(2), kEpNewTokens);
}

}  // namespace
}  // namespace fm::it
