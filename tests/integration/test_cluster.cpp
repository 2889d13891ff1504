// Multi-process clusters on loopback: the distributed daemon against `flashmesh serve`.
#include <gtest/gtest.h>
#include <arpa/inet.h>
#include <netinet/in.h>
#include <signal.h>
#include <sys/socket.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <fstream>
#include <thread>

#include "tests/integration/cluster_fixture.h"

namespace fm::it {
namespace {

using namespace std::chrono_literals;

constexpr int kNewTokens = 8;
constexpr int kStepTokens = 16;   // limits.max_step_tokens of PipelineTest's cluster and server

std::vector<int32_t> Prompt(int i) {
  std::vector<int32_t> p;
  for (int k = 0; k < 3 + i % 5; ++k) p.push_back(10 + (i * 37 + k * 11) % 250);
  return p;
}

flashmesh::v1::GenerateRequest SampledRequest(int i) {
  auto req = TokensRequest(Prompt(i), kNewTokens);
  auto* s = req.mutable_sampling();
  s->set_greedy(false);
  s->set_temperature(0.8f);
  s->set_top_p(0.95f);
  s->set_top_k(40);
  s->set_seed(1000 + i);
  s->set_has_seed(true);
  s->set_top_logprobs(i % 3);
  // The penalties and min-p too, so the last stage's token history is checked against the single
  // process's.
  if (i % 4 == 1) s->set_frequency_penalty(0.5f), s->set_presence_penalty(0.3f);
  if (i % 4 == 2) s->set_repetition_penalty(1.3f);
  if (i % 4 == 3) s->set_min_p(0.05f);
  return req;
}

// Each token's alternatives, most likely first, the chosen token's entry with the chosen
// logprob: greedy gives `n` of them, the chosen token first; sampling 1..n (top-p can keep fewer).
void ExpectTopLogprobs(const Generation& g, int n, bool greedy, const std::string& what) {
  ASSERT_EQ(g.top.size(), g.ids.size()) << what;
  for (size_t t = 0; t < g.ids.size(); ++t) {
    const auto& top = g.top[t];
    if (greedy || n == 0) ASSERT_EQ(top.size(), static_cast<size_t>(n)) << what << " token " << t;
    else ASSERT_TRUE(!top.empty() && top.size() <= static_cast<size_t>(n)) << what << " token " << t;
    for (size_t j = 1; j < top.size(); ++j) EXPECT_GE(top[j - 1].second, top[j].second) << what;
    for (const auto& [id, lp] : top) {
      if (id == g.ids[t]) {
        EXPECT_EQ(lp, g.logprobs[t]) << what << " token " << t;
      }
    }
    if (greedy && n > 0) {
      EXPECT_EQ(top[0].first, g.ids[t]) << what << " token " << t;
    }
  }
}

void ExpectSame(const Generation& a, const Generation& b, const std::string& what) {
  ASSERT_TRUE(a.status.ok()) << what << ": " << a.status.error_message();
  ASSERT_TRUE(b.status.ok()) << what << ": " << b.status.error_message();
  EXPECT_EQ(a.ids, b.ids) << what;
  EXPECT_EQ(a.logprobs, b.logprobs) << what;   // f32 frames: bit-exact
  EXPECT_EQ(a.top, b.top) << what;
  EXPECT_EQ(a.finish.reason(), b.finish.reason()) << what;
}

// The reference and the 3-stage cluster, started once for the equality tests.
class PipelineTest : public ::testing::Test {
 protected:
  static void SetUpTestSuite() {
    // Prompts longer than 16 tokens go in chunks (LongPromptsInChunksEqualSingleProcess).
    ClusterSpec spec;
    spec.max_step_tokens = kStepTokens;
    server_ = new Server({"--max-step-tokens", std::to_string(kStepTokens), "--max-context",
                          std::to_string(spec.max_context)});
    cluster_ = new Cluster(spec);
    cluster_->StartAll();
    ASSERT_TRUE(WaitHealthy(server_->api(), 60s)) << server_->process()->Log();
    ASSERT_TRUE(WaitHealthy(cluster_->api(), 60s)) << cluster_->Logs();
  }
  static void TearDownTestSuite() {
    delete cluster_;
    delete server_;
  }
  static Server* server_;
  static Cluster* cluster_;
};
Server* PipelineTest::server_ = nullptr;
Cluster* PipelineTest::cluster_ = nullptr;

TEST_F(PipelineTest, ThreeStagesEqualSingleProcessGreedyAndSeeded) {
  auto single = Connect(server_->api());
  auto pipe = Connect(cluster_->api());
  int sampled_differs = 0, penalized_differs = 0;
  for (int i = 0; i < 8; ++i) {
    auto greedy = TokensRequest(Prompt(i), kNewTokens);
    greedy.mutable_sampling()->set_top_logprobs(i % 2 ? 4 : 0);
    Generation a = Generate(single.get(), greedy), b = Generate(pipe.get(), greedy);
    ExpectSame(a, b, "greedy prompt " + std::to_string(i));
    ExpectTopLogprobs(a, i % 2 ? 4 : 0, true, "greedy prompt " + std::to_string(i));
    EXPECT_EQ(a.ids.size(), static_cast<size_t>(kNewTokens));
    EXPECT_EQ(a.finish.reason(), flashmesh::v1::FINISH_REASON_LENGTH);
    EXPECT_EQ(a.finish.usage().completion_tokens(), kNewTokens);
    EXPECT_EQ(a.finish.usage().prompt_tokens(), static_cast<int>(Prompt(i).size()));
    auto sampled = SampledRequest(i);
    Generation c = Generate(single.get(), sampled);
    ExpectSame(c, Generate(pipe.get(), sampled), "seeded prompt " + std::to_string(i));
    ExpectTopLogprobs(c, i % 3, false, "seeded prompt " + std::to_string(i));
    sampled_differs += c.ids != a.ids;
    // Greedy with penalties: the pipeline's tokens are the single process's, and the penalties
    // move it off the plain greedy path. This random model's greedy path repeats no token within
    // 8, so the penalties here favour the sequence's tokens (repetition < 1 on the prompt's and
    // generated ones, negative frequency / presence on generated ones) to change its picks.
    auto penalized = TokensRequest(Prompt(i), kNewTokens);
    if (i % 2) {
      penalized.mutable_sampling()->set_repetition_penalty(0.2f);
    } else {
      penalized.mutable_sampling()->set_frequency_penalty(-2.0f);
      penalized.mutable_sampling()->set_presence_penalty(-1.5f);
    }
    Generation d = Generate(single.get(), penalized);
    ExpectSame(d, Generate(pipe.get(), penalized), "penalized prompt " + std::to_string(i));
    penalized_differs += d.ids != a.ids;
  }
  EXPECT_GT(sampled_differs, 0) << "seeded sampling never left the greedy path: not exercised";
  EXPECT_GT(penalized_differs, 0) << "the penalties never changed a greedy pick: not exercised";
  auto status = StatusAfterFrees(pipe.get());
  ASSERT_EQ(status.nodes_size(), 3);
  EXPECT_EQ(status.nodes(0).layer_begin(), 0);
  for (int i = 0; i < 3; ++i) {
    EXPECT_EQ(status.nodes(i).state(), flashmesh::v1::NODE_STATE_UP);
    EXPECT_GT(status.nodes(i).weight_bytes(), 0u);
    EXPECT_EQ(status.nodes(i).kv_bytes(), 0u) << "finished sequences are freed";
    if (i > 0) {
      EXPECT_EQ(status.nodes(i).layer_begin(), status.nodes(i - 1).layer_end());
    }
  }
}

// The last line of `generate --format ids` output: the generated ids.
std::string IdsLine(const std::string& out) {
  std::string last, line;
  for (char ch : out) {
    if (ch != '\n') {
      line += ch;
      continue;
    }
    if (!line.empty() && line.find_first_not_of("0123456789 ") == std::string::npos) last = line;
    line.clear();
  }
  return last;
}

// stop_token_ids, min_tokens and logit_bias: each does what it says on a pipeline, with the
// single process's tokens.
TEST_F(PipelineTest, StopTokensMinTokensAndLogitBias) {
  auto single = Connect(server_->api());
  auto pipe = Connect(cluster_->api());
  const auto plain_req = TokensRequest(Prompt(1), kNewTokens);
  const Generation plain = Generate(single.get(), plain_req);
  ASSERT_TRUE(plain.status.ok()) << plain.status.error_message();
  ASSERT_EQ(plain.ids.size(), static_cast<size_t>(kNewTokens));
  const int32_t third = plain.ids[2];
  ASSERT_TRUE(plain.ids[0] != third && plain.ids[1] != third) << "pick another prompt";
  auto both = [&](const flashmesh::v1::GenerateRequest& req, const std::string& what) {
    Generation a = Generate(single.get(), req);
    ExpectSame(a, Generate(pipe.get(), req), what);
    return a;
  };

  // The third token stops the stream: it is reported (and counted) but adds no text.
  auto stop_req = plain_req;
  stop_req.add_stop_token_ids(third);
  const Generation stopped = both(stop_req, "stop_token_ids");
  EXPECT_EQ(stopped.ids, std::vector<int32_t>(plain.ids.begin(), plain.ids.begin() + 3));
  EXPECT_EQ(stopped.finish.reason(), flashmesh::v1::FINISH_REASON_STOP);
  EXPECT_EQ(stopped.finish.usage().completion_tokens(), 3);
  ASSERT_EQ(stopped.pieces.size(), 3u);
  EXPECT_EQ(stopped.pieces[2], "");

  // min_tokens 4 holds that token back for the first 4 tokens: 3 tokens as before, then another.
  auto min_req = stop_req;
  min_req.set_min_tokens(4);
  const Generation held = both(min_req, "min_tokens");
  ASSERT_GE(held.ids.size(), 4u);
  EXPECT_EQ(std::vector<int32_t>(held.ids.begin(), held.ids.begin() + 2),
            std::vector<int32_t>(plain.ids.begin(), plain.ids.begin() + 2));
  for (size_t i = 0; i < 4; ++i) EXPECT_NE(held.ids[i], third) << "token " << i;
  for (size_t i = 4; i < held.ids.size(); ++i) {
    if (held.ids[i] == third) {
      EXPECT_EQ(i + 1, held.ids.size()) << "it stops once allowed";
    }
  }

  // A bias of +100 makes one token every pick; -100 keeps the first pick from being one.
  auto up = plain_req;
  (*up.mutable_sampling()->mutable_logit_bias())[7] = 100.0f;
  EXPECT_EQ(both(up, "logit_bias +100").ids, std::vector<int32_t>(kNewTokens, 7));
  auto down = plain_req;
  (*down.mutable_sampling()->mutable_logit_bias())[plain.ids[0]] = -100.0f;
  const Generation biased = both(down, "logit_bias -100");
  ASSERT_FALSE(biased.ids.empty());
  for (int32_t id : biased.ids) EXPECT_NE(id, plain.ids[0]);
}

// `generate --model` and `generate --server` with the same options: the ids line of each.
std::pair<std::string, std::string> LocalAndRemoteIds(const std::string& api, const std::vector<std::string>& opts) {
  std::vector<std::string> common = {"--tokens", "5,17,42,99", "--max-tokens", "6", "--format", "ids"};
  common.insert(common.end(), opts.begin(), opts.end());
  std::vector<std::string> local = {"generate", "--model", SmallModel(), "--threads", "1"};
  std::vector<std::string> remote = {"generate", "--server", api};
  local.insert(local.end(), common.begin(), common.end());
  remote.insert(remote.end(), common.begin(), common.end());
  std::string out_local, out_remote;
  EXPECT_EQ(RunFlashmesh(local, &out_local), 0) << out_local;
  EXPECT_EQ(RunFlashmesh(remote, &out_remote), 0) << out_remote;
  EXPECT_FALSE(IdsLine(out_local).empty()) << out_local;
  return {IdsLine(out_local), IdsLine(out_remote)};
}

TEST_F(PipelineTest, GenerateCliServerModeEqualsLocalMode) {
  std::vector<std::string> outputs;
  for (const std::vector<std::string>& opts :
       {std::vector<std::string>{"--greedy"},
        std::vector<std::string>{"--temperature", "0.7", "--top-p", "0.9", "--seed", "7"},
        // The local mode keeps the penalties' history itself (model/generate.cpp), the server's
        // last stage from the tokens of its steps (worker/shard_runtime.cpp).
        std::vector<std::string>{"--greedy", "--repetition-penalty", "0.5", "--frequency-penalty", "-1",
                                 "--presence-penalty", "-1"},
        std::vector<std::string>{"--temperature", "0.9", "--min-p", "0.05", "--seed", "3",
                                 "--frequency-penalty", "-0.5", "--repetition-penalty", "0.8"}}) {
    const auto [local, remote] = LocalAndRemoteIds(cluster_->api(), opts);
    EXPECT_EQ(local, remote);
    outputs.push_back(local);
  }
  EXPECT_NE(outputs[0], outputs[2]) << "the penalties did not change the greedy ids: not exercised";
  // Stop tokens, min_tokens and a bias: the local mode's stop rule (model/generate.cpp) is the
  // scheduler's. The greedy path's third token stops it once min_tokens 2 allow.
  std::vector<std::string> greedy_ids;
  for (size_t at = 0; at < outputs[0].size();) {
    const size_t end = std::min(outputs[0].find(' ', at), outputs[0].size());
    greedy_ids.push_back(outputs[0].substr(at, end - at));
    at = end + 1;
  }
  ASSERT_GE(greedy_ids.size(), 4u) << outputs[0];
  const auto [local, remote] = LocalAndRemoteIds(
      cluster_->api(), {"--greedy", "--stop-token-ids", greedy_ids[2] + ",4095", "--min-tokens", "2",
                        "--logit-bias", "4000:-2,4001:-3"});
  EXPECT_EQ(local, remote);
  if (greedy_ids[0] != greedy_ids[2] && greedy_ids[1] != greedy_ids[2]) {
    EXPECT_EQ(local, greedy_ids[0] + " " + greedy_ids[1] + " " + greedy_ids[2]);
  }
}

// A prompt of 2-4 chunks: the cluster's tokens and logprobs are the single process's, bit for
// bit, alone or beside streams decoding, greedy or seeded; `generate --model` with the same
// chunk size gives the same ids.
TEST_F(PipelineTest, LongPromptsInChunksEqualSingleProcess) {
  auto single = Connect(server_->api());
  auto pipe = Connect(cluster_->api());
  auto long_prompt = [](int i) {
    std::vector<int32_t> p;
    for (int k = 0; k < 2 * kStepTokens + 5 + 9 * i; ++k) p.push_back(10 + (i * 53 + k * 7) % 250);
    return p;
  };
  std::vector<flashmesh::v1::GenerateRequest> reqs;
  for (int i = 0; i < 3; ++i) {
    reqs.push_back(TokensRequest(long_prompt(i), kNewTokens));
    auto sampled = TokensRequest(long_prompt(i), kNewTokens);
    *sampled.mutable_sampling() = SampledRequest(i).sampling();
    reqs.push_back(sampled);
  }
  std::vector<Generation> alone(reqs.size());
  for (size_t i = 0; i < reqs.size(); ++i) {
    alone[i] = Generate(single.get(), reqs[i]);
    ExpectSame(alone[i], Generate(pipe.get(), reqs[i]), "long prompt " + std::to_string(i));
    EXPECT_EQ(alone[i].ids.size(), static_cast<size_t>(kNewTokens));
  }
  // Together, with short prompts decoding beside them.
  std::vector<Generation> together(reqs.size()), beside(4);
  std::vector<std::thread> threads;
  for (size_t i = 0; i < reqs.size(); ++i)
    threads.emplace_back([&, i] { together[i] = Generate(Connect(cluster_->api()).get(), reqs[i]); });
  for (int i = 0; i < 4; ++i)
    threads.emplace_back([&, i] {
      beside[i] = Generate(Connect(cluster_->api()).get(), TokensRequest(Prompt(i), 3 * kNewTokens));
    });
  for (auto& t : threads) t.join();
  for (size_t i = 0; i < reqs.size(); ++i) ExpectSame(alone[i], together[i], "together " + std::to_string(i));
  for (const auto& g : beside) EXPECT_TRUE(g.status.ok()) << g.status.error_message();
  // The local path chunks the same way.
  std::string ids;
  for (int32_t t : long_prompt(2)) ids += (ids.empty() ? "" : ",") + std::to_string(t);
  std::string out;
  ASSERT_EQ(RunFlashmesh({"generate", "--model", SmallModel(), "--threads", "1", "--tokens", ids,
                          "--max-tokens", std::to_string(kNewTokens), "--greedy", "--format", "ids",
                          "--max-step-tokens", std::to_string(kStepTokens)},
                         &out),
            0)
      << out;
  std::string want;
  for (int32_t t : alone[4].ids) want += (want.empty() ? "" : " ") + std::to_string(t);
  EXPECT_EQ(IdsLine(out), want) << out;
}

// Past the short prompts above: a generation of a few hundred tokens, a prompt that all but
// fills the context (the context ends it), and a stop string cut where the single process cuts.
TEST_F(PipelineTest, LongGenerationsFullContextsAndStopStringsEqualSingleProcess) {
  auto single = Connect(server_->api());
  auto pipe = Connect(cluster_->api());
  const auto long_run = TokensRequest(Prompt(3), 240);
  Generation a = Generate(single.get(), long_run);
  ExpectSame(a, Generate(pipe.get(), long_run), "240 tokens");
  EXPECT_EQ(a.ids.size(), 240u);

  const int max_context = ClusterSpec{}.max_context;
  std::vector<int32_t> full;
  for (int k = 0; k < max_context - 3; ++k) full.push_back(10 + (k * 29) % 250);
  const auto filling = TokensRequest(full, 8);
  Generation f = Generate(single.get(), filling);
  ExpectSame(f, Generate(pipe.get(), filling), "a prompt 3 tokens short of the context");
  EXPECT_EQ(f.ids.size(), 3u) << "the context ends it";
  EXPECT_EQ(f.finish.reason(), flashmesh::v1::FINISH_REASON_LENGTH);

  // The text of a token of the long run (the first with text from the 6th on) as a stop
  // string: both stop on the same token, that one or an earlier one with the same text.
  size_t k = 5;
  while (k < a.pieces.size() && a.pieces[k].empty()) ++k;
  ASSERT_LT(k, a.pieces.size()) << "the long run decoded to no text";
  const std::string stop = a.pieces[k];
  auto stopping = long_run;
  stopping.add_stop(stop);
  Generation s1 = Generate(single.get(), stopping), s2 = Generate(pipe.get(), stopping);
  ExpectSame(s1, s2, "stop string");
  EXPECT_EQ(s1.finish.reason(), flashmesh::v1::FINISH_REASON_STOP);
  EXPECT_EQ(s1.finish.stop_string(), stop);
  EXPECT_LE(s1.ids.size(), k + 1);
}

TEST_F(PipelineTest, ThirtyTwoConcurrentStreamsEachEqualItsRunAlone) {
  auto pipe = Connect(cluster_->api());
  constexpr int kStreams = 32;
  std::vector<Generation> alone(kStreams), together(kStreams);
  for (int i = 0; i < kStreams; ++i) alone[i] = Generate(pipe.get(), i % 2 ? SampledRequest(i) : TokensRequest(Prompt(i), kNewTokens));
  std::vector<std::thread> threads;
  for (int i = 0; i < kStreams; ++i)
    threads.emplace_back([&, i] {
      auto stub = Connect(cluster_->api());
      together[i] = Generate(stub.get(), i % 2 ? SampledRequest(i) : TokensRequest(Prompt(i), kNewTokens));
    });
  for (auto& t : threads) t.join();
  for (int i = 0; i < kStreams; ++i) ExpectSame(alone[i], together[i], "stream " + std::to_string(i));
}

TEST_F(PipelineTest, CancelReturnsKvOfEveryWorkerToItsPreviousValue) {
  auto pipe = Connect(cluster_->api());
  auto before = Status(pipe.get());
  LiveStream live(pipe.get(), TokensRequest(Prompt(3), 200));
  ASSERT_TRUE(live.started());
  ASSERT_TRUE(live.Next());
  auto during = Status(pipe.get());
  ASSERT_EQ(before.nodes_size(), 3);
  ASSERT_EQ(during.nodes_size(), 3);
  for (int i = 0; i < 3; ++i) EXPECT_GT(during.nodes(i).kv_bytes(), before.nodes(i).kv_bytes()) << "node " << i;
  live.Cancel();
  EXPECT_EQ(live.Finish().error_code(), grpc::StatusCode::CANCELLED);
  auto deadline = std::chrono::steady_clock::now() + 5s;
  bool restored = false;
  while (!restored && std::chrono::steady_clock::now() < deadline) {
    auto now = Status(pipe.get());
    restored = true;
    for (int i = 0; i < 3; ++i) {
      restored = restored && now.nodes(i).kv_bytes() == before.nodes(i).kv_bytes() &&
                 now.nodes(i).active_sequences() == before.nodes(i).active_sequences();
    }
    if (!restored) std::this_thread::sleep_for(50ms);
  }
  EXPECT_TRUE(restored) << "KV bytes did not return to the value before the request";
}

TEST(ClusterFailure, KilledWorkerEndsStreamUnavailableAndRestartedWorkerServesAgain) {
  Cluster cluster(ClusterSpec{});
  cluster.StartAll();
  ASSERT_TRUE(WaitHealthy(cluster.api(), 60s)) << cluster.Logs();
  auto stub = Connect(cluster.api());
  LiveStream live(stub.get(), TokensRequest(Prompt(1), 250));
  ASSERT_TRUE(live.started()) << cluster.Logs();
  cluster.KillWorker(1, SIGKILL);
  auto killed_at = std::chrono::steady_clock::now();
  grpc::Status st = live.Finish();
  auto ended_after = std::chrono::steady_clock::now() - killed_at;
  EXPECT_EQ(st.error_code(), grpc::StatusCode::UNAVAILABLE) << st.error_message();
  EXPECT_NE(st.error_message().find("w1"), std::string::npos) << st.error_message();
  EXPECT_LT(ended_after, 5s);

  // Marked down within 3 s of the kill: asked until it is (10 s). The first ask comes once the
  // stream ended (up to 5 s above); the ask that saw it down started by then or by 3 s, give or
  // take one ask (a process start and an RPC) and its pause.
  std::string out;
  int rc = -1;
  auto seen_down_ask = std::chrono::steady_clock::duration::max();
  for (const auto until = std::chrono::steady_clock::now() + 10s; std::chrono::steady_clock::now() < until;) {
    const auto asked = std::chrono::steady_clock::now();
    rc = RunFlashmesh({"health", "--server", cluster.api(), "--node", "w1"}, &out, 5s);
    if (rc == 2) {
      seen_down_ask = asked - killed_at;
      break;
    }
    std::this_thread::sleep_for(100ms);
  }
  EXPECT_EQ(rc, 2) << out;
  EXPECT_LT(seen_down_ask, std::max<std::chrono::steady_clock::duration>(ended_after, 3s) + 2s);
  EXPECT_EQ(RunFlashmesh({"health", "--server", cluster.api()}, &out, 5s), 1) << out;
  EXPECT_EQ(RunFlashmesh({"health", "--server", cluster.api(), "--node", "w0"}, &out, 5s), 0) << out;

  cluster.StartWorker(1);
  ASSERT_TRUE(WaitHealthy(cluster.api(), 60s)) << cluster.Logs();
  EXPECT_EQ(RunFlashmesh({"health", "--server", cluster.api()}, &out, 5s), 0) << out;
  Generation g = Generate(stub.get(), TokensRequest(Prompt(2), kNewTokens));
  ASSERT_TRUE(g.status.ok()) << g.status.error_message() << cluster.Logs();
  EXPECT_EQ(g.ids.size(), static_cast<size_t>(kNewTokens));
}

// `flashmesh drain` takes a worker out of service the way an operator restarts one: the live
// request finishes whole, new ones are refused naming the node, --wait returns once it holds
// nothing, and --resume brings the cluster back. The call is signed with the YAML's secret.
TEST(ClusterCli, DrainFinishesTheLiveRequestRefusesNewOnesAndResumes) {
  Cluster cluster(ClusterSpec{});
  cluster.StartAll();
  ASSERT_TRUE(WaitHealthy(cluster.api(), 60s)) << cluster.Logs();
  auto stub = Connect(cluster.api());
  LiveStream live(stub.get(), TokensRequest(Prompt(1), 250));
  ASSERT_TRUE(live.started()) << cluster.Logs();
  std::string out;
  ASSERT_EQ(RunFlashmesh({"drain", "--config", cluster.yaml(), "--node", "w1"}, &out, 10s), 0)
      << out;
  EXPECT_NE(out.find("node w1 draining: "), std::string::npos) << out;
  // The coordinator sees it at the next heartbeat.
  EXPECT_TRUE(Eventually([&] {
    return RunFlashmesh({"health", "--server", cluster.api(), "--node", "w1"}, &out, 5s) == 1;
  }, 10s)) << out;
  EXPECT_NE(out.find("degraded: node w1 is draining"), std::string::npos) << out;
  Generation refused = Generate(stub.get(), TokensRequest(Prompt(2), 4));
  EXPECT_EQ(refused.status.error_code(), grpc::StatusCode::UNAVAILABLE);
  EXPECT_NE(refused.status.error_message().find("w1"), std::string::npos)
      << refused.status.error_message();
  EXPECT_NE(refused.status.error_message().find("draining"), std::string::npos)
      << refused.status.error_message();
  const grpc::Status st = live.Finish();
  EXPECT_TRUE(st.ok()) << st.error_message();
  EXPECT_EQ(live.tokens(), 250);
  EXPECT_EQ(live.last().finish().reason(), flashmesh::v1::FINISH_REASON_LENGTH);
  ASSERT_EQ(RunFlashmesh({"drain", "--config", cluster.yaml(), "--node", "w1", "--wait", "10"},
                         &out, 20s), 0) << out;
  EXPECT_NE(out.find("node w1 drained: no live sequence in the cluster"), std::string::npos) << out;
  ASSERT_EQ(RunFlashmesh({"drain", "--config", cluster.yaml(), "--node", "w1", "--resume"}, &out,
                         10s), 0) << out;
  ASSERT_TRUE(WaitHealthy(cluster.api(), 10s)) << cluster.Logs();
  Generation g = Generate(stub.get(), TokensRequest(Prompt(2), kNewTokens));
  ASSERT_TRUE(g.status.ok()) << g.status.error_message();
  EXPECT_EQ(g.ids.size(), static_cast<size_t>(kNewTokens));
  EXPECT_EQ(RunFlashmesh({"drain", "--config", cluster.yaml(), "--node", "w9"}, &out, 10s), 2);
  EXPECT_NE(out.find("no node named 'w9'"), std::string::npos) << out;
  EXPECT_EQ(RunFlashmesh({"drain", "--config", cluster.yaml(), "--node", "w1", "--wait", "1",
                          "--resume"}, &out, 10s), 2) << out;
}

// A drain is the operator's word that a machine goes away, so it holds when a new coordinator
// takes over and reloads every worker: the drained one comes out of its load draining (never
// up, so no request is admitted for it) and new requests are refused naming it, until --resume.
TEST(ClusterCli, ADrainHoldsAcrossANewCoordinatorUntilResumed) {
  ClusterSpec spec;
  spec.stages = 2;
  Cluster cluster(spec);
  cluster.StartAll();
  ASSERT_TRUE(WaitHealthy(cluster.api(), 60s)) << cluster.Logs();
  std::string out;
  ASSERT_EQ(RunFlashmesh({"drain", "--config", cluster.yaml(), "--node", "w1"}, &out, 10s), 0) << out;
  cluster.coordinator()->Signal(SIGKILL);
  cluster.coordinator()->Wait(10s);
  std::string api_b;
  const std::unique_ptr<Process> b = cluster.StartNextCoordinator(&api_b);
  // B has its own epoch: it loads both workers before either serves.
  ASSERT_TRUE(Eventually([&] {
    return b->Log().find("node w0 up") != std::string::npos &&
           b->Log().find("node w1 draining") != std::string::npos;
  }, 60s)) << b->Log() << cluster.Logs();
  auto stub = Connect(api_b);
  std::this_thread::sleep_for(1s);   // heartbeats of the reloaded w1 (every 250 ms)
  const auto st = Status(stub.get());
  EXPECT_FALSE(st.healthy());
  EXPECT_NE(st.reason().find("node w1"), std::string::npos) << st.reason();
  EXPECT_NE(st.reason().find("draining"), std::string::npos) << st.reason();
  EXPECT_EQ(b->Log().find("node w1 up"), std::string::npos) << b->Log();
  Generation refused = Generate(stub.get(), TokensRequest(Prompt(2), 4));
  EXPECT_EQ(refused.status.error_code(), grpc::StatusCode::UNAVAILABLE);
  EXPECT_NE(refused.status.error_message().find("w1 (127.0.0.1"), std::string::npos)
      << refused.status.error_message();
  EXPECT_NE(refused.status.error_message().find("draining"), std::string::npos)
      << refused.status.error_message();
  ASSERT_EQ(RunFlashmesh({"drain", "--config", cluster.yaml(), "--node", "w1", "--resume"}, &out,
                         10s), 0) << out;
  ASSERT_TRUE(WaitHealthy(api_b, 10s)) << b->Log();
  Generation g = Generate(stub.get(), TokensRequest(Prompt(2), kNewTokens));
  ASSERT_TRUE(g.status.ok()) << g.status.error_message();
  EXPECT_EQ(g.ids.size(), static_cast<size_t>(kNewTokens));
}

// Under expert parallelism a sequence lives on one member, but every member serves its
// experts: --wait on the other member returns only once that sequence is done, so stopping the
// drained worker then fails nothing.
TEST(ClusterCli, DrainWaitCoversTheSequencesOfAnExpertParallelGroup) {
  ClusterSpec spec;
  spec.stages = 1;
  spec.expert_parallel = 2;
  Cluster cluster(spec);
  cluster.StartAll();
  ASSERT_TRUE(WaitHealthy(cluster.api(), 60s)) << cluster.Logs();
  auto stub = Connect(cluster.api());
  LiveStream live(stub.get(), TokensRequest(Prompt(3), 200));   // the first request lives on w0
  ASSERT_TRUE(live.started()) << cluster.Logs();
  std::string out;
  ASSERT_EQ(RunFlashmesh({"drain", "--config", cluster.yaml(), "--node", "w1", "--wait", "30"},
                         &out, 40s), 0) << out;
  EXPECT_NE(out.find("node w1 draining: 0 live sequence(s) on it"), std::string::npos) << out;
  EXPECT_NE(out.find("node w1 drained"), std::string::npos) << out;
  cluster.KillWorker(1, SIGKILL);
  const grpc::Status st = live.Finish();
  EXPECT_TRUE(st.ok()) << st.error_message();
  EXPECT_EQ(live.tokens(), 200);
}

TEST(ClusterCli, UpStartsTheWholeClusterStatusListsNodesAndSigintStopsAll) {
  Cluster cluster(ClusterSpec{});   // only for its YAML and ports: `up` starts the processes
  TempDir dir;
  Process up({"up", "--config", cluster.yaml(), "--threads", "1"}, dir.path() + "/up.log");
  ASSERT_TRUE(WaitHealthy(cluster.api(), 60s)) << up.Log();
  for (int i = 0; i < 3; ++i) {   // --threads reaches every worker
    const std::string line = "node " + cluster.node(i) + " listening on ";
    const size_t at = up.Log().find(line);
    ASSERT_NE(at, std::string::npos) << up.Log();
    const std::string rest = up.Log().substr(at, up.Log().find('\n', at) - at);
    EXPECT_NE(rest.find(", 1 kernel threads"), std::string::npos) << rest;
  }
  auto stub = Connect(cluster.api());
  Generation g = Generate(stub.get(), TokensRequest(Prompt(0), 4));
  ASSERT_TRUE(g.status.ok()) << g.status.error_message();
  EXPECT_EQ(g.ids.size(), 4u);
  std::string out;
  ASSERT_EQ(RunFlashmesh({"status", "--server", cluster.api()}, &out, 10s), 0) << out;
  for (int i = 0; i < 3; ++i) EXPECT_NE(out.find(cluster.node(i) + " "), std::string::npos) << out;
  EXPECT_EQ(out.find("host<->device"), std::string::npos) << "CPU nodes have no device: " << out;
  ASSERT_EQ(RunFlashmesh({"status", "--server", cluster.api(), "--json"}, &out, 10s), 0) << out;
  EXPECT_NE(out.find("\"weight_bytes\""), std::string::npos) << out;
  const nlohmann::json j = nlohmann::json::parse(out);
  for (const auto& n : j.at("nodes")) {
    EXPECT_EQ(n.at("host_to_device_bytes").get<uint64_t>(), 0u) << n.dump();
    EXPECT_EQ(n.at("device_to_host_bytes").get<uint64_t>(), 0u) << n.dump();
    EXPECT_EQ(n.at("device_tokens").get<uint64_t>(), 0u) << n.dump();
  }
  // A worker's control port is not the API: the CLI says so, not an empty reason.
  EXPECT_EQ(RunFlashmesh({"status", "--server", cluster.control(0)}, &out, 10s), 3) << out;
  EXPECT_NE(out.find("status: " + cluster.control(0) +
                     " is not a coordinator's API: UNIMPLEMENTED: the server there does not serve this call"),
            std::string::npos) << out;
  EXPECT_EQ(RunFlashmesh({"generate", "--server", cluster.control(0), "--prompt", "hi"}, &out, 10s), 1);
  EXPECT_NE(out.find("UNIMPLEMENTED: the server there does not serve this call"), std::string::npos)
      << out;
  up.Signal(SIGINT);
  EXPECT_EQ(up.Wait(15s), 0) << up.Log();
  EXPECT_EQ(RunFlashmesh({"health", "--server", cluster.api()}, &out, 10s), 2) << "coordinator still up";
  // status exits like health: 2 when the coordinator does not answer.
  EXPECT_EQ(RunFlashmesh({"status", "--server", cluster.api()}, &out, 10s), 2) << out;
  EXPECT_NE(out.find("down: coordinator"), std::string::npos) << out;
}

// Holds 127.0.0.1:`port` with a listening socket for the test's duration.
class PortTaken {
 public:
  explicit PortTaken(int port) : fd_(socket(AF_INET, SOCK_STREAM, 0)) {
    sockaddr_in a{};
    a.sin_family = AF_INET;
    a.sin_port = htons(static_cast<uint16_t>(port));
    a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
    ok_ = fd_ >= 0 && bind(fd_, reinterpret_cast<sockaddr*>(&a), sizeof a) == 0 && listen(fd_, 1) == 0;
  }
  ~PortTaken() {
    if (fd_ >= 0) close(fd_);
  }
  bool ok() const { return ok_; }

