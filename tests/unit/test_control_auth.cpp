// Worker control-RPC credentials and fencing (rpc/control_auth.h) over a real in-process
// gRPC server: signed calls pass, unsigned / wrong-secret / altered / replayed / expired ones
// are UNAUTHENTICATED, and an older coordinator term is refused state changes.
#include <grpcpp/grpcpp.h>

#include <chrono>
#include <mutex>
#include <string>

#include <gtest/gtest.h>

#include "flashmesh/v1/worker.grpc.pb.h"
#include "rpc/control_auth.h"
#include "rpc/grpc_status.h"

namespace fm {
namespace {

namespace v1 = flashmesh::v1;

// Health (read-only) and StartSequence (a state change, standing in for a LoadShard: its term
// is followed once it passed) behind a ControlGuard; remembers the last credential it saw so
// that a test can replay it.
class GuardedService final : public v1::Worker::Service {
 public:
  GuardedService(const std::string& secret, const std::string& node) : guard_(secret, node) {}
  grpc::Status Health(grpc::ServerContext* ctx, const v1::HealthRequest* req,
                      v1::HealthResponse* resp) override {
    Remember(*ctx);
    if (grpc::Status a = guard_.Admit(ctx, "Health", *req, false); !a.ok()) return a;
    resp->set_term(guard_.term());
    return grpc::Status::OK;
  }
  grpc::Status StartSequence(grpc::ServerContext* ctx, const v1::StartSequenceRequest* req,
                             v1::StartSequenceResponse*) override {
    Remember(*ctx);
    uint64_t term = 0;
    grpc::Status a = guard_.Admit(ctx, "StartSequence", *req, true, &term);
    if (a.ok()) guard_.Follow(term);
    return a;
  }
  std::string last_auth() {
    std::lock_guard<std::mutex> l(mu_);
    return last_auth_;
  }
  uint64_t term() const { return guard_.term(); }

 private:
  void Remember(const grpc::ServerContext& ctx) {
    auto it = ctx.client_metadata().find(kAuthMetadata);
    std::lock_guard<std::mutex> l(mu_);
    last_auth_ = it == ctx.client_metadata().end() ? "" : std::string(it->second.data(), it->second.size());
  }
  ControlGuard guard_;
  std::mutex mu_;
  std::string last_auth_;
};

class ControlAuth : public ::testing::Test {
 protected:
  void SetUp() override {
    auto s = StartGrpcServer("127.0.0.1:0", &service_, &port_, 1 << 20);
    ASSERT_TRUE(s.ok()) << s.status().ToString();
    server_ = std::move(s).value();
  }
  void TearDown() override { server_->Shutdown(); }
  std::string address() const { return "127.0.0.1:" + std::to_string(port_); }
  std::unique_ptr<v1::Worker::Stub> Signed(const std::string& secret, uint64_t term,
                                           const std::string& node = "w0") {
    return v1::Worker::NewStub(NewWorkerChannel(address(), node, {}, secret, term));
  }
  std::unique_ptr<v1::Worker::Stub> Plain() {
    return v1::Worker::NewStub(grpc::CreateChannel(address(), grpc::InsecureChannelCredentials()));
  }

