#include "worker/data_plane.h"

#include <chrono>

#include "common/log.h"

namespace fm {
namespace {

constexpr net::Millis kDialTimeout{5000};
constexpr net::Millis kRecvPoll{250};  // how often the receiver notices a new peer or stop

// x's rows in host memory: x itself on a CPU shard; from a device, one copy into `staging`
// (reused across steps, so it grows to the largest step once).
Result<const float*> HostRows(const Activations& x, std::vector<float>* staging) {
  if (!x.device()) return x.data();
  staging->resize(static_cast<size_t>(x.rows() * x.row_floats()));
  FM_RETURN_IF_ERROR(x.CopyToHost(0, x.rows(), staging->data()));
  return staging->data();
}

// The activation frame of one step from host rows: f32 as is, bf16 converted into the reused
// buffer.
net::CommBuffer ActivationBuffer(net::FrameDType dtype, int64_t rows, int64_t row_floats,
                                 const float* x, std::vector<uint16_t>* bf16) {
  net::CommBuffer b;
  b.dtype = dtype;
  b.shape = {static_cast<uint32_t>(rows), static_cast<uint32_t>(row_floats)};
  const size_t n = static_cast<size_t>(rows * row_floats);
  if (dtype == net::FrameDType::kBF16) {
    bf16->resize(n);
    net::F32ToBf16Payload(x, n, bf16->data());
    b.data = bf16->data();
    b.nbytes = n * 2;
  } else {
    b.data = x;
    b.nbytes = n * sizeof(float);
  }
  return b;
}

// A [rows, row_floats] ACTIVATION header of step `step_id`, or the error naming what differs.
Status CheckActivationHeader(const net::FrameHeader& h, uint64_t step_id, int64_t rows,
                             int64_t row_floats) {
  if (h.rank != 2 || h.dims[0] != rows || h.dims[1] != row_floats)
    return InvalidArgument("activation of step " + std::to_string(step_id) +
                           " from the previous stage: rank " + std::to_string(h.rank) + " [" +
                           std::to_string(h.dims[0]) + ", " + std::to_string(h.dims[1]) +
                           "], want [" + std::to_string(rows) + ", " + std::to_string(row_floats) +
                           "]");
  return Status::Ok();
}

class TransportActivationSink : public ActivationSink {
 public:
  TransportActivationSink(net::Transport* t, std::string peer, std::string address,
                          net::FrameDType dtype)
      : t_(t), peer_(std::move(peer)), address_(std::move(address)), dtype_(dtype) {}

  // A device X crosses once, into the host buffer the transport writes the payload from (f32).
  Status Send(uint64_t step_id, Clock::time_point deadline, const Activations& x) override {
    if (!t_->IsConnected(peer_))
      FM_RETURN_IF_ERROR(t_->Connect(peer_, address_, kDialTimeout).Wrap("next stage"));
    FM_ASSIGN_OR_RETURN(const float* rows, HostRows(x, &staging_));
    const net::CommBuffer b = ActivationBuffer(dtype_, x.rows(), x.row_floats(), rows, &bf16_);
    net::FrameHeader h;
    h.kind = net::FrameKind::kActivation;
    h.dtype = b.dtype;
    h.step_id = step_id;
    h.set_shape(b.shape);
    return sends_
        .Send(step_id, peer_, [&] { return t_->Send(peer_, h, b.data, b.nbytes, net::Until(deadline)); })
        .Wrap("next stage");
  }
  void AbortStep(uint64_t step) override { sends_.Abort(step, t_); }

 private:
  net::Transport* t_;
  net::AbortableSends sends_;
  std::string peer_, address_;
  net::FrameDType dtype_;
  std::vector<float> staging_;  // a device X's rows (device shards only)
  std::vector<uint16_t> bf16_;  // reused conversion buffer (bf16 frames only)
};

// Device memory goes to the communicator as it is when it takes device buffers (NCCL) and the
// frame is f32; otherwise the rows are brought to the host first.
class CommActivationSink : public ActivationSink {
 public:
  CommActivationSink(net::Communicator* comm, int peer, net::FrameDType dtype)
      : comm_(comm), peer_(peer), dtype_(dtype) {}

  Status Send(uint64_t step_id, Clock::time_point deadline, const Activations& x) override {
    net::CommBuffer b;
    if (x.device() && comm_->device_buffers() && dtype_ == net::FrameDType::kF32) {
      b.shape = {static_cast<uint32_t>(x.rows()), static_cast<uint32_t>(x.row_floats())};
      b.data = x.data();
      b.nbytes = x.bytes();
      b.device = true;
    } else {
      FM_ASSIGN_OR_RETURN(const float* rows, HostRows(x, &staging_));
      b = ActivationBuffer(dtype_, x.rows(), x.row_floats(), rows, &bf16_);
    }
    return comm_->Send(peer_, net::FrameKind::kActivation, step_id, 0, b, net::Until(deadline))
        .Wrap("next stage");
  }
  void AbortStep(uint64_t step) override { comm_->AbortStep(step); }

