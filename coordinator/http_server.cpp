#include "coordinator/http_server.h"

#include <netinet/in.h>
#include <netinet/tcp.h>
#include <poll.h>
#include <sys/socket.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <csignal>
#include <chrono>
#include <cstring>
#include <thread>

#include <boost/asio/ip/tcp.hpp>
#include <openssl/err.h>
#include <openssl/ssl.h>

#include "config/cluster_config.h"
#include "coordinator/openai_request.h"
#include "common/log.h"

namespace fm {
namespace {

using Clock = std::chrono::steady_clock;
// Longest single wait: how fast a connection notices Shutdown.
constexpr int kPollSliceMs = 100;

const char* Reason(int status) {
  switch (status) {
    case 200: return "OK";
    case 400: return "Bad Request";
    case 401: return "Unauthorized";
    case 404: return "Not Found";
    case 405: return "Method Not Allowed";
    case 408: return "Request Timeout";
    case 413: return "Payload Too Large";
    case 429: return "Too Many Requests";
    case 431: return "Request Header Fields Too Large";
    case 500: return "Internal Server Error";
    case 501: return "Not Implemented";
    case 503: return "Service Unavailable";
    case 504: return "Gateway Timeout";
    default: return "Unknown";
  }
}

std::string Head(int status, const std::string& content_type, const HttpResponder::Headers& extra) {
  std::string h = "HTTP/1.1 " + std::to_string(status) + " " + Reason(status) + "\r\n";
  h += "Content-Type: " + content_type + "\r\n";
  for (const auto& [name, value] : extra) h += name + ": " + value + "\r\n";
  return h;
}

// Waits until `fd` has `events` or `deadline` passes (or `stop`); true when ready.
bool WaitFd(int fd, short events, Clock::time_point deadline, const std::atomic<bool>* stop) {
  while (!(stop && *stop)) {
    auto left = std::chrono::duration_cast<std::chrono::milliseconds>(deadline - Clock::now()).count();
    if (left <= 0) return false;
    pollfd p{fd, events, 0};
    int n = ::poll(&p, 1, static_cast<int>(std::min<long long>(left, kPollSliceMs)));
    if (n > 0) return true;
    if (n < 0 && errno != EINTR) return false;
  }
  return false;
}

std::string ErrorJson(int status, const std::string& message) {
  OpenAiError e;
  e.http_status = status;
  e.message = message;
  e.type = status == 503 ? "service_unavailable" : "invalid_request_error";
  return e.ToJson();
}

// The oldest queued OpenSSL error of this thread as text (and the queue cleared).
std::string OpenSslError() {
  const unsigned long e = ERR_get_error();
  char text[256] = "unknown OpenSSL error";
  if (e != 0) ERR_error_string_n(e, text, sizeof text);
  ERR_clear_error();
  return text;
}

struct SslCtxFree {
  void operator()(SSL_CTX* c) const { SSL_CTX_free(c); }
};
using SslCtxPtr = std::unique_ptr<SSL_CTX, SslCtxFree>;

// A TLS server context (1.2 or newer) for the certificate chain and key of `tls`.
Result<SslCtxPtr> NewServerTls(const HttpTls& tls) {
  SslCtxPtr ctx(SSL_CTX_new(TLS_server_method()));
  if (!ctx) return Internal("http: TLS context: " + OpenSslError());
  SSL_CTX_set_min_proto_version(ctx.get(), TLS1_2_VERSION);
  SSL_CTX_set_mode(ctx.get(), SSL_MODE_ENABLE_PARTIAL_WRITE | SSL_MODE_ACCEPT_MOVING_WRITE_BUFFER);
  if (SSL_CTX_use_certificate_chain_file(ctx.get(), tls.cert_file.c_str()) != 1)
    return InvalidArgument("security.tls.cert: cannot load " + tls.cert_file + ": " + OpenSslError());
  // Also checks that the key belongs to the certificate ("key values mismatch").
  if (SSL_CTX_use_PrivateKey_file(ctx.get(), tls.key_file.c_str(), SSL_FILETYPE_PEM) != 1)
    return InvalidArgument("security.tls.key: cannot load " + tls.key_file + " for " +
                           tls.cert_file + ": " + OpenSslError());
  return ctx;
}

}  // namespace

// One client connection on a non-blocking socket, plain or TLS. Recv and Send never block: they
// return kWouldBlock and the poll event to wait for (a TLS read can need the socket writable,
// and a write readable).
class HttpConn {
 public:
  static constexpr ssize_t kWouldBlock = -1;
  static constexpr ssize_t kFailed = -2;
  HttpConn(int fd, SSL* ssl) : fd_(fd), ssl_(ssl) {}
  ~HttpConn() {
    if (ssl_) SSL_free(ssl_);
  }
  HttpConn(const HttpConn&) = delete;
  HttpConn& operator=(const HttpConn&) = delete;
  int fd() const { return fd_; }