  GuardedService service_{"s3cret", "w0"};
  int port_ = 0;
  std::unique_ptr<grpc::Server> server_;
};

grpc::Status Health(v1::Worker::Stub* stub, v1::HealthResponse* resp,
                    const std::multimap<std::string, std::string>& md = {}) {
  grpc::ClientContext ctx;
  for (const auto& [k, v] : md) ctx.AddMetadata(k, v);
  return stub->Health(&ctx, v1::HealthRequest(), resp);
}

grpc::Status Start(v1::Worker::Stub* stub, uint64_t seq,
                   const std::multimap<std::string, std::string>& md = {}) {
  grpc::ClientContext ctx;
  for (const auto& [k, v] : md) ctx.AddMetadata(k, v);
  v1::StartSequenceRequest req;
  req.set_seq_id(seq);
  v1::StartSequenceResponse resp;
  return stub->StartSequence(&ctx, req, &resp);
}

void ExpectRefused(const grpc::Status& s, grpc::StatusCode code, const std::string& needle) {
  EXPECT_EQ(s.error_code(), code) << s.error_message();
  EXPECT_NE(s.error_message().find(needle), std::string::npos) << s.error_message();
}

TEST_F(ControlAuth, SignedCallsPassAndTheNewestTermIsFollowed) {
  auto t100 = Signed("s3cret", 100);
  v1::HealthResponse h;
  ASSERT_TRUE(Health(t100.get(), &h).ok());
  EXPECT_EQ(h.term(), 0u) << "a read does not change the followed term";
  ASSERT_TRUE(Start(t100.get(), 1).ok());
  EXPECT_EQ(service_.term(), 100u);
  auto t50 = Signed("s3cret", 50);
  ExpectRefused(Start(t50.get(), 2), grpc::StatusCode::FAILED_PRECONDITION,
                "StartSequence refused: stale coordinator term 50; this worker follows term 100");
  {  // marked, so that the stale coordinator steps down instead of taking the worker for dead
    grpc::ClientContext ctx;
    v1::StartSequenceRequest req;
    req.set_seq_id(5);
    v1::StartSequenceResponse resp;
    ASSERT_FALSE(t50->StartSequence(&ctx, req, &resp).ok());
    const auto& md = ctx.GetServerTrailingMetadata();
    auto it = md.find(kFaultKey);
    ASSERT_NE(it, md.end()) << "no fault mark";
    EXPECT_EQ(std::string(it->second.data(), it->second.size()), kFaultSuperseded);
  }
  ASSERT_TRUE(Health(t50.get(), &h).ok());   // the stale one may still look, and learns why
  EXPECT_EQ(h.term(), 100u);
  ASSERT_TRUE(Start(Signed("s3cret", 200).get(), 3).ok());
  EXPECT_EQ(service_.term(), 200u);
  ExpectRefused(Start(t100.get(), 4), grpc::StatusCode::FAILED_PRECONDITION, "follows term 200");
}

// A request with a map field (Sampling.logit_bias) verifies whatever order protobuf writes the
// entries in: the MAC signs deterministic bytes on both sides. Signed over SerializeAsString,
// most of these calls failed ("credential does not verify") and the worker was marked down.
TEST_F(ControlAuth, ARequestWithAMapFieldVerifies) {
  auto stub = Signed("s3cret", 100);
  for (int call = 0; call < 20; ++call) {
    grpc::ClientContext ctx;
    v1::StartSequenceRequest req;
    req.set_seq_id(100 + call);
    for (int k = 0; k < 16; ++k) (*req.mutable_sampling()->mutable_logit_bias())[(k * 7919 + call * 31) % 4096] = k - 8.0f;
    v1::StartSequenceResponse resp;
    const grpc::Status s = stub->StartSequence(&ctx, req, &resp);
    ASSERT_TRUE(s.ok()) << "call " << call << ": " << s.error_message();
  }
  v1::StartSequenceRequest a, b;
  for (int k = 0; k < 64; ++k) (*a.mutable_sampling()->mutable_logit_bias())[k * 13] = 1.0f;
  ASSERT_TRUE(b.ParseFromString(a.SerializeAsString()));
  EXPECT_EQ(CanonicalBytes(a), CanonicalBytes(b));
}

TEST_F(ControlAuth, UnsignedWrongAlteredReplayedAndExpiredCallsAreRefused) {
  v1::HealthResponse h;
  ExpectRefused(Health(Plain().get(), &h), grpc::StatusCode::UNAUTHENTICATED,
                "Health: missing or malformed 'x-flashmesh-term'");
  ExpectRefused(Health(Plain().get(), &h, {{kTermMetadata, "7"}}),
                grpc::StatusCode::UNAUTHENTICATED, "requires the cluster secret");
  ExpectRefused(Health(Signed("other", 7).get(), &h), grpc::StatusCode::UNAUTHENTICATED,
                "does not verify");
  ExpectRefused(Start(Signed("other", 7).get(), 1), grpc::StatusCode::UNAUTHENTICATED,
                "does not verify");
  EXPECT_EQ(service_.term(), 0u) << "a refused call must not move the term";

  // A recorded call: replayed as is, on another RPC, or with another body.
  ASSERT_TRUE(Start(Signed("s3cret", 7).get(), 1).ok());
  const std::string recorded = service_.last_auth();
  ASSERT_FALSE(recorded.empty());
  auto plain = Plain();
  ExpectRefused(Start(plain.get(), 1, {{kTermMetadata, "7"}, {kAuthMetadata, recorded}}),
                grpc::StatusCode::UNAUTHENTICATED, "already used");
  ExpectRefused(Start(plain.get(), 2, {{kTermMetadata, "7"}, {kAuthMetadata, recorded}}),
                grpc::StatusCode::UNAUTHENTICATED, "does not verify");
  ExpectRefused(Health(plain.get(), &h, {{kTermMetadata, "7"}, {kAuthMetadata, recorded}}),
                grpc::StatusCode::UNAUTHENTICATED, "does not verify");
  ExpectRefused(Start(plain.get(), 1, {{kTermMetadata, "8"}, {kAuthMetadata, recorded}}),
                grpc::StatusCode::UNAUTHENTICATED, "does not verify");

  // A call signed for another worker (a Reset{} or Drain{} body is the same for all).
  ExpectRefused(Start(Signed("s3cret", 7, "w1").get(), 1), grpc::StatusCode::UNAUTHENTICATED,
                "a call for another node");
  // Numbers of the allowed digit counts past 64 bits.
  ExpectRefused(Health(plain.get(), &h, {{kTermMetadata, "99999999999999999999"}}),
                grpc::StatusCode::UNAUTHENTICATED, "out of range");
  ExpectRefused(Health(plain.get(), &h, {{kTermMetadata, "7"}, {kAuthMetadata, "9999999999999999999.n.m"}}),
                grpc::StatusCode::UNAUTHENTICATED, "out of range");

  // A valid MAC over a timestamp two minutes old.
  const int64_t old = std::chrono::duration_cast<std::chrono::milliseconds>(
                          std::chrono::system_clock::now().time_since_epoch())
                          .count() -
                      120000;
  v1::StartSequenceRequest req;
  req.set_seq_id(5);
  const std::string mac = ControlCallMac(ControlKey("s3cret"), "w0", "StartSequence", 7, old, "n0nce",
                                         req.SerializeAsString());
  ExpectRefused(Start(plain.get(), 5,
                      {{kTermMetadata, "7"}, {kAuthMetadata, std::to_string(old) + ".n0nce." + mac}}),
                grpc::StatusCode::UNAUTHENTICATED, "off this worker's clock");
}

// A worker whose Health lists `ids` live sequences (8-byte varints each past 2^49).
class ListingService final : public v1::Worker::Service {
 public:
  explicit ListingService(int ids) : ids_(ids) {}
  grpc::Status Health(grpc::ServerContext*, const v1::HealthRequest*,
                      v1::HealthResponse* resp) override {
    for (int i = 0; i < ids_; ++i) resp->add_seq_ids((uint64_t{1} << 50) + static_cast<uint64_t>(i));
    return grpc::Status::OK;
  }

