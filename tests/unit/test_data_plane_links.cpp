// worker/data_plane's links for a device X: in place on a communicator that takes device
// buffers (NCCL), one copy to or from the host otherwise; a send bounded by its step's deadline
// and ended by a reset. The stages' tokens over these links: test_data_plane.cpp.
#include <gtest/gtest.h>
#include <signal.h>
#include <sys/wait.h>
#include <unistd.h>

#include <atomic>
#include <chrono>
#include <cstring>
#include <future>
#include <thread>

#include "net/tcp_transport.h"
#include "worker/data_plane.h"

namespace fm {
namespace {

using namespace std::chrono_literals;

std::unique_ptr<net::Transport> SecretTcpTransport(const std::string& name) {
  auto t = net::MakeTcpTransport({.self_name = name, .secret = "unit-secret"});
  EXPECT_TRUE(t.ok());
  EXPECT_TRUE((*t)->Listen("127.0.0.1:0").ok());
  return std::move(t).value();
}

TEST(DataPlane, ActivationDTypeNames) {
  EXPECT_EQ(*ActivationFrameDType(flashmesh::v1::ACTIVATION_DTYPE_F32), net::FrameDType::kF32);
  EXPECT_EQ(*ActivationFrameDType(flashmesh::v1::ACTIVATION_DTYPE_BF16), net::FrameDType::kBF16);
  auto bad = ActivationFrameDType(static_cast<flashmesh::v1::ActivationDType>(7));   // a newer one
  ASSERT_FALSE(bad.ok());
  EXPECT_EQ(bad.status().message(), "activation_dtype: unknown value 7");
}

// Host memory flagged as device memory, counting the copies across: a device shard's X as the
// links see it (they pick the path; the bytes are the communicator's business).
class FlaggedDeviceActivations final : public Activations {
 public:
  explicit FlaggedDeviceActivations(int64_t row_floats) : Activations(row_floats) {}
  bool device() const override { return true; }
  Status Resize(int64_t rows) override {
    mem_.resize(std::max(mem_.size(), static_cast<size_t>(rows * row_floats_)));
    data_ = mem_.data();
    rows_ = rows;
    return Status::Ok();
  }
  Status CopyFromHost(int64_t row0, int64_t n, const float* src) override {
    ++from_host;
    FM_RETURN_IF_ERROR(CheckRows("CopyFromHost", row0, n));
    std::memcpy(row(row0), src, n * row_floats_ * sizeof(float));
    return Status::Ok();
  }
  Status CopyToHost(int64_t row0, int64_t n, float* dst) const override {
    ++to_host;
    FM_RETURN_IF_ERROR(CheckRows("CopyToHost", row0, n));
    std::memcpy(dst, row(row0), n * row_floats_ * sizeof(float));
    return Status::Ok();
  }
  Status CopyRows(int64_t, const Activations&, int64_t, int64_t) override {
    return Internal("not used by the links");
  }
  std::vector<float> Values() const { return {data_, data_ + rows_ * row_floats_}; }

  int from_host = 0;
  mutable int to_host = 0;

 private:
  std::vector<float> mem_;
};

// Takes device buffers, as NCCL does, over a TCP communicator: records what it was handed and
// moves the bytes as the host memory they really are here.
class DeviceBufferComm final : public net::Communicator {
 public:
  explicit DeviceBufferComm(net::Communicator* inner) : inner_(inner) {}
  int rank() const override { return inner_->rank(); }
  int size() const override { return inner_->size(); }
  const std::string& name(int rank) const override { return inner_->name(rank); }
  bool device_buffers() const override { return true; }
  void AbortStep(uint64_t step) override { inner_->AbortStep(step); }
  Result<std::vector<net::Frame>> AllToAllV(net::FrameKind kind, uint64_t step, uint32_t tag,
                                            const std::vector<net::CommBuffer>& send,
                                            net::Millis timeout) override {
    return inner_->AllToAllV(kind, step, tag, send, timeout);
  }
  Status Send(int peer, net::FrameKind kind, uint64_t step, uint32_t tag,
              const net::CommBuffer& buf, net::Millis timeout) override {
    sent_device = buf.device;
    sent_data = buf.data;
    sent_timeout = timeout;
    net::CommBuffer host = buf;
    host.device = false;
    return inner_->Send(peer, kind, step, tag, host, timeout);
  }
  Result<net::Frame> Recv(int peer, net::FrameKind kind, uint64_t step, uint32_t tag,
                          net::Millis timeout) override {
    ++frames_received;
    return inner_->Recv(peer, kind, step, tag, timeout);
  }
  Result<net::FrameHeader> RecvInto(int peer, net::FrameKind kind, uint64_t step, uint32_t tag,
                                    const net::RecvTarget& into, net::Millis timeout) override {
    received_into_device = into.device;
    received_into = into.data;
    net::RecvTarget host = into;
    host.device = false;
    return inner_->RecvInto(peer, kind, step, tag, host, timeout);
  }

