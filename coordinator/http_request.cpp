#include "coordinator/http_request.h"

#include <algorithm>
#include <cctype>

#include <boost/beast/http.hpp>

namespace fm {

namespace http = boost::beast::http;

struct HttpRequestParser::Impl {
  http::request_parser<http::string_body> parser;
};

std::string HttpRequest::Header(const std::string& lower_name) const {
  auto it = headers.find(lower_name);
  return it == headers.end() ? "" : it->second;
}

namespace {

std::string Lower(boost::beast::string_view s) {
  std::string out(s.data(), s.size());
  std::transform(out.begin(), out.end(), out.begin(), [](unsigned char c) { return std::tolower(c); });
  return out;
}

}  // namespace

HttpRequestParser::HttpRequestParser(size_t max_header_bytes, size_t max_body_bytes)
    : impl_(std::make_unique<Impl>()), max_header_bytes_(max_header_bytes), max_body_bytes_(max_body_bytes) {
  impl_->parser.header_limit(static_cast<std::uint32_t>(max_header_bytes));
  impl_->parser.body_limit(max_body_bytes);
  impl_->parser.eager(true);
}

HttpRequestParser::~HttpRequestParser() = default;

HttpRequestParser::State HttpRequestParser::Feed(std::string* buffer) {
  auto& p = impl_->parser;
  while (!p.is_done()) {
    if (buffer->empty()) return State::kNeedMore;
    // The parser sees at most what the header may still take, and past the header a header's
    // worth plus the CRLF that ends the chunk before a chunk-size line: Beast bounds neither
    // chunk lines nor trailers, and it checks its header limit within one call only, while it
    // takes a header's complete lines over several.
    const bool in_header = !p.is_header_done();
    const size_t limit = in_header ? max_header_bytes_ - header_bytes_ : max_header_bytes_ + 2;
    const size_t window = std::min(buffer->size(), limit);
    boost::beast::error_code ec;
    size_t used = window == 0 ? 0 : p.put(boost::asio::buffer(buffer->data(), window), ec);
    buffer->erase(0, used);
    if (in_header && !p.is_header_done()) header_bytes_ += used;
    if (ec && ec != http::error::need_more) {
      error_status_ = ec == http::error::header_limit ? 431 : ec == http::error::body_limit ? 413 : 400;
      error_ = error_status_ == 431 ? "a header over " + std::to_string(max_header_bytes_) + " bytes"
               : error_status_ == 413 ? "a body over " + std::to_string(max_body_bytes_) + " bytes"
                                      : ec.message();
      return State::kError;
    }
    if (p.is_header_done()) {
      // Only chunked, the one coding this server decodes (RFC 9112: 501 for the others).
      const auto te = p.get().find(http::field::transfer_encoding);
      if (te != p.get().end() && Lower(te->value()) != "chunked") {
        error_ = "Transfer-Encoding '" + std::string(te->value()) + "' (only chunked is supported)";
        error_status_ = 501;
        return State::kError;
      }
    }
    if (ec == http::error::need_more || (used == 0 && !p.is_done())) {
      if (used > 0) continue;   // it took what it could of the window: the next one
      if (window < limit) return State::kNeedMore;   // the rest has not come yet
      // The parser takes body bytes as they come (eager), so what it could not finish within
      // the whole window is a header, chunk-size line or trailer over the limit.
      error_ = (in_header ? "a header over " : "a chunk line or trailer over ") +
               std::to_string(max_header_bytes_) + " bytes";
      error_status_ = 431;
      return State::kError;
    }
  }
  const auto& msg = p.get();
  request_.method = std::string(msg.method_string());
  std::string target(msg.target());
  request_.path = target.substr(0, target.find('?'));
  for (const auto& field : msg) request_.headers[Lower(field.name_string())] = std::string(field.value());
  request_.body = msg.body();
  request_.keep_alive = msg.keep_alive();
  return State::kDone;
}

bool HttpRequestParser::TakeContinue() {
  const auto& p = impl_->parser;
  if (continue_sent_ || !p.is_header_done() || p.is_done()) return false;
  const auto expect = p.get().find(http::field::expect);
  if (expect == p.get().end() || Lower(expect->value()) != "100-continue") return false;
  continue_sent_ = true;
  return true;
}

}  // namespace fm
