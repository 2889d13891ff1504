// The stage-to-stage data plane on real worker processes: exactly one framed, raw activation
// per micro-batch and hop (64-byte header + rows x hc*H values + the 16-byte tag of a cluster
// with a secret, nothing else on the wire),
// bf16 frames at half the payload, and the cluster secret enforced between workers.
#include <gtest/gtest.h>

#include <arpa/inet.h>
#include <netinet/in.h>
#include <sys/socket.h>
#include <unistd.h>

#include <chrono>
#include <fstream>
#include <string>
#include <thread>
#include <nlohmann/json.hpp>

#include "tests/integration/cluster_fixture.h"

namespace fm::it {
namespace {

using namespace std::chrono_literals;

// net/frame.h kFrameHeaderSize + net/frame_auth.h kFrameTagSize (the fixture sets a secret).
constexpr uint64_t kFrameOverhead = 64 + 16;

// hc_mult * hidden_size of the small preset (values per manifold row).
uint64_t RowValues() {
  std::ifstream f(SmallModel() + "/config.json");
  auto j = nlohmann::json::parse(f);
  return j.at("hc_mult").get<uint64_t>() * j.at("hidden_size").get<uint64_t>();
}

struct WireDelta {
  std::vector<uint64_t> sent, received;
};

WireDelta Delta(const flashmesh::v1::ClusterStatusResponse& a,
                const flashmesh::v1::ClusterStatusResponse& b) {
  WireDelta d;
  EXPECT_EQ(a.nodes_size(), b.nodes_size());
  if (a.nodes_size() != b.nodes_size()) return d;
  for (int i = 0; i < a.nodes_size(); ++i) {
    d.sent.push_back(b.nodes(i).data_bytes_sent() - a.nodes(i).data_bytes_sent());
    d.received.push_back(b.nodes(i).data_bytes_received() - a.nodes(i).data_bytes_received());
  }
  return d;
}

// One request alone: a prefill step with the prompt, then one decode step per further token.
// Every hop carries one frame per step: steps * header + (prompt + new - 1) rows.
uint64_t ExpectedHopBytes(size_t prompt, int new_tokens, uint64_t bytes_per_value) {
  return new_tokens * kFrameOverhead + (prompt + new_tokens - 1) * RowValues() * bytes_per_value;
}

TEST(DataPlane, OneRawF32FramePerStepAndHop) {
  Cluster cluster(ClusterSpec{});
  cluster.StartAll();
  ASSERT_TRUE(WaitHealthy(cluster.api(), 60s)) << cluster.Logs();
  auto stub = Connect(cluster.api());
  const std::vector<int32_t> prompt = {11, 22, 33, 44, 55};
  auto before = Status(stub.get());
  Generation g = Generate(stub.get(), TokensRequest(prompt, 6));
  ASSERT_TRUE(g.status.ok()) << g.status.error_message() << cluster.Logs();
  ASSERT_EQ(g.ids.size(), 6u);
  WireDelta d = Delta(before, Status(stub.get()));
  ASSERT_EQ(d.sent.size(), 3u) << cluster.Logs();
  const uint64_t hop = ExpectedHopBytes(prompt.size(), 6, 4);
  EXPECT_EQ(d.sent, (std::vector<uint64_t>{hop, hop, 0}));
  EXPECT_EQ(d.received, (std::vector<uint64_t>{0, hop, hop}));
  const auto after = Status(stub.get());
  for (const auto& n : after.nodes()) EXPECT_EQ(n.data_frames_rejected(), 0u) << n.name();
}

TEST(DataPlane, Bf16FramesCarryHalfThePayloadAndStillGenerate) {
  ClusterSpec spec;
  spec.stages = 2;
  spec.activation_dtype = "bf16";
  Cluster cluster(spec);
  cluster.StartAll();
  ASSERT_TRUE(WaitHealthy(cluster.api(), 60s)) << cluster.Logs();
  auto stub = Connect(cluster.api());
  const std::vector<int32_t> prompt = {7, 8, 9};
  auto before = Status(stub.get());
  Generation g = Generate(stub.get(), TokensRequest(prompt, 4));
  ASSERT_TRUE(g.status.ok()) << g.status.error_message() << cluster.Logs();
  EXPECT_EQ(g.ids.size(), 4u);
  WireDelta d = Delta(before, Status(stub.get()));
  ASSERT_EQ(d.sent.size(), 2u) << cluster.Logs();
  EXPECT_EQ(d.sent[0], ExpectedHopBytes(prompt.size(), 4, 2));
  EXPECT_EQ(d.received[1], d.sent[0]);
}

TEST(DataPlane, WorkerWithAnotherClusterSecretIsRefusedAndNamedDown) {
  ClusterSpec spec;
  spec.stages = 2;
  Cluster cluster(spec);
  cluster.StartWorker(0);
  cluster.StartCoordinator();
  // w0 has read its secret once it listens, the coordinator once it serves; only then give w1
  // another one (rewriting it earlier could hand the coordinator the other secret instead).
  auto deadline = std::chrono::steady_clock::now() + 30s;
  while ((cluster.worker(0)->Log().find("(data)") == std::string::npos ||
          cluster.coordinator()->Log().find("serving ") == std::string::npos) &&
         std::chrono::steady_clock::now() < deadline)
    std::this_thread::sleep_for(20ms);
  std::ofstream(cluster.secret_file()) << "some-other-secret\n";  // read by w1 at its start
  cluster.StartWorker(1);
  // w1 refuses the coordinator's calls (signed with the other secret): it never loads, the
  // cluster never serves, and the coordinator names w1 and why.
  const std::string err = NodeErrorContaining(cluster.api(), "wrong cluster secret", 30s);
  EXPECT_NE(err.find("wrong cluster secret"), std::string::npos) << err << cluster.Logs();
  auto stub = Connect(cluster.api());
  // w0 may still be loading its shard (the reason names the first node not up): until it is up.
  auto status = Status(stub.get());
  for (auto until = std::chrono::steady_clock::now() + 30s;
       status.reason().find("is loading") != std::string::npos && std::chrono::steady_clock::now() < until;
       status = Status(stub.get()))
    std::this_thread::sleep_for(50ms);
  EXPECT_FALSE(status.healthy());
  EXPECT_NE(status.reason().find("node w1"), std::string::npos) << status.reason();
  Generation g = Generate(stub.get(), TokensRequest({1, 2, 3}, 4));
  ASSERT_FALSE(g.status.ok());
  EXPECT_NE(g.status.error_message().find("w1"), std::string::npos) << g.status.error_message();
  EXPECT_TRUE(g.ids.empty());
}

// A worker that cannot start (its control port taken) ends the bench at once, naming it, instead
// of after the 180 s start timeout; and --streams beyond the YAML's per-client limit is refused
// before anything starts.
TEST(BenchCluster, AWorkerThatExitsEndsTheWaitAndTooManyStreamsAreRefused) {
  ClusterSpec spec;
  spec.stages = 1;
  spec.max_streams_per_client = 4;
  Cluster cluster(spec);
  std::string out;
  EXPECT_EQ(RunFlashmesh({"bench", "cluster", "--config", cluster.yaml(), "--streams", "5"}, &out), 1)
      << out;
  EXPECT_NE(out.find("--streams 5: "), std::string::npos) << out;
  EXPECT_NE(out.find("limits.max_streams_per_client"), std::string::npos) << out;

  const int port = std::stoi(cluster.control(0).substr(cluster.control(0).rfind(':') + 1));
  const int fd = socket(AF_INET, SOCK_STREAM, 0);
  ASSERT_GE(fd, 0);
  sockaddr_in addr{};
  addr.sin_family = AF_INET;
  addr.sin_port = htons(static_cast<uint16_t>(port));
  addr.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  ASSERT_EQ(bind(fd, reinterpret_cast<sockaddr*>(&addr), sizeof addr), 0);
  ASSERT_EQ(listen(fd, 4), 0);
  const auto t0 = std::chrono::steady_clock::now();
  EXPECT_EQ(RunFlashmesh({"bench", "cluster", "--config", cluster.yaml(), "--tokens", "4",
                          "--streams", "2"}, &out, std::chrono::seconds(120)), 1) << out;
  close(fd);
  EXPECT_LT(std::chrono::steady_clock::now() - t0, std::chrono::seconds(60));
  EXPECT_NE(out.find("worker w0 exited (status 1)"), std::string::npos) << out;
}

TEST(BenchCluster, ReportsBothSidesTheirRatioAndTheExactWireBytes) {
  Cluster cluster(ClusterSpec{});   // only its YAML: bench cluster starts the processes itself
  nlohmann::json j;
  RunBenchCluster(cluster, &j);
  if (HasFatalFailure()) return;
  EXPECT_EQ(j.at("pipeline_stages").get<int>(), 3);
  EXPECT_TRUE(j.at("tokens_match").get<bool>());
  const double single = j.at("single").at("decode_tok_s").get<double>();
  const double pipe = j.at("cluster").at("decode_tok_s").get<double>();
  EXPECT_GT(single, 0);
  EXPECT_GT(pipe, 0);
  EXPECT_DOUBLE_EQ(j.at("decode_ratio").get<double>(), pipe / single);
  EXPECT_GT(j.at("cluster").at("streams_tok_s").get<double>(), 0);
  const double first_single = j.at("single").at("first_token_s").get<double>();
  const double first_pipe = j.at("cluster").at("first_token_s").get<double>();
  EXPECT_GT(first_single, 0);
  EXPECT_GT(first_pipe, 0);
  EXPECT_DOUBLE_EQ(j.at("first_token_speedup").get<double>(), first_single / first_pipe);
  EXPECT_EQ(j.at("cluster").at("h2d_bytes_per_token").get<double>(), 0);   // CPU workers
  EXPECT_EQ(j.at("cluster").at("d2h_bytes_per_token").get<double>(), 0);
  // Two hops, each one frame per step: (4 * 80 + (3 + 3) rows * hc*H * 4) bytes, per 4 tokens.
  EXPECT_DOUBLE_EQ(j.at("cluster").at("wire_bytes_per_token").get<double>(),
                   2.0 * ExpectedHopBytes(3, 4, 4) / 4);
  // The cost model predicts the same frames, and a pipeline no faster than one process.
  const auto& predicted = j.at("predicted");
  EXPECT_DOUBLE_EQ(predicted.at("cluster").at("wire_bytes_per_token").get<double>(),
                   2.0 * ExpectedHopBytes(3, 4, 4) / 4);
  EXPECT_EQ(predicted.at("cluster").at("ep_bytes_per_token").get<double>(), 0);
  EXPECT_GT(predicted.at("decode_ratio").get<double>(), 0.5);
  EXPECT_LT(predicted.at("decode_ratio").get<double>(), 1);
  // A 3-token prompt is one chunk: the pipeline adds its hops and overlaps nothing.
  EXPECT_LT(predicted.at("first_token_speedup").get<double>(), 1);
}

}  // namespace
}  // namespace fm::it
