// Socket helpers of the TCP data plane (tcp_conn.h).
#include "net/tcp_conn.h"

namespace fm::net {

Status SplitAddress(const std::string& address, std::string* host, std::string* port) {
  const size_t colon = address.rfind(':');
  if (colon == std::string::npos || colon == 0 || colon + 1 == address.size())
    return InvalidArgument("address '" + address + "': expected host:port");
  *host = address.substr(0, colon);
  *port = address.substr(colon + 1);
  if (host->size() >= 2 && host->front() == '[' && host->back() == ']')
    *host = host->substr(1, host->size() - 2);
  for (char ch : *port)
    if (ch < '0' || ch > '9') return InvalidArgument("address '" + address + "': bad port");
  return Status::Ok();
}

void CloseSocket(Conn& c, const std::string& why) {
  if (c.local_close.empty()) c.local_close = why;
  error_code ignored;
  c.socket.shutdown(tcp::socket::shutdown_both, ignored);
  c.socket.close(ignored);
}

SocketDeadline::SocketDeadline(const std::shared_ptr<Conn>& c, Millis timeout)
    : timer_(c->socket.get_executor()) {
  timer_.expires_after(timeout);
  timer_.async_wait([c, fired = fired_](const error_code& ec) {
    if (ec) return;
    *fired = true;
    CloseSocket(*c, "deadline");
  });
}

asio::ip::address RemoteAddress(const tcp::socket& s) {
  error_code ec;
  asio::ip::address a = s.remote_endpoint(ec).address();
  if (a.is_v6() && a.to_v6().is_v4_mapped())
    return asio::ip::make_address_v4(asio::ip::v4_mapped, a.to_v6());
  return a;
}

std::string Endpoint(const tcp::socket& s) {
  error_code ec;
  auto ep = s.remote_endpoint(ec);
  return ec ? std::string("?") : ep.address().to_string() + ":" + std::to_string(ep.port());
}

}  // namespace fm::net