 private:
  net::Communicator* comm_;
  int peer_;
  net::FrameDType dtype_;
  std::vector<float> staging_;
  std::vector<uint16_t> bf16_;
};

// f32 frames land in x directly (RecvInto: ncclRecv into the device X, or the host X); bf16
// frames, and a device X over a communicator of host memory, come as a frame and are copied in.
class CommActivationSource : public ActivationSource {
 public:
  CommActivationSource(net::Communicator* comm, int peer, net::FrameDType dtype)
      : comm_(comm), peer_(peer), dtype_(dtype) {}

  Status Receive(uint64_t step_id, int64_t rows, Clock::time_point deadline,
                 Activations* x) override {
    const net::Millis timeout = net::Until(deadline);
    FM_RETURN_IF_ERROR(x->Resize(rows));
    if (dtype_ == net::FrameDType::kF32 && (!x->device() || comm_->device_buffers())) {
      const net::RecvTarget into{x->data(), x->bytes(), x->device()};
      Result<net::FrameHeader> h =
          comm_->RecvInto(peer_, net::FrameKind::kActivation, step_id, 0, into, timeout);
      if (!h.ok()) return h.status().Wrap("previous stage");
      FM_RETURN_IF_ERROR(CheckActivationHeader(*h, step_id, rows, x->row_floats()));
      if (h->dtype != net::FrameDType::kF32)
        return InvalidArgument("activation of step " + std::to_string(step_id) +
                               " from the previous stage: dtype " +
                               net::FrameDTypeName(h->dtype) + ", want f32");
      return Status::Ok();
    }
    Result<net::Frame> f = comm_->Recv(peer_, net::FrameKind::kActivation, step_id, 0, timeout);
    if (!f.ok()) return f.status().Wrap("previous stage");
    FM_RETURN_IF_ERROR(CheckActivationHeader(f->header, step_id, rows, x->row_floats()));
    if (f->header.dtype != net::FrameDType::kF32 && f->header.dtype != net::FrameDType::kBF16)
      return InvalidArgument("activation of step " + std::to_string(step_id) +
                             " from the previous stage: dtype " +
                             net::FrameDTypeName(f->header.dtype) + ", want f32 or bf16");
    return CopyPayloadIn(*f, x);
  }
  void AbortStep(uint64_t step) override { comm_->AbortStep(step); }

 private:
  net::Communicator* comm_;
  int peer_;
  net::FrameDType dtype_;
};

}  // namespace

std::unique_ptr<ActivationSink> NewCommActivationSink(net::Communicator* comm, int peer,
                                                      net::FrameDType dtype) {
  return std::make_unique<CommActivationSink>(comm, peer, dtype);
}

std::unique_ptr<ActivationSource> NewCommActivationSource(net::Communicator* comm, int peer,
                                                          net::FrameDType dtype) {
  return std::make_unique<CommActivationSource>(comm, peer, dtype);
}

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

Status ActivationReceiver::Deliver(net::Frame f) {
  const net::FrameHeader& h = f.header;
  if (h.kind != net::FrameKind::kActivation)
    return InvalidArgument(std::string("frame kind ") + net::FrameKindName(h.kind) +
                           " on the stage data plane (want ACTIVATION)");
  if (h.rank != 2) return InvalidArgument("activation frame of rank " + std::to_string(h.rank) + " (want 2)");
  return executor_->Receive(std::move(f));
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
      const uint64_t step_id = f->header.step_id;
      Status st = Deliver(std::move(f).value());
      if (st.code() == Code::kInvalidArgument || st.code() == Code::kResourceExhausted) {
        FM_LOG(kWarn, "worker") << "dropping the connection to '" << peer << "': " << st.ToString();
        transport_->Disconnect(peer);
        // That step's input is lost: it fails now, naming why, not at its deadline.
        // UNAVAILABLE, not the refusal's code: the client's request was fine.
        executor_->FailWaitingStep(
            step_id, Unavailable("the input from '" + peer + "' was refused: " + st.message()));
        lock.lock();
        ++rejected_;
        continue;
      }
      if (!st.ok()) {
        FM_LOG(kWarn, "worker") << "activation from '" << peer << "': " << st.ToString();
      }
    } else if (f.status().code() == Code::kUnavailable) {
      // Closed: wait for the previous stage to dial again (it does on its next send). Not yet
      // (DEADLINE_EXCEEDED) is the usual answer: the loop polls again.
      if (Status w = transport_->WaitForPeer(peer, kRecvPoll); !w.ok() && w.code() != Code::kDeadlineExceeded) {
        FM_LOG(kWarn, "worker") << "waiting for '" << peer << "' to reconnect: " << w.ToString();
      }
    }
    lock.lock();
  }
}

Result<net::FrameDType> ActivationFrameDType(flashmesh::v1::ActivationDType dtype) {
  switch (dtype) {
    case flashmesh::v1::ACTIVATION_DTYPE_F32: return net::FrameDType::kF32;
    case flashmesh::v1::ACTIVATION_DTYPE_BF16: return net::FrameDType::kBF16;
    default: return InvalidArgument("activation_dtype: unknown value " + std::to_string(dtype));
  }
}

}  // namespace fm
