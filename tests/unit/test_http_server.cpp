// HttpServer's bounds with short limits and a test handler: read and idle timeouts, the
// response deadline, a client that goes away, and Shutdown with connections still open.
#include <gtest/gtest.h>

#include <arpa/inet.h>
#include <netinet/in.h>
#include <stdlib.h>
#include <sys/resource.h>
#include <sys/socket.h>
#include <unistd.h>

#include <atomic>
#include <chrono>
#include <filesystem>
#include <optional>
#include <thread>

#include "coordinator/http_server.h"
#include "tests/integration/http_client.h"

namespace fm {
namespace {

using namespace std::chrono_literals;
using Clock = std::chrono::steady_clock;

struct TestServer {
  std::atomic<int> abandoned{0};
  std::atomic<Code> why{Code::kOk};   // AbandonedBecause() of the last abandoned stream
  std::unique_ptr<HttpServer> server;
  explicit TestServer(HttpLimits limits, const std::optional<HttpTls>& tls = std::nullopt) {
    auto s = HttpServer::Start("127.0.0.1:0", limits, [this](const HttpRequest& req, HttpResponder* out) {
      if (req.path == "/stream") {   // streams until the client or the deadline ends it
        out->StartStream(200, "text/event-stream");
        while (!out->Abandoned()) {
          out->Send("data: x\n\n");
          std::this_thread::sleep_for(20ms);
        }
        why = out->AbandonedBecause().code();
        ++abandoned;
        return;
      }
      if (req.path == "/flood") {   // as fast as the client takes it
        out->StartStream(200, "text/event-stream");
        const std::string block(64 << 10, 'x');
        while (!out->Abandoned()) out->Send(block);
        why = out->AbandonedBecause().code();
        ++abandoned;
        return;
      }
      out->Reply(200, "text/plain", req.method + " " + req.path + " " + req.body);
    }, tls);
    EXPECT_TRUE(s.ok()) << s.status().ToString();
    server = std::move(s).value();
  }
  int port() const { return server->port(); }
};

HttpLimits Short() {
  HttpLimits l;
  l.idle_timeout = 300ms;
  l.read_timeout = 300ms;
  l.response_timeout = 600ms;
  l.max_connections = 4;
  return l;
}

TEST(HttpServer, AnswersAndKeepsTheConnectionAlive) {
  TestServer t(Short());
  it::HttpResult r = it::HttpRaw(t.port(), "POST /a HTTP/1.1\r\nContent-Length: 2\r\n\r\nhi"
                                           "GET /b HTTP/1.1\r\nConnection: close\r\n\r\n", 5s);
  EXPECT_EQ(r.status, 200);
  EXPECT_NE(r.raw.find("Content-Length: 10\r\nConnection: keep-alive\r\n\r\nPOST /a hi"), std::string::npos) << r.raw;
  EXPECT_NE(r.raw.find("Connection: close\r\n\r\nGET /b "), std::string::npos) << r.raw;
}

TEST(HttpServer, AnIncompleteRequestIs408AfterTheReadTimeout) {
  TestServer t(Short());
  const auto start = Clock::now();
  it::HttpResult r = it::HttpRaw(t.port(), "POST /a HTTP/1.1\r\nContent-Length: 10\r\n\r\nabc", 5s);
  const auto took = Clock::now() - start;
  EXPECT_EQ(r.status, 408) << r.raw;
  EXPECT_GE(took, 250ms);
  EXPECT_LT(took, 2s);
}

TEST(HttpServer, AnIdleConnectionIsClosedAfterTheIdleTimeout) {
  TestServer t(Short());
  const auto start = Clock::now();
  it::HttpResult r = it::HttpRaw(t.port(), "", 5s);   // connects, sends nothing
  const auto took = Clock::now() - start;
  EXPECT_EQ(r.raw, "") << "closed without an answer";
  EXPECT_GE(took, 250ms);
  EXPECT_LT(took, 2s);
}

TEST(HttpServer, AStreamEndsAtTheResponseDeadline) {
  TestServer t(Short());
  const auto start = Clock::now();
  it::HttpResult r = it::HttpCall(t.port(), "GET", "/stream", "", {}, 5s);
  const auto took = Clock::now() - start;
  EXPECT_EQ(r.status, 200);
  EXPECT_EQ(r.body.rfind("data: x\n\n", 0), 0u);
  EXPECT_GE(took, 550ms);
  EXPECT_LT(took, 3s);
  EXPECT_EQ(t.abandoned, 1);
  EXPECT_EQ(t.why, Code::kDeadlineExceeded);
}

TEST(HttpServer, AClientThatGoesAwayAbandonsItsStream) {
  HttpLimits l = Short();
  l.response_timeout = 60s;
  TestServer t(l);
  it::HttpStream s(t.port(), "GET /stream HTTP/1.1\r\n\r\n");
  ASSERT_NE(s.ReadUntil("data: x", 2, 5s).find("data: x"), std::string::npos);
  s.Close();
  const auto deadline = Clock::now() + 2s;
  while (t.abandoned == 0 && Clock::now() < deadline) std::this_thread::sleep_for(10ms);
  EXPECT_EQ(t.abandoned, 1);
  EXPECT_EQ(t.why, Code::kCancelled);
}

// A client that reads nothing would hold its stream (and its generation) until the response
// deadline: the server gives up once a write waited write_stall_timeout.
TEST(HttpServer, AStreamWhoseClientReadsNothingEndsAfterTheWriteStallTimeout) {
  HttpLimits l = Short();
  l.response_timeout = 60s;
  l.write_stall_timeout = 300ms;
  TestServer t(l);
  it::HttpStream s(t.port(), "GET /flood HTTP/1.1\r\n\r\n");   // never read
  const auto start = Clock::now();
  while (t.abandoned == 0 && Clock::now() - start < 10s) std::this_thread::sleep_for(10ms);
  EXPECT_EQ(t.abandoned, 1);
  EXPECT_EQ(t.why, Code::kDeadlineExceeded);
  EXPECT_LT(Clock::now() - start, 5s);
}

// curl sends `Expect: 100-continue` before a body over 1 kB and waits a second for the answer.
TEST(HttpServer, AnExpectOf100ContinueIsAnsweredBeforeTheBody) {
  TestServer t(Short());
  it::HttpStream s(t.port(), "POST /a HTTP/1.1\r\nExpect: 100-continue\r\nContent-Length: 2\r\n\r\n");
  EXPECT_NE(s.ReadUntil("HTTP/1.1 100 Continue\r\n\r\n", 1, 2s).find("100 Continue"), std::string::npos);
  s.Send("hi");
  const std::string got = s.ReadUntil("POST /a hi", 1, 2s);
  EXPECT_NE(got.find("HTTP/1.1 200"), std::string::npos) << got;
  EXPECT_NE(got.find("POST /a hi"), std::string::npos) << got;
}

TEST(HttpServer, ShutdownEndsOpenConnectionsPromptly) {
  HttpLimits l = Short();
  l.idle_timeout = l.read_timeout = l.response_timeout = 60s;
  TestServer t(l);
  it::HttpStream idle(t.port(), "");
  it::HttpStream streaming(t.port(), "GET /stream HTTP/1.1\r\n\r\n");
  ASSERT_NE(streaming.ReadUntil("data: x", 1, 5s).find("data: x"), std::string::npos);
  const auto start = Clock::now();
  t.server->Shutdown();
  EXPECT_LT(Clock::now() - start, 2s);
  EXPECT_EQ(t.abandoned, 1);
  EXPECT_EQ(t.why, Code::kUnavailable);
}

// Past max_connections, a few more connections serve one GET of /health or /metrics, so a
// liveness probe or a scrape is answered while clients hold every slot; anything else gets the
// cap's 503, and so does a connection past those too. An idle probe connection is closed after
// probe_read_timeout.
TEST(HttpServer, ProbesAreAnsweredPastTheConnectionCap) {
  HttpLimits l = Short();
  l.idle_timeout = l.read_timeout = 60s;
  l.max_connections = 2;
  l.probe_connections = 1;
  l.probe_read_timeout = 1500ms;
  TestServer t(l);
  // A probe's slot frees a moment after its answer (the server lingers ~200 ms for the client to
  // read it), so each call retries for a while until it is not the cap's raw 503.
  auto call = [&](const std::string& method, const std::string& path) {
    it::HttpResult r;
    const auto deadline = Clock::now() + 10s;
    while ((r = it::HttpCall(t.port(), method, path, "", {}, 5s)).status == 503 &&
           r.body.find("too many connections") != std::string::npos && method == "GET" &&
           Clock::now() < deadline)
      std::this_thread::sleep_for(50ms);
    return r;
  };
  it::HttpStream a(t.port(), ""), b(t.port(), "");   // every slot held (accepted in order)
  it::HttpResult r = call("GET", "/health");
  EXPECT_EQ(r.status, 200) << r.raw;
  EXPECT_EQ(r.body, "GET /health ");
  EXPECT_EQ(call("GET", "/metrics").status, 200);
  r = call("POST", "/v1/completions");
  EXPECT_EQ(r.status, 503) << r.raw;
  EXPECT_NE(r.body.find("too many connections (2)"), std::string::npos) << r.raw;

  // The probe slot held by an idle connection: the cap's 503 until it is closed for idling.
  std::this_thread::sleep_for(300ms);   // the last call's slot is free again
  const auto held_at = Clock::now();
  it::HttpStream c(t.port(), "");
  r = it::HttpCall(t.port(), "GET", "/health", "", {}, 5s);
  if (Clock::now() - held_at < 1s) {
    EXPECT_EQ(r.status, 503) << r.raw;   // else c may be gone
  }
  r = call("GET", "/health");
  EXPECT_EQ(r.status, 200) << r.raw;
}

// A pooled client's kept-alive connections hold every slot after its burst: a new client closes
// the one idle the longest between requests instead of getting the cap's 503, and the other
// keeps serving.
TEST(HttpServer, AtTheCapTheConnectionIdleTheLongestMakesRoom) {
  HttpLimits l = Short();
  l.idle_timeout = l.read_timeout = 60s;
  l.max_connections = 2;
  l.probe_connections = 0;
  TestServer t(l);
  it::HttpStream a(t.port(), "GET /a HTTP/1.1\r\n\r\n");
  EXPECT_NE(a.ReadUntil("GET /a ", 1, 5s).find("GET /a "), std::string::npos);
  std::this_thread::sleep_for(50ms);   // a idle the longest
  it::HttpStream b(t.port(), "GET /b HTTP/1.1\r\n\r\n");
  EXPECT_NE(b.ReadUntil("GET /b ", 1, 5s).find("GET /b "), std::string::npos);
  it::HttpResult r = it::HttpCall(t.port(), "POST", "/c", "", {}, 5s);
  EXPECT_EQ(r.status, 200) << r.raw;
  EXPECT_EQ(r.body, "POST /c ");
  b.Send("GET /b2 HTTP/1.1\r\n\r\n");
  EXPECT_NE(b.ReadUntil("GET /b2 ", 1, 5s).find("GET /b2 "), std::string::npos) << "b was not idle the longest";
  a.Send("GET /a2 HTTP/1.1\r\n\r\n");
  EXPECT_EQ(a.ReadUntil("GET /a2 ", 1, 1s).find("GET /a2 "), std::string::npos) << "a should have been closed";
}

// Out of descriptors, accept fails while the listener stays readable: the accept loop waits a
// poll slice between tries instead of spinning a core, and serves again once descriptors free.
TEST(HttpServer, OutOfDescriptorsTheAcceptLoopDoesNotSpin) {
#ifdef __SANITIZE_ADDRESS__
  // UBSan checks a call's vptr by reading the object through a pipe, which needs a descriptor:
  // out of them it reports every logged line as a call on an invalid object.
  GTEST_SKIP() << "the sanitizer runtime needs descriptors of its own";
#endif
  TestServer t(Short());
  // The lowest free descriptor: the limit lets the client's socket take it and no more.
  const int lowest = ::dup(0);
  ASSERT_GE(lowest, 0);
  ::close(lowest);
  rlimit saved{};
  ASSERT_EQ(::getrlimit(RLIMIT_NOFILE, &saved), 0);
  rlimit low = saved;
  low.rlim_cur = static_cast<rlim_t>(lowest + 1);
  ASSERT_EQ(::setrlimit(RLIMIT_NOFILE, &low), 0);
  const int client = ::socket(AF_INET, SOCK_STREAM, 0);
  sockaddr_in addr{};
  addr.sin_family = AF_INET;
  addr.sin_port = htons(static_cast<uint16_t>(t.port()));
  addr.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  const bool connected = client >= 0 && ::connect(client, reinterpret_cast<sockaddr*>(&addr), sizeof addr) == 0;
  auto cpu_seconds = [] {
    rusage u{};
    ::getrusage(RUSAGE_SELF, &u);
    return u.ru_utime.tv_sec + u.ru_stime.tv_sec + (u.ru_utime.tv_usec + u.ru_stime.tv_usec) * 1e-6;
  };
  const double before = cpu_seconds();
  std::this_thread::sleep_for(600ms);
  const double used = cpu_seconds() - before;
  ASSERT_EQ(::setrlimit(RLIMIT_NOFILE, &saved), 0);
  ASSERT_TRUE(connected) << "the client socket did not connect";
  EXPECT_LT(used, 0.2) << "the accept loop spun while accept failed";
  ::close(client);
  EXPECT_EQ(it::HttpCall(t.port(), "GET", "/x", "", {}, 5s).status, 200);
}

// A fresh directory with a test CA and a certificate for 127.0.0.1 (removed at exit).
struct Pki {
  std::string dir;
  bool ok = false;
  Pki() {
    char tmpl[] = "/tmp/fm_pki_XXXXXX";
    dir = mkdtemp(tmpl);
    ok = it::MakeTestCertificates(dir);
  }
  ~Pki() { std::filesystem::remove_all(dir); }
};

TEST(HttpServer, TlsServesVerifiedClientsKeepAliveAndStreamsAndRefusesPlainText) {
  Pki pki;
  ASSERT_TRUE(pki.ok) << "openssl could not make the test certificates";
  TestServer t(Short(), HttpTls{pki.dir + "/node.pem", pki.dir + "/node.key"});
  ASSERT_TRUE(t.server);
  std::string error;
  // Two requests in one TLS session: the first keeps the connection, the second closes it.
  it::HttpResult r = it::HttpsRaw(t.port(), pki.dir + "/ca.pem",
                                  "POST /a HTTP/1.1\r\nContent-Length: 2\r\n\r\nhi"
                                  "GET /b HTTP/1.1\r\nConnection: close\r\n\r\n", 5s, &error);
  EXPECT_EQ(r.status, 200) << error;
  EXPECT_NE(r.raw.find("Connection: keep-alive\r\n\r\nPOST /a hi"), std::string::npos) << r.raw;
  EXPECT_NE(r.raw.find("Connection: close\r\n\r\nGET /b "), std::string::npos) << r.raw;
  // A stream runs until its response deadline (600 ms) and the handler learns it.
  r = it::HttpsRaw(t.port(), pki.dir + "/ca.pem", "GET /stream HTTP/1.1\r\n\r\n", 5s, &error);
  EXPECT_EQ(r.status, 200) << error;
  EXPECT_NE(r.body.find("data: x\n\n"), std::string::npos) << r.raw;
  EXPECT_TRUE([&] {
    for (int i = 0; i < 50 && t.abandoned == 0; ++i) std::this_thread::sleep_for(20ms);
    return t.abandoned == 1;
  }());
  // Plain HTTP gets no HTTP answer; a client that does not trust the CA is refused.
  EXPECT_EQ(it::HttpRaw(t.port(), "GET /a HTTP/1.1\r\n\r\n", 5s).status, 0);
  EXPECT_EQ(it::HttpsRaw(t.port(), pki.dir + "/node.pem", "GET /a HTTP/1.1\r\n\r\n", 5s, &error).status, 0);
  EXPECT_NE(error.find("certificate verify failed"), std::string::npos) << error;
  // A client that connects and says nothing is dropped after the read timeout (300 ms).
  const auto start = Clock::now();
  EXPECT_EQ(it::HttpRaw(t.port(), "", 5s).status, 0);
  EXPECT_LT(Clock::now() - start, 3s);
}

// Over TLS the evicted connection's thread still ends its session (OpenSSL writes an alert
// through plain write()): the server neither dies of SIGPIPE nor refuses the newcomer.
TEST(HttpServer, OverTlsAnIdleConnectionIsEvictedAtTheCapAndTheServerLives) {
  Pki pki;
  ASSERT_TRUE(pki.ok) << "openssl could not make the test certificates";
  HttpLimits l = Short();
  l.idle_timeout = l.read_timeout = 60s;
  l.max_connections = 1;
  l.probe_connections = 0;
  TestServer t(l, HttpTls{pki.dir + "/node.pem", pki.dir + "/node.key"});
  ASSERT_TRUE(t.server);
  it::HttpResult first;
  const auto start = Clock::now();
  std::thread pooled([&] {   // one kept-alive request, then idle until the server closes it
    first = it::HttpsRaw(t.port(), pki.dir + "/ca.pem", "GET /a HTTP/1.1\r\n\r\n", 20s);
  });
  std::this_thread::sleep_for(500ms);
  std::string error;
  it::HttpResult r = it::HttpsRaw(t.port(), pki.dir + "/ca.pem",
                                  "POST /c HTTP/1.1\r\nContent-Length: 0\r\nConnection: close\r\n\r\n",
                                  5s, &error);
  pooled.join();
  EXPECT_EQ(r.status, 200) << r.raw << error;
  EXPECT_EQ(r.body, "POST /c ");
  EXPECT_EQ(first.status, 200) << first.raw;
  EXPECT_EQ(first.body, "GET /a ");
  EXPECT_LT(Clock::now() - start, 10s) << "the idle connection was closed by its timeout, not evicted";
}

TEST(HttpServer, TlsFilesThatDoNotLoadAreNamed) {
  Pki pki;
  ASSERT_TRUE(pki.ok);
  auto handler = [](const HttpRequest&, HttpResponder* out) { out->Reply(200, "text/plain", ""); };
  auto missing = HttpServer::Start("127.0.0.1:0", Short(), handler,
                                   HttpTls{pki.dir + "/none.pem", pki.dir + "/node.key"});
  ASSERT_FALSE(missing.ok());
  EXPECT_NE(missing.status().message().find("security.tls.cert: cannot load " + pki.dir + "/none.pem"),
            std::string::npos) << missing.status().ToString();
  auto mismatched = HttpServer::Start("127.0.0.1:0", Short(), handler,
                                      HttpTls{pki.dir + "/node.pem", pki.dir + "/ca.key"});
  ASSERT_FALSE(mismatched.ok());
  EXPECT_NE(mismatched.status().message().find("security.tls.key: cannot load " + pki.dir +
                                               "/ca.key for " + pki.dir + "/node.pem"),
            std::string::npos) << mismatched.status().ToString();
  EXPECT_NE(mismatched.status().message().find("key values mismatch"), std::string::npos)
      << mismatched.status().ToString();
}

}  // namespace
}  // namespace fm
