// Issue 17 on real processes: worker control RPCs refused without the coordinator's
// credential (and nothing changes), a worker's LoadShard peers pinned to the cluster YAML, a
// stale coordinator stepping down instead of fighting, and a worker's data plane under attack
// (unknown names, lying lengths) dropping the connection with its memory bounded while the
// cluster keeps serving.
#include <grpcpp/grpcpp.h>
#include <gtest/gtest.h>
#include <nlohmann/json.hpp>
#include <signal.h>

#include <cstdlib>
#include <fstream>
#include <iterator>
#include <functional>
#include <thread>

#include "flashmesh/v1/worker.grpc.pb.h"
#include "rpc/control_auth.h"
#include "tests/integration/cluster_fixture.h"
#include "tests/integration/http_client.h"
#include "tests/unit/test_net_util.h"

namespace fm::it {
namespace {

using namespace std::chrono_literals;
namespace v1 = flashmesh::v1;
using Call = std::function<grpc::Status(v1::Worker::Stub*, grpc::ClientContext*)>;

// Every Worker RPC, each with a request an attacker would send.
std::vector<std::pair<std::string, Call>> EveryWorkerRpc(const std::string& evil_dir) {
  return {
      {"LoadShard", [=](v1::Worker::Stub* s, grpc::ClientContext* c) {
         v1::LoadShardRequest r;   // the model swap
         r.mutable_shard()->set_model_dir(evil_dir);
         r.mutable_shard()->set_num_stages(1);
         r.mutable_shard()->set_embed(true);
         r.mutable_shard()->set_head(true);
         v1::LoadShardResponse out;
         return s->LoadShard(c, r, &out);
       }},
      {"Health", [](v1::Worker::Stub* s, grpc::ClientContext* c) {
         v1::HealthResponse out;
         return s->Health(c, v1::HealthRequest(), &out);
       }},
      {"Stats", [](v1::Worker::Stub* s, grpc::ClientContext* c) {
         v1::StatsResponse out;
         return s->Stats(c, v1::StatsRequest(), &out);
       }},
      {"Drain", [](v1::Worker::Stub* s, grpc::ClientContext* c) {
         v1::DrainResponse out;
         return s->Drain(c, v1::DrainRequest(), &out);
       }},
      {"Reset", [](v1::Worker::Stub* s, grpc::ClientContext* c) {
         v1::ResetResponse out;
         return s->Reset(c, v1::ResetRequest(), &out);
       }},
      {"StartSequence", [](v1::Worker::Stub* s, grpc::ClientContext* c) {
         v1::StartSequenceRequest r;
         r.set_seq_id(77);
         r.set_max_context(16);
         v1::StartSequenceResponse out;
         return s->StartSequence(c, r, &out);
       }},
      {"StepBatch", [](v1::Worker::Stub* s, grpc::ClientContext* c) {
         v1::StepBatchRequest r;
         r.set_step_id(1);
         r.add_items()->set_seq_id(77);
         v1::StepBatchResponse out;
         return s->StepBatch(c, r, &out);
       }},
      {"FreeSequence", [](v1::Worker::Stub* s, grpc::ClientContext* c) {
         v1::FreeSequenceRequest r;
         r.add_seq_ids(1);
         v1::FreeSequenceResponse out;
         return s->FreeSequence(c, r, &out);
       }},
      {"NewNcclId", [](v1::Worker::Stub* s, grpc::ClientContext* c) {
         v1::NewNcclIdResponse out;
         return s->NewNcclId(c, v1::NewNcclIdRequest(), &out);
       }},
  };
}

grpc::Status Invoke(const Call& call, v1::Worker::Stub* stub) {
  grpc::ClientContext ctx;
  ctx.set_deadline(std::chrono::system_clock::now() + 10s);
  return call(stub, &ctx);
}

// Signed for node 0 of `cluster` (its control address and name).
std::unique_ptr<v1::Worker::Stub> WorkerStub(const Cluster& cluster, const std::string& secret,
                                             uint64_t term) {
  return v1::Worker::NewStub(NewWorkerChannel(cluster.control(0), cluster.node(0), {}, secret, term));
}

void WaitForLog(Process* p, const std::string& needle) {
  const auto deadline = std::chrono::steady_clock::now() + 30s;
  while (p->Log().find(needle) == std::string::npos && std::chrono::steady_clock::now() < deadline)
    std::this_thread::sleep_for(20ms);
}

std::vector<int32_t> Greedy(v1::Inference::Stub* stub) {
  Generation g = Generate(stub, TokensRequest({5, 6, 7, 8}, 6));
  EXPECT_TRUE(g.status.ok()) << g.status.error_message();
  return g.ids;
}

TEST(Security, EveryWorkerRpcRefusesUnauthenticatedAndWrongCredentialCallers) {
  ClusterSpec spec;
  spec.stages = 1;
  Cluster cluster(spec);
  cluster.StartWorker(0);
  WaitForLog(cluster.worker(0), "(control)");
  TempDir evil;
  auto plain = v1::Worker::NewStub(grpc::CreateChannel(cluster.control(0),
                                                       grpc::InsecureChannelCredentials()));
  auto wrong = WorkerStub(cluster, "guessed-secret", ~uint64_t{0} >> 1);
  for (const auto& [name, call] : EveryWorkerRpc(evil.path())) {
    for (auto* stub : {plain.get(), wrong.get()}) {
      grpc::Status s = Invoke(call, stub);
      EXPECT_EQ(s.error_code(), grpc::StatusCode::UNAUTHENTICATED)
          << name << ": " << s.error_message();
      EXPECT_EQ(s.error_message().rfind(name + ": ", 0), 0u) << s.error_message();
    }
  }
  // Nothing changed: not loaded, not draining, no term followed.
  auto right = WorkerStub(cluster, spec.cluster_secret, 1);
  grpc::ClientContext ctx;
  v1::HealthResponse h;
  ASSERT_TRUE(right->Health(&ctx, v1::HealthRequest(), &h).ok());
  EXPECT_FALSE(h.loaded());
  EXPECT_FALSE(h.draining());
  EXPECT_EQ(h.term(), 0u);
}

// serve's in-process worker listens on a loopback port (ClusterStatus names it): its control
// calls need the credential of a secret made for that process, so another local user cannot
// drain, reset or reload it, with or without the API's bearer tokens.
TEST(Security, ServesInProcessWorkerRefusesUnsignedControlCalls) {
  Server server;
  ASSERT_TRUE(WaitHealthy(server.api(), 60s)) << server.process()->Log();
  auto api = Connect(server.api());
  const auto status = Status(api.get());
  ASSERT_EQ(status.nodes_size(), 1);
  auto plain = v1::Worker::NewStub(grpc::CreateChannel(status.nodes(0).control(),
                                                       grpc::InsecureChannelCredentials()));
  for (const auto& [name, call] : EveryWorkerRpc("/tmp"))
    EXPECT_EQ(Invoke(call, plain.get()).error_code(), grpc::StatusCode::UNAUTHENTICATED) << name;
  EXPECT_TRUE(Status(api.get()).healthy());
  EXPECT_TRUE(Generate(api.get(), TokensRequest({5, 6, 7}, 2)).status.ok());
}

TEST(Security, ForgedCallsChangeNothingOnAServingCluster) {
  ClusterSpec spec;
  spec.stages = 2;
  Cluster cluster(spec);
  cluster.StartAll();
  ASSERT_TRUE(WaitHealthy(cluster.api(), 60s)) << cluster.Logs();
  auto api = Connect(cluster.api());
  const std::vector<int32_t> before = Greedy(api.get());
  TempDir evil;
  for (int w = 0; w < 2; ++w) {
    auto plain = v1::Worker::NewStub(grpc::CreateChannel(cluster.control(w),
                                                         grpc::InsecureChannelCredentials()));
    for (const auto& [name, call] : EveryWorkerRpc(evil.path()))
      EXPECT_EQ(Invoke(call, plain.get()).error_code(), grpc::StatusCode::UNAUTHENTICATED) << name;
  }
  // Activation theft even with the secret: w0's next hop must be w1 at its YAML address.
  auto insider = WorkerStub(cluster, spec.cluster_secret, ~uint64_t{0} >> 1);
  grpc::ClientContext ctx;
  v1::LoadShardRequest steal;
  steal.mutable_shard()->set_num_stages(2);
  steal.mutable_shard()->set_embed(true);
  steal.mutable_shard()->set_next_node("w1");
  steal.mutable_shard()->set_next_data("127.0.0.1:1");
  v1::LoadShardResponse out;
  grpc::Status s = insider->LoadShard(&ctx, steal, &out);
  EXPECT_EQ(s.error_code(), grpc::StatusCode::INVALID_ARGUMENT);
  EXPECT_NE(s.error_message().find("shard.next_node: 'w1' at 127.0.0.1:1, but the cluster YAML puts "
                                   "its data plane at " + cluster.data(1)),
            std::string::npos)
      << s.error_message();
  // A malformed shard is refused before any group forms: an NCCL group would wait for its
  // peers (on a GPU) or fail for want of one (here), either way hiding the bad field.
  grpc::ClientContext ctx2;
  v1::LoadShardRequest group;
  v1::ShardSpec* g = group.mutable_shard();
  g->set_num_stages(1);
  g->set_head(true);   // but not embed, on stage 0
  for (int w = 0; w < 2; ++w) {
    g->add_ep_nodes(cluster.node(w));
    g->add_ep_data(cluster.data(w));
  }
  for (int64_t b : {0, 8, 16}) g->add_ep_expert_begin(b);
  g->set_ep_transport(v1::TRANSPORT_NCCL);
  s = insider->LoadShard(&ctx2, group, &out);
  EXPECT_EQ(s.error_code(), grpc::StatusCode::INVALID_ARGUMENT);
  EXPECT_NE(s.error_message().find("shard.embed: false on stage 0"), std::string::npos)
      << s.error_message();
  // A refused LoadShard moves nothing, not even the term: the cluster serves as before.
  EXPECT_TRUE(Status(api.get()).healthy()) << Status(api.get()).reason();
  EXPECT_EQ(Greedy(api.get()), before);
}

TEST(Security, StaleCoordinatorStepsDownAndTheNewOneServesWithoutAReloadStorm) {
  ClusterSpec spec;
  spec.stages = 2;
  Cluster cluster(spec);
  cluster.StartAll();
  ASSERT_TRUE(WaitHealthy(cluster.api(), 60s)) << cluster.Logs();
  cluster.coordinator()->Signal(SIGSTOP);   // the old coordinator freezes...
  std::string api_b;
  const std::unique_ptr<Process> b = cluster.StartNextCoordinator(&api_b);
  ASSERT_TRUE(WaitHealthy(api_b, 60s)) << b->Log() << cluster.Logs();
  cluster.coordinator()->Signal(SIGCONT);   // ...and wakes up with an older term
  auto stub_a = Connect(cluster.api());
  auto stub_b = Connect(api_b);
  const auto deadline = std::chrono::steady_clock::now() + 15s;
  while (Status(stub_a.get()).reason().find("stepped down") == std::string::npos &&
         std::chrono::steady_clock::now() < deadline)
    std::this_thread::sleep_for(100ms);
  const auto a = Status(stub_a.get());
  EXPECT_FALSE(a.healthy());
  EXPECT_NE(a.reason().find("stepped down: node w"), std::string::npos) << a.reason();
  // It no longer watches the nodes, so it vouches for none of them (they serve B).
  ASSERT_EQ(a.nodes_size(), 2);
  for (const auto& n : a.nodes()) {
    EXPECT_EQ(n.state(), v1::NODE_STATE_UNSPECIFIED) << n.name();
    EXPECT_NE(n.error().find("not watched: this coordinator (term"), std::string::npos) << n.error();
  }
  std::string out;
  EXPECT_EQ(RunFlashmesh({"health", "--server", cluster.api(), "--node", cluster.node(0)}, &out, 5s), 1) << out;
  EXPECT_NE(out.find("degraded: node " + cluster.node(0) + " is unknown: not watched"), std::string::npos) << out;
  // Three seconds of watching: B stays healthy throughout and loads nobody again.
  for (int i = 0; i < 30; ++i) {
    ASSERT_TRUE(Status(stub_b.get()).healthy()) << b->Log();
    std::this_thread::sleep_for(100ms);
  }
  for (const char* node : {"node w0 up", "node w1 up"}) {
    size_t n = 0;
    for (size_t at = b->Log().find(node); at != std::string::npos; at = b->Log().find(node, at + 1)) ++n;
    EXPECT_EQ(n, 1u) << node << " came up " << n << " times:\n" << b->Log();
  }
  Generation g = Generate(stub_b.get(), TokensRequest({5, 6, 7}, 4));
  EXPECT_TRUE(g.status.ok()) << g.status.error_message();
  EXPECT_EQ(g.ids.size(), 4u);
  Generation stale = Generate(stub_a.get(), TokensRequest({5, 6, 7}, 4));
  EXPECT_FALSE(stale.status.ok());
  EXPECT_NE(stale.status.error_message().find("stepped down"), std::string::npos)
      << stale.status.error_message();
}

TEST(Security, DataPlaneAttacksOnAWorkerAreDroppedWithItsMemoryBounded) {
  ClusterSpec spec;
  spec.stages = 2;
  spec.cluster_secret = "";   // the shipped default: loopback, no secret
  Cluster cluster(spec);
  cluster.StartAll();
  ASSERT_TRUE(WaitHealthy(cluster.api(), 60s)) << cluster.Logs();
  auto api = Connect(cluster.api());
  const std::vector<int32_t> before = Greedy(api.get());
  const pid_t w1 = cluster.worker(1)->pid();
  ASSERT_TRUE(net::ResetPeakResident(w1)) << "cannot write /proc/" << w1 << "/clear_refs";
  const uint64_t rss0 = net::PeakResidentBytes(w1);
  namespace asio = boost::asio;
  asio::io_context io;
  // An unknown name is refused in the handshake: the worker hangs up on its hello.
  asio::ip::tcp::socket stranger(io);
  stranger.connect(net::EndpointOf(cluster.data(1)));
  asio::write(stranger, asio::buffer(net::EncodeHello({"mallory", net::Nonce{}})));
  EXPECT_TRUE(net::ClosedByServer(stranger, 2000ms));
  // Three connections claiming w0's name (no secret) each announce a 1 GiB frame.
  for (int i = 0; i < 3; ++i) {
    asio::ip::tcp::socket liar(io);
    liar.connect(net::EndpointOf(cluster.data(1)));
    net::RawHandshake(liar, "w0", "w1", "");
    if (HasFatalFailure()) return;
    asio::write(liar, asio::buffer(net::HeaderClaiming(uint64_t{1} << 30)));
    EXPECT_TRUE(net::ClosedByServer(liar, 2000ms)) << "connection " << i;
  }
  EXPECT_LT(net::PeakResidentBytes(w1), rss0 + (uint64_t{64} << 20))
      << "w1 allocated a claimed frame";
  const std::string log = cluster.worker(1)->Log();
  EXPECT_NE(log.find("handshake: peer name 'mallory' is not one of this node's peers"),
            std::string::npos) << log;
  EXPECT_NE(log.find("exceeds the limit of"), std::string::npos) << log;
  // The cluster keeps serving the same tokens (w0 dials w1 again on its next frame).
  std::vector<int32_t> after;
  for (int attempt = 0; attempt < 3 && after != before; ++attempt) {
    Generation g = Generate(api.get(), TokensRequest({5, 6, 7, 8}, 6));
    if (g.status.ok()) after = g.ids;
  }
  EXPECT_EQ(after, before) << cluster.Logs();
}

TEST(Security, PublicApiLimitsRequestSizePromptStopStringsAndStreamsPerClient) {
  TempDir dir;   // tokens name clients (only checked tokens do)
  std::ofstream(dir.path() + "/tokens") << "client-a\nclient-b\nclient-c\n";
  Server server({"--max-streams-per-client", "16", "--token-file", dir.path() + "/tokens"});
  auto stub = Connect(server.api());
  const auto ready_by = std::chrono::steady_clock::now() + 60s;
  while (!Generate(stub.get(), TokensRequest({5, 6}, 1), "client-c").status.ok() &&
         std::chrono::steady_clock::now() < ready_by)   // until the in-process worker loaded
    std::this_thread::sleep_for(100ms);
  auto text = [](size_t bytes) {
    v1::GenerateRequest r;
    r.set_text(std::string(bytes, 'a'));
    r.set_max_tokens(1);
    return r;
  };
  Generation big = Generate(stub.get(), text(5 << 20), "client-c");   // over the 4 MiB request limit
  EXPECT_EQ(big.status.error_code(), grpc::StatusCode::RESOURCE_EXHAUSTED) << big.status.error_message();
  Generation long_prompt = Generate(stub.get(), text(32 * 8192 + 1), "client-c");   // serve: max_context 8192
  EXPECT_EQ(long_prompt.status.error_code(), grpc::StatusCode::INVALID_ARGUMENT);
  EXPECT_NE(long_prompt.status.error_message().find("input.text: 262145 bytes, more than 262144"),
            std::string::npos) << long_prompt.status.error_message();
  v1::GenerateRequest stops = TokensRequest({1, 2}, 1);
  for (int i = 0; i < 17; ++i) stops.add_stop("s" + std::to_string(i));
  Generation many = Generate(stub.get(), stops, "client-c");
  EXPECT_NE(many.status.error_message().find("stop: 17 strings (at most 16)"), std::string::npos);
  stops.clear_stop();
  stops.add_stop(std::string(257, 'x'));
  Generation long_stop = Generate(stub.get(), stops, "client-c");
  EXPECT_NE(long_stop.status.error_message().find("stop[0]: 257 bytes (at most 256)"),
            std::string::npos) << long_stop.status.error_message();
  // 16 generations of one client run; its 17th is refused at once; another client's is not.
  std::vector<std::unique_ptr<grpc::ClientContext>> ctxs;
  std::vector<std::unique_ptr<grpc::ClientReader<v1::GenerateResponse>>> running;
  for (int i = 0; i < 16; ++i) {
    ctxs.push_back(std::make_unique<grpc::ClientContext>());
    ctxs.back()->AddMetadata("authorization", "Bearer client-a");
    running.push_back(stub->Generate(ctxs.back().get(), TokensRequest({1, 2, 3}, 4000)));
    v1::GenerateResponse first;
    ASSERT_TRUE(running.back()->Read(&first)) << "stream " << i << " did not start";
  }
  Generation seventeenth = Generate(stub.get(), TokensRequest({1, 2, 3}, 1), "client-a");
  EXPECT_EQ(seventeenth.status.error_code(), grpc::StatusCode::RESOURCE_EXHAUSTED);
  EXPECT_NE(seventeenth.status.error_message().find("already has 16 generations running"),
            std::string::npos) << seventeenth.status.error_message();
  {   // client-b is admitted (queued behind the full batch: it only runs out of time)
    grpc::ClientContext ctx;
    ctx.AddMetadata("authorization", "Bearer client-b");
    ctx.set_deadline(std::chrono::system_clock::now() + 1s);
    auto reader = stub->Generate(&ctx, TokensRequest({1, 2, 3}, 1));
    v1::GenerateResponse resp;
    while (reader->Read(&resp)) {
    }
    const grpc::Status s = reader->Finish();
    EXPECT_NE(s.error_code(), grpc::StatusCode::RESOURCE_EXHAUSTED) << s.error_message();
  }
  for (auto& c : ctxs) c->TryCancel();
  for (auto& r : running) r->Finish();
}

// Without a token file a header names nobody: a tokenless gRPC client is its address, whatever
// it sends, so a new header per request does not get past the limit.
TEST(Security, WithoutTokensAClientIsItsAddressNotItsHeader) {
  Server server({"--max-streams-per-client", "1"});
  ASSERT_TRUE(WaitHealthy(server.api(), 60s)) << server.process()->Log();
  auto stub = Connect(server.api());
  grpc::ClientContext ctx;
  ctx.AddMetadata("authorization", "Bearer x1");
  auto running = stub->Generate(&ctx, TokensRequest({1, 2, 3}, 4000));
  v1::GenerateResponse first;
  ASSERT_TRUE(running->Read(&first)) << "the first stream did not start";
  Generation second = Generate(stub.get(), TokensRequest({1, 2, 3}, 1), "x2");
  EXPECT_EQ(second.status.error_code(), grpc::StatusCode::RESOURCE_EXHAUSTED) << second.status.error_message();
  ctx.TryCancel();
  running->Finish();
}

TEST(Security, TlsEndToEndWithGeneratedCertificates) {
  TempDir pki;
  ASSERT_TRUE(MakeTestCertificates(pki.path()));
  ClusterSpec spec;
  spec.stages = 2;
  spec.tls_dir = pki.path();
  spec.http = true;
  Cluster cluster(spec);
  cluster.StartAll();
  const std::string ca = pki.path() + "/ca.pem";
  std::string out;
  const auto deadline = std::chrono::steady_clock::now() + 60s;
  while (RunFlashmesh({"health", "--server", cluster.api(), "--tls-ca", ca}, &out) != 0 &&
         std::chrono::steady_clock::now() < deadline)
    std::this_thread::sleep_for(200ms);
  ASSERT_EQ(RunFlashmesh({"health", "--server", cluster.api(), "--tls-ca", ca}, &out), 0)
      << out << cluster.Logs();
  grpc::SslCredentialsOptions o;
  std::ifstream in(ca);
  o.pem_root_certs.assign(std::istreambuf_iterator<char>(in), std::istreambuf_iterator<char>());
  auto tls = v1::Inference::NewStub(grpc::CreateChannel(cluster.api(), grpc::SslCredentials(o)));
  Generation g = Generate(tls.get(), TokensRequest({5, 6, 7}, 4));
  ASSERT_TRUE(g.status.ok()) << g.status.error_message();
  EXPECT_EQ(g.ids.size(), 4u);
  // The HTTP API speaks TLS with the same certificate: the completion matches the gRPC one.
  std::string error;
  HttpResult https = HttpsRaw(cluster.http_port(), ca, Request("GET", "/health"), 30s, &error);
  EXPECT_EQ(https.status, 200) << error << https.raw;
  const std::string body = R"({"model":"m","prompt":[5,6,7],"max_tokens":4,"temperature":0,"ignore_eos":true})";
  https = HttpsRaw(cluster.http_port(), ca, Request("POST", "/v1/completions", body), 60s, &error);
  ASSERT_EQ(https.status, 200) << error << https.raw;
  EXPECT_NE(https.body.find("\"text\":" + nlohmann::json(g.text).dump()), std::string::npos) << https.body;
  // A plain-HTTP request gets no HTTP answer, and a client that does not trust the CA is refused.
  EXPECT_EQ(HttpCall(cluster.http_port(), "GET", "/health", "", {}, 10s).status, 0);
  EXPECT_EQ(HttpsRaw(cluster.http_port(), pki.path() + "/node.pem", Request("GET", "/health"), 10s,
                     &error).status, 0);
  EXPECT_NE(error.find("certificate verify failed"), std::string::npos) << error;
  // Plain text is not spoken; a worker wants a client certificate of the CA, not only the CA.
  Generation plain = Generate(Connect(cluster.api()).get(), TokensRequest({5, 6, 7}, 4));
  EXPECT_EQ(plain.status.error_code(), grpc::StatusCode::UNAVAILABLE) << plain.status.error_message();
  auto worker = v1::Worker::NewStub(NewWorkerChannel(cluster.control(0), cluster.node(0), {}, spec.cluster_secret, 1,
                                                     grpc::SslCredentials(o)));
  grpc::ClientContext ctx;
  ctx.set_deadline(std::chrono::system_clock::now() + 5s);
  v1::HealthResponse h;
  EXPECT_EQ(worker->Health(&ctx, v1::HealthRequest(), &h).error_code(), grpc::StatusCode::UNAVAILABLE);
}

}  // namespace
}  // namespace fm::it