 private:
  int ids_;
};

// The coordinator's worker channel takes a reply up to kWorkerMaxReplyBytes and fails a larger
// one with RESOURCE_EXHAUSTED instead of receiving it whole.
TEST(WorkerChannel, RefusesAReplyOverTheCap) {
  // Packed, 8 bytes an id: 1000 ids (8 KB) under and over the cap.
  for (int ids : {kWorkerMaxReplyBytes / 8 - 1000, kWorkerMaxReplyBytes / 8 + 1000}) {
    ListingService service(ids);
    int port = 0;
    auto server = StartGrpcServer("127.0.0.1:0", &service, &port, 1 << 20);
    ASSERT_TRUE(server.ok()) << server.status().ToString();
    auto stub = v1::Worker::NewStub(
        NewWorkerChannel("127.0.0.1:" + std::to_string(port), "w0", WorkerChannelArgs(), "", 1));
    v1::HealthResponse h;
    grpc::ClientContext ctx;
    ctx.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(30));
    grpc::Status s = stub->Health(&ctx, v1::HealthRequest(), &h);
    if (ids < kWorkerMaxReplyBytes / 8) {
      ASSERT_TRUE(s.ok()) << s.error_message();
      EXPECT_EQ(h.seq_ids_size(), ids);
    } else {
      ExpectRefused(s, grpc::StatusCode::RESOURCE_EXHAUSTED, "larger than max");
      EXPECT_EQ(h.seq_ids_size(), 0);
    }
    server.value()->Shutdown();
  }
}

// A port in use is an error, not a second listener sharing it (gRPC's default SO_REUSEPORT).
TEST(GrpcServer, APortInUseIsRefused) {
  ListingService first(0), second(0);
  int port = 0, port2 = 0;
  auto a = StartGrpcServer("127.0.0.1:0", &first, &port, 1 << 20);
  ASSERT_TRUE(a.ok()) << a.status().ToString();
  auto b = StartGrpcServer("127.0.0.1:" + std::to_string(port), &second, &port2, 1 << 20);
  ASSERT_FALSE(b.ok()) << "two servers listen on port " << port;
  EXPECT_NE(b.status().message().find("cannot listen on 127.0.0.1:" + std::to_string(port)),
            std::string::npos) << b.status().message();
  a.value()->Shutdown();
}

TEST(ControlAuthKey, DependsOnTheSecretAndIsNotTheSecret) {
  EXPECT_EQ(ControlKey(""), "");
  EXPECT_EQ(ControlKey("a").size(), 32u);
  EXPECT_NE(ControlKey("a"), ControlKey("b"));
  EXPECT_NE(ControlCallMac(ControlKey("a"), "w0", "Reset", 1, 2, "n", ""),
            ControlCallMac(ControlKey("a"), "w0", "Drain", 1, 2, "n", ""));
  EXPECT_NE(ControlCallMac(ControlKey("a"), "w0", "Reset", 1, 2, "n", ""),
            ControlCallMac(ControlKey("a"), "w1", "Reset", 1, 2, "n", ""));
}

}  // namespace
}  // namespace fm
