// A cluster whose nodes say `device: cuda:0`: the worker runs its shard on the GPU
// (model/cuda/shard_model.h). With a GPU the cluster serves; without one, LoadShard fails
// naming the device, health says degraded and Generate is UNAVAILABLE (nothing hangs). Also the
// NCCL stage link (transport nccl between stages), tensor and expert parallel on cuda workers and
// the device decode bench.
#include <gtest/gtest.h>

#include <chrono>
#include <cstdlib>
#include <string>
#include <thread>
#include <vector>

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
    // Every stage ran 3 + 7 rows on its device, copying X in and out each step.
    const flashmesh::v1::ClusterStatusResponse status = Status(stub.get());
    for (const auto& n : status.nodes()) {
      EXPECT_EQ(n.device_tokens(), 10u) << n.name();
      EXPECT_GT(n.host_to_device_bytes(), 0u) << n.name();
      EXPECT_GT(n.device_to_host_bytes(), 0u) << n.name();
    }
    return;
  }
#if FM_TEST_CUDA
  const std::string why = "device cuda:0: cuda:0: this host has 0 CUDA device(s)";
#else
  const std::string why = "built without CUDA";
#endif
  const std::string error = NodeErrorContaining(cluster.api(), why, 60s);
  EXPECT_NE(error.find(why), std::string::npos) << error << cluster.Logs();
  std::string out;
  EXPECT_EQ(RunFlashmesh({"health", "--server", cluster.api()}, &out, 5s), 1) << out;  // degraded
  auto stub = Connect(cluster.api());
  Generation g = Generate(stub.get(), TokensRequest({5, 6, 7}, 4));
  EXPECT_EQ(g.status.error_code(), grpc::StatusCode::UNAVAILABLE) << g.status.error_message();
}

// A cluster of `spec` whose workers all run on cuda:0 (TCP between them): with a GPU it equals
// one cuda:0 worker; without one a worker's load fails naming the device.
void ExpectCudaClusterEqualsOneCudaWorkerOrSaysWhy(ClusterSpec spec) {
  spec.device = "cuda:0";
  Cluster cluster(spec);
  cluster.StartAll();
  if (Gpus() > 0) {
    ExpectEqualsOneCudaWorker(cluster);
    return;
  }
#if FM_TEST_CUDA
  const std::string why = "device cuda:0: cuda:0: this host has 0 CUDA device(s)";
#else
  const std::string why = "built without CUDA";
#endif
  const std::string error = NodeErrorContaining(cluster.api(), why, 60s);
  EXPECT_NE(error.find(why), std::string::npos) << error << cluster.Logs();
}

// tensor_parallel 2 on cuda workers: each member uploads its share and gathers the rest
// (docs/gpu.md "Tensor parallel on the device").
TEST(DeviceShard, TensorParallelCudaWorkersEqualOneCudaWorkerOrSayWhy) {
  ClusterSpec spec;
  spec.stages = 1;
  spec.tensor_parallel = 2;
  ExpectCudaClusterEqualsOneCudaWorkerOrSaysWhy(spec);
}

// expert_parallel 2 on cuda workers, one stage and two: each member's experts run on its GPU
// (DeviceExpertRunner), never on the CPU (docs/gpu.md "Expert parallel on the device").
TEST(DeviceShard, ExpertParallelCudaWorkersEqualOneCudaWorkerOrSayWhy) {
  ClusterSpec spec;
  spec.stages = 1;
  spec.expert_parallel = 2;
  ExpectCudaClusterEqualsOneCudaWorkerOrSaysWhy(spec);
}

TEST(DeviceShard, TwoStagesOfExpertParallelCudaWorkersEqualOneCudaWorkerOrSayWhy) {
  ClusterSpec spec;
  spec.stages = 2;
  spec.expert_parallel = 2;
  ExpectCudaClusterEqualsOneCudaWorkerOrSaysWhy(spec);
}

// transport nccl with two stages: the hop is a two-rank NCCL link between the stages' GPUs. With
// two GPUs the pipeline equals one worker holding every layer on cuda:0 token for token and
// logprob for logprob (the same kernels per layer; the manifold crosses the link as exact f32);
// without a GPU the first stage's load fails naming the stage transport and the device, and
// health says degraded. One GPU cannot hold both ranks (NCCL: one rank per GPU): skipped.
TEST(DeviceShard, NcclStageLinkEqualsOneGpuWorkerOrSaysWhyItCannotLoad) {
  const int gpus = Gpus();
  if (gpus == 1) GTEST_SKIP() << "one GPU: an NCCL stage link needs a GPU per stage";
  ClusterSpec spec;
  spec.stages = 2;
  spec.transport = "nccl";
  spec.gpus = gpus;
  Cluster cluster(spec);
  cluster.StartAll();
  if (gpus >= 2) {
    ExpectEqualsOneCudaWorker(cluster);
    return;
  }
#if FM_TEST_NCCL
  const std::string error = NodeErrorContaining(cluster.api(), "shard.stage_transport nccl", 60s);
  EXPECT_NE(error.find("shard.stage_transport nccl"), std::string::npos) << error << cluster.Logs();
  EXPECT_NE(error.find("NCCL stage link: cuda:"), std::string::npos) << error;
  EXPECT_NE(error.find("but this host has 0 CUDA device(s)"), std::string::npos) << error;
#else
  const std::string error = NodeErrorContaining(cluster.api(), "built without NCCL", 60s);
  EXPECT_NE(error.find("built without NCCL"), std::string::npos) << error << cluster.Logs();
#endif
  std::string out;
  EXPECT_EQ(RunFlashmesh({"health", "--server", cluster.api()}, &out, 5s), 1) << out;  // degraded
}