 private:
  int fd_;
  bool ok_ = false;
};

// A worker that cannot start (its data port is taken) stops `up` with its error, instead of
// leaving a cluster that never becomes healthy running.
TEST(ClusterCli, UpExitsWhenAWorkerCannotStart) {
  Cluster cluster(ClusterSpec{});   // only for its YAML and ports
  const std::string data1 = cluster.data(1);
  PortTaken taken(std::stoi(data1.substr(data1.rfind(':') + 1)));
  ASSERT_TRUE(taken.ok()) << "cannot hold " << data1;
  TempDir dir;
  Process up({"up", "--config", cluster.yaml()}, dir.path() + "/up.log");
  EXPECT_EQ(up.Wait(30s), 1) << up.Log();
  const std::string log = up.Log();
  EXPECT_NE(log.find("worker w1: data plane (nodes[].data " + data1 + ")"), std::string::npos) << log;
  EXPECT_NE(log.find("w1 exited (status 1): it could not start"), std::string::npos) << log;
  std::string out;
  EXPECT_EQ(RunFlashmesh({"health", "--server", cluster.api()}, &out, 10s), 2) << "coordinator left running";
}

TEST(ClusterCli, YamlErrorsNameFileAndLineThroughCoordinator) {
  TempDir dir;
  std::string path = dir.path() + "/bad.yaml";
  std::ofstream(path) << "model: " << SmallModel() << "\n"
                      << "coordinator: { listen: 127.0.0.1:7070 }\n"
                      << "nodes:\n"
                      << "  - { name: a, control: 127.0.0.1:7101, data: 127.0.0.1:7201, device: cpu, memory_gib: 2 }\n"
                      << "bogus_key: 1\n";
  std::string out;
  EXPECT_EQ(RunFlashmesh({"coordinator", "--config", path}, &out, 20s), 1);
  EXPECT_NE(out.find("bad.yaml:5:"), std::string::npos) << out;
  EXPECT_NE(out.find("bogus_key"), std::string::npos) << out;

  std::ofstream(path) << "model: " << SmallModel() << "\n"
                      << "coordinator: { listen: 127.0.0.1:7070 }\n"
                      << "nodes:\n"
                      << "  - { name: a, control: 127.0.0.1:7101, data: 127.0.0.1:7201, device: cpu, memory_gib: lots }\n";
  EXPECT_EQ(RunFlashmesh({"coordinator", "--config", path}, &out, 20s), 1);
  EXPECT_NE(out.find("bad.yaml:4:"), std::string::npos) << out;
  EXPECT_NE(out.find("memory_gib"), std::string::npos) << out;
}

}  // namespace
}  // namespace fm::it
