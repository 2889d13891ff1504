// HttpServer: the coordinator's HTTP/1.1 listener (OpenAI-compatible API, /health, /metrics).
// A Boost.Asio acceptor; one thread per connection (at most max_connections; the next one is
// answered 503 and closed), requests parsed by Boost.Beast (http_request.h). Every socket wait
// is a poll with a deadline, so a slow or silent client can hold a connection for at most
// read_timeout per request and idle_timeout between requests, and a response for at most
// response_timeout; Shutdown ends every connection within ~100 ms of its handler returning.
// With HttpTls (security.tls's certificate and key) every connection is a TLS session (1.2 or
// newer, OpenSSL on the same non-blocking sockets and deadlines; the handshake within read_timeout).
#pragma once
#include <atomic>
#include <chrono>
#include <functional>
#include <list>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <string_view>
#include <thread>
#include <utility>
#include <vector>

#include "common/status.h"
#include "coordinator/http_request.h"

namespace fm {

struct HttpLimits {
  size_t max_header_bytes = 16 << 10;
  size_t max_body_bytes = 4 << 20;
  int max_connections = 64;
  // Beyond max_connections, this many more for a GET of /health or /metrics only, read within
  // probe_read_timeout: a liveness probe or a scrape must not fail because clients (or a
  // slow-sending one) hold every slot. Any other request there gets the cap's 503.
  int probe_connections = 4;
  std::chrono::milliseconds probe_read_timeout{2000};
  std::chrono::milliseconds idle_timeout{5000};        // keep-alive connection without a request (uvicorn's)
  std::chrono::milliseconds read_timeout{30000};       // from a request's first byte to its end
  std::chrono::milliseconds response_timeout{600000};  // one response, streams included
  // A response whose client takes no byte for this long ends (limits.write_stall_timeout_s,
  // as on gRPC): a stream nobody reads must not keep its generation and stream slot.
  std::chrono::milliseconds write_stall_timeout{60000};
};

// The listener's certificate chain and private key (PEM files), as security.tls names them.
struct HttpTls {
  std::string cert_file;
  std::string key_file;
};

class HttpConn;   // one client connection: plain TCP or TLS (http_server.cpp)

// One response in progress. A handler either calls Reply once, or StartStream once and then
// Send for each piece of the body (the stream ends when the handler returns; the connection
// closes, which is how the client sees the end of an HTTP/1.1 body without a length).
class HttpResponder {
 public:
  using Headers = std::vector<std::pair<std::string, std::string>>;
  // False when the client is gone or the response timed out.
  bool Reply(int status, const std::string& content_type, const std::string& body,
             const Headers& extra = {});
  bool StartStream(int status, const std::string& content_type, const Headers& extra = {});
  bool Send(std::string_view bytes);
  // The client closed its side (or reset), the response deadline passed, or the server stops:
  // a handler waiting for tokens polls this to cancel its request.
  bool Abandoned();
  // Why Abandoned() said so: Cancelled (the client is gone), DeadlineExceeded (the response ran
  // past HttpLimits.response_timeout) or Unavailable (the server stops); Ok while it has not.
  Status AbandonedBecause() const;

 private:
  friend class HttpServer;
  HttpResponder(HttpConn* conn, std::chrono::milliseconds timeout,
                std::chrono::milliseconds stall, const std::atomic<bool>* stop)
      : conn_(conn), timeout_(timeout), stall_(stall),
        deadline_(std::chrono::steady_clock::now() + timeout), stop_(stop) {}
  bool SendAll(std::string_view bytes);
  HttpConn* conn_;
  std::chrono::milliseconds timeout_;
  std::chrono::milliseconds stall_;   // the longest a write may wait for the client to read
  std::chrono::steady_clock::time_point deadline_;
  const std::atomic<bool>* stop_;
  bool keep_alive_ = true;
  bool replied_ = false;
  bool failed_ = false;
  bool stalled_ = false;   // failed_ because the client read nothing for stall_
};

using HttpHandler = std::function<void(const HttpRequest&, HttpResponder*)>;

class HttpServer {
 public:
  // Listens on `listen` (host:port; port 0 picks one); over TLS when `tls` is given (errors
  // name the file that does not load).
  static Result<std::unique_ptr<HttpServer>> Start(const std::string& listen, HttpLimits limits,
                                                   HttpHandler handler,
                                                   const std::optional<HttpTls>& tls = std::nullopt);
  ~HttpServer();
  int port() const { return port_; }
  // Stops accepting and waits for every connection thread (handlers must return promptly once
  // Abandoned() is true).
  void Shutdown();

 private:
  struct Impl;
  struct Connection {
    std::thread thread;
    std::atomic<bool> done{false};
    int fd = -1;
    // Kept alive after a response and waiting for the first byte of the next request: such a
    // connection may be closed to make room at the cap (EvictIdle). Under HttpServer::mu_.
    bool idle = false, evicted = false;
    std::chrono::steady_clock::time_point idle_since;
  };
  HttpServer() = default;
  void AcceptLoop();
  // Serves a connection; a probe connection (one past max_connections) serves one GET of
  // /health or /metrics and refuses anything else.
  void Serve(Connection* self, bool probe);
  // Marks `self` idle between requests, or busy again: false when it was evicted meanwhile.
  bool SetIdle(Connection* self, bool idle);
  // At the cap: closes the connection idle the longest between requests, if any (as nginx
  // reuses keep-alive connections), so that a pooled client's idle sockets do not lock
  // everyone else out until idle_timeout; true when one was closed.
  bool EvictIdle();
  // Reads one request, waiting at most `idle` for its first byte and `read` from there to its
  // end, and never past `not_after`; false when the connection should close (after an error
  // reply if any).
  bool ReadRequest(HttpConn* conn, Connection* self, std::string* buffer, HttpRequest* req,
                   std::chrono::milliseconds idle, std::chrono::milliseconds read,
                   std::chrono::steady_clock::time_point not_after);
  void Reap(bool all);
  // The 503 of a connection past the cap: its JSON body, and the whole answer as bytes on the
  // wire (for the accept loop, which sends it without a responder).
  std::string TooManyConnectionsJson() const;
  std::string TooManyConnections() const;

  std::unique_ptr<Impl> impl_;
  HttpLimits limits_;
  HttpHandler handler_;
  int port_ = 0;
  std::atomic<bool> stop_{false};
  std::atomic<int> open_{0};
  std::atomic<int> probes_open_{0};   // of those, probe connections
  std::mutex mu_;   // guards connections_
  std::list<std::unique_ptr<Connection>> connections_;
  std::thread accept_thread_;
};

}  // namespace fm
