#include "coordinator/http_server.h"

#include <netinet/in.h>
#include <netinet/tcp.h>
#include <poll.h>
#include <sys/socket.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>

#include <boost/asio/ip/tcp.hpp>

#include "config/cluster_config.h"
#include "coordinator/openai_request.h"

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

}  // namespace

struct HttpServer::Impl {
  boost::asio::io_context io;
  boost::asio::ip::tcp::acceptor acceptor{io};
};

bool HttpResponder::SendAll(std::string_view bytes) {
  while (!bytes.empty() && !failed_) {
    ssize_t n = ::send(fd_, bytes.data(), bytes.size(), MSG_NOSIGNAL);
    if (n > 0) {
      bytes.remove_prefix(static_cast<size_t>(n));
      continue;
    }
    if (n < 0 && (errno == EAGAIN || errno == EWOULDBLOCK || errno == EINTR)) {
      if (!WaitFd(fd_, POLLOUT, deadline_, stop_)) failed_ = true;
      continue;
    }
    failed_ = true;
  }
  return !failed_;
}

bool HttpResponder::Reply(int status, const std::string& content_type, const std::string& body,
                          const Headers& extra) {
  replied_ = true;
  std::string out = Head(status, content_type, extra);
  out += "Content-Length: " + std::to_string(body.size()) + "\r\n";
  out += keep_alive_ ? "Connection: keep-alive\r\n\r\n" : "Connection: close\r\n\r\n";
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
  pollfd p{fd_, static_cast<short>(POLLIN | POLLRDHUP), 0};
  if (::poll(&p, 1, 0) <= 0) return false;
  if (p.revents & (POLLRDHUP | POLLHUP | POLLERR)) {
    failed_ = true;
    return true;
  }
  return false;   // readable: a pipelined request, read after this response
}

Result<std::unique_ptr<HttpServer>> HttpServer::Start(const std::string& listen, HttpLimits limits,
                                                      HttpHandler handler) {
  FM_ASSIGN_OR_RETURN(HostPort hp, ParseHostPort(listen, /*allow_zero=*/true));
  std::unique_ptr<HttpServer> s(new HttpServer());
  s->impl_ = std::make_unique<Impl>();
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
  std::lock_guard<std::mutex> lock(mu_);
  for (auto it = connections_.begin(); it != connections_.end();) {
    if (all || (*it)->done) {
      (*it)->thread.join();
      it = connections_.erase(it);
    } else {
      ++it;
    }
  }
}

void HttpServer::AcceptLoop() {
  const int lfd = impl_->acceptor.native_handle();
  while (!stop_) {
    pollfd p{lfd, POLLIN, 0};
    int n = ::poll(&p, 1, kPollSliceMs);
    Reap(/*all=*/false);
    if (n <= 0) continue;
    int fd = ::accept4(lfd, nullptr, nullptr, SOCK_NONBLOCK | SOCK_CLOEXEC);
    if (fd < 0) continue;
    if (open_ >= limits_.max_connections) {
      // Best effort, never blocking the accept loop: the client learns why.
      std::string body = ErrorJson(503, "too many connections (" + std::to_string(limits_.max_connections) + ")");
      std::string out = Head(503, "application/json", {{"Retry-After", "1"}}) + "Content-Length: " +
                        std::to_string(body.size()) + "\r\nConnection: close\r\n\r\n" + body;
      ssize_t ignored = ::send(fd, out.data(), out.size(), MSG_NOSIGNAL);
      (void)ignored;
      ::close(fd);
      continue;
    }
    ++open_;
    auto c = std::make_unique<Connection>();
    Connection* raw = c.get();
    std::lock_guard<std::mutex> lock(mu_);
    connections_.push_back(std::move(c));
    raw->thread = std::thread([this, fd, raw] {
      Serve(fd);
      --open_;
      raw->done = true;
    });
  }
}

bool HttpServer::ReadRequest(int fd, std::string* buffer, HttpRequest* req) {
  HttpRequestParser parser(limits_.max_header_bytes, limits_.max_body_bytes);
  // Until the first byte of a request: the idle limit; from there, the read limit.
  Clock::time_point deadline = Clock::now() + limits_.idle_timeout;
  bool started = false;
  auto reply_error = [&](int status, const std::string& message) {
    HttpResponder r(fd, Clock::now() + std::chrono::seconds(5), &stop_);
    r.keep_alive_ = false;
    r.Reply(status, "application/json", ErrorJson(status, message));
  };
  while (true) {
    if (!buffer->empty() && !started) {
      started = true;
      deadline = Clock::now() + limits_.read_timeout;
    }
    switch (parser.Feed(buffer)) {
      case HttpRequestParser::State::kDone:
        *req = parser.request();
        return true;
      case HttpRequestParser::State::kError:
        reply_error(parser.error_status(), "malformed HTTP request: " + parser.error());
        return false;
      case HttpRequestParser::State::kNeedMore:
        break;
    }
    if (!WaitFd(fd, POLLIN, deadline, &stop_)) {
      if (started && !stop_) reply_error(408, "the request did not arrive within " +
                                                   std::to_string(limits_.read_timeout.count()) + " ms");
      return false;
    }
    char chunk[16384];
    ssize_t n = ::recv(fd, chunk, sizeof chunk, 0);
    if (n == 0) return false;   // the client closed
    if (n < 0) {
      if (errno == EAGAIN || errno == EWOULDBLOCK || errno == EINTR) continue;
      return false;
    }
    buffer->append(chunk, static_cast<size_t>(n));
  }
}

void HttpServer::Serve(int fd) {
  int one = 1;
  ::setsockopt(fd, IPPROTO_TCP, TCP_NODELAY, &one, sizeof one);
  std::string buffer;
  while (!stop_) {
    HttpRequest req;
    if (!ReadRequest(fd, &buffer, &req)) break;
    HttpResponder r(fd, Clock::now() + limits_.response_timeout, &stop_);
    r.keep_alive_ = req.keep_alive;
    handler_(req, &r);
    if (!r.replied_) r.Reply(500, "application/json", ErrorJson(500, "the handler sent no response"));
    if (!r.keep_alive_ || r.failed_) break;
  }
  // Half-close, then give the client a moment to read the rest before the socket goes.
  ::shutdown(fd, SHUT_WR);
  Clock::time_point linger = Clock::now() + std::chrono::milliseconds(200);
  char sink[4096];
  while (WaitFd(fd, POLLIN, linger, nullptr) && ::recv(fd, sink, sizeof sink, 0) > 0) {
  }
  ::close(fd);
}

}  // namespace fm
