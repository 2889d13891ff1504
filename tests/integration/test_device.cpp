// A cluster whose nodes say `device: cuda:0`: the worker runs its shard on the GPU
// (model/cuda/shard_model.h). With a GPU the cluster serves; without one, LoadShard fails
// naming the device, health says degraded and Generate is UNAVAILABLE (nothing hangs).
#include <gtest/gtest.h>

#include <chrono>
#include <string>
#include <thread>

#include "tests/integration/cluster_fixture.h"

namespace fm::it {
namespace {

using namespace std::chrono_literals;

TEST(DeviceShard, CudaNodeServesOnAGpuOrSaysWhyItCannotLoad) {
  ClusterSpec spec;
  spec.stages = 2;
  spec.device = "cuda:0";
  Cluster cluster(spec);
  cluster.StartAll();
  if (Gpus() > 0) {
    ASSERT_TRUE(WaitHealthy(cluster.api(), 120s)) << cluster.Logs();
    auto stub = Connect(cluster.api());
    Generation g = Generate(stub.get(), TokensRequest({5, 6, 7}, 8));
    ASSERT_TRUE(g.status.ok()) << g.status.error_message() << cluster.Logs();
    EXPECT_EQ(g.ids.size(), 8u);
    return;
  }
  std::string error;
  const auto until = std::chrono::steady_clock::now() + 60s;
  while (error.empty() && std::chrono::steady_clock::now() < until) {
    std::this_thread::sleep_for(200ms);
    auto stub = Connect(cluster.api());
    const auto status = Status(stub.get());
    for (const auto& n : status.nodes())
      if (n.state() == flashmesh::v1::NODE_STATE_DOWN && !n.error().empty()) error = n.error();
  }
#if FM_TEST_CUDA
  EXPECT_NE(error.find("device cuda:0: cuda:0: this host has 0 CUDA device(s)"), std::string::npos)
      << error << cluster.Logs();
#else
  EXPECT_NE(error.find("built without CUDA"), std::string::npos) << error << cluster.Logs();
#endif
  std::string out;
  EXPECT_EQ(RunFlashmesh({"health", "--server", cluster.api()}, &out, 5s), 1) << out;  // degraded
  auto stub = Connect(cluster.api());
  Generation g = Generate(stub.get(), TokensRequest({5, 6, 7}, 4));
  EXPECT_EQ(g.status.error_code(), grpc::StatusCode::UNAVAILABLE) << g.status.error_message();
}

// The device decode bench: with a GPU it reports the JSON keys (graph and eager); without one
// it fails naming the device; --eager alone is a usage error.
TEST(DeviceShard, BenchDecodeOnADeviceRunsOrSaysWhy) {
  std::string out;
  EXPECT_EQ(RunFlashmesh({"bench", "decode", "--model", SmallModel(), "--eager"}, &out), 2);
  EXPECT_NE(out.find("--eager: only with --device cuda:N"), std::string::npos) << out;
  for (const char* mode : {"--json", "--eager"}) {
    const int rc = RunFlashmesh({"bench", "decode", "--model", SmallModel(), "--device", "cuda:0",
                                 "--context", "8", "--tokens", "4", "--json", mode},
                                &out, 120s);
    if (Gpus() > 0) {
      EXPECT_EQ(rc, 0) << out;
      EXPECT_NE(out.find("\"tok_per_s\""), std::string::npos) << out;
      EXPECT_NE(out.find(std::string("\"cuda_graph\": ") + (mode[2] == 'e' ? "false" : "true")),
                std::string::npos)
          << out;
    } else {
      EXPECT_EQ(rc, 1) << out;
      EXPECT_NE(out.find("cuda:0"), std::string::npos) << out;
    }
  }
}

}  // namespace
}  // namespace fm::it
