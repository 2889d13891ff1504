// Faults on a live 3-stage cluster and what the cluster does about them (docs/operations.md,
// "Failure model"): out-of-band control calls, a failed LoadShard, a frozen stage, expired
// queued requests, SIGTERM under load, and a bounded soak of all of it together.
#include <gtest/gtest.h>
#include <signal.h>

#include <atomic>
#include <filesystem>
#include <functional>
#include <map>
#include <mutex>
#include <random>
#include <thread>

#include "flashmesh/v1/worker.grpc.pb.h"
#include "rpc/control_auth.h"
#include "tests/integration/cluster_fixture.h"
#include "tests/integration/http_client.h"

namespace fm::it {
namespace {

using namespace std::chrono_literals;
using Clock = std::chrono::steady_clock;

std::vector<int32_t> Prompt(int i) {
  std::vector<int32_t> p;
  for (int k = 0; k < 3 + i % 4; ++k) p.push_back(20 + (i * 41 + k * 13) % 240);
  return p;
}

// An insider's stub to a worker (an operator or a stray client holding the cluster secret):
// every call signed and carrying the term the worker follows (read through Health, which any
// term may call), so the out-of-band calls pass authentication and the fence as the
// coordinator's own would, and the tests see what the cluster does about them.
std::unique_ptr<flashmesh::v1::Worker::Stub> WorkerStub(const Cluster& cluster, int i) {
  const std::string control = cluster.control(i), node = cluster.node(i);
  const std::string secret = ClusterSpec{}.cluster_secret;
  auto probe = flashmesh::v1::Worker::NewStub(NewWorkerChannel(control, node, {}, secret, 0));
  grpc::ClientContext ctx;
  ctx.set_deadline(std::chrono::system_clock::now() + 5s);
  flashmesh::v1::HealthResponse health;
  const grpc::Status st = probe->Health(&ctx, flashmesh::v1::HealthRequest(), &health);
  EXPECT_TRUE(st.ok()) << control << ": " << st.error_message();
  return flashmesh::v1::Worker::NewStub(NewWorkerChannel(control, node, {}, secret, health.term()));
}

// One Generate in its own thread; `started` once its first token arrived.
struct Stream {
  Generation g;
  Clock::time_point ended;
  std::atomic<bool> started{false};
  std::thread thread;
  grpc::ClientContext ctx;

