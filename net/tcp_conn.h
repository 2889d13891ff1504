// The sockets of the TCP data plane (tcp_transport.cpp): one connection's state, closing it,
// a deadline that closes it, and address helpers. Used on the transport's io thread only.
#pragma once
#include <utility>  // Boost 1.74's awaitable.hpp uses std::exchange without including it

#include <boost/asio.hpp>
#include <boost/asio/redirect_error.hpp>

#include <memory>
#include <mutex>
#include <string>

#include "common/status.h"
#include "net/frame_auth.h"
#include "net/transport.h"

namespace fm::net {

namespace asio = boost::asio;
using tcp = asio::ip::tcp;
using boost::system::error_code;

// "host:port" or "[v6]:port" -> host, port (the port as text, for the resolver).
Status SplitAddress(const std::string& address, std::string* host, std::string* port);

struct Conn {
  explicit Conn(asio::io_context& io) : socket(io) {}
  tcp::socket socket;
  std::string peer;            // authenticated name ("" during the handshake)
  std::string remote;          // "ip:port" of the other end, for logs
  std::string local_close;     // why this side closed it (read loop reports it)
  std::mutex send_mu;          // one gather write in flight per socket: Send callers queue here
  // Frame tags (with a secret): tx under send_mu, rx in the read loop; set before Register.
  std::unique_ptr<FrameSealer> tx, rx;
};

// Shuts the socket down (pending operations complete with an error); the first reason stays.
void CloseSocket(Conn& c, const std::string& why);

// Closes the connection's socket if the operations it guards are not done by the deadline,
// which makes the pending read/write complete with an error.
class SocketDeadline {
 public:
  SocketDeadline(const std::shared_ptr<Conn>& c, Millis timeout);
  ~SocketDeadline() { timer_.cancel(); }
  bool fired() const { return *fired_; }

 private:
  std::shared_ptr<bool> fired_ = std::make_shared<bool>(false);
  asio::steady_timer timer_;
};

inline auto Redirect(error_code& ec) { return asio::redirect_error(asio::use_awaitable, ec); }

// The remote address with IPv4-mapped IPv6 unmapped, so that it compares to a resolved IPv4.
asio::ip::address RemoteAddress(const tcp::socket& s);
// "ip:port" of the other end; "?" when unknown.
std::string Endpoint(const tcp::socket& s);

inline constexpr size_t kPayloadChunk = size_t{1} << 20;  // payload read step: memory follows the bytes

}  // namespace fm::net
