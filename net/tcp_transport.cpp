// TCP data plane over Boost.Asio: the Transport calls (net/tcp_transport.h), made from any
// thread, each handing its socket work to the io thread and waiting with a deadline. The
// connections themselves (accept, dial, handshake, read loop): tcp_transport_conns.cpp.
#include "net/tcp_transport.h"

#include <array>
#include <future>

#include "common/log.h"
#include "net/tcp_transport_impl.h"

namespace fm::net {

TcpTransport::~TcpTransport() {
  asio::post(io_, [this] {
    error_code ignored;
    if (acceptor_) acceptor_->close(ignored);
    std::lock_guard<std::mutex> l(mu_);
    for (auto& [name, p] : peers_)
      if (p.conn) CloseSocket(*p.conn, "transport shut down");
    for (auto& c : handshaking_) CloseSocket(*c, "transport shut down");
    io_.stop();
  });
  thread_.join();
}

Status TcpTransport::Listen(const std::string& address) {
  std::string host, port;
  FM_RETURN_IF_ERROR(SplitAddress(address, &host, &port));
  if (acceptor_) return InvalidArgument("listen " + address + ": already listening");
  error_code ec;
  tcp::resolver resolver(io_);
  auto eps = resolver.resolve(host, port, tcp::resolver::passive, ec);
  if (ec || eps.empty()) return Unavailable("listen " + address + ": resolve: " + ec.message());
  const tcp::endpoint ep = eps.begin()->endpoint();
  auto acc = std::make_unique<tcp::acceptor>(io_);
  acc->open(ep.protocol(), ec);
  if (!ec) acc->set_option(tcp::acceptor::reuse_address(true), ec);
  if (!ec) acc->bind(ep, ec);
  if (!ec) acc->listen(asio::socket_base::max_listen_connections, ec);
  if (ec) return Unavailable("listen " + address + ": " + ec.message());
  const auto bound = acc->local_endpoint(ec);
  {
    std::lock_guard<std::mutex> l(mu_);
    listen_address_ = (ep.address().is_v6() ? "[" + host + "]" : host) + ":" +
                      std::to_string(bound.port());
    if (!ep.address().is_unspecified()) dial_from_ = ep.address();
  }
  acceptor_ = std::move(acc);
  asio::co_spawn(io_, AcceptLoop(), asio::detached);
  FM_LOG(kInfo, "net") << "'" << opts_.self_name << "' listening on " << listen_address();
  return Status::Ok();
}

std::string TcpTransport::listen_address() const {
  std::lock_guard<std::mutex> l(mu_);
  return listen_address_;
}

Status TcpTransport::Connect(const std::string& peer, const std::string& address, Millis timeout) {
  FM_RETURN_IF_ERROR(ValidatePeerName(peer).Wrap("connect"));
  std::string host, port;
  FM_RETURN_IF_ERROR(SplitAddress(address, &host, &port).Wrap("connect to peer '" + peer + "'"));
  auto c = std::make_shared<Conn>(io_);
  auto done = std::make_shared<std::promise<Status>>();
  auto result = done->get_future();
  asio::co_spawn(io_, Dial(c, peer, address, host, port, timeout),
                 [done](std::exception_ptr e, Status s) {
                   done->set_value(e ? Internal("connect: unexpected exception") : s);
                 });
  // The coroutine's own deadline closes the socket at `timeout`; the margin covers the io
  // thread finishing that close.
  if (result.wait_for(timeout + Millis(2000)) != std::future_status::ready)
    return DeadlineExceeded("connect to peer '" + peer + "' at " + address + ": no answer");
  return result.get();
}

Status TcpTransport::Send(const std::string& peer, const FrameHeader& header, const void* payload,
                          size_t nbytes, Millis timeout) {
  FrameHeader h = header;
  std::array<uint8_t, kFrameHeaderSize> hdr;
  FM_RETURN_IF_ERROR(
      EncodeFrameHeader(&h, payload, nbytes, hdr.data()).Wrap("send to peer '" + peer + "'"));
  if (nbytes > max_payload_)
    return InvalidArgument("send to peer '" + peer + "': payload of " + std::to_string(nbytes) +
                           " bytes exceeds the limit of " + std::to_string(max_payload_.load()));
  std::shared_ptr<Conn> c;
  {
    std::lock_guard<std::mutex> l(mu_);
    auto it = peers_.find(peer);
    if (it == peers_.end() || !it->second.conn)
      return Unavailable("send to peer '" + peer + "': not connected" +
                         (it == peers_.end() ? "" : " (" + it->second.close_reason + ")"));
    c = it->second.conn;
  }
  std::lock_guard<std::mutex> serial(c->send_mu);
  std::vector<uint8_t> cipher;
  FrameTag tag{};
  if (c->tx)
    FM_RETURN_IF_ERROR(c->tx->Seal(hdr.data(), payload, nbytes, &cipher, &tag)
                           .Wrap("send to peer '" + peer + "'"));
  const void* body = c->tx && c->tx->encrypt() ? static_cast<const void*>(cipher.data()) : payload;
  struct Op {
    std::mutex m;
    std::condition_variable cv;
    bool done = false;
    error_code ec;
  };
  auto op = std::make_shared<Op>();
  const std::array<asio::const_buffer, 3> bufs = {asio::buffer(hdr), asio::buffer(body, nbytes),
                                                  asio::buffer(tag.data(), c->tx ? tag.size() : 0)};
  asio::post(io_, [c, op, bufs] {
    asio::async_write(c->socket, bufs, [op](const error_code& ec, size_t) {
      std::lock_guard<std::mutex> l(op->m);
      op->ec = ec;
      op->done = true;
      op->cv.notify_all();
    });
  });
  std::unique_lock<std::mutex> l(op->m);
  bool timed_out = false;
  if (!op->cv.wait_for(l, timeout, [&] { return op->done; })) {
    // The write still references hdr and payload: abort it and wait for its completion.
    timed_out = true;
    asio::post(io_, [c] { CloseSocket(*c, "send timed out"); });
    op->cv.wait(l, [&] { return op->done; });
  }
  if (timed_out)
    return DeadlineExceeded("send to peer '" + peer + "': " + std::to_string(nbytes) +
                            " bytes not written within " + std::to_string(timeout.count()) +
                            " ms; connection closed");
  if (op->ec) return Unavailable("send to peer '" + peer + "': " + op->ec.message());
  std::lock_guard<std::mutex> sl(mu_);
  stats_.frames_sent++;
  stats_.bytes_sent += kFrameHeaderSize + nbytes + (c->tx ? kFrameTagSize : 0);
  return Status::Ok();
}

Result<Frame> TcpTransport::Recv(const std::string& peer, Millis timeout) {
  std::unique_lock<std::mutex> l(mu_);
  PeerState* p = nullptr;
  auto ready = [&] {
    auto it = peers_.find(peer);
    p = it == peers_.end() ? nullptr : &it->second;
    return p && (!p->queue.empty() || !p->conn);
  };
  if (!cv_.wait_for(l, timeout, ready)) {
    return DeadlineExceeded("recv from peer '" + peer + "': no frame within " +
                            std::to_string(timeout.count()) + " ms" +
                            (p ? "" : " (peer never connected)"));
  }
  if (p->queue.empty())
    return Unavailable("recv from peer '" + peer + "': connection closed (" + p->close_reason +
                       ")");
  Frame f = std::move(p->queue.front());
  p->queue.pop_front();
  p->queued_bytes -= QueuedCost(f.payload.size());
  return f;
}

Status TcpTransport::WaitForPeer(const std::string& peer, Millis timeout) {
  std::unique_lock<std::mutex> l(mu_);
  const bool up = cv_.wait_for(l, timeout, [&] {
    auto it = peers_.find(peer);
    return it != peers_.end() && it->second.conn != nullptr;
  });
  if (up) return Status::Ok();
  return DeadlineExceeded("peer '" + peer + "' did not connect within " +
                          std::to_string(timeout.count()) + " ms");
}

bool TcpTransport::IsConnected(const std::string& peer) const {
  std::lock_guard<std::mutex> l(mu_);
  auto it = peers_.find(peer);
  return it != peers_.end() && it->second.conn != nullptr;
}

std::vector<std::string> TcpTransport::ConnectedPeers() const {
  std::lock_guard<std::mutex> l(mu_);
  std::vector<std::string> out;
  for (const auto& [name, p] : peers_)
    if (p.conn) out.push_back(name);
  return out;  // std::map iterates sorted
}

void TcpTransport::Disconnect(const std::string& peer) {
  std::shared_ptr<Conn> c;
  {
    std::lock_guard<std::mutex> l(mu_);
    auto it = peers_.find(peer);
    if (it == peers_.end() || !it->second.conn) return;
    c = std::move(it->second.conn);
    it->second.close_reason = "disconnected locally";
  }
  cv_.notify_all();
  asio::post(io_, [c] { CloseSocket(*c, "disconnected locally"); });
}

Status TcpTransport::SetAllowedPeers(const std::vector<AllowedPeer>& peers) {
  std::map<std::string, AllowedHost> allowed;
  for (const AllowedPeer& p : peers) {
    FM_RETURN_IF_ERROR(ValidatePeerName(p.name).Wrap("allowed peer"));
    AllowedHost& a = allowed[p.name];
    a.host = p.host;
    if (p.host.empty()) continue;
    // Resolved now if it can be; a name that does not resolve yet (a peer's pod not
    // scheduled) is resolved again when that peer connects.
    error_code ec;
    tcp::resolver resolver(io_);
    auto eps = resolver.resolve(p.host, "0", ec);
    if (!ec) a.Set(eps);
  }
  std::vector<std::shared_ptr<Conn>> gone;
  {
    std::lock_guard<std::mutex> l(mu_);
    for (auto& [name, p] : peers_)
      if (p.conn && !allowed.count(name)) {
        gone.push_back(std::move(p.conn));
        p.close_reason = "no longer in the plan";
      }
    allowed_ = std::move(allowed);
  }
  cv_.notify_all();
  for (auto& c : gone) asio::post(io_, [c] { CloseSocket(*c, "no longer in the plan"); });
  return Status::Ok();
}

void TcpTransport::SetLimits(uint64_t max_payload, uint64_t max_queued_bytes) {
  max_payload_ = max_payload;
  max_queued_ = max_queued_bytes;
}

TransportStats TcpTransport::stats() const {
  std::lock_guard<std::mutex> l(mu_);
  return stats_;
}

Result<std::unique_ptr<Transport>> MakeTcpTransport(const TransportOptions& options) {
  FM_RETURN_IF_ERROR(ValidatePeerName(options.self_name).Wrap("transport self_name"));
  if (options.max_payload == 0) return InvalidArgument("transport max_payload: must be > 0");
  if (options.encrypt && options.secret.empty())
    return InvalidArgument("transport encrypt: needs a cluster secret (security.cluster_secret_file)");
  if (options.frame_timeout.count() <= 0)
    return InvalidArgument("transport frame_timeout: must be > 0");
  return std::unique_ptr<Transport>(new TcpTransport(options));
}

}  // namespace fm::net