  // Bytes read (> 0), 0 when the client closed, kWouldBlock (wait for *want) or kFailed.
  ssize_t Recv(char* buf, size_t n, short* want) {
    if (ssl_) return SslResult(SSL_read(ssl_, buf, static_cast<int>(n)), want);
    const ssize_t got = ::recv(fd_, buf, n, 0);
    if (got >= 0) return got;
    *want = POLLIN;
    return errno == EAGAIN || errno == EWOULDBLOCK || errno == EINTR ? kWouldBlock : kFailed;
  }
  // Bytes written (> 0), kWouldBlock (wait for *want) or kFailed.
  ssize_t Send(const char* p, size_t n, short* want) {
    if (ssl_) {
      const ssize_t r = SslResult(SSL_write(ssl_, p, static_cast<int>(n)), want);
      return r == 0 ? kFailed : r;
    }
    const ssize_t sent = ::send(fd_, p, n, MSG_NOSIGNAL);
    if (sent > 0) return sent;
    *want = POLLOUT;
    return sent < 0 && (errno == EAGAIN || errno == EWOULDBLOCK || errno == EINTR) ? kWouldBlock : kFailed;
  }
  // The TLS handshake, finished by `deadline` (true at once for plain TCP).
  bool Handshake(Clock::time_point deadline, const std::atomic<bool>* stop) {
    if (!ssl_) return true;
    while (true) {
      short want = POLLIN;
      const ssize_t r = SslResult(SSL_accept(ssl_), &want);
      if (r > 0) return true;
      if (r != kWouldBlock || !WaitFd(fd_, want, deadline, stop)) return false;
    }
  }
  // TLS close_notify (best effort, never waiting), then the TCP half-close.
  void ShutdownWrite() {
    if (ssl_ && SSL_shutdown(ssl_) < 0) ERR_clear_error();
    ::shutdown(fd_, SHUT_WR);
  }

