#include "tests/integration/http_client.h"

#include <arpa/inet.h>
#include <netinet/in.h>
#include <poll.h>
#include <sys/socket.h>
#include <unistd.h>

#include <openssl/err.h>
#include <openssl/ssl.h>
#include <openssl/x509v3.h>
#include <sys/time.h>

#include <algorithm>
#include <cctype>
#include <cstdlib>
#include <fstream>
#include <memory>

namespace fm::it {
namespace {

int Dial(int port) {
  int fd = socket(AF_INET, SOCK_STREAM, 0);
  sockaddr_in addr{};
  addr.sin_family = AF_INET;
  addr.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  addr.sin_port = htons(static_cast<uint16_t>(port));
  if (connect(fd, reinterpret_cast<sockaddr*>(&addr), sizeof addr) != 0) {
    close(fd);
    return -1;
  }
  return fd;
}

void SendAll(int fd, const std::string& bytes) {
  size_t off = 0;
  while (off < bytes.size()) {
    ssize_t n = send(fd, bytes.data() + off, bytes.size() - off, MSG_NOSIGNAL);
    if (n <= 0) return;
    off += static_cast<size_t>(n);
  }
}

// Appends what arrives within `timeout_ms` (one read): 1 data, 0 nothing yet, -1 EOF or error.
int ReadSome(int fd, std::string* out, int timeout_ms) {
  pollfd p{fd, POLLIN, 0};
  if (poll(&p, 1, timeout_ms) <= 0) return 0;
  char buf[8192];
  ssize_t n = recv(fd, buf, sizeof buf, 0);
  if (n <= 0) return -1;
  out->append(buf, static_cast<size_t>(n));
  return 1;
}

}  // namespace

HttpResult HttpRaw(int port, const std::string& request, std::chrono::milliseconds timeout) {
  HttpResult r;
  int fd = Dial(port);
  if (fd < 0) return r;
  SendAll(fd, request);
  const auto deadline = std::chrono::steady_clock::now() + timeout;
  while (std::chrono::steady_clock::now() < deadline) {
    auto left = std::chrono::duration_cast<std::chrono::milliseconds>(deadline - std::chrono::steady_clock::now());
    if (ReadSome(fd, &r.raw, static_cast<int>(std::max<long long>(1, left.count()))) <= 0) break;
  }
  close(fd);
  ParseResponse(&r);
  return r;
}

void ParseResponse(HttpResult* out) {
  HttpResult& r = *out;
  size_t end = r.raw.find("\r\n\r\n");
  if (r.raw.rfind("HTTP/1.1 ", 0) != 0 || end == std::string::npos) return;
  r.status = std::stoi(r.raw.substr(9, 3));
  size_t line = r.raw.find("\r\n") + 2;
  while (line < end) {
    size_t eol = r.raw.find("\r\n", line);
    std::string h = r.raw.substr(line, eol - line);
    size_t colon = h.find(':');
    std::string name = h.substr(0, colon);
    std::transform(name.begin(), name.end(), name.begin(), [](unsigned char c) { return std::tolower(c); });
    size_t v = h.find_first_not_of(' ', colon + 1);
    r.headers[name] = v == std::string::npos ? "" : h.substr(v);
    line = eol + 2;
  }
  r.body = r.raw.substr(end + 4);
}

std::string Request(const std::string& method, const std::string& path, const std::string& body,
                    const std::vector<std::string>& headers) {
  std::string req = method + " " + path + " HTTP/1.1\r\nHost: 127.0.0.1\r\nConnection: close\r\n";
  for (const auto& h : headers) req += h + "\r\n";
  if (!body.empty() || method == "POST")
    req += "Content-Type: application/json\r\nContent-Length: " + std::to_string(body.size()) + "\r\n";
  return req + "\r\n" + body;
}

HttpResult HttpCall(int port, const std::string& method, const std::string& path, const std::string& body,
                    const std::vector<std::string>& headers, std::chrono::milliseconds timeout) {
  return HttpRaw(port, Request(method, path, body, headers), timeout);
}

HttpResult HttpsRaw(int port, const std::string& ca_file, const std::string& request,
                    std::chrono::milliseconds timeout, std::string* error) {
  HttpResult r;
  auto fail = [&](const std::string& what) {
    char text[256] = "";
    ERR_error_string_n(ERR_get_error(), text, sizeof text);
    if (error) *error = what + ": " + text;
    return r;
  };
  int fd = Dial(port);
  if (fd < 0) return fail("connect");
  timeval tv{static_cast<time_t>(timeout.count() / 1000), static_cast<suseconds_t>(timeout.count() % 1000 * 1000)};
  setsockopt(fd, SOL_SOCKET, SO_RCVTIMEO, &tv, sizeof tv);
  setsockopt(fd, SOL_SOCKET, SO_SNDTIMEO, &tv, sizeof tv);
  std::unique_ptr<SSL_CTX, decltype(&SSL_CTX_free)> ctx(SSL_CTX_new(TLS_client_method()), SSL_CTX_free);
  std::unique_ptr<SSL, decltype(&SSL_free)> ssl(nullptr, SSL_free);
  // The server must present a certificate of this CA, for the address dialled.
  if (ctx && SSL_CTX_load_verify_locations(ctx.get(), ca_file.c_str(), nullptr) == 1) {
    SSL_CTX_set_verify(ctx.get(), SSL_VERIFY_PEER, nullptr);
    X509_VERIFY_PARAM_set1_ip_asc(SSL_CTX_get0_param(ctx.get()), "127.0.0.1");
    ssl.reset(SSL_new(ctx.get()));
  }
  if (!ssl || SSL_set_fd(ssl.get(), fd) != 1 || SSL_connect(ssl.get()) != 1) {
    close(fd);
    return fail("TLS handshake");
  }
  size_t off = 0;
  while (off < request.size()) {
    const int n = SSL_write(ssl.get(), request.data() + off, static_cast<int>(request.size() - off));
    if (n <= 0) break;
    off += static_cast<size_t>(n);
  }
  char buf[8192];
  for (int n; (n = SSL_read(ssl.get(), buf, sizeof buf)) > 0;) r.raw.append(buf, static_cast<size_t>(n));
  close(fd);
  ParseResponse(&r);
  return r;
}

std::string PostJson(const std::string& path, const std::string& body, const std::vector<std::string>& headers) {
  std::string req = "POST " + path + " HTTP/1.1\r\nHost: 127.0.0.1\r\nConnection: close\r\n";
  for (const auto& h : headers) req += h + "\r\n";
  return req + "Content-Type: application/json\r\nContent-Length: " + std::to_string(body.size()) + "\r\n\r\n" + body;
}

bool MakeTestCertificates(const std::string& dir) {
  const std::string cd = "cd '" + dir + "' && ", quiet = " >/dev/null 2>&1";
  std::ofstream(dir + "/ext") << "subjectAltName=IP:127.0.0.1\n";
  return std::system((cd + "openssl req -x509 -newkey rsa:2048 -nodes -keyout ca.key -out ca.pem "
                      "-days 1 -subj /CN=fm-test-ca" + quiet).c_str()) == 0 &&
         std::system((cd + "openssl req -newkey rsa:2048 -nodes -keyout node.key -out node.csr "
                      "-subj /CN=127.0.0.1" + quiet).c_str()) == 0 &&
         std::system((cd + "openssl x509 -req -in node.csr -CA ca.pem -CAkey ca.key "
                      "-CAcreateserial -out node.pem -days 1 -extfile ext" + quiet).c_str()) == 0;
}

HttpStream::HttpStream(int port, const std::string& request) : fd_(Dial(port)) {
  if (fd_ >= 0) SendAll(fd_, request);
}

HttpStream::~HttpStream() { Close(); }

void HttpStream::Send(const std::string& bytes) {
  if (fd_ >= 0) SendAll(fd_, bytes);
}

void HttpStream::Close() {
  if (fd_ >= 0) close(fd_);
  fd_ = -1;
}

std::string HttpStream::ReadUntil(const std::string& needle, int count, std::chrono::milliseconds timeout) {
  const auto deadline = std::chrono::steady_clock::now() + timeout;
  auto seen = [&] {
    int n = 0;
    for (size_t at = got_.find(needle); at != std::string::npos; at = got_.find(needle, at + needle.size())) ++n;
    return n;
  };
  while (fd_ >= 0 && seen() < count && std::chrono::steady_clock::now() < deadline)
    if (ReadSome(fd_, &got_, 100) < 0) break;
  return got_;
}

}  // namespace fm::it
