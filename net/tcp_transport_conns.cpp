// A data-plane connection's life on the transport's io thread (tcp_transport_impl.h): accept
// (bounded while in handshake) or dial, the handshake of handshake.h and the allowed-peer check,
// registration as its peer's connection, then the read loop that validates every frame and
// queues it for its peer.
#include <array>

#include "common/log.h"
#include "net/frame_auth.h"
#include "net/tcp_transport_impl.h"

namespace fm::net {
namespace {

// Connections that may be in their handshake at once: a node has a few peers, so more are a
// flood (each holds a descriptor for up to handshake_timeout); the extra ones are closed at once.
constexpr size_t kMaxHandshaking = 64;
// After a failed accept (out of descriptors, EMFILE): the same error would come back at once.
constexpr auto kAcceptRetry = std::chrono::milliseconds(100);

}  // namespace

asio::awaitable<void> TcpTransport::AcceptLoop() {
  for (;;) {
    auto c = std::make_shared<Conn>(io_);
    error_code ec;
    co_await acceptor_->async_accept(c->socket, Redirect(ec));
    if (ec == asio::error::operation_aborted || !acceptor_->is_open()) co_return;
    if (ec) {   // wait instead of spinning the I/O thread (and the log) on it
      FM_LOG(kWarn, "net") << "accept on " << listen_address() << ": " << ec.message()
                           << "; trying again in " << kAcceptRetry.count() << " ms";
      asio::steady_timer pause(io_, kAcceptRetry);
      co_await pause.async_wait(Redirect(ec));
      continue;
    }
    bool flood = false;
    {
      std::lock_guard<std::mutex> l(mu_);
      flood = handshaking_.size() >= kMaxHandshaking;
      if (flood) stats_.connections_rejected++;
    }
    if (flood) {
      c->socket.close(ec);
      continue;
    }
    asio::co_spawn(io_, Accepted(std::move(c)), asio::detached);
  }
}

asio::awaitable<void> TcpTransport::Accepted(std::shared_ptr<Conn> c) {
  c->remote = Endpoint(c->socket);
  error_code ignored;
  c->socket.set_option(tcp::no_delay(true), ignored);
  {
    std::lock_guard<std::mutex> l(mu_);
    handshaking_.push_back(c);
  }
  Status s = co_await AcceptHandshake(c);
  {
    std::lock_guard<std::mutex> l(mu_);
    std::erase(handshaking_, c);
    if (!s.ok()) stats_.connections_rejected++;
  }
  if (!s.ok()) {
    FM_LOG(kWarn, "net") << "'" << opts_.self_name << "' rejected connection from " << c->remote
                         << ": " << s.message();
    CloseSocket(*c, "handshake failed");
    co_return;
  }
  Register(c);
  co_await ReadLoop(c);
}

asio::awaitable<Status> TcpTransport::AcceptHandshake(std::shared_ptr<Conn> c) {
  SocketDeadline deadline(c, opts_.handshake_timeout);
  error_code ec;
  auto io_error = [&](const char* what) {
    return deadline.fired()
               ? DeadlineExceeded(std::string("handshake: ") + what + ": not done within " +
                                  std::to_string(opts_.handshake_timeout.count()) + " ms")
               : Unavailable(std::string("handshake: ") + what + ": " + ec.message());
  };
  std::array<uint8_t, kHelloFixedSize> fixed;
  co_await asio::async_read(c->socket, asio::buffer(fixed), Redirect(ec));
  if (ec) co_return io_error("reading hello");
  Nonce dialer_nonce;
  Result<size_t> name_len = DecodeHelloFixed(fixed.data(), fixed.size(), &dialer_nonce);
  if (!name_len.ok()) co_return name_len.status();
  std::vector<uint8_t> name_bytes(*name_len);
  co_await asio::async_read(c->socket, asio::buffer(name_bytes), Redirect(ec));
  if (ec) co_return io_error("reading hello name");
  Result<std::string> dialer = DecodeHelloName(name_bytes.data(), name_bytes.size());
  if (!dialer.ok()) co_return dialer.status();
  if (Status allowed = co_await CheckAllowed(*dialer, RemoteAddress(c->socket)); !allowed.ok())
    co_return allowed;
  Result<Nonce> nonce = RandomNonce();
  if (!nonce.ok()) co_return nonce.status();
  std::vector<uint8_t> reply = EncodeHello({opts_.self_name, *nonce});
  const Mac mine = HandshakeMac(opts_.secret, HandshakeRole::kAcceptor, dialer_nonce, *nonce,
                                *dialer, opts_.self_name);
  reply.insert(reply.end(), mine.begin(), mine.end());
  co_await asio::async_write(c->socket, asio::buffer(reply), Redirect(ec));
  if (ec) co_return io_error("writing hello");
  Mac theirs;
  co_await asio::async_read(c->socket, asio::buffer(theirs), Redirect(ec));
  if (ec == asio::error::eof)
    co_return Unauthenticated("handshake: peer '" + *dialer +
                              "' hung up instead of authenticating (our MAC did not verify: "
                              "different cluster secret?)");
  if (ec) co_return io_error("reading MAC");
  const Mac want = HandshakeMac(opts_.secret, HandshakeRole::kDialer, dialer_nonce, *nonce,
                                *dialer, opts_.self_name);
  if (!MacEqual(theirs, want))
    co_return Unauthenticated("handshake: peer '" + *dialer +
                              "' failed authentication (wrong cluster secret)");
  co_await asio::async_write(c->socket, asio::buffer(kHandshakeOk), Redirect(ec));
  if (ec) co_return io_error("writing ok");
  c->peer = *dialer;
  StartSession(*c, HandshakeRole::kAcceptor, dialer_nonce, *nonce, *dialer, opts_.self_name);
  co_return Status::Ok();
}

asio::awaitable<Status> TcpTransport::Dial(std::shared_ptr<Conn> c, std::string peer,
                                           std::string address, std::string host, std::string port,
                                           Millis timeout) {
  Status s = co_await DialHandshake(c, peer, address, host, port, timeout);
  if (!s.ok()) {
    CloseSocket(*c, "handshake failed");
    co_return s;
  }
  c->peer = peer;
  Register(c);
  asio::co_spawn(io_, ReadLoop(c), asio::detached);
  co_return Status::Ok();
}

asio::awaitable<Status> TcpTransport::DialHandshake(std::shared_ptr<Conn> c, std::string peer,
                                                    std::string address, std::string host,
                                                    std::string port, Millis timeout) {
  const std::string who = "connect to peer '" + peer + "' at " + address;
  SocketDeadline deadline(c, timeout);
  error_code ec;
  auto io_error = [&](const char* what) {
    return deadline.fired() ? DeadlineExceeded(who + ": " + what + ": not done within " +
                                               std::to_string(timeout.count()) + " ms")
                            : Unavailable(who + ": " + what + ": " + ec.message());
  };
  tcp::resolver resolver(io_);
  auto eps = co_await resolver.async_resolve(host, port, Redirect(ec));
  if (ec) co_return io_error("resolve");
  std::optional<asio::ip::address> from;
  {
    std::lock_guard<std::mutex> l(mu_);
    from = dial_from_;
  }
  if (!from) {
    co_await asio::async_connect(c->socket, eps, Redirect(ec));
  } else {
    // From the address this node listens on: the peer checks a connection's source against
    // this node's data address in the plan, and the kernel's choice of source may differ (a
    // second address on the interface, 127.0.0.2).
    ec = asio::error::address_family_not_supported;
    for (const auto& e : eps) {
      if (deadline.fired() || e.endpoint().address().is_v6() != from->is_v6()) continue;
      error_code ignored;
      c->socket.close(ignored);
      c->socket.open(e.endpoint().protocol(), ec);
      if (!ec) c->socket.bind(tcp::endpoint(*from, 0), ec);
      if (!ec) co_await c->socket.async_connect(e.endpoint(), Redirect(ec));
      if (!ec) break;
    }
  }
  if (ec) co_return io_error("connect");
  c->remote = Endpoint(c->socket);
  c->socket.set_option(tcp::no_delay(true), ec);
  Result<Nonce> nonce = RandomNonce();
  if (!nonce.ok()) co_return nonce.status();
  // Named, not a temporary: GCC 12 mis-destroys temporaries inside co_await expressions.
  const std::vector<uint8_t> hello = EncodeHello({opts_.self_name, *nonce});
  co_await asio::async_write(c->socket, asio::buffer(hello), Redirect(ec));
  if (ec) co_return io_error("writing hello");
  std::array<uint8_t, kHelloFixedSize> fixed;
  co_await asio::async_read(c->socket, asio::buffer(fixed), Redirect(ec));
  if (ec == asio::error::eof)
    co_return Unauthenticated(who + ": it hung up on our hello (it does not take '" +
                              opts_.self_name + "' from this address as a peer of its plan)");
  if (ec) co_return io_error("reading hello");
  Nonce acceptor_nonce;
  Result<size_t> name_len = DecodeHelloFixed(fixed.data(), fixed.size(), &acceptor_nonce);
  if (!name_len.ok()) co_return name_len.status().Wrap(who);
  std::vector<uint8_t> rest(*name_len + kMacSize);
  co_await asio::async_read(c->socket, asio::buffer(rest), Redirect(ec));
  if (ec) co_return io_error("reading hello name");
  Result<std::string> name = DecodeHelloName(rest.data(), *name_len);
  if (!name.ok()) co_return name.status().Wrap(who);
  if (*name != peer)
    co_return Unauthenticated(who + ": it presents itself as '" + *name + "'");
  Mac theirs;
  std::copy(rest.begin() + *name_len, rest.end(), theirs.begin());
  const Mac want = HandshakeMac(opts_.secret, HandshakeRole::kAcceptor, *nonce, acceptor_nonce,
                                opts_.self_name, peer);
  if (!MacEqual(theirs, want))
    co_return Unauthenticated(who + ": peer failed authentication (wrong cluster secret)");
  const Mac mine = HandshakeMac(opts_.secret, HandshakeRole::kDialer, *nonce, acceptor_nonce,
                                opts_.self_name, peer);
  co_await asio::async_write(c->socket, asio::buffer(mine), Redirect(ec));
  if (ec) co_return io_error("writing MAC");
  std::array<uint8_t, sizeof(kHandshakeOk)> ok;
  co_await asio::async_read(c->socket, asio::buffer(ok), Redirect(ec));
  if (ec == asio::error::eof)
    co_return Unauthenticated(who + ": peer rejected our authentication (wrong cluster secret)");
  if (ec) co_return io_error("reading ok");
  if (!std::equal(ok.begin(), ok.end(), kHandshakeOk))
    co_return Unauthenticated(who + ": bad handshake acknowledgement");
  StartSession(*c, HandshakeRole::kDialer, *nonce, acceptor_nonce, opts_.self_name, peer);
  co_return Status::Ok();
}

void TcpTransport::StartSession(Conn& c, HandshakeRole me, const Nonce& dialer_nonce,
                                const Nonce& acceptor_nonce, const std::string& dialer,
                                const std::string& acceptor) const {
  if (opts_.secret.empty()) return;
  const HandshakeRole them = me == HandshakeRole::kDialer ? HandshakeRole::kAcceptor
                                                          : HandshakeRole::kDialer;
  c.tx = std::make_unique<FrameSealer>(
      SessionKey(opts_.secret, me, dialer_nonce, acceptor_nonce, dialer, acceptor), opts_.encrypt);
  c.rx = std::make_unique<FrameSealer>(
      SessionKey(opts_.secret, them, dialer_nonce, acceptor_nonce, dialer, acceptor), opts_.encrypt);
}

asio::awaitable<Status> TcpTransport::CheckAllowed(std::string name, asio::ip::address from) {
  std::string host;
  {
    std::lock_guard<std::mutex> l(mu_);
    if (!allowed_) co_return Status::Ok();
    auto it = allowed_->find(name);
    if (it == allowed_->end())
      co_return Unauthenticated("handshake: peer name '" + name + "' is not one of this node's peers");
    if (it->second.host.empty() || it->second.Admits(from)) co_return Status::Ok();
    host = it->second.host;
  }
  error_code ec;
  tcp::resolver resolver(io_);
  auto eps = co_await resolver.async_resolve(host, "0", Redirect(ec));
  if (ec)
    co_return Unauthenticated("handshake: peer '" + name + "' connected from " + from.to_string() +
                              ", and its host in the plan, '" + host + "', does not resolve: " +
                              ec.message());
  AllowedHost now;
  now.host = host;
  now.Set(eps);
  {
    // The plan may have changed during the lookup: admit only a peer it still names, at
    // this host.
    std::lock_guard<std::mutex> l(mu_);
    if (!allowed_) co_return Status::Ok();
    auto it = allowed_->find(name);
    if (it == allowed_->end() || it->second.host != host)
      co_return Unauthenticated("handshake: peer '" + name + "' left the plan while it connected");
    it->second = now;
  }
  if (now.Admits(from)) co_return Status::Ok();
  co_return Unauthenticated("handshake: peer '" + name + "' connected from " + from.to_string() +
                            ", not from its address in the plan (" +
                            (now.addresses.empty() ? host : now.addresses[0].to_string()) + ")");
}

void TcpTransport::Register(const std::shared_ptr<Conn>& c) {
  std::shared_ptr<Conn> old;
  {
    std::lock_guard<std::mutex> l(mu_);
    PeerState& p = peers_[c->peer];
    old = std::exchange(p.conn, c);
    p.close_reason.clear();
  }
  if (old) CloseSocket(*old, "replaced by a new connection");
  cv_.notify_all();
  FM_LOG(kInfo, "net") << "'" << opts_.self_name << "' connected to peer '" << c->peer << "' ("
                       << c->remote << ")";
}

asio::awaitable<Result<Frame>> TcpTransport::ReadFrame(std::shared_ptr<Conn> c, bool* bad_frame) {
  std::array<uint8_t, kFrameHeaderSize> hdr;
  error_code ec;
  co_await asio::async_read(c->socket, asio::buffer(hdr.data(), 1), Redirect(ec));
  if (ec) co_return Unavailable(ec == asio::error::eof ? "peer closed the connection" : ec.message());
  const std::string limit = std::to_string(opts_.frame_timeout.count()) + " ms";
  {
    SocketDeadline deadline(c, opts_.frame_timeout);
    co_await asio::async_read(c->socket, asio::buffer(hdr.data() + 1, hdr.size() - 1),
                              Redirect(ec));
    if (deadline.fired()) {
      *bad_frame = true;
      co_return DeadlineExceeded("frame header not complete within " + limit);
    }
  }
  if (ec) co_return Unavailable("connection lost inside a frame header: " + ec.message());
  *bad_frame = true;
  Result<FrameHeader> decoded = DecodeFrameHeader(hdr.data(), hdr.size(), max_payload_);
  if (!decoded.ok()) co_return decoded.status();
  const FrameHeader h = *decoded;
  {
    std::lock_guard<std::mutex> l(mu_);
    const uint64_t queued = peers_[c->peer].queued_bytes + QueuedCost(h.payload_bytes);
    if (queued > max_queued_)
      co_return ResourceExhausted("unread frames would hold " + std::to_string(queued) +
                                  " bytes, over the limit of " + std::to_string(max_queued_.load()));
  }
  Frame f;
  f.header = h;
  for (size_t got = 0; got < h.payload_bytes;) {
    const size_t n = std::min<uint64_t>(kPayloadChunk, h.payload_bytes - got);
    f.payload.resize(got + n);
    SocketDeadline deadline(c, opts_.frame_timeout);
    co_await asio::async_read(c->socket, asio::buffer(f.payload.data() + got, n), Redirect(ec));
    if (deadline.fired())
      co_return DeadlineExceeded("payload stalled at " + std::to_string(got) + " of " +
                                 std::to_string(h.payload_bytes) + " bytes for " + limit);
    if (ec) {
      *bad_frame = false;
      co_return Unavailable("connection lost inside a frame: " + ec.message());
    }
    got += n;
  }
  if (c->rx) {
    FrameTag tag;
    SocketDeadline deadline(c, opts_.frame_timeout);
    co_await asio::async_read(c->socket, asio::buffer(tag), Redirect(ec));
    if (deadline.fired()) co_return DeadlineExceeded("frame tag not received within " + limit);
    if (ec) {
      *bad_frame = false;
      co_return Unavailable("connection lost inside a frame: " + ec.message());
    }
    if (Status t = c->rx->Open(hdr.data(), f.payload.data(), f.payload.size(), tag); !t.ok())
      co_return t;
  }
  if (Status v = VerifyFramePayload(f.header, f.payload.data(), f.payload.size()); !v.ok())
    co_return v;
  *bad_frame = false;
  co_return f;
}

asio::awaitable<void> TcpTransport::ReadLoop(std::shared_ptr<Conn> c) {
  std::string reason;
  bool bad_frame = false;
  for (;;) {
    Result<Frame> f = co_await ReadFrame(c, &bad_frame);
    if (!f.ok()) {
      reason = f.status().message();
      break;
    }
    {
      std::lock_guard<std::mutex> l(mu_);
      auto it = peers_.find(c->peer);
      if (it == peers_.end() || it->second.conn != c) continue;  // replaced: drop its frames
      stats_.frames_received++;
      stats_.bytes_received += kFrameHeaderSize + f->payload.size() + (c->rx ? kFrameTagSize : 0);
      it->second.queued_bytes += QueuedCost(f->payload.size());
      it->second.queue.push_back(std::move(f).value());
    }
    cv_.notify_all();
  }
  if (!bad_frame && !c->local_close.empty()) reason = "closed locally: " + c->local_close;
  if (bad_frame)
    FM_LOG(kWarn, "net") << "'" << opts_.self_name << "' dropping connection to peer '"
                         << c->peer << "' (" << c->remote << "): bad frame: " << reason;
  else
    FM_LOG(kInfo, "net") << "'" << opts_.self_name << "' lost peer '" << c->peer << "' ("
                         << c->remote << "): " << reason;
  CloseSocket(*c, bad_frame ? "bad frame" : reason);
  {
    std::lock_guard<std::mutex> l(mu_);
    if (bad_frame) stats_.connections_dropped++;
    auto it = peers_.find(c->peer);
    if (it != peers_.end() && it->second.conn == c) {
      it->second.conn = nullptr;
      it->second.close_reason = bad_frame ? "bad frame: " + reason : reason;
    }
  }
  cv_.notify_all();
}

}  // namespace fm::net
