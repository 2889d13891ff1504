#include "net/nccl_communicator.h"

#include <cuda_runtime.h>
#include <nccl.h>

#include <atomic>
#include <chrono>
#include <cstring>
#include <mutex>
#include <thread>

#include "common/device_transfers.h"
#include "common/log.h"

namespace fm::net {
namespace {

using Clock = std::chrono::steady_clock;
static_assert(sizeof(ncclUniqueId) == kNcclUniqueIdBytes);

Status CudaError(cudaError_t e, const char* call) {
  return Internal(std::string(call) + ": " + cudaGetErrorName(e) + " (" + cudaGetErrorString(e) + ")");
}
#define FM_CUDA_OK(call)                                 \
  do {                                                   \
    const cudaError_t fm_e = (call);                     \
    if (fm_e != cudaSuccess) return CudaError(fm_e, #call); \
  } while (0)

Status NcclError(ncclResult_t r, const char* call) {
  return Internal(std::string(call) + ": " + ncclGetErrorString(r));
}

// Device memory that only grows, allocated and freed in stream order on the communicator's
// stream (cudaMallocAsync / cudaFreeAsync): no device-wide synchronization in the middle of an
// exchange, which could wait behind another communicator's kernel spinning on a peer.
class DeviceScratch {
 public:
  DeviceScratch() = default;
  DeviceScratch(const DeviceScratch&) = delete;
  DeviceScratch& operator=(const DeviceScratch&) = delete;
  uint8_t* data() const { return static_cast<uint8_t*>(p_); }
  Status Reserve(size_t bytes, cudaStream_t stream) {
    if (bytes <= size_) return Status::Ok();
    const size_t want = std::max<size_t>(bytes, 2 * size_);
    Release(stream);
    FM_CUDA_OK(cudaMallocAsync(&p_, want, stream));
    size_ = want;
    return Status::Ok();
  }
  void Release(cudaStream_t stream) {
    if (p_) cudaFreeAsync(p_, stream);
    p_ = nullptr;
    size_ = 0;
  }

 private:
  void* p_ = nullptr;
  size_t size_ = 0;
};

class NcclComm final : public NcclCommunicator {
 public:
  NcclComm(std::vector<CommMember> members, int rank, int device, const ncclUniqueId& id,
           std::string label)
      : members_(std::move(members)), rank_(rank), device_(device), id_(id),
        label_(std::move(label)) {}

  ~NcclComm() override {
    int previous = 0;
    const bool restore = cudaGetDevice(&previous) == cudaSuccess;
    cudaSetDevice(device_);
    if (comm_) ncclCommAbort(comm_);   // never blocks on peers that may be gone
    if (stream_) {
      dev_.Release(stream_);
      cudaStreamDestroy(stream_);   // its resources go once its work is done
    }
    if (restore) cudaSetDevice(previous);
  }

  int rank() const override { return rank_; }
  int size() const override { return static_cast<int>(members_.size()); }
  const std::string& name(int rank) const override { return members_[rank].name; }
  bool broken() const override { return broken_.load(); }
  void SetMaxPayload(uint64_t bytes) override { max_payload_.store(bytes); }
  bool device_buffers() const override { return true; }
  void AbortStep(uint64_t step) override { aborted_step_.store(step); }

  Result<std::vector<Frame>> AllToAllV(FrameKind kind, uint64_t step, uint32_t tag,
                                       const std::vector<CommBuffer>& send,
                                       Millis timeout) override {
    return AllToAll(kind, step, tag, send, Clock::now() + timeout, nullptr);
  }

  // NCCL sends are rendezvous: Send returns once the peer's matching Recv took the frame.
  Status Send(int peer, FrameKind kind, uint64_t step, uint32_t tag, const CommBuffer& buf,
              Millis timeout) override {
    FM_RETURN_IF_ERROR(CheckPeer(peer));
    std::vector<const CommBuffer*> out(size(), nullptr);
    out[peer] = &buf;
    return Exchange(kind, step, tag, out, std::vector<bool>(size(), false), Clock::now() + timeout)
        .status();
  }

  Result<Frame> Recv(int peer, FrameKind kind, uint64_t step, uint32_t tag,
                     Millis timeout) override {
    FM_RETURN_IF_ERROR(CheckPeer(peer));
    std::vector<bool> in(size(), false);
    in[peer] = true;
    FM_ASSIGN_OR_RETURN(std::vector<Frame> got,
                        Exchange(kind, step, tag, std::vector<const CommBuffer*>(size(), nullptr),
                                 in, Clock::now() + timeout));
    return std::move(got[peer]);
  }

  // A device target takes the payload straight from ncclRecv; a host one through the scratch.
  Result<FrameHeader> RecvInto(int peer, FrameKind kind, uint64_t step, uint32_t tag,
                               const RecvTarget& into, Millis timeout) override {
    FM_RETURN_IF_ERROR(CheckPeer(peer));
    std::vector<bool> in(size(), false);
    in[peer] = true;
    std::vector<RecvTarget> targets(size());
    targets[peer] = into;
    FM_ASSIGN_OR_RETURN(std::vector<Frame> got,
                        Exchange(kind, step, tag, std::vector<const CommBuffer*>(size(), nullptr),
                                 in, Clock::now() + timeout, &targets));
    return got[peer].header;
  }

  // Device targets take their payloads straight from ncclRecv; host ones through the scratch.
  Result<std::vector<FrameHeader>> AllToAllVInto(FrameKind kind, uint64_t step, uint32_t tag,
                                                 const std::vector<CommBuffer>& send,
                                                 const std::vector<RecvTarget>& into,
                                                 Millis timeout) override {
    FM_RETURN_IF_ERROR(CheckBufferCount(into.size()));
    FM_ASSIGN_OR_RETURN(std::vector<Frame> got,
                        AllToAll(kind, step, tag, send, Clock::now() + timeout, &into));
    std::vector<FrameHeader> headers(size());
    for (int r = 0; r < size(); ++r) headers[r] = got[r].header;
    return headers;
  }

 private:

  // send[r] to every other rank r, a frame (or into[r]) from each.
  Result<std::vector<Frame>> AllToAll(FrameKind kind, uint64_t step, uint32_t tag,
                                      const std::vector<CommBuffer>& send,
                                      Clock::time_point deadline,
                                      const std::vector<RecvTarget>* into) {
    FM_RETURN_IF_ERROR(CheckBufferCount(send.size()));
    std::vector<const CommBuffer*> out(size(), nullptr);
    std::vector<bool> in(size(), true);
    for (int r = 0; r < size(); ++r) out[r] = r == rank_ ? nullptr : &send[r];
    in[rank_] = false;
    return Exchange(kind, step, tag, out, in, deadline, into);
  }

  std::string Group() const {
    return label_ + " (rank " + std::to_string(rank_) + " of " + std::to_string(size()) + ")";
  }

  // Ends the communicator for good: NCCL cannot resume after a failed operation.
  Status Fail(Status why) {
    if (comm_) ncclCommAbort(comm_);
    comm_ = nullptr;
    broken_why_ = why.message();
    broken_.store(true);
    FM_LOG(kWarn, "net") << Group() << " broken: " << why.ToString();
    return why;
  }

  // Waits until NCCL finished enqueueing (non-blocking communicator) and, with a stream, until
  // the stream drained; the deadline, AbortStep and NCCL's asynchronous errors end the wait.
  Status Wait(uint64_t step, Clock::time_point deadline, const std::string& what, bool stream) {
    while (true) {
      ncclResult_t async = ncclSuccess;
      const ncclResult_t q = ncclCommGetAsyncError(comm_, &async);
      if (q != ncclSuccess) return Fail(NcclError(q, "ncclCommGetAsyncError"));
      if (async != ncclSuccess && async != ncclInProgress)
        return Fail(Unavailable(Group() + ": " + what + ": " + ncclGetErrorString(async) +
                                " (a member died or left the group)"));
      if (async == ncclSuccess) {
        if (!stream) return Status::Ok();
        const cudaError_t e = cudaStreamQuery(stream_);
        if (e == cudaSuccess) return Status::Ok();
        if (e != cudaErrorNotReady) return Fail(CudaError(e, "cudaStreamQuery"));
      }
      if (step != 0 && aborted_step_.load() == step)
        return Fail(Unavailable(Group() + ": step " + std::to_string(step) + " aborted by a reset"));
      if (Clock::now() >= deadline)
        return Fail(DeadlineExceeded(Group() + ": " + what + " did not finish in time (members " +
                                     Names() + "; one is dead or stuck)"));
      std::this_thread::sleep_for(std::chrono::microseconds(20));
    }
  }

  std::string Names() const {
    std::string s;
    for (const auto& m : members_) s += (s.empty() ? "" : ", ") + m.name;
    return s;
  }

  Status EnsureInit(uint64_t step, Clock::time_point deadline) {
    if (comm_) return Status::Ok();
    FM_CUDA_OK(cudaStreamCreateWithFlags(&stream_, cudaStreamNonBlocking));
    ncclConfig_t config = NCCL_CONFIG_INITIALIZER;
    config.blocking = 0;   // so that forming the group has a deadline
    const ncclResult_t r = ncclCommInitRankConfig(&comm_, size(), id_, rank_, &config);
    if (r != ncclSuccess && r != ncclInProgress) {
      if (comm_) ncclCommAbort(comm_);
      comm_ = nullptr;
      return Fail(NcclError(r, "ncclCommInitRankConfig"));
    }
    return Wait(step, deadline, "forming the group", false);
  }

  // Queues a staging copy on stream_ and counts it as this device's step traffic
  // (common/device_transfers.h). dir: cudaMemcpyHostToDevice or cudaMemcpyDeviceToHost.
  Status Stage(void* dst, const void* src, size_t bytes, cudaMemcpyKind dir) {
    if (bytes == 0) return Status::Ok();
    FM_CUDA_OK(cudaMemcpyAsync(dst, src, bytes, dir, stream_));
    CountTransfer(device_, TransferPhase::kStep,
                  dir == cudaMemcpyHostToDevice ? TransferDirection::kHostToDevice
                                                : TransferDirection::kDeviceToHost,
                  bytes);
    return Status::Ok();
  }

  // One grouped round: for every rank r, send[r] bytes out (null: none) and recv[r] in.
  Status Round(uint64_t step, Clock::time_point deadline, const std::string& what,
               const std::vector<std::pair<const uint8_t*, size_t>>& send,
               const std::vector<std::pair<uint8_t*, size_t>>& recv) {
    ncclResult_t r = ncclGroupStart();
    for (int p = 0; p < size() && r == ncclSuccess; ++p) {
      if (send[p].first && send[p].second > 0)
        r = ncclSend(send[p].first, send[p].second, ncclUint8, p, comm_, stream_);
      if ((r == ncclSuccess || r == ncclInProgress) && recv[p].first && recv[p].second > 0)
        r = ncclRecv(recv[p].first, recv[p].second, ncclUint8, p, comm_, stream_);
      if (r == ncclInProgress) r = ncclSuccess;
    }
    const ncclResult_t end = ncclGroupEnd();
    if (r != ncclSuccess) return Fail(NcclError(r, "ncclSend/ncclRecv"));
    if (end != ncclSuccess && end != ncclInProgress) return Fail(NcclError(end, "ncclGroupEnd"));
    return Wait(step, deadline, what, true);
  }

  // into: where each rank's payload goes (RecvInto, AllToAllVInto); null: Frames.
  Result<std::vector<Frame>> Exchange(FrameKind kind, uint64_t step, uint32_t tag,
                                      const std::vector<const CommBuffer*>& out,
                                      const std::vector<bool>& in, Clock::time_point deadline,
                                      const std::vector<RecvTarget>* into = nullptr) {
    std::lock_guard<std::mutex> lock(mu_);
    if (broken_.load())
      return Unavailable(Group() + " is broken (" + broken_why_ + "); the group must be loaded again");
    // The headers this rank sends, encoded and so checked (shape, payload length) before this
    // rank touches the group: a bad buffer is this caller's error and this communicator stays
    // whole (the peers, already in the exchange, still meet their deadline or a tag mismatch
    // unless the caller retries the same exchange correctly). NCCL delivers
    // the bytes or fails the group, so the payload CRC is not used (a device payload could not
    // be read for it anyway): 0 on the wire, not checked.
    std::vector<uint8_t> encoded(size() * kFrameHeaderSize, 0);
    for (int p = 0; p < size(); ++p) {
      if (!out[p]) continue;
      FM_ASSIGN_OR_RETURN(FrameHeader h, HeaderFor(p, kind, step, tag, *out[p]));
      FM_RETURN_IF_ERROR(EncodeFrameHeaderWithoutPayloadCrc(&h, out[p]->nbytes,
                                                            encoded.data() + p * kFrameHeaderSize)
                             .Wrap(Group() + ": send to rank " + std::to_string(p)));
    }
    FM_CUDA_OK(cudaSetDevice(device_));
    FM_RETURN_IF_ERROR(EnsureInit(step, deadline));
    // From here on the peers are in the exchange too: any failure ends the group (a rank that
    // went on would meet the others' payload round with its next header round).
    Result<std::vector<Frame>> got =
        ExchangeRounds(kind, step, tag, out, encoded, in, deadline, into);
    if (!got.ok() && !broken_.load()) return Fail(got.status());
    return got;
  }

  Result<std::vector<Frame>> ExchangeRounds(FrameKind kind, uint64_t step, uint32_t tag,
                                            const std::vector<const CommBuffer*>& out,
                                            const std::vector<uint8_t>& encoded,
                                            const std::vector<bool>& in,
                                            Clock::time_point deadline,
                                            const std::vector<RecvTarget>* into) {
    const std::string what = std::string(FrameKindName(kind)) + " step " + std::to_string(step) +
                             " tag " + std::to_string(tag);
    const int R = size();
    const size_t hdr = R * kFrameHeaderSize;
    // Headers: rank r's 64 bytes at r * 64 of each area (sent, then received).
    std::vector<uint8_t> headers(2 * hdr, 0);
    uint8_t* hs = headers.data();
    uint8_t* hr = headers.data() + hdr;
    std::memcpy(hs, encoded.data(), hdr);
    FM_RETURN_IF_ERROR(dev_.Reserve(2 * hdr, stream_));
    uint8_t* ds = dev_.data();
    uint8_t* dr = dev_.data() + hdr;
    FM_RETURN_IF_ERROR(Stage(ds, hs, hdr, cudaMemcpyHostToDevice));
    std::vector<std::pair<const uint8_t*, size_t>> s(R, {nullptr, 0});
    std::vector<std::pair<uint8_t*, size_t>> rv(R, {nullptr, 0});
    for (int p = 0; p < R; ++p) {
      if (out[p]) s[p] = {ds + p * kFrameHeaderSize, kFrameHeaderSize};
      if (in[p]) rv[p] = {dr + p * kFrameHeaderSize, kFrameHeaderSize};
    }
    FM_RETURN_IF_ERROR(Round(step, deadline, what + " (headers)", s, rv));
    FM_RETURN_IF_ERROR(Stage(hr, dr, hdr, cudaMemcpyDeviceToHost));
    FM_RETURN_IF_ERROR(Wait(step, deadline, what + " (headers)", true));

    // Check every header before any payload moves: a peer out of step ends the group.
    std::vector<Frame> got(R);
    size_t payload_bytes = 0;
    for (int p = 0; p < R; ++p) {
      if (out[p]) payload_bytes += out[p]->nbytes;
      if (!in[p]) continue;
      const std::string who = "rank " + std::to_string(p) + " (" + name(p) + ")";
      Result<FrameHeader> h = DecodeFrameHeader(hr + p * kFrameHeaderSize, kFrameHeaderSize,
                                                  max_payload_.load());
      if (!h.ok()) return h.status().Wrap(Group() + ": header from " + who);
      if (h->kind != kind || h->step_id != step || h->tag != tag)
        return Internal(who + " sent " + FrameKindName(h->kind) + " step " +
                        std::to_string(h->step_id) + " tag " + std::to_string(h->tag) +
                        ", expected " + what);
      if (into) FM_RETURN_IF_ERROR(CheckFits(p, h->payload_bytes, (*into)[p].capacity).Wrap(Group()));
      got[p].header = *h;
      payload_bytes += h->payload_bytes;
    }
    if (payload_bytes == 0) return got;

    // Payloads: device memory goes to ncclSend/ncclRecv as it is; host memory through the
    // scratch (host to device before the round, device to host after), packed rank by rank.
    size_t staged = 0;
    for (int p = 0; p < R; ++p) {
      if (out[p] && !out[p]->device) staged += out[p]->nbytes;
      if (in[p] && !(into && (*into)[p].device)) staged += got[p].header.payload_bytes;
    }
    FM_RETURN_IF_ERROR(dev_.Reserve(staged, stream_));
    struct ToHost {
      void* dst;
      const uint8_t* scratch;
      size_t bytes;
    };
    std::vector<ToHost> to_host;   // the received payloads that go to host memory
    size_t off = 0;
    for (int p = 0; p < R; ++p) {
      s[p] = {nullptr, 0};
      rv[p] = {nullptr, 0};
      if (out[p] && out[p]->nbytes > 0) {
        const CommBuffer& b = *out[p];
        if (b.device) {
          s[p] = {static_cast<const uint8_t*>(b.data), b.nbytes};
        } else {
          FM_RETURN_IF_ERROR(Stage(dev_.data() + off, b.data, b.nbytes, cudaMemcpyHostToDevice));
          s[p] = {dev_.data() + off, b.nbytes};
          off += b.nbytes;
        }
      }
      const size_t n = in[p] ? got[p].header.payload_bytes : 0;
      if (n == 0) continue;
      if (into && (*into)[p].device) {
        rv[p] = {static_cast<uint8_t*>((*into)[p].data), n};
        continue;
      }
      void* dst = into ? (*into)[p].data : nullptr;
      if (!into) {
        got[p].payload.resize(n);
        dst = got[p].payload.data();
      }
      rv[p] = {dev_.data() + off, n};
      to_host.push_back({dst, dev_.data() + off, n});
      off += n;
    }
    FM_RETURN_IF_ERROR(Round(step, deadline, what, s, rv));
    for (const ToHost& c : to_host)
      FM_RETURN_IF_ERROR(Stage(c.dst, c.scratch, c.bytes, cudaMemcpyDeviceToHost));
    if (!to_host.empty()) FM_RETURN_IF_ERROR(Wait(step, deadline, what, true));
    return got;
  }

  std::vector<CommMember> members_;
  int rank_;
  int device_;
  ncclUniqueId id_;
  std::string label_;   // "NCCL EP group", "NCCL stage link": what errors call it
  ncclComm_t comm_ = nullptr;
  cudaStream_t stream_ = nullptr;
  std::mutex mu_;   // one exchange at a time
  DeviceScratch dev_;
  std::atomic<bool> broken_{false};
  std::string broken_why_;   // under mu_
  std::atomic<uint64_t> aborted_step_{0};
  std::atomic<uint64_t> max_payload_{kDefaultMaxFramePayload};   // SetMaxPayload
};

}  // namespace

bool NcclBuilt() { return true; }

Result<std::string> NcclNewUniqueId() {
  ncclUniqueId id;
  const ncclResult_t r = ncclGetUniqueId(&id);
  if (r != ncclSuccess) return NcclError(r, "ncclGetUniqueId");
  return std::string(id.internal, sizeof(id.internal));
}

Result<std::unique_ptr<NcclCommunicator>> MakeNcclCommunicator(std::vector<CommMember> members,
                                                               int rank, int cuda_device,
                                                               const std::string& unique_id,
                                                               const std::string& label) {
  if (members.empty()) return InvalidArgument(label + ": no members");
  if (rank < 0 || rank >= static_cast<int>(members.size()))
    return InvalidArgument(label + ": rank " + std::to_string(rank) + " outside [0, " +
                           std::to_string(members.size()) + ")");
  if (unique_id.size() != kNcclUniqueIdBytes)
    return InvalidArgument(label + ": unique id of " + std::to_string(unique_id.size()) +
                           " bytes, want " + std::to_string(kNcclUniqueIdBytes));
  int devices = 0;
  if (cudaGetDeviceCount(&devices) != cudaSuccess) devices = 0;
  if (cuda_device < 0 || cuda_device >= devices)
    return InvalidArgument(label + ": cuda:" + std::to_string(cuda_device) + " but this host has " +
                           std::to_string(devices) + " CUDA device(s)");
  ncclUniqueId id;
  std::memcpy(id.internal, unique_id.data(), kNcclUniqueIdBytes);
  return std::unique_ptr<NcclCommunicator>(
      std::make_unique<NcclComm>(std::move(members), rank, cuda_device, id, label));
}

}  // namespace fm::net