  bool sent_device = false, received_into_device = false;
  const void* sent_data = nullptr;
  net::Millis sent_timeout{0};
  void* received_into = nullptr;
  int frames_received = 0;

 private:
  net::Communicator* inner_;
};

struct CommPair {
  std::unique_ptr<net::Transport> t0 = SecretTcpTransport("s0"), t1 = SecretTcpTransport("s1");
  std::unique_ptr<net::Communicator> c0, c1;
  CommPair() {
    const std::vector<net::CommMember> m = {{"s0", t0->listen_address()}, {"s1", t1->listen_address()}};
    c0 = std::move(net::MakeTcpCommunicator(t0.get(), m, 0)).value();
    c1 = std::move(net::MakeTcpCommunicator(t1.get(), m, 1)).value();
  }
};

// x = 3 rows of 8: values bf16 holds exactly, so a bf16 hop is lossless here.
void FillThreeRows(FlaggedDeviceActivations* x) {
  EXPECT_TRUE(x->Resize(3).ok());
  for (int64_t i = 0; i < 24; ++i) x->data()[i] = 0.5f * static_cast<float>(i - 7);
}

// Sends step 5 of x from `sink` while `source` receives it into `y`.
void Hop(ActivationSink* sink, ActivationSource* source, const Activations& x, Activations* y) {
  Status sent;
  std::thread sender([&] { sent = sink->Send(5, StageExecutor::Clock::now() + 10s, x); });
  const Status got = source->Receive(5, x.rows(), StageExecutor::Clock::now() + 10s, y);
  sender.join();
  EXPECT_TRUE(sent.ok()) << sent.ToString();
  EXPECT_TRUE(got.ok()) << got.ToString();
}

TEST(DataPlane, DeviceXGoesInPlaceThroughACommunicatorOfDeviceBuffers) {
  CommPair pair;
  DeviceBufferComm d0(pair.c0.get()), d1(pair.c1.get());
  auto sink = NewCommActivationSink(&d0, 1, net::FrameDType::kF32);
  auto source = NewCommActivationSource(&d1, 0, net::FrameDType::kF32);
  FlaggedDeviceActivations x(8);
  FillThreeRows(&x);
  FlaggedDeviceActivations y(8);
  Hop(sink.get(), source.get(), x, &y);
  EXPECT_TRUE(d0.sent_device);
  EXPECT_EQ(d0.sent_data, x.data()) << "the send reads the shard's buffer itself";
  EXPECT_TRUE(d1.received_into_device);
  EXPECT_EQ(d1.received_into, y.data()) << "the receive writes the shard's buffer itself";
  EXPECT_EQ(x.to_host, 0);
  EXPECT_EQ(y.from_host, 0);
  EXPECT_EQ(y.rows(), 3);
  EXPECT_EQ(y.Values(), x.Values());
}

// On a rendezvous link (NCCL) a send completes only once the next stage posts its receive, after
// its current step: the send has the step's deadline, not a fixed 30 s.
TEST(DataPlane, AStageSendWaitsUntilTheStepsDeadline) {
  CommPair pair;
  DeviceBufferComm d0(pair.c0.get());
  auto sink = NewCommActivationSink(&d0, 1, net::FrameDType::kF32);
  auto source = NewCommActivationSource(pair.c1.get(), 0, net::FrameDType::kF32);
  FlaggedDeviceActivations x(8), y(8);
  FillThreeRows(&x);
  ASSERT_TRUE(sink->Send(5, StageExecutor::Clock::now() + 120s, x).ok());
  EXPECT_GT(d0.sent_timeout, 110s);
  EXPECT_LE(d0.sent_timeout, 120s);
  ASSERT_TRUE(source->Receive(5, 3, StageExecutor::Clock::now() + 10s, &y).ok());
  EXPECT_EQ(y.Values(), x.Values());
}

// A frozen peer (SIGSTOP; a hung host or a partition looks the same) stops reading, so a large
// send blocks once the socket buffers are full. A reset must end it at once, not at the step's
// deadline: the stage link and the EP communicator both close the connection of the aborted
// step's send (the next send dials again).
TEST(DataPlane, AResetEndsASendBlockedOnAFrozenPeer) {
  int fds[2];
  ASSERT_EQ(pipe(fds), 0);
  const pid_t child = fork();
  if (child == 0) {   // the peer: a transport that answers handshakes until it is stopped
    close(fds[0]);
    auto t = net::MakeTcpTransport({.self_name = "s1", .secret = "unit-secret"});
    if (!t.ok() || !(*t)->Listen("127.0.0.1:0").ok()) _exit(1);
    const std::string a = (*t)->listen_address();
    if (write(fds[1], a.data(), a.size()) != static_cast<ssize_t>(a.size())) _exit(1);
    close(fds[1]);
    while (true) pause();
  }
  ASSERT_GT(child, 0);
  close(fds[1]);
  char buf[128] = {};
  const ssize_t n = read(fds[0], buf, sizeof buf - 1);
  close(fds[0]);
  struct Reap {
    pid_t pid;
    ~Reap() { kill(pid, SIGKILL); waitpid(pid, nullptr, 0); }
  } reap{child};
  ASSERT_GT(n, 0);
  const std::string addr(buf, static_cast<size_t>(n));
  auto t0 = SecretTcpTransport("s0");
  auto sink = NewTransportActivationSink(t0.get(), "s1", addr, net::FrameDType::kF32);
  auto comm = net::MakeTcpCommunicator(t0.get(), {{"s0", t0->listen_address()}, {"s1", addr}}, 0);
  ASSERT_TRUE(comm.ok());
  auto x = NewHostActivations(4096);
  // 128 MiB: far more than loopback's socket buffers hold.
  const int64_t big_rows = 8192;
  std::vector<float> zeros(static_cast<size_t>(big_rows) * 4096, 0.0f);
  const auto deadline = StageExecutor::Clock::now() + 60s;
  // Sends `send` (which must block) on a thread, aborts step `step` after 1 s: its status, and
  // how long the abort took to end it.
  auto blocked_then_aborted = [&](const std::function<Status()>& send,
                                  const std::function<void()>& abort) {
    auto done = std::async(std::launch::async, send);
    EXPECT_EQ(done.wait_for(1s), std::future_status::timeout) << "the send did not block";
    const auto t = std::chrono::steady_clock::now();
    abort();
    const Status st = done.get();
    return std::make_pair(st, std::chrono::steady_clock::now() - t);
  };

  for (int round = 0; round < 2; ++round) {   // the stage link, then the communicator
    kill(child, SIGCONT);
    ASSERT_TRUE(x->Resize(1).ok());
    ASSERT_TRUE(x->CopyFromHost(0, 1, zeros.data()).ok());
    ASSERT_TRUE(sink->Send(10 * round + 1, deadline, *x).ok());   // connects while it runs
    kill(child, SIGSTOP);
    ASSERT_TRUE(x->Resize(big_rows).ok());
    ASSERT_TRUE(x->CopyFromHost(0, big_rows, zeros.data()).ok());
    const uint64_t step = 10 * round + 2;
    auto [st, took] = round == 0
        ? blocked_then_aborted([&] { return sink->Send(step, deadline, *x); },
                               [&] { sink->AbortStep(step); })
        : blocked_then_aborted(
              [&] {
                net::CommBuffer b;
                b.shape = {static_cast<uint32_t>(big_rows), 4096};
                b.data = zeros.data();
                b.nbytes = zeros.size() * sizeof(float);
                return (*comm)->Send(1, net::FrameKind::kActivation, step, 0, b, 60s);
              },
              [&] { (*comm)->AbortStep(step); });
    EXPECT_EQ(st.code(), Code::kUnavailable) << "round " << round << ": " << st.ToString();
    EXPECT_LT(took, 10s) << "round " << round;   // at once, not at the 60 s deadline (TSan: 2.3 s)
    sink->AbortStep(0);
    (*comm)->AbortStep(0);
  }
}

TEST(DataPlane, DeviceXCrossesOnceOverACommunicatorOfHostMemory) {
  CommPair pair;
  auto sink = NewCommActivationSink(pair.c0.get(), 1, net::FrameDType::kF32);
  auto source = NewCommActivationSource(pair.c1.get(), 0, net::FrameDType::kF32);
  FlaggedDeviceActivations x(8);
  FillThreeRows(&x);
  FlaggedDeviceActivations y(8);
  Hop(sink.get(), source.get(), x, &y);
  EXPECT_EQ(x.to_host, 1);
  EXPECT_EQ(y.from_host, 1);
  EXPECT_EQ(y.Values(), x.Values());
}

// bf16 frames are converted on the host, so even a communicator of device buffers gets host
// memory, and the receiver widens the frame before its one copy in.
TEST(DataPlane, Bf16FramesOfADeviceXGoThroughTheHost) {
  CommPair pair;
  DeviceBufferComm d0(pair.c0.get()), d1(pair.c1.get());
  auto sink = NewCommActivationSink(&d0, 1, net::FrameDType::kBF16);
  auto source = NewCommActivationSource(&d1, 0, net::FrameDType::kBF16);
  FlaggedDeviceActivations x(8);
  FillThreeRows(&x);
  FlaggedDeviceActivations y(8);
  Hop(sink.get(), source.get(), x, &y);
  EXPECT_FALSE(d0.sent_device);
  EXPECT_EQ(d1.received_into, nullptr) << "a bf16 frame is not received in place";
  EXPECT_EQ(d1.frames_received, 1);
  EXPECT_EQ(x.to_host, 1);
  EXPECT_EQ(y.from_host, 1);
  EXPECT_EQ(y.Values(), x.Values());
}

// A TCP hop from a device stage: one copy to the host, which the frame's payload is written from.
TEST(DataPlane, TransportSinkCopiesADeviceXOnceIntoTheFrame) {
  auto t0 = SecretTcpTransport("s0"), t1 = SecretTcpTransport("s1");
  auto sink = NewTransportActivationSink(t0.get(), "s1", t1->listen_address(), net::FrameDType::kF32);
  FlaggedDeviceActivations x(8);
  FillThreeRows(&x);
  ASSERT_TRUE(sink->Send(9, StageExecutor::Clock::now() + 10s, x).ok());
  EXPECT_EQ(x.to_host, 1);
  auto f = t1->Recv("s0", 5000ms);
  ASSERT_TRUE(f.ok()) << f.status().ToString();
  EXPECT_EQ(f->header.step_id, 9u);
  EXPECT_EQ(f->header.shape(), (std::vector<uint32_t>{3, 8}));
  ASSERT_EQ(f->payload.size(), 24 * sizeof(float));
  EXPECT_EQ(std::memcmp(f->payload.data(), x.data(), f->payload.size()), 0);
  // The receiving stage's single copy in, from the payload as received.
  FlaggedDeviceActivations y(8);
  ASSERT_TRUE(y.Resize(3).ok());
  ASSERT_TRUE(CopyPayloadIn(*f, &y).ok());
  EXPECT_EQ(y.from_host, 1);
  EXPECT_EQ(y.Values(), x.Values());
}

}  // namespace
}  // namespace fm
