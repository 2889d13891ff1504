// Emulation stand-in for kernels/cuda/device.cu: one "device" whose memory is host memory.
#include <cstdlib>
#include <cstring>
#include <string>
#include <utility>

#include <cuda_runtime.h>

#include "common/device_transfers.h"
#include "kernels/cuda/check.cuh"
#include "kernels/cuda/device.h"
#include "kernels/cuda/ops.h"

namespace fm::cuda {
namespace {
// The error of every call on a lost device (EmuLoseDevice), as CudaStatus words it.
Status Lost(const char* call) {
  if (!emu_device_lost) return Status::Ok();
  return Internal(std::string(call) + ": an illegal memory access was encountered "
                  "(cudaErrorIllegalAddress, emulated)");
}
}  // namespace

int DeviceCount() { return 1; }
int64_t KernelLaunches() { return launches_made.load(std::memory_order_relaxed); }
std::string DeviceDescription(int) { return "CPU emulation"; }
Status Synchronize() { return Lost("cudaDeviceSynchronize"); }
Status SynchronizeStream() { return Lost("cudaStreamSynchronize"); }
Result<DeviceMemory> MemoryInfo() { return DeviceMemory{size_t{8} << 30, size_t{8} << 30}; }
Status SetDevice(int index) {
  FM_RETURN_IF_ERROR(Lost("cudaSetDevice"));
  if (index == 0) return Status::Ok();
  return InvalidArgument("cuda:" + std::to_string(index) + ": this host has 1 CUDA device(s)");
}
Status DeviceHealth(int index) {
  return Lost("cudaStreamQuery").Wrap("cuda:" + std::to_string(index) +
                                      " is unusable for the rest of this process");
}

Result<DeviceBuffer> DeviceBuffer::Alloc(size_t bytes) {
  FM_RETURN_IF_ERROR(Lost("cudaMalloc"));
  DeviceBuffer b;
  if (bytes == 0) return Result<DeviceBuffer>(std::move(b));
  b.ptr_ = EmuDeviceAlloc(bytes);  // 0xFF bytes, a faulting page past the end (cuda_runtime.h)
  if (!b.ptr_) return ResourceExhausted("emulated cudaMalloc of " + std::to_string(bytes));
  b.size_ = bytes;
  return Result<DeviceBuffer>(std::move(b));
}

DeviceBuffer::~DeviceBuffer() { EmuDeviceFree(ptr_); }

DeviceBuffer::DeviceBuffer(DeviceBuffer&& other) noexcept
    : ptr_(std::exchange(other.ptr_, nullptr)),
      size_(std::exchange(other.size_, 0)),
      device_(other.device_) {}

DeviceBuffer& DeviceBuffer::operator=(DeviceBuffer&& other) noexcept {
  if (this != &other) {
    EmuDeviceFree(ptr_);
    ptr_ = std::exchange(other.ptr_, nullptr);
    size_ = std::exchange(other.size_, 0);
    device_ = other.device_;
  }
  return *this;
}

// A copy inside a capture is refused, as device.cu refuses it (a replay would copy uncounted);
// device.cu's counting too: the bytes of each copy, Upload's as load traffic.
static Status NotWhileCapturing(const char* what) {
  if (emu_capture) return Internal(std::string(what) + ": a host<->device copy while capturing a graph");
  return Status::Ok();
}

static Status FromHost(const DeviceBuffer& b, const void* src, size_t bytes, size_t offset,
                       TransferPhase phase) {
  if (offset > b.size() || bytes > b.size() - offset) return OutOfRange("CopyFromHost past the buffer");
  if (bytes == 0) return Status::Ok();
  FM_RETURN_IF_ERROR(Lost("cudaMemcpy"));
  FM_RETURN_IF_ERROR(NotWhileCapturing("CopyFromHost"));
  std::memcpy(b.as<char>() + offset, src, bytes);
  CountTransfer(b.device(), phase, TransferDirection::kHostToDevice, bytes);
  return Status::Ok();
}

Status DeviceBuffer::CopyFromHostAsync(const void* src, size_t bytes, size_t offset) {
  return FromHost(*this, src, bytes, offset, TransferPhase::kStep);
}

Status DeviceBuffer::CopyFromHost(const void* src, size_t bytes, size_t offset) {
  return FromHost(*this, src, bytes, offset, TransferPhase::kStep);
}

Status DeviceBuffer::CopyToHost(void* dst, size_t bytes, size_t offset) const {
  if (offset > size_ || bytes > size_ - offset) return OutOfRange("CopyToHost past the buffer");
  if (bytes == 0) return Status::Ok();
  FM_RETURN_IF_ERROR(Lost("cudaMemcpy"));
  FM_RETURN_IF_ERROR(NotWhileCapturing("CopyToHost"));
  std::memcpy(dst, static_cast<const char*>(ptr_) + offset, bytes);
  CountTransfer(device_, TransferPhase::kStep, TransferDirection::kDeviceToHost, bytes);
  return Status::Ok();
}

// kernels/cuda/membw.cu times device memory; the emulation has none to time.
Result<double> MeasureReadBandwidth(size_t, int) {
  return Unavailable("MeasureReadBandwidth: no device memory in the CPU emulation");
}

Status CopyOnDevice(void* dst, const void* src, size_t bytes) {
  if (bytes == 0) return Status::Ok();
  if (!dst || !src) return InvalidArgument("CopyOnDevice: null device pointer");
  if (emu_capture) return Internal("CopyOnDevice: copies are not captured here");
  std::memcpy(dst, src, bytes);
  return Status::Ok();
}

Result<DeviceBuffer> Upload(const void* src, size_t bytes) {
  FM_ASSIGN_OR_RETURN(DeviceBuffer b, DeviceBuffer::Alloc(bytes));
  FM_RETURN_IF_ERROR(FromHost(b, src, bytes, 0, TransferPhase::kLoad));
  return Result<DeviceBuffer>(std::move(b));
}

// Streams: one queue that runs at once; the handle only has to be non-null (a real stream).
Result<Stream> Stream::Create() {
  static int the_queue;
  Stream s;
  s.handle_ = &the_queue;
  return Result<Stream>(std::move(s));
}
Stream::~Stream() = default;
Stream::Stream(Stream&& other) noexcept : handle_(std::exchange(other.handle_, nullptr)) {}
Stream& Stream::operator=(Stream&& other) noexcept {
  handle_ = std::exchange(other.handle_, nullptr);
  return *this;
}
Status Stream::Synchronize() const { return Lost("cudaStreamSynchronize"); }
StreamScope::StreamScope(const Stream&) : saved_(nullptr) {}
StreamScope::~StreamScope() = default;

struct Graph::Impl {
  std::vector<std::function<void()>> launches;
};
Graph::Graph() = default;
Graph::~Graph() = default;
Graph::Graph(Graph&& other) noexcept = default;
Graph& Graph::operator=(Graph&& other) noexcept = default;
size_t Graph::nodes() const { return impl_ ? impl_->launches.size() : 0; }

Result<Graph> Graph::Capture(const Stream& stream, const std::function<Status()>& body) {
  if (!stream.handle()) return InvalidArgument("Graph::Capture: the default stream cannot be captured");
  auto impl = std::make_unique<Impl>();
  emu_capture = &impl->launches;
  Status st = body();
  emu_capture = nullptr;
  if (st.ok() && emu_fail_captures)
    st = Internal("cudaGraphInstantiate: out of memory (emulated)");
  if (!st.ok()) return st.Wrap("capturing a CUDA graph");
  Graph g;
  g.impl_ = std::move(impl);
  return Result<Graph>(std::move(g));
}

Status Graph::Launch(const Stream&) const {
  FM_RETURN_IF_ERROR(Lost("cudaGraphLaunch"));
  if (!impl_) return Internal("Graph::Launch: an empty graph");
  for (const auto& launch : impl_->launches) launch();
  return Status::Ok();
}

}  // namespace fm::cuda
