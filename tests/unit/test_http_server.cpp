// HttpServer's bounds with short limits and a test handler: read and idle timeouts, the
// response deadline, a client that goes away, and Shutdown with connections still open.
#include <gtest/gtest.h>

#include <atomic>
#include <chrono>
#include <thread>

#include "coordinator/http_server.h"
#include "tests/integration/http_client.h"

namespace fm {
namespace {

using namespace std::chrono_literals;
using Clock = std::chrono::steady_clock;

struct TestServer {
  std::atomic<int> abandoned{0};
  std::unique_ptr<HttpServer> server;
  explicit TestServer(HttpLimits limits) {
    auto s = HttpServer::Start("127.0.0.1:0", limits, [this](const HttpRequest& req, HttpResponder* out) {
      if (req.path == "/stream") {   // streams until the client or the deadline ends it
        out->StartStream(200, "text/event-stream");
        while (!out->Abandoned()) {
          out->Send("data: x\n\n");
          std::this_thread::sleep_for(20ms);
        }
        ++abandoned;
        return;
      }
      out->Reply(200, "text/plain", req.method + " " + req.path + " " + req.body);
    });
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
}

}  // namespace
}  // namespace fm
