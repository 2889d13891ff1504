// The Inference API of `flashmesh serve`: request validation, queue limits, bearer tokens.
#include <arpa/inet.h>
#include <gtest/gtest.h>
#include <netinet/in.h>
#include <poll.h>
#include <sys/socket.h>
#include <unistd.h>

#include <cmath>
#include <fstream>
#include <limits>
#include <thread>

#include "rpc/grpc_status.h"
#include "tests/integration/cluster_fixture.h"

namespace fm::it {
namespace {

using namespace std::chrono_literals;

void ExpectError(const Generation& g, grpc::StatusCode code, const std::string& field) {
  EXPECT_EQ(g.status.error_code(), code) << g.status.error_message();
  EXPECT_NE(g.status.error_message().find(field), std::string::npos)
      << "'" << g.status.error_message() << "' does not name " << field;
  EXPECT_TRUE(g.ids.empty());
}

class ApiTest : public ::testing::Test {
 protected:
  static void SetUpTestSuite() {
    server_ = new Server({"--max-context", "64", "--max-tokens", "32"});
    ASSERT_TRUE(WaitHealthy(server_->api(), 60s)) << server_->process()->Log();
  }
  static void TearDownTestSuite() { delete server_; }
  static Server* server_;
};
Server* ApiTest::server_ = nullptr;

TEST_F(ApiTest, BadInputsAreInvalidArgumentNamingTheField) {
  auto stub = Connect(server_->api());
  flashmesh::v1::GenerateRequest empty;
  empty.set_max_tokens(4);
  ExpectError(Generate(stub.get(), empty), grpc::StatusCode::INVALID_ARGUMENT, "input");
  ExpectError(Generate(stub.get(), TokensRequest({}, 4)), grpc::StatusCode::INVALID_ARGUMENT, "input.tokens");

  ExpectError(Generate(stub.get(), TokensRequest({5, 1 << 30}, 4)), grpc::StatusCode::INVALID_ARGUMENT,
              "input.tokens.ids[1]");
  ExpectError(Generate(stub.get(), TokensRequest({5, -1}, 4)), grpc::StatusCode::INVALID_ARGUMENT,
              "input.tokens.ids[1]");
  ExpectError(Generate(stub.get(), TokensRequest({5, 6}, 0)), grpc::StatusCode::INVALID_ARGUMENT, "max_tokens");
  ExpectError(Generate(stub.get(), TokensRequest({5, 6}, -3)), grpc::StatusCode::INVALID_ARGUMENT, "max_tokens");
  ExpectError(Generate(stub.get(), TokensRequest({5, 6}, 33)), grpc::StatusCode::INVALID_ARGUMENT, "max_tokens");
  ExpectError(Generate(stub.get(), TokensRequest(std::vector<int32_t>(64, 7), 4)),
              grpc::StatusCode::INVALID_ARGUMENT, "max_context");

  auto neg_t = TokensRequest({5, 6}, 4);
  neg_t.mutable_sampling()->set_greedy(false);
  neg_t.mutable_sampling()->set_temperature(-0.5f);
  ExpectError(Generate(stub.get(), neg_t), grpc::StatusCode::INVALID_ARGUMENT, "sampling.temperature");
  for (float t : {std::nanf(""), std::numeric_limits<float>::infinity()}) {
    auto bad_t = TokensRequest({5, 6}, 4);
    bad_t.mutable_sampling()->set_greedy(false);
    bad_t.mutable_sampling()->set_temperature(t);
    ExpectError(Generate(stub.get(), bad_t), grpc::StatusCode::INVALID_ARGUMENT, "is not a finite number");
  }
  for (float p : {0.0f, -0.1f, 1.5f}) {
    auto bad_p = TokensRequest({5, 6}, 4);
    bad_p.mutable_sampling()->set_greedy(false);
    bad_p.mutable_sampling()->set_temperature(0.7f);
    bad_p.mutable_sampling()->set_top_p(p);
    ExpectError(Generate(stub.get(), bad_p), grpc::StatusCode::INVALID_ARGUMENT, "sampling.top_p");
  }
  // Penalties apply with greedy too, so they are checked with it.
  for (auto [field, value] : {std::pair{"sampling.repetition_penalty", 0.0f},
                              std::pair{"sampling.repetition_penalty", -1.0f},
                              std::pair{"sampling.frequency_penalty", 2.5f},
                              std::pair{"sampling.presence_penalty", std::nanf("")}}) {
    auto bad = TokensRequest({5, 6}, 4);
    auto* s = bad.mutable_sampling();
    s->set_greedy(true);
    if (std::string(field) == "sampling.repetition_penalty") s->set_repetition_penalty(value);
    if (std::string(field) == "sampling.frequency_penalty") s->set_frequency_penalty(value);
    if (std::string(field) == "sampling.presence_penalty") s->set_presence_penalty(value);
    ExpectError(Generate(stub.get(), bad), grpc::StatusCode::INVALID_ARGUMENT, field);
  }
  auto bad_min_p = TokensRequest({5, 6}, 4);
  bad_min_p.mutable_sampling()->set_greedy(false);
  bad_min_p.mutable_sampling()->set_temperature(0.5f);
  bad_min_p.mutable_sampling()->set_min_p(1.5f);
  ExpectError(Generate(stub.get(), bad_min_p), grpc::StatusCode::INVALID_ARGUMENT, "sampling.min_p: 1.500000 outside [0, 1]");
  auto bad_bias = TokensRequest({5, 6}, 4);
  (*bad_bias.mutable_sampling()->mutable_logit_bias())[1 << 30] = 1.0f;
  ExpectError(Generate(stub.get(), bad_bias), grpc::StatusCode::INVALID_ARGUMENT,
              "sampling.logit_bias: token 1073741824 outside [0, ");
  auto bad_stop_id = TokensRequest({5, 6}, 4);
  bad_stop_id.add_stop_token_ids(3);
  bad_stop_id.add_stop_token_ids(-3);
  ExpectError(Generate(stub.get(), bad_stop_id), grpc::StatusCode::INVALID_ARGUMENT, "stop_token_ids[1]: -3 outside");
  auto bad_min_tokens = TokensRequest({5, 6}, 4);
  bad_min_tokens.set_min_tokens(5);
  ExpectError(Generate(stub.get(), bad_min_tokens), grpc::StatusCode::INVALID_ARGUMENT,
              "min_tokens: 5 outside [0, max_tokens 4]");
  for (int n : {-1, 21}) {   // greedy too: alternatives are asked for either way
    auto bad_top = TokensRequest({5, 6}, 4);
    bad_top.mutable_sampling()->set_greedy(true);
    bad_top.mutable_sampling()->set_top_logprobs(n);
    ExpectError(Generate(stub.get(), bad_top), grpc::StatusCode::INVALID_ARGUMENT,
                "sampling.top_logprobs: " + std::to_string(n) + " outside [0, 20]");
  }
  // Malformed UTF-8 in text fields: refused naming the field and the byte (was INTERNAL with
  // no details while the fields were proto strings).
  flashmesh::v1::GenerateRequest bad_text;
  bad_text.set_text("hi \xC3\x28 there");
  bad_text.set_max_tokens(4);
  ExpectError(Generate(stub.get(), bad_text), grpc::StatusCode::INVALID_ARGUMENT,
              "input.text: not valid UTF-8 (byte 3 of 11)");
  auto bad_stop = TokensRequest({5, 6}, 4);
  bad_stop.add_stop("ok");
  bad_stop.add_stop("\xFF");
  ExpectError(Generate(stub.get(), bad_stop), grpc::StatusCode::INVALID_ARGUMENT,
              "stop[1]: not valid UTF-8 (byte 0 of 1)");
  // Greedy ignores the other sampling fields (api.proto), whatever they hold.
  auto greedy_nan = TokensRequest({5, 6}, 3);
  greedy_nan.mutable_sampling()->set_temperature(std::nanf(""));
  greedy_nan.mutable_sampling()->set_top_p(7.f);
  Generation g = Generate(stub.get(), greedy_nan);
  EXPECT_TRUE(g.status.ok()) << g.status.error_message();
  // And a good request still works afterwards.
  Generation ok = Generate(stub.get(), TokensRequest({5, 6}, 3));
  ASSERT_TRUE(ok.status.ok()) << ok.status.error_message();
  EXPECT_EQ(ok.ids.size(), 3u);
}

TEST_F(ApiTest, ContextLimitFinishesWithLength) {
  auto stub = Connect(server_->api());
  Generation g = Generate(stub.get(), TokensRequest(std::vector<int32_t>(60, 9), 32));
  ASSERT_TRUE(g.status.ok()) << g.status.error_message();
  EXPECT_EQ(g.finish.reason(), flashmesh::v1::FINISH_REASON_LENGTH);
  EXPECT_EQ(g.ids.size(), 4u) << "60 prompt + 4 generated = max_context 64";
}

TEST_F(ApiTest, TextInputAndStopStrings) {
  auto stub = Connect(server_->api());
  flashmesh::v1::GenerateRequest req;
  req.set_text("hello world");
  req.set_max_tokens(12);
  req.set_ignore_eos(true);
  req.mutable_sampling()->set_greedy(true);
  Generation g = Generate(stub.get(), req);
  ASSERT_TRUE(g.status.ok()) << g.status.error_message();
  EXPECT_EQ(g.ids.size(), 12u);
  EXPECT_EQ(g.finish.reason(), flashmesh::v1::FINISH_REASON_LENGTH);
  // Stop at the first non-empty piece of the greedy continuation: the same tokens up to it.
  size_t first = 0;
  while (first < g.pieces.size() && g.pieces[first].empty()) ++first;
  ASSERT_LT(first, g.pieces.size()) << "greedy continuation decoded to no text";
  req.add_stop(g.pieces[first]);
  Generation s = Generate(stub.get(), req);
  ASSERT_TRUE(s.status.ok()) << s.status.error_message();
  EXPECT_EQ(s.finish.reason(), flashmesh::v1::FINISH_REASON_STOP);
  EXPECT_EQ(s.finish.stop_string(), g.pieces[first]);
  ASSERT_LE(s.ids.size(), first + 1);
  EXPECT_EQ(s.ids, std::vector<int32_t>(g.ids.begin(), g.ids.begin() + s.ids.size()));
}

// Tokenize answers every text the tokenizer takes: a character split over byte-level tokens
// made the reply's pieces invalid UTF-8, which a proto3 string may not hold (the client could
// not parse it). Its text is bounded as Generate's.
TEST_F(ApiTest, TokenizeGivesEachTokensBytesAndBoundsItsText) {
  auto stub = Connect(server_->api());
  const std::string text = "hello \u4f60\u597d \U0001F600";
  flashmesh::v1::TokenizeRequest req;
  req.set_text(text);
  flashmesh::v1::TokenizeResponse resp;
  grpc::ClientContext ctx;
  const grpc::Status st = stub->Tokenize(&ctx, req, &resp);
  ASSERT_TRUE(st.ok()) << st.error_message();
  ASSERT_EQ(resp.ids_size(), resp.pieces_size());
  std::string joined;
  for (const auto& p : resp.pieces()) joined += p;
  EXPECT_EQ(joined, text);
  req.set_text(std::string(32 * 64 + 1, 'a'));   // over 32 bytes x max_context 64
  grpc::ClientContext big;
  const grpc::Status refused = stub->Tokenize(&big, req, &resp);
  EXPECT_EQ(refused.error_code(), grpc::StatusCode::INVALID_ARGUMENT);
  EXPECT_EQ(refused.error_message().rfind("text: ", 0), 0u) << refused.error_message();
}

// A connection that never starts HTTP/2 (a leaked or hostile socket) is closed once the
// handshake timeout passes, instead of holding a descriptor for good.
TEST_F(ApiTest, ASilentConnectionIsClosedAfterTheHandshakeTimeout) {
  const std::string api = server_->api();
  const int port = std::stoi(api.substr(api.rfind(':') + 1));
  const int fd = ::socket(AF_INET, SOCK_STREAM, 0);
  ASSERT_GE(fd, 0);
  sockaddr_in addr{};
  addr.sin_family = AF_INET;
  addr.sin_port = htons(static_cast<uint16_t>(port));
  addr.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  ASSERT_EQ(::connect(fd, reinterpret_cast<sockaddr*>(&addr), sizeof addr), 0);
  const auto start = std::chrono::steady_clock::now();
  bool closed = false;
  while (!closed && std::chrono::steady_clock::now() - start < kHandshakeTimeout + 5s) {
    pollfd p{fd, POLLIN, 0};
    if (::poll(&p, 1, 200) <= 0) continue;
    char buf[256];
    closed = ::recv(fd, buf, sizeof buf, 0) <= 0;
  }
  ::close(fd);
  EXPECT_TRUE(closed) << "still open " << (kHandshakeTimeout + 5s).count() << " ms after connecting";
}

TEST(ApiLimits, FullQueueIsResourceExhausted) {
  Server server({"--max-batch", "1", "--max-queue", "1", "--max-tokens", "4096", "--max-context", "8192"});
  ASSERT_TRUE(WaitHealthy(server.api(), 60s)) << server.process()->Log();
  auto stub = Connect(server.api());
  // One long request running, one queued behind it: the third finds the queue full.
  // Each is seen running / queued before the next is sent (a fixed pause raced a slow start).
  std::vector<std::thread> threads;
  std::vector<std::unique_ptr<grpc::ClientContext>> ctxs;
  ctxs.reserve(2);
  for (int i = 0; i < 2; ++i) {
    ctxs.push_back(std::make_unique<grpc::ClientContext>());
    grpc::ClientContext* ctx = ctxs.back().get();
    threads.emplace_back([&, ctx] {
      auto req = TokensRequest({5, 6, 7}, 4000);
      auto reader = stub->Generate(ctx, req);
      flashmesh::v1::GenerateResponse resp;
      while (reader->Read(&resp)) {
      }
      reader->Finish();
    });
    const auto until = std::chrono::steady_clock::now() + 30s;
    auto seen = [&] {
      const auto st = Status(stub.get());
      return st.active_requests() == 1 && st.queued_requests() == i;
    };
    while (!seen() && std::chrono::steady_clock::now() < until) std::this_thread::sleep_for(20ms);
    if (!seen()) {
      ADD_FAILURE() << "request " << i << " not seen: " << Status(stub.get()).DebugString();
      break;
    }
  }
  if (!HasFailure()) {
    Generation g = Generate(stub.get(), TokensRequest({5, 6}, 4));
    ExpectError(g, grpc::StatusCode::RESOURCE_EXHAUSTED, "max_queue");
  }
  for (auto& c : ctxs) c->TryCancel();
  for (auto& t : threads) t.join();
}

// A deadline centuries out (Python's timeout=1e10 s) is no deadline: it overflowed the
// nanoseconds of ServerContext::deadline() and could land in the past.
TEST(ApiLimits, AFarDeadlineIsNoDeadline) {
  Server server;
  ASSERT_TRUE(WaitHealthy(server.api(), 60s)) << server.process()->Log();
  auto stub = Connect(server.api());
  grpc::ClientContext ctx;
  ctx.set_deadline(gpr_time_add(gpr_now(GPR_CLOCK_REALTIME), gpr_time_from_seconds(10000000000LL, GPR_TIMESPAN)));
  auto reader = stub->Generate(&ctx, TokensRequest({5, 6}, 3));
  flashmesh::v1::GenerateResponse resp;
  int tokens = 0;
  bool finished = false;
  while (reader->Read(&resp)) {
    tokens += resp.has_token();
    finished = finished || resp.has_finish();
  }
  const grpc::Status st = reader->Finish();
  EXPECT_TRUE(st.ok()) << st.error_code() << " " << st.error_message();
  EXPECT_EQ(tokens, 3);
  EXPECT_TRUE(finished);
}

// A client that stops reading a stream: once its flow-control window is full the server's write
// waits; after --write-stall-timeout the call is cancelled and its stream slot freed, so the
// same client can generate again (it used to stay held until the connection died).
TEST(ApiLimits, AClientThatStopsReadingLosesItsStreamAfterTheWriteStallTimeout) {
  Server server({"--max-streams-per-client", "1", "--max-tokens", "3000", "--max-context", "4096",
                 "--write-stall-timeout", "1"});
  ASSERT_TRUE(WaitHealthy(server.api(), 60s)) << server.process()->Log();
  // A small window (4 KiB, no BDP growth): a few hundred tokens fill it.
  grpc::ChannelArguments args;
  args.SetInt(GRPC_ARG_HTTP2_BDP_PROBE, 0);
  args.SetInt(GRPC_ARG_HTTP2_STREAM_LOOKAHEAD_BYTES, 4096);
  auto slow = flashmesh::v1::Inference::NewStub(
      grpc::CreateCustomChannel(server.api(), grpc::InsecureChannelCredentials(), args));
  grpc::ClientContext ctx;
  auto req = TokensRequest({5, 6, 7}, 3000);
  req.set_ignore_eos(true);
  auto reader = slow->Generate(&ctx, req);   // never read
  auto stub = Connect(server.api());
  const auto until = std::chrono::steady_clock::now() + 60s;
  Generation g;
  do {
    std::this_thread::sleep_for(200ms);
    g = Generate(stub.get(), TokensRequest({5, 6}, 2));
  } while (!g.status.ok() && std::chrono::steady_clock::now() < until);
  EXPECT_TRUE(g.status.ok()) << g.status.error_message() << "\n" << Status(stub.get()).DebugString();
  ctx.TryCancel();
  reader->Finish();
}

TEST(ApiAuth, BearerTokenFromTokenFile) {
  TempDir dir;
  std::ofstream(dir.path() + "/tokens") << "# API tokens\ns3cret\n";
  Server server({"--token-file", dir.path() + "/tokens"});
  auto stub = Connect(server.api());
  auto deadline = std::chrono::steady_clock::now() + 60s;
  Generation g;
  do {   // wait until the in-process worker has loaded
    g = Generate(stub.get(), TokensRequest({5, 6}, 2), "s3cret");
    if (g.status.ok()) break;
    std::this_thread::sleep_for(100ms);
  } while (std::chrono::steady_clock::now() < deadline);
  ASSERT_TRUE(g.status.ok()) << g.status.error_message() << server.process()->Log();
  EXPECT_EQ(Generate(stub.get(), TokensRequest({5, 6}, 2)).status.error_code(), grpc::StatusCode::UNAUTHENTICATED);
  EXPECT_EQ(Generate(stub.get(), TokensRequest({5, 6}, 2), "wrong").status.error_code(),
            grpc::StatusCode::UNAUTHENTICATED);
  std::string out;
  EXPECT_EQ(RunFlashmesh({"health", "--server", server.api(), "--token-file", dir.path() + "/tokens"}, &out, 10s), 0) << out;
  // Nothing asked (exit 3), not "down" (2): refused credentials, unusable flags, a typo.
  std::ofstream(dir.path() + "/wrong") << "wrong\n";
  for (const std::string cmd : {"health", "status"}) {
    EXPECT_EQ(RunFlashmesh({cmd, "--server", server.api(), "--token-file", dir.path() + "/wrong"}, &out, 10s), 3) << out;
    EXPECT_NE(out.find(cmd + ": coordinator " + server.api() + " refused the credentials"), std::string::npos) << out;
    EXPECT_EQ(RunFlashmesh({cmd, "--server", server.api()}, &out, 10s), 3) << out;
    EXPECT_EQ(RunFlashmesh({cmd, "--server", server.api(), "--token-file", dir.path() + "/none"}, &out, 10s), 3) << out;
    EXPECT_EQ(RunFlashmesh({cmd, "--server", server.api(), "--tls-ca", dir.path() + "/tokens"}, &out, 10s), 3) << out;
    EXPECT_NE(out.find("not a PEM file"), std::string::npos) << out;
    EXPECT_EQ(RunFlashmesh({cmd, "--sever", server.api()}, &out, 10s), 3) << out;
  }
}

}  // namespace
}  // namespace fm::it
