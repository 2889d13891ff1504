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

HttpRequestParser::HttpRequestParser(size_t max_header_bytes, size_t max_body_bytes)
    : impl_(std::make_unique<Impl>()) {
  impl_->parser.header_limit(static_cast<std::uint32_t>(max_header_bytes));
  impl_->parser.body_limit(max_body_bytes);
  impl_->parser.eager(true);
}

HttpRequestParser::~HttpRequestParser() = default;

HttpRequestParser::State HttpRequestParser::Feed(std::string* buffer) {
  auto& p = impl_->parser;
  while (!p.is_done()) {
    if (buffer->empty()) return State::kNeedMore;
    boost::beast::error_code ec;
    size_t used = p.put(boost::asio::buffer(buffer->data(), buffer->size()), ec);
    buffer->erase(0, used);
    if (ec == http::error::need_more) return State::kNeedMore;
    if (ec) {
      error_ = ec.message();
      error_status_ = ec == http::error::header_limit ? 431 : ec == http::error::body_limit ? 413 : 400;
      return State::kError;
    }
    if (used == 0 && !p.is_done()) return State::kNeedMore;
  }
  const auto& msg = p.get();
  request_.method = std::string(msg.method_string());
  std::string target(msg.target());
  request_.path = target.substr(0, target.find('?'));
  for (const auto& field : msg) {
    std::string name(field.name_string());
    std::transform(name.begin(), name.end(), name.begin(), [](unsigned char c) { return std::tolower(c); });
    request_.headers[name] = std::string(field.value());
  }
  request_.body = msg.body();
  request_.keep_alive = msg.keep_alive();
  return State::kDone;
}

}  // namespace fm
