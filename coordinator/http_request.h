// HTTP/1.1 request parsing for the coordinator's HTTP server: Boost.Beast's request parser
// behind a byte-feeding interface with the server's limits (header and body size), so that the
// server reads its socket with its own timeouts and the fuzz target feeds arbitrary bytes.
#pragma once
#include <cstddef>
#include <map>
#include <memory>
#include <string>

namespace fm {

struct HttpRequest {
  std::string method;                          // "GET", "POST", ...
  std::string path;                            // target without the query string
  std::map<std::string, std::string> headers;  // names lower-cased; a repeated one keeps the last
  std::string body;
  bool keep_alive = true;
  std::string Header(const std::string& lower_name) const;   // "" when absent
};

class HttpRequestParser {
 public:
  enum class State { kNeedMore, kDone, kError };
  HttpRequestParser(size_t max_header_bytes, size_t max_body_bytes);
  ~HttpRequestParser();
  // Parses from the front of *buffer and erases what it consumed; the bytes after a complete
  // request stay (pipelined requests), and on kNeedMore at most max_header_bytes + 1 stay.
  // kDone: request() holds the request; kError: the request is unparseable or over a limit
  // (error_status() 400, 413, 431 or 501, error() says why).
  State Feed(std::string* buffer);
  // True once, when the header asked `Expect: 100-continue` and the body has not all come:
  // the server answers 100 Continue.
  bool TakeContinue();
  const HttpRequest& request() const { return request_; }
  int error_status() const { return error_status_; }
  const std::string& error() const { return error_; }

 private:
  struct Impl;
  std::unique_ptr<Impl> impl_;
  size_t max_header_bytes_, max_body_bytes_;
  size_t header_bytes_ = 0;   // of the header, taken by the parser so far
  bool continue_sent_ = false;
  HttpRequest request_;
  int error_status_ = 0;
  std::string error_;
};

}  // namespace fm
