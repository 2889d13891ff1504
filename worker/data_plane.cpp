#include "worker/data_plane.h"

#include <chrono>

#include "common/log.h"

namespace fm {
namespace {

constexpr net::Millis kDialTimeout{5000};
constexpr net::Millis kSendTimeout{30000};
constexpr net::Millis kRecvPoll{250};  // how often the receiver notices a new peer or stop

class TransportActivationSink : public ActivationSink {
 public:
  TransportActivationSink(net::Transport* t, std::string peer, std::string address,
                          net::FrameDType dtype)
      : t_(t), peer_(std::move(peer)), address_(std::move(address)), dtype_(dtype) {}

  Status Send(uint64_t step_id, int64_t rows, int64_t row_floats, const float* x) override {
    if (!t_->IsConnected(peer_))
      FM_RETURN_IF_ERROR(t_->Connect(peer_, address_, kDialTimeout).Wrap("next stage"));
    net::FrameHeader h;
    h.kind = net::FrameKind::kActivation;
    h.dtype = dtype_;
    h.step_id = step_id;
    h.set_shape({static_cast<uint32_t>(rows), static_cast<uint32_t>(row_floats)});
    const size_t n = static_cast<size_t>(rows * row_floats);
    if (dtype_ == net::FrameDType::kBF16) {
      bf16_.resize(n);
      net::F32ToBf16Payload(x, n, bf16_.data());
      return t_->Send(peer_, h, bf16_.data(), n * 2, kSendTimeout).Wrap("next stage");
    }
    return t_->Send(peer_, h, x, n * sizeof(float), kSendTimeout).Wrap("next stage");
  }

 private:
  net::Transport* t_;
  std::string peer_, address_;
  net::FrameDType dtype_;
  std::vector<uint16_t> bf16_;  // reused conversion buffer (bf16 frames only)
};

}  // namespace

std::unique_ptr<ActivationSink> NewTransportActivationSink(net::Transport* transport,
                                                           std::string peer, std::string address,
                                                           net::FrameDType dtype) {
  return std::make_unique<TransportActivationSink>(transport, std::move(peer), std::move(address),
                                                   dtype);
}

ActivationReceiver::ActivationReceiver(net::Transport* transport, StageExecutor* executor)
    : transport_(transport), executor_(executor), thread_([this] { Loop(); }) {}

ActivationReceiver::~ActivationReceiver() {
  {
    std::lock_guard<std::mutex> lock(mu_);
    stop_ = true;
  }
  cv_.notify_all();
  thread_.join();
}

void ActivationReceiver::SetPeer(std::string peer) {
  {
    std::lock_guard<std::mutex> lock(mu_);
    peer_ = std::move(peer);
  }
  cv_.notify_all();
}

uint64_t ActivationReceiver::frames_rejected() const {
  std::lock_guard<std::mutex> lock(mu_);
  return rejected_;
}

Status ActivationReceiver::Deliver(const net::Frame& f) {
  const net::FrameHeader& h = f.header;
  if (h.kind != net::FrameKind::kActivation)
    return InvalidArgument(std::string("frame kind ") + net::FrameKindName(h.kind) +
                           " on the stage data plane (want ACTIVATION)");
  if (h.rank != 2) return InvalidArgument("activation frame of rank " + std::to_string(h.rank) + " (want 2)");
  FM_ASSIGN_OR_RETURN(std::vector<float> x, net::FramePayloadAsF32(f));
  return executor_->Receive(h.step_id, h.dims[0], h.dims[1], std::move(x));
}

void ActivationReceiver::Loop() {
  std::unique_lock<std::mutex> lock(mu_);
  while (true) {
    cv_.wait(lock, [&] { return stop_ || !peer_.empty(); });
    if (stop_) return;
    const std::string peer = peer_;
    lock.unlock();
    Result<net::Frame> f = transport_->Recv(peer, kRecvPoll);
    if (f.ok()) {
      Status st = Deliver(*f);
      if (st.code() == Code::kInvalidArgument) {
        FM_LOG(kWarn, "worker") << "dropping the connection to '" << peer << "': " << st.ToString();
        transport_->Disconnect(peer);
        lock.lock();
        ++rejected_;
        continue;
      }
      if (!st.ok()) FM_LOG(kWarn, "worker") << "activation from '" << peer << "': " << st.ToString();
    } else if (f.status().code() == Code::kUnavailable) {
      // Closed: wait for the previous stage to dial again (it does on its next send).
      transport_->WaitForPeer(peer, kRecvPoll);
    }
    lock.lock();
  }
}

Result<net::FrameDType> ParseActivationDType(const std::string& name) {
  if (name == "f32") return net::FrameDType::kF32;
  if (name == "bf16") return net::FrameDType::kBF16;
  return InvalidArgument("activation_dtype '" + name + "': want f32 or bf16");
}

}  // namespace fm