  Stream(flashmesh::v1::Inference::Stub* stub, flashmesh::v1::GenerateRequest req,
         std::chrono::milliseconds deadline) {
    ctx.set_deadline(std::chrono::system_clock::now() + deadline);
    thread = std::thread([this, stub, req] {
      auto reader = stub->Generate(&ctx, req);
      flashmesh::v1::GenerateResponse resp;
      while (reader->Read(&resp)) {
        if (resp.has_token()) {
          g.ids.push_back(resp.token().id());
          started = true;
        } else if (resp.has_finish()) {
          g.finish = resp.finish();
          g.finished = true;
        }
      }
      g.status = reader->Finish();
      ended = Clock::now();
    });
  }
  ~Stream() {
    if (thread.joinable()) thread.join();
  }
  bool WaitStarted(std::chrono::milliseconds timeout) {
    const auto until = Clock::now() + timeout;
    while (!started && Clock::now() < until) std::this_thread::sleep_for(5ms);
    return started;
  }
};

// Every worker holds no sequence and no KV within `timeout`; otherwise what they hold.
std::string WaitNothingHeld(flashmesh::v1::Inference::Stub* stub, std::chrono::milliseconds timeout) {
  const auto until = Clock::now() + timeout;
  std::string held;
  do {
    held.clear();
    auto st = Status(stub);
    for (const auto& n : st.nodes())
      if (n.active_sequences() != 0 || n.kv_bytes() != 0)
        held += n.name() + ": " + std::to_string(n.active_sequences()) + " sequences, " +
                std::to_string(n.kv_bytes()) + " KV bytes; ";
    if (st.nodes_size() == 0) held = "no nodes in ClusterStatus";
    if (held.empty()) return "";
    std::this_thread::sleep_for(100ms);
  } while (Clock::now() < until);
  return held;
}

TEST(SelfHealing, StrayStepAndOutOfBandResetUnderLoadEndWithinSecondsAndTheNextRequestsSucceed) {
  Cluster cluster(ClusterSpec{});
  cluster.StartAll();
  ASSERT_TRUE(WaitHealthy(cluster.api(), 60s)) << cluster.Logs();
  auto stub = Connect(cluster.api());
  const Generation ref = Generate(stub.get(), TokensRequest(Prompt(3), 8));
  ASSERT_TRUE(ref.status.ok()) << ref.status.error_message();

  std::vector<std::unique_ptr<Stream>> load;
  for (int i = 0; i < 4; ++i) load.push_back(std::make_unique<Stream>(stub.get(), TokensRequest(Prompt(i), 200), 60s));
  for (auto& s : load) ASSERT_TRUE(s->WaitStarted(30s)) << cluster.Logs();

  // A stray step names no sequence the worker holds, or none at all: refused at once, before
  // it joins the worker's step order.
  auto w0 = WorkerStub(cluster, 0);
  flashmesh::v1::StepBatchRequest stray;
  stray.set_step_id(1ull << 40);
  auto* item = stray.add_items();
  item->set_seq_id(987654);
  item->add_tokens(1);
  flashmesh::v1::StepBatchResponse sresp;
  grpc::ClientContext sctx;
  sctx.set_deadline(std::chrono::system_clock::now() + 5s);
  const auto t0 = Clock::now();
  grpc::Status ss = w0->StepBatch(&sctx, stray, &sresp);
  EXPECT_EQ(ss.error_code(), grpc::StatusCode::NOT_FOUND) << ss.error_message();
  EXPECT_LT(Clock::now() - t0, 2s);  // not its 5 s deadline; the slack is for the TSan run (CI)
  stray.clear_items();
  grpc::ClientContext ectx;
  EXPECT_EQ(w0->StepBatch(&ectx, stray, &sresp).error_code(), grpc::StatusCode::INVALID_ARGUMENT);

  // An out-of-band Reset of a stage drops the live sequences under the coordinator's feet.
  auto w1 = WorkerStub(cluster, 1);
  grpc::ClientContext rctx;
  flashmesh::v1::ResetResponse rresp;
  ASSERT_TRUE(w1->Reset(&rctx, flashmesh::v1::ResetRequest(), &rresp).ok());
  const auto reset_at = Clock::now();
  int failed = 0;
  for (auto& s : load) {
    s->thread.join();
    EXPECT_LT(s->ended - reset_at, 5s);
    if (s->g.status.ok()) continue;
    ++failed;
    EXPECT_EQ(s->g.status.error_code(), grpc::StatusCode::UNAVAILABLE) << s->g.status.error_message();
    EXPECT_NE(s->g.status.error_message().find("node w1"), std::string::npos) << s->g.status.error_message();
  }
  EXPECT_GT(failed, 0) << "the reset came after every stream had finished";
  ASSERT_TRUE(WaitHealthy(cluster.api(), 10s)) << cluster.Logs();
  Generation again = Generate(stub.get(), TokensRequest(Prompt(3), 8));
  ASSERT_TRUE(again.status.ok()) << again.status.error_message();
  EXPECT_EQ(again.ids, ref.ids);
  EXPECT_EQ(WaitNothingHeld(stub.get(), 5s), "");
}

TEST(SelfHealing, FailedLoadShardLeavesTheWorkerUnloadedAndALaterGoodLoadServes) {
  TempDir dir;
  const std::string model = dir.path() + "/model";
  std::filesystem::copy(SmallModel(), model, std::filesystem::copy_options::recursive);
  Cluster cluster(ClusterSpec{});
  cluster.StartWorker(0);
  cluster.StartWorker(1, {"--model", model});
  cluster.StartWorker(2);
  cluster.StartCoordinator();
  ASSERT_TRUE(WaitHealthy(cluster.api(), 60s)) << cluster.Logs();
  auto stub = Connect(cluster.api());
  const Generation ref = Generate(stub.get(), TokensRequest(Prompt(1), 6));
  ASSERT_TRUE(ref.status.ok()) << ref.status.error_message();

  auto w1 = WorkerStub(cluster, 1);
  flashmesh::v1::LoadShardRequest lreq;
  lreq.mutable_shard()->set_stage(1);
  lreq.mutable_shard()->set_num_stages(3);
  lreq.mutable_shard()->set_next_node("w2");
  lreq.mutable_shard()->set_next_data(cluster.data(2));   // the YAML's (a worker refuses others)
  lreq.mutable_shard()->set_prev_node("w0");
  flashmesh::v1::LoadShardResponse lresp;
  // Specs that cannot serve are refused by field before anything is replaced: w1 keeps its shard.
  const std::vector<std::pair<std::function<void(flashmesh::v1::ShardSpec*)>, std::string>> bad = {
      {[](auto* s) { s->set_embed(true); }, "shard.embed: true on stage 1 (stage 0, and only it, embeds)"},
      {[](auto* s) { s->set_head(true); }, "shard.head: true on stage 1 of 3"},
      {[](auto* s) { s->set_max_context(-1); }, "shard.max_context -1"},
      {[](auto* s) { s->set_max_step_rows(-5); }, "shard.max_step_rows -5"}};
  for (const auto& [edit, want] : bad) {
    flashmesh::v1::LoadShardRequest r = lreq;
    edit(r.mutable_shard());
    grpc::ClientContext c;
    const grpc::Status st = w1->LoadShard(&c, r, &lresp);
    EXPECT_EQ(st.error_code(), grpc::StatusCode::INVALID_ARGUMENT) << st.error_message();
    EXPECT_NE(st.error_message().find(want), std::string::npos) << st.error_message();
  }
  const Generation same = Generate(stub.get(), TokensRequest(Prompt(1), 6));
  ASSERT_TRUE(same.status.ok()) << same.status.error_message();
  EXPECT_EQ(same.ids, ref.ids);

  std::filesystem::rename(model + "/config.json", model + "/config.json.away");
  grpc::ClientContext lctx;
  EXPECT_FALSE(w1->LoadShard(&lctx, lreq, &lresp).ok());
  flashmesh::v1::HealthResponse h;
  grpc::ClientContext hctx;
  ASSERT_TRUE(w1->Health(&hctx, flashmesh::v1::HealthRequest(), &h).ok());
  EXPECT_FALSE(h.loaded()) << "half-wired: loaded without its next stage";

  // The coordinator sees w1 unloaded and loads it again: health says "is loading its shard"
  // while that LoadShard runs, then "LoadShard failed" once the missing config.json fails it.
  std::string out;
  const auto until = Clock::now() + 10s;
  int rc = 0;
  while (Clock::now() < until) {
    rc = RunFlashmesh({"health", "--server", cluster.api()}, &out, 5s);
    if (rc != 0 && out.find("LoadShard failed") != std::string::npos) break;
    std::this_thread::sleep_for(100ms);
  }
  EXPECT_EQ(rc, 1) << out;
  EXPECT_NE(out.find("node w1"), std::string::npos) << out;
  EXPECT_NE(out.find("LoadShard failed"), std::string::npos) << out;
  Generation g = Generate(stub.get(), TokensRequest(Prompt(1), 6));
  EXPECT_EQ(g.status.error_code(), grpc::StatusCode::UNAVAILABLE) << g.status.error_message();

  std::filesystem::rename(model + "/config.json.away", model + "/config.json");
  ASSERT_TRUE(WaitHealthy(cluster.api(), 15s)) << cluster.Logs();   // the next load, <= 8 s backoff
  Generation again = Generate(stub.get(), TokensRequest(Prompt(1), 6));
  ASSERT_TRUE(again.status.ok()) << again.status.error_message();
  EXPECT_EQ(again.ids, ref.ids);
}

TEST(SelfHealing, StoppingAndContinuingAStageTwentyTimesLeavesNoSequenceOrKvBehind) {
  Cluster cluster(ClusterSpec{});
  cluster.StartAll();
  ASSERT_TRUE(WaitHealthy(cluster.api(), 60s)) << cluster.Logs();
  auto stub = Connect(cluster.api());
  for (int i = 0; i < 20; ++i) {
    Stream s(stub.get(), TokensRequest(Prompt(i), 64), 30s);
    s.WaitStarted(5s);
    cluster.worker(1)->Signal(SIGSTOP);
    // Mostly shorter than the heartbeat timeout (the step fails or waits), every fifth longer
    // (the node is marked down meanwhile).
    std::this_thread::sleep_for(i % 5 == 4 ? 3000ms : 150ms);
    cluster.worker(1)->Signal(SIGCONT);
    s.thread.join();
    EXPECT_TRUE(s.g.status.ok() || s.g.status.error_code() == grpc::StatusCode::UNAVAILABLE)
        << i << ": " << s.g.status.error_message();
    if (i % 5 == 4) {
      ASSERT_TRUE(WaitHealthy(cluster.api(), 20s)) << cluster.Logs();
    }
  }
  ASSERT_TRUE(WaitHealthy(cluster.api(), 20s)) << cluster.Logs();
  EXPECT_EQ(WaitNothingHeld(stub.get(), 10s), "") << cluster.Logs();
}

// The status table asks every node's Stats at once: two frozen nodes (not yet DOWN) cost one
// 800 ms Stats deadline together, not one each, and the live node's counters still come.
TEST(SelfHealing, StatusWithTwoFrozenNodesCostsOneStatsDeadline) {
  Cluster cluster(ClusterSpec{});
  cluster.StartAll();
  ASSERT_TRUE(WaitHealthy(cluster.api(), 60s)) << cluster.Logs();
  auto stub = Connect(cluster.api());
  cluster.worker(1)->Signal(SIGSTOP);
  cluster.worker(2)->Signal(SIGSTOP);
  grpc::ClientContext ctx;
  ctx.set_deadline(std::chrono::system_clock::now() + 10s);
  flashmesh::v1::ClusterStatusResponse status;
  const auto start = Clock::now();
  const grpc::Status rpc = stub->ClusterStatus(&ctx, flashmesh::v1::ClusterStatusRequest(), &status);
  const auto took = Clock::now() - start;
  cluster.worker(1)->Signal(SIGCONT);
  cluster.worker(2)->Signal(SIGCONT);
  ASSERT_TRUE(rpc.ok()) << rpc.error_message();
  EXPECT_LT(took, 1500ms) << "one after the other, two Stats deadlines take 1600 ms";
  ASSERT_EQ(status.nodes_size(), 3);
  EXPECT_GT(status.nodes(0).weight_bytes(), 0u);
  for (int i : {1, 2}) {
    EXPECT_EQ(status.nodes(i).state(), flashmesh::v1::NODE_STATE_UP) << "frozen for less than the heartbeat timeout";
    EXPECT_EQ(status.nodes(i).weight_bytes(), 0u) << "a frozen node's counters are left out";
  }
}

// The verdict and the rows of one status reply agree while a frozen node goes down: a reply
// said "healthy" (read before its 800 ms wait for the frozen node's Stats) above that node's
// "down" row (read after it).
TEST(SelfHealing, AStatusReplyNeverCallsTheClusterHealthyAboveADownNode) {
  ClusterSpec spec;
  spec.http = true;
  Cluster cluster(spec);
  cluster.StartAll();
  ASSERT_TRUE(WaitHealthy(cluster.api(), 60s)) << cluster.Logs();
  auto stub = Connect(cluster.api());
  cluster.worker(1)->Signal(SIGSTOP);
  bool saw_down = false, scrape_saw_down = false;
  const auto until = Clock::now() + 4s;   // the heartbeat timeout is 2 s: it goes down within
  while (Clock::now() < until) {
    const auto st = Status(stub.get());
    ASSERT_EQ(st.nodes_size(), 3);
    const bool down = st.nodes(1).state() == flashmesh::v1::NODE_STATE_DOWN;
    saw_down = saw_down || down;
    EXPECT_FALSE(down && st.healthy()) << st.DebugString();
    // /metrics the same: never ready beside a node that is not up.
    const std::string m = HttpCall(cluster.http_port(), "GET", "/metrics", "", {}, 10s).body;
    const bool ready = m.find("\nflashmesh_cluster_ready 1\n") != std::string::npos;
    const bool w1_up = m.find("\nflashmesh_node_up{node=\"w1\"} 1\n") != std::string::npos;
    scrape_saw_down = scrape_saw_down || !w1_up;
    EXPECT_FALSE(ready && !w1_up) << m;
  }
  EXPECT_TRUE(scrape_saw_down);
  cluster.worker(1)->Signal(SIGCONT);
  EXPECT_TRUE(saw_down);
  EXPECT_TRUE(WaitHealthy(cluster.api(), 20s)) << cluster.Logs();
}

// A coordinator that did not run (SIGSTOP, a VM pause) past its calls' deadlines blames itself:
// a stream that fails then says so, and no healthy worker is marked down for it (its
// StallWatch saw the gap). 6 s: the steps in flight run out of time (5 s) during the pause, and
// so do the heartbeats (timeout 2 s).
TEST(SelfHealing, AFrozenCoordinatorBlamesItselfNotAHealthyWorker) {
  ClusterSpec spec;
  spec.max_tokens = 600;
  spec.max_context = 1024;
  Cluster cluster(spec);
  cluster.StartAll();
  ASSERT_TRUE(WaitHealthy(cluster.api(), 60s)) << cluster.Logs();
  auto stub = Connect(cluster.api());
  std::vector<std::unique_ptr<LiveStream>> live;
  for (int i = 0; i < 3; ++i) {
    live.push_back(std::make_unique<LiveStream>(stub.get(), TokensRequest(Prompt(i), 600)));
    ASSERT_TRUE(live.back()->started()) << cluster.Logs();
  }
  cluster.coordinator()->Signal(SIGSTOP);
  std::this_thread::sleep_for(6s);
  cluster.coordinator()->Signal(SIGCONT);
  for (auto& l : live) {
    const grpc::Status st = l->Finish();   // a stream whose answers were waiting may go on
    if (st.ok()) continue;
    EXPECT_EQ(st.error_code(), grpc::StatusCode::UNAVAILABLE);
    EXPECT_NE(st.error_message().find("this coordinator did not run for "), std::string::npos)
        << st.error_message();
  }
  ASSERT_TRUE(WaitHealthy(cluster.api(), 20s)) << cluster.Logs();
  const std::string log = cluster.coordinator()->Log();
  EXPECT_NE(log.find("this process did not run for "), std::string::npos) << log;
  for (int i = 0; i < 3; ++i)
    EXPECT_EQ(log.find("node " + cluster.node(i) + " down"), std::string::npos) << log;
  Generation g = Generate(stub.get(), TokensRequest(Prompt(3), 4));
  ASSERT_TRUE(g.status.ok()) << g.status.error_message();
  EXPECT_EQ(g.ids.size(), 4u);
}

TEST(SelfHealing, SixtyFourExpiredQueuedRequestsDoNotBlockANewOne) {
  ClusterSpec spec;
  spec.max_batch = 1;
  spec.max_queue = 64;
  spec.max_streams_per_client = 128;   // 65 at once from this one client
  Cluster cluster(spec);
  cluster.StartAll();
  ASSERT_TRUE(WaitHealthy(cluster.api(), 60s)) << cluster.Logs();
  auto stub = Connect(cluster.api());
  Stream busy(stub.get(), TokensRequest(Prompt(0), 200), 120s);   // holds the one batch slot
  ASSERT_TRUE(busy.WaitStarted(30s));
  {
    std::vector<std::unique_ptr<Stream>> expired;
    for (int i = 0; i < 64; ++i)
      expired.push_back(std::make_unique<Stream>(stub.get(), TokensRequest(Prompt(i), 4), 300ms));
    for (auto& e : expired) {
      e->thread.join();
      EXPECT_EQ(e->g.status.error_code(), grpc::StatusCode::DEADLINE_EXCEEDED) << e->g.status.error_message();
    }
  }
  const auto until = Clock::now() + 2s;
  while (Status(stub.get()).queued_requests() != 0 && Clock::now() < until) std::this_thread::sleep_for(20ms);
  EXPECT_EQ(Status(stub.get()).queued_requests(), 0);
  Generation fresh = Generate(stub.get(), TokensRequest(Prompt(5), 4));
  EXPECT_TRUE(fresh.status.ok()) << fresh.status.error_message();
  EXPECT_EQ(fresh.ids.size(), 4u);
}

TEST(SelfHealing, SigtermUnderLoadStopsEveryDaemonWithinItsGracePeriod) {
  Cluster cluster(ClusterSpec{});
  cluster.StartAll();
  ASSERT_TRUE(WaitHealthy(cluster.api(), 60s)) << cluster.Logs();
  auto stub = Connect(cluster.api());
  std::vector<std::unique_ptr<Stream>> load;
  for (int i = 0; i < 4; ++i) load.push_back(std::make_unique<Stream>(stub.get(), TokensRequest(Prompt(i), 250), 60s));
  for (auto& s : load) ASSERT_TRUE(s->WaitStarted(30s));
  // The last stage frozen: the steps of the others are in flight, waiting on it.
  cluster.worker(2)->Signal(SIGSTOP);
  std::this_thread::sleep_for(300ms);
  cluster.worker(1)->Signal(SIGTERM);
  EXPECT_EQ(cluster.worker(1)->Wait(5s), 0) << cluster.Logs();
  cluster.worker(2)->Signal(SIGCONT);
  cluster.coordinator()->Signal(SIGTERM);
  EXPECT_EQ(cluster.coordinator()->Wait(5s), 0) << cluster.Logs();
  for (int i : {0, 2}) {
    cluster.worker(i)->Signal(SIGTERM);
    EXPECT_EQ(cluster.worker(i)->Wait(5s), 0) << cluster.Logs();
  }
  for (auto& s : load) s->thread.join();
}

// 32 streams with random cancels while a worker is killed and restarted 5 times and another
// is reset once out of band: no request outlives its deadline, every completed one equals the
// single process, and nothing is left on the workers.
TEST(SelfHealing, SoakThirtyTwoStreamsThroughKillsRestartsAndAStrayReset) {
  Server reference;
  Cluster cluster(ClusterSpec{});
  cluster.StartAll();
  ASSERT_TRUE(WaitHealthy(reference.api(), 60s)) << reference.process()->Log();
  ASSERT_TRUE(WaitHealthy(cluster.api(), 60s)) << cluster.Logs();
  constexpr int kPrompts = 8, kTokens = 12;
  auto ref_stub = Connect(reference.api());
  std::vector<std::vector<int32_t>> want(kPrompts);
  for (int p = 0; p < kPrompts; ++p) {
    Generation g = Generate(ref_stub.get(), TokensRequest(Prompt(p), kTokens));
    ASSERT_TRUE(g.status.ok()) << g.status.error_message();
    want[p] = g.ids;
  }
  auto stub = Connect(cluster.api());
  std::atomic<bool> stop{false};
  std::atomic<int> completed{0}, failed{0}, cancelled{0};
  std::mutex mu;
  std::vector<std::string> problems;
  std::vector<std::thread> streams;
  for (int t = 0; t < 32; ++t) {
    streams.emplace_back([&, t] {
      std::mt19937 rng(t);
      for (int n = 0; !stop; ++n) {
        const int p = (t + n) % kPrompts;
        const bool cancel = rng() % 4 == 0;
        const auto deadline = 20s;
        grpc::ClientContext ctx;
        ctx.set_deadline(std::chrono::system_clock::now() + deadline);
        const auto sent = Clock::now();
        auto reader = stub->Generate(&ctx, TokensRequest(Prompt(p), kTokens));
        std::vector<int32_t> ids;
        flashmesh::v1::GenerateResponse resp;
        while (reader->Read(&resp)) {
          if (resp.has_token()) ids.push_back(resp.token().id());
          if (cancel && ids.size() == 3) ctx.TryCancel();
        }
        grpc::Status st = reader->Finish();
        std::lock_guard<std::mutex> lock(mu);
        if (Clock::now() - sent > deadline + 2s) problems.push_back("a request outlived its deadline");
        if (st.ok() && ids != want[p]) problems.push_back("prompt " + std::to_string(p) + ": other tokens");
        (st.ok() ? completed : cancel && st.error_code() == grpc::StatusCode::CANCELLED ? cancelled : failed)++;
        if (!st.ok()) std::this_thread::sleep_for(50ms);
      }
    });
  }
  for (int k = 0; k < 5; ++k) {
    std::this_thread::sleep_for(1500ms);
    cluster.KillWorker(1, SIGKILL);
    std::this_thread::sleep_for(300ms);
    cluster.StartWorker(1);
    EXPECT_TRUE(WaitHealthy(cluster.api(), 30s)) << cluster.Logs();
    if (k == 2) {
      auto w2 = WorkerStub(cluster, 2);
      grpc::ClientContext rctx;
      flashmesh::v1::ResetResponse rresp;
      EXPECT_TRUE(w2->Reset(&rctx, flashmesh::v1::ResetRequest(), &rresp).ok());
    }
  }
  std::this_thread::sleep_for(1500ms);
  stop = true;
  for (auto& t : streams) t.join();
  EXPECT_TRUE(problems.empty()) << problems.front();
  EXPECT_GE(completed, 8) << failed << " failed, " << cancelled << " cancelled";
  EXPECT_GT(cancelled, 0);
  ASSERT_TRUE(WaitHealthy(cluster.api(), 20s)) << cluster.Logs();
  EXPECT_EQ(WaitNothingHeld(stub.get(), 10s), "") << cluster.Logs();
}

}  // namespace
}  // namespace fm::it