// The device decode bench: with a GPU it reports the JSON keys (graph, eager, the tensor-core
// weight core, launch overlap); without one it fails naming the device; --eager, --weight-core tc
// or --launch-overlap alone, and a weight core that does not exist, are usage errors naming the
// flag.
TEST(DeviceShard, BenchDecodeOnADeviceRunsOrSaysWhy) {
  std::string out;
  EXPECT_EQ(RunFlashmesh({"bench", "decode", "--model", SmallModel(), "--eager"}, &out), 2);
  EXPECT_NE(out.find("--eager: only with --device cuda:N"), std::string::npos) << out;
  EXPECT_EQ(RunFlashmesh({"bench", "decode", "--model", SmallModel(), "--weight-core", "tc"}, &out), 2);
  EXPECT_NE(out.find("--weight-core tc: only with --device cuda:N"), std::string::npos) << out;
  EXPECT_EQ(RunFlashmesh({"bench", "decode", "--model", SmallModel(), "--launch-overlap"}, &out), 2);
  EXPECT_NE(out.find("--launch-overlap: only with --device cuda:N"), std::string::npos) << out;
  EXPECT_EQ(RunFlashmesh({"bench", "decode", "--model", SmallModel(), "--device", "cuda:0",
                          "--weight-core", "mma"}, &out), 2);
  EXPECT_NE(out.find("--weight-core: 'mma' (want fma or tc)"), std::string::npos) << out;
  const std::vector<std::vector<std::string>> modes = {
      {"--json"}, {"--eager"}, {"--weight-core", "tc"}, {"--launch-overlap"}};
  for (const auto& mode : modes) {
    std::vector<std::string> args = {"bench", "decode", "--model", SmallModel(), "--device", "cuda:0",
                                     "--context", "8", "--tokens", "4", "--streams", "3", "--json"};
    args.insert(args.end(), mode.begin(), mode.end());
    const int rc = RunFlashmesh(args, &out, 120s);
    if (Gpus() > 0) {
      EXPECT_EQ(rc, 0) << out;
      EXPECT_NE(out.find("\"tok_per_s\""), std::string::npos) << out;
      EXPECT_NE(out.find("\"streams\": 3, \"streams_tok_per_s\""), std::string::npos) << out;
      EXPECT_NE(out.find(std::string("\"cuda_graph\": ") + (mode[0] == "--eager" ? "false" : "true")),
                std::string::npos)
          << out;
      EXPECT_NE(out.find(std::string("\"weight_core\": \"") + (mode.size() == 2 ? "tc" : "fma")),
                std::string::npos)
          << out;
      EXPECT_NE(out.find(std::string("\"launch_overlap\": ") +
                         (mode[0] == "--launch-overlap" ? "true" : "false")),
                std::string::npos)
          << out;
      EXPECT_NE(out.find("\"h2d_bytes_per_token\": "), std::string::npos) << out;
      EXPECT_NE(out.find("\"d2h_bytes_per_token\": "), std::string::npos) << out;
    } else {
      EXPECT_EQ(rc, 1) << out;
      EXPECT_NE(out.find("cuda:0"), std::string::npos) << out;
    }
  }
}

// Streams on the CPU: 3 sequences decode as one batch, each step picks a token for each, and
// the JSON counts all of them (and predicts no full model); --streams 0 is a usage error naming the flag.
TEST(BenchDecode, StreamsDecodeTogetherOnTheCpu) {
  std::string out;
  ASSERT_EQ(RunFlashmesh({"bench", "decode", "--model", SmallModel(), "--context", "4", "--tokens",
                          "3", "--streams", "3", "--threads", "1", "--json"},
                         &out, 120s),
            0)
      << out;
  EXPECT_NE(out.find("\"streams\": 3,"), std::string::npos) << out;
  // A step of 3 rows is not one stream's token time: no full-model prediction from it.
  EXPECT_EQ(out.find("full_model_ms_per_token"), std::string::npos) << out;
  EXPECT_EQ(RunFlashmesh({"bench", "decode", "--model", SmallModel(), "--streams", "0"}, &out), 2);
  EXPECT_NE(out.find("--streams: '0' is not an integer >= 1"), std::string::npos) << out;
}

// One stream on the CPU: the JSON predicts the full model from the greedy head and reports the
// head with a serving request's richer pick (top logprobs, penalties, min-p) beside it.
TEST(BenchDecode, OneStreamTimesTheGreedyAndTheRichHead) {
  std::string out;
  ASSERT_EQ(RunFlashmesh({"bench", "decode", "--model", SmallModel(), "--context", "4", "--tokens",
                          "3", "--threads", "1", "--json"},
                         &out, 120s),
            0)
      << out;
  EXPECT_NE(out.find("\"full_model_ms_per_token\": "), std::string::npos) << out;
  for (const std::string key : {"\"head_ms\": ", "\"head_rich_ms\": "}) {
    const size_t at = out.find(key);
    ASSERT_NE(at, std::string::npos) << key << " in " << out;
    EXPECT_GT(std::strtod(out.c_str() + at + key.size(), nullptr), 0.0) << key << " in " << out;
  }
}

}  // namespace
}  // namespace fm::it
