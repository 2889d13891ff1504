// TCP data plane over Boost.Asio. One io thread owns every socket (all socket operations run
// there, so no socket is touched by two threads); callers of Send/Recv/Connect hand work to it
// and wait with a deadline. Each connection runs a C++20 coroutine: handshake, then a read loop
// that validates every frame and queues it for its peer.
#include "net/tcp_transport.h"

#include <array>
#include <atomic>
#include <condition_variable>
#include <deque>
#include <future>
#include <map>
#include <mutex>
#include <optional>
#include <thread>

#include "common/log.h"
#include "net/frame_auth.h"
#include "net/handshake.h"
#include "net/tcp_conn.h"

namespace fm::net {
namespace {

// Connections that may be in their handshake at once: a node has a few peers, so more are a
// flood (each holds a descriptor for up to handshake_timeout); the extra ones are closed at once.
constexpr size_t kMaxHandshaking = 64;
// After a failed accept (out of descriptors, EMFILE): the same error would come back at once.
constexpr auto kAcceptRetry = std::chrono::milliseconds(100);

class TcpTransport final : public Transport {
 public:
  explicit TcpTransport(TransportOptions o)
      : work_(asio::make_work_guard(io_)),
        opts_(std::move(o)),
        max_payload_(opts_.max_payload),
        max_queued_(opts_.max_queued_bytes),
        thread_([this] { io_.run(); }) {}

  ~TcpTransport() override {
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

  Status Listen(const std::string& address) override {
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

  std::string listen_address() const override {
    std::lock_guard<std::mutex> l(mu_);
    return listen_address_;
  }

  Status Connect(const std::string& peer, const std::string& address, Millis timeout) override {
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

  Status Send(const std::string& peer, const FrameHeader& header, const void* payload,
              size_t nbytes, Millis timeout) override {
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

  Result<Frame> Recv(const std::string& peer, Millis timeout) override {
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

  Status WaitForPeer(const std::string& peer, Millis timeout) override {
    std::unique_lock<std::mutex> l(mu_);
    const bool up = cv_.wait_for(l, timeout, [&] {
      auto it = peers_.find(peer);
      return it != peers_.end() && it->second.conn != nullptr;
    });
    if (up) return Status::Ok();
    return DeadlineExceeded("peer '" + peer + "' did not connect within " +
                            std::to_string(timeout.count()) + " ms");
  }

  bool IsConnected(const std::string& peer) const override {
    std::lock_guard<std::mutex> l(mu_);
    auto it = peers_.find(peer);
    return it != peers_.end() && it->second.conn != nullptr;
  }

  std::vector<std::string> ConnectedPeers() const override {
    std::lock_guard<std::mutex> l(mu_);
    std::vector<std::string> out;
    for (const auto& [name, p] : peers_)
      if (p.conn) out.push_back(name);
    return out;  // std::map iterates sorted
  }

  void Disconnect(const std::string& peer) override {
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

  Status SetAllowedPeers(const std::vector<AllowedPeer>& peers) override {
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

  void SetLimits(uint64_t max_payload, uint64_t max_queued_bytes) override {
    max_payload_ = max_payload;
    max_queued_ = max_queued_bytes;
  }

  TransportStats stats() const override {
    std::lock_guard<std::mutex> l(mu_);
    return stats_;
  }

 private:
  // What an unread frame holds: its payload plus the header and bookkeeping, so that a flood
  // of empty frames reaches the limit too (each ~100 bytes of memory).
  static uint64_t QueuedCost(uint64_t payload_bytes) { return payload_bytes + 128; }

  struct PeerState {
    std::deque<Frame> queue;
    uint64_t queued_bytes = 0;    // QueuedCost of the frames in queue
    std::shared_ptr<Conn> conn;   // the current connection; null when closed
    std::string close_reason;
  };

  asio::awaitable<void> AcceptLoop() {
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

  // Acceptor side of handshake.h, then the read loop.
  asio::awaitable<void> Accepted(std::shared_ptr<Conn> c) {
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

  asio::awaitable<Status> AcceptHandshake(std::shared_ptr<Conn> c) {
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

  // Dialer side of handshake.h; on success the connection is registered and read.
  asio::awaitable<Status> Dial(std::shared_ptr<Conn> c, std::string peer, std::string address,
                               std::string host, std::string port, Millis timeout) {
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

  asio::awaitable<Status> DialHandshake(std::shared_ptr<Conn> c, std::string peer,
                                        std::string address, std::string host, std::string port,
                                        Millis timeout) {
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

  // With a secret: the connection's frame sealers, one per direction, `me` being this side.
  void StartSession(Conn& c, HandshakeRole me, const Nonce& dialer_nonce,
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

  // Whether `name` connecting from `from` is a peer of the plan (SetAllowedPeers). An address
  // its host did not have when last resolved resolves the host again: a pod that moved has a
  // new address, and a name may not have resolved yet when the plan came.
  asio::awaitable<Status> CheckAllowed(std::string name, asio::ip::address from) {
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

  // Makes c the connection of its peer (replacing an older one).
  void Register(const std::shared_ptr<Conn>& c) {
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

  // One frame: header, then the payload in kPayloadChunk steps (memory grows with the bytes
  // that really arrived, not with the length a header claims). Only the wait for the first
  // byte is unbounded; the rest of the frame runs on frame_timeout deadlines. Errors set
  // *bad_frame when the peer sent something invalid (not merely closed or stalled).
  asio::awaitable<Result<Frame>> ReadFrame(std::shared_ptr<Conn> c, bool* bad_frame) {
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

  asio::awaitable<void> ReadLoop(std::shared_ptr<Conn> c) {
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

  // Declared first so that it is destroyed last: the sockets held by peers_ and by pending
  // handlers must be destroyed while their io context still exists.
  asio::io_context io_;
  asio::executor_work_guard<asio::io_context::executor_type> work_;
  const TransportOptions opts_;
  std::atomic<uint64_t> max_payload_, max_queued_;   // SetLimits
  mutable std::mutex mu_;  // guards peers_, handshaking_, stats_, listen_address_, allowed_
  std::condition_variable cv_;
  std::map<std::string, PeerState> peers_;
  std::vector<std::shared_ptr<Conn>> handshaking_;
  // SetAllowedPeers: name -> the addresses it may connect from (empty: any); unset: anyone.
  // A peer's host in the plan and its addresses when last resolved ("" or a wildcard: any).
  struct AllowedHost {
    std::string host;
    bool any = false;
    std::vector<asio::ip::address> addresses;
    void Set(const tcp::resolver::results_type& eps) {
      addresses.clear();
      for (const auto& e : eps) {
        any = any || e.endpoint().address().is_unspecified();   // listens everywhere
        addresses.push_back(e.endpoint().address());
      }
    }
    bool Admits(const asio::ip::address& from) const {
      return any || std::find(addresses.begin(), addresses.end(), from) != addresses.end();
    }
  };
  std::optional<std::map<std::string, AllowedHost>> allowed_;
  std::optional<asio::ip::address> dial_from_;   // the listen address, unless a wildcard
  TransportStats stats_;
  std::string listen_address_;
  std::unique_ptr<tcp::acceptor> acceptor_;
  std::thread thread_;  // last: starts running io_ once everything above exists
};

}  // namespace

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