 private:
  ssize_t SslResult(int ret, short* want) {
    if (ret > 0) return ret;
    switch (SSL_get_error(ssl_, ret)) {
      case SSL_ERROR_WANT_READ: *want = POLLIN; return kWouldBlock;
      case SSL_ERROR_WANT_WRITE: *want = POLLOUT; return kWouldBlock;
      case SSL_ERROR_ZERO_RETURN: return 0;
      default:
        FM_LOG(kDebug, "http") << "TLS connection failed: " << OpenSslError();
        return kFailed;
    }
  }
  int fd_;
  SSL* ssl_;
};

struct HttpServer::Impl {
  boost::asio::io_context io;
  boost::asio::ip::tcp::acceptor acceptor{io};
  SslCtxPtr tls;   // null: plain HTTP
};

bool HttpResponder::SendAll(std::string_view bytes) {
  while (!bytes.empty() && !failed_) {
    short want = POLLOUT;
    const ssize_t n = conn_->Send(bytes.data(), bytes.size(), &want);
    if (n > 0) {
      bytes.remove_prefix(static_cast<size_t>(n));
    } else if (n != HttpConn::kWouldBlock) {
      failed_ = true;
    } else if (const auto until = std::min(deadline_, Clock::now() + stall_);
               !WaitFd(conn_->fd(), want, until, stop_)) {
      failed_ = true;
      stalled_ = until < deadline_ && !*stop_;
    }
  }
  return !failed_;
}

bool HttpResponder::Reply(int status, const std::string& content_type, const std::string& body,
                          const Headers& extra) {
  replied_ = true;
  std::string out = Head(status, content_type, extra);
  out += "Content-Length: " + std::to_string(body.size()) + "\r\n";
  // A stopping server closes the connection after this reply: it says so.
  out += keep_alive_ && !*stop_ ? "Connection: keep-alive\r\n\r\n" : "Connection: close\r\n\r\n";
  out += body;
  return SendAll(out);
}

bool HttpResponder::StartStream(int status, const std::string& content_type, const Headers& extra) {
  replied_ = true;
  keep_alive_ = false;   // the body ends when the connection closes
  std::string out = Head(status, content_type, extra);
  out += "Cache-Control: no-cache\r\nConnection: close\r\n\r\n";
  return SendAll(out);
}

bool HttpResponder::Send(std::string_view bytes) { return SendAll(bytes); }

bool HttpResponder::Abandoned() {
  if (failed_ || *stop_ || Clock::now() >= deadline_) return true;
  pollfd p{conn_->fd(), static_cast<short>(POLLIN | POLLRDHUP), 0};
  if (::poll(&p, 1, 0) <= 0) return false;
  if (p.revents & (POLLRDHUP | POLLHUP | POLLERR)) {
    failed_ = true;
    return true;
  }
  return false;   // readable: a pipelined request, read after this response
}

Status HttpResponder::AbandonedBecause() const {
  if (stalled_)
    return DeadlineExceeded("the client read nothing for " + std::to_string(stall_.count() / 1000) +
                            " s (limits.write_stall_timeout_s)");
  if (failed_) return Cancelled("the client closed the connection");
  if (*stop_) return Unavailable("the server is shutting down");
  if (Clock::now() >= deadline_)
    return DeadlineExceeded("the response ran past the server's limit of " +
                            std::to_string(timeout_.count() / 1000) +
                            " s (HttpLimits.response_timeout)");
  return Status::Ok();
}

Result<std::unique_ptr<HttpServer>> HttpServer::Start(const std::string& listen, HttpLimits limits,
                                                      HttpHandler handler,
                                                      const std::optional<HttpTls>& tls) {
  FM_ASSIGN_OR_RETURN(HostPort hp, ParseHostPort(listen, /*allow_zero=*/true));
  // OpenSSL writes through plain write(): a peer gone (a reset client, an evicted connection's
  // alert) would raise SIGPIPE and end the process. Plain sockets send with MSG_NOSIGNAL.
  std::signal(SIGPIPE, SIG_IGN);
  std::unique_ptr<HttpServer> s(new HttpServer());
  s->impl_ = std::make_unique<Impl>();
  if (tls) {
    FM_ASSIGN_OR_RETURN(s->impl_->tls, NewServerTls(*tls));
  }
  s->limits_ = limits;
  s->handler_ = std::move(handler);
  namespace ip = boost::asio::ip;
  boost::system::error_code ec;
  ip::tcp::resolver resolver(s->impl_->io);
  auto endpoints = resolver.resolve(hp.host, std::to_string(hp.port), ec);
  if (ec || endpoints.empty()) return InvalidArgument("http: cannot resolve " + listen + ": " + ec.message());
  ip::tcp::endpoint ep = endpoints.begin()->endpoint();
  auto& acc = s->impl_->acceptor;
  acc.open(ep.protocol(), ec);
  if (!ec) acc.set_option(ip::tcp::acceptor::reuse_address(true), ec);
  if (!ec) acc.bind(ep, ec);
  if (!ec) acc.listen(boost::asio::socket_base::max_listen_connections, ec);
  if (ec) return Unavailable("http: cannot listen on " + listen + ": " + ec.message());
  s->port_ = acc.local_endpoint().port();
  s->accept_thread_ = std::thread([p = s.get()] { p->AcceptLoop(); });
  return s;
}

HttpServer::~HttpServer() { Shutdown(); }

void HttpServer::Shutdown() {
  stop_ = true;
  if (accept_thread_.joinable()) accept_thread_.join();
  Reap(/*all=*/true);
  boost::system::error_code ec;
  if (impl_) impl_->acceptor.close(ec);
}

void HttpServer::Reap(bool all) {
  // Joined outside mu_: a connection thread takes mu_ on its way out (SetIdle, the end of Serve).
  std::list<std::unique_ptr<Connection>> ending;
  {
    std::lock_guard<std::mutex> lock(mu_);
    for (auto it = connections_.begin(); it != connections_.end();) {
      auto next = std::next(it);
      if (all || (*it)->done) ending.splice(ending.end(), connections_, it);
      it = next;
    }
  }
  for (auto& c : ending) c->thread.join();
}

void HttpServer::AcceptLoop() {
  const int lfd = impl_->acceptor.native_handle();
  bool accept_failing = false;
  while (!stop_) {
    pollfd p{lfd, POLLIN, 0};
    int n = ::poll(&p, 1, kPollSliceMs);
    Reap(/*all=*/false);
    if (n <= 0) continue;
    int fd = ::accept4(lfd, nullptr, nullptr, SOCK_NONBLOCK | SOCK_CLOEXEC);
    if (fd < 0) {
      // Out of descriptors (EMFILE, ENFILE, ENOBUFS): the listener stays readable and the next
      // accept fails the same way, so wait a slice instead of spinning on it.
      if (errno != EAGAIN && errno != EWOULDBLOCK && errno != EINTR && errno != ECONNABORTED) {
        if (!accept_failing) {   // once a streak, not ten lines a second
          FM_LOG(kWarn, "http") << "accept: " << std::strerror(errno) << "; trying again every "
                                << kPollSliceMs << " ms";
        }
        accept_failing = true;
        std::this_thread::sleep_for(std::chrono::milliseconds(kPollSliceMs));
      }
      continue;
    }
    accept_failing = false;
    const bool probe = open_ - probes_open_ >= limits_.max_connections && !EvictIdle();
    if (probe && probes_open_ >= limits_.probe_connections) {
      // Best effort, never blocking the accept loop: a plain-HTTP client learns why.
      const std::string out = TooManyConnections();
      if (!impl_->tls) {
        ssize_t ignored = ::send(fd, out.data(), out.size(), MSG_NOSIGNAL);
        (void)ignored;
      }
      ::close(fd);
      continue;
    }
    ++open_;
    if (probe) ++probes_open_;
    auto c = std::make_unique<Connection>();
    Connection* raw = c.get();
    raw->fd = fd;
    std::lock_guard<std::mutex> lock(mu_);
    connections_.push_back(std::move(c));
    raw->thread = std::thread([this, raw, probe] {
      Serve(raw, probe);
      if (probe) --probes_open_;
      --open_;
      raw->done = true;
    });
  }
}

bool HttpServer::SetIdle(Connection* self, bool idle) {
  std::lock_guard<std::mutex> lock(mu_);
  if (self->evicted) return false;
  self->idle = idle;
  if (idle) self->idle_since = Clock::now();
  return true;
}

bool HttpServer::EvictIdle() {
  std::lock_guard<std::mutex> lock(mu_);
  Connection* oldest = nullptr;
  for (const auto& c : connections_)
    if (c->idle && !c->evicted && (!oldest || c->idle_since < oldest->idle_since)) oldest = c.get();
  if (!oldest) return false;
  // Its thread wakes to a closed socket and ends (a request whose bytes were on their way is
  // lost, as at idle_timeout: the race every keep-alive client retries).
  // Read side only: a TLS session still writes its closing alert on the way out.
  oldest->evicted = true;
  ::shutdown(oldest->fd, SHUT_RD);
  return true;
}

bool HttpServer::ReadRequest(HttpConn* conn, Connection* self, std::string* buffer, HttpRequest* req,
                             std::chrono::milliseconds idle, std::chrono::milliseconds read,
                             Clock::time_point not_after) {
  HttpRequestParser parser(limits_.max_header_bytes, limits_.max_body_bytes);
  // Until the first byte of a request: the idle limit; from there, the read limit.
  Clock::time_point deadline = std::min(Clock::now() + idle, not_after);
  bool started = false;
  auto reply_error = [&](int status, const std::string& message) {
    HttpResponder r(conn, std::chrono::seconds(5), std::chrono::seconds(5), &stop_);
    r.keep_alive_ = false;
    r.Reply(status, "application/json", ErrorJson(status, message));
  };
  while (true) {
    if (!buffer->empty() && !started) {
      started = true;
      deadline = std::min(Clock::now() + read, not_after);
      if (self && !SetIdle(self, false)) return false;
    }
    switch (parser.Feed(buffer)) {
      case HttpRequestParser::State::kDone:
        *req = parser.request();
        return true;
      case HttpRequestParser::State::kError:
        reply_error(parser.error_status(), parser.error_status() == 400 ? "malformed HTTP request: " + parser.error()
                                                                        : parser.error());
        return false;
      case HttpRequestParser::State::kNeedMore:
        break;
    }
    // A client that sent `Expect: 100-continue` waits for this before its body (curl does so
    // for bodies over 1 kB, for a second).
    if (parser.TakeContinue()) {
      HttpResponder r(conn, read, read, &stop_);
      if (!r.SendAll("HTTP/1.1 100 Continue\r\n\r\n")) return false;
    }
    // Read first, wait only when nothing is there: TLS may hold decrypted bytes already.
    char chunk[16384];
    short want = POLLIN;
    const ssize_t n = conn->Recv(chunk, sizeof chunk, &want);
    if (n > 0) {
      buffer->append(chunk, static_cast<size_t>(n));
      continue;
    }
    if (n != HttpConn::kWouldBlock) return false;   // the client closed, or the connection failed
    if (!WaitFd(conn->fd(), want, deadline, &stop_)) {
      if (started && !stop_) reply_error(408, "the request did not arrive within " +
                                                   std::to_string(read.count()) + " ms");
      return false;
    }
  }
}

std::string HttpServer::TooManyConnectionsJson() const {
  return ErrorJson(503, "too many connections (" + std::to_string(limits_.max_connections) + ")");
}

std::string HttpServer::TooManyConnections() const {
  const std::string body = TooManyConnectionsJson();
  return Head(503, "application/json", {{"Retry-After", "1"}}) + "Content-Length: " +
         std::to_string(body.size()) + "\r\nConnection: close\r\n\r\n" + body;
}

void HttpServer::Serve(Connection* self, bool probe) {
  const int fd = self->fd;
  int one = 1;
  ::setsockopt(fd, IPPROTO_TCP, TCP_NODELAY, &one, sizeof one);
  SSL* ssl = nullptr;
  if (impl_->tls) {
    ssl = SSL_new(impl_->tls.get());
    if (!ssl || SSL_set_fd(ssl, fd) != 1) {
      FM_LOG(kWarn, "http") << "TLS session: " << OpenSslError();
      if (ssl) SSL_free(ssl);
      ::close(fd);
      return;
    }
  }
  HttpConn conn(fd, ssl);
  std::string buffer;
  // A probe connection has probe_read_timeout from its accept for the handshake and the request.
  const Clock::time_point not_after =
      probe ? Clock::now() + limits_.probe_read_timeout : Clock::time_point::max();
  bool ok = conn.Handshake(std::min(Clock::now() + limits_.read_timeout, not_after), &stop_);
  for (bool kept_alive = false; ok && !stop_; kept_alive = true) {
    HttpRequest req;
    // Between requests of a kept-alive connection with nothing of the next one buffered yet,
    // the accept loop may evict it (EvictIdle).
    Connection* evictable = nullptr;
    if (kept_alive && buffer.empty()) {
      if (!SetIdle(self, true)) break;   // evicted already
      evictable = self;
    }
    if (!ReadRequest(&conn, evictable, &buffer, &req, limits_.idle_timeout, limits_.read_timeout,
                     not_after))
      break;
    HttpResponder r(&conn, limits_.response_timeout,
                    std::max(limits_.write_stall_timeout, std::chrono::milliseconds(1)), &stop_);
    r.keep_alive_ = req.keep_alive && !probe;
    if (probe && !(req.method == "GET" && (req.path == "/health" || req.path == "/metrics"))) {
      r.Reply(503, "application/json", TooManyConnectionsJson(), {{"Retry-After", "1"}});
      break;
    }
    handler_(req, &r);
    if (!r.replied_) r.Reply(500, "application/json", ErrorJson(500, "the handler sent no response"));
    if (!r.keep_alive_ || r.failed_) break;
  }
  {
    std::lock_guard<std::mutex> lock(mu_);   // not evictable once its descriptor may be reused
    self->idle = false;
  }
  // Half-close, then give the client a moment to read the rest before the socket goes.
  conn.ShutdownWrite();
  Clock::time_point linger = Clock::now() + std::chrono::milliseconds(200);
  char sink[4096];
  while (WaitFd(fd, POLLIN, linger, nullptr) && ::recv(fd, sink, sizeof sink, 0) > 0) {
  }
  ::close(fd);
}

}  // namespace fm
