#include <cuda_runtime.h>

#include <cstdio>
#include <string>
#include <utility>

#include "common/device_transfers.h"
#include "kernels/cuda/check.cuh"
#include "kernels/cuda/device.h"

namespace fm::cuda {

namespace {
thread_local cudaStream_t current_stream = nullptr;
}  // namespace

cudaStream_t CurrentStream() { return current_stream; }

int64_t KernelLaunches() { return launches_made.load(std::memory_order_relaxed); }

int DeviceCount() {
  int n = 0;
  if (cudaGetDeviceCount(&n) != cudaSuccess) {
    cudaGetLastError();  // clear the sticky "no driver" error
    return 0;
  }
  return n;
}

std::string DeviceDescription(int index) {
  cudaDeviceProp p{};
  cudaError_t e = cudaGetDeviceProperties(&p, index);
  if (e != cudaSuccess) return cudaGetErrorString(e);
  char buf[640];  // name (256) + numbers
  std::snprintf(buf, sizeof buf, "%s (sm_%d%d, %.1f GiB)", p.name, p.major, p.minor,
                p.totalGlobalMem / double(1ull << 30));
  return buf;
}

Status Synchronize() {
  FM_CUDA_RETURN_IF_ERROR(cudaDeviceSynchronize());
  return Status::Ok();
}

Status SynchronizeStream() {
  FM_CUDA_RETURN_IF_ERROR(cudaStreamSynchronize(current_stream));
  return Status::Ok();
}

Result<DeviceMemory> MemoryInfo() {
  DeviceMemory m;
  FM_CUDA_RETURN_IF_ERROR(cudaMemGetInfo(&m.free, &m.total));
  return m;
}

Status DeviceHealth(int index) {
  // Without waiting (a step that failed on a dead peer may leave a communicator's kernel
  // behind): an error that is not sticky is cleared, a sticky one comes back from every call.
  cudaGetLastError();
  cudaError_t e = cudaSetDevice(index);
  if (e == cudaSuccess) e = cudaStreamQuery(nullptr);
  if (e == cudaErrorNotReady) {   // work queued: the device runs
    cudaGetLastError();
    return Status::Ok();
  }
  if (e == cudaSuccess) return Status::Ok();
  return CudaStatus(e, "cudaStreamQuery")
      .Wrap("cuda:" + std::to_string(index) + " is unusable for the rest of this process");
}

Status SetDevice(int index) {
  const int n = DeviceCount();
  if (index < 0 || index >= n)
    return InvalidArgument("cuda:" + std::to_string(index) + ": this host has " +
                           std::to_string(n) + " CUDA device(s)");
  FM_CUDA_RETURN_IF_ERROR(cudaSetDevice(index));
  return Status::Ok();
}

Result<DeviceBuffer> DeviceBuffer::Alloc(size_t bytes) {
  DeviceBuffer b;
  if (bytes == 0) return Result<DeviceBuffer>(std::move(b));
  cudaError_t e = cudaMalloc(&b.ptr_, bytes);
  if (e != cudaSuccess) {
    cudaGetLastError();
    b.ptr_ = nullptr;
    return CudaStatus(e, "cudaMalloc").Wrap("allocating " + std::to_string(bytes) +
                                            " device bytes");
  }
  b.size_ = bytes;
  FM_CUDA_RETURN_IF_ERROR(cudaGetDevice(&b.device_));  // where its copies are counted
  return Result<DeviceBuffer>(std::move(b));
}

DeviceBuffer::~DeviceBuffer() {
  if (ptr_) cudaFree(ptr_);
}

DeviceBuffer::DeviceBuffer(DeviceBuffer&& other) noexcept
    : ptr_(std::exchange(other.ptr_, nullptr)),
      size_(std::exchange(other.size_, 0)),
      device_(other.device_) {}

DeviceBuffer& DeviceBuffer::operator=(DeviceBuffer&& other) noexcept {
  if (this != &other) {
    if (ptr_) cudaFree(ptr_);
    ptr_ = std::exchange(other.ptr_, nullptr);
    size_ = std::exchange(other.size_, 0);
    device_ = other.device_;
  }
  return *this;
}

static Status CheckRange(size_t bytes, size_t offset, size_t size, const char* what) {
  if (offset > size || bytes > size - offset)
    return OutOfRange(std::string(what) + ": " + std::to_string(bytes) + " bytes at offset " +
                      std::to_string(offset) + " exceed the device buffer of " +
                      std::to_string(size) + " bytes");
  return Status::Ok();
}

// A copy queued while its stream is being captured would become a node of the graph and run on
// every replay, where no counter sees it (the default stream is never captured: Graph::Capture).
static Status NotCapturing(const char* what) {
  if (!current_stream) return Status::Ok();
  cudaStreamCaptureStatus capture = cudaStreamCaptureStatusNone;
  FM_CUDA_RETURN_IF_ERROR(cudaStreamIsCapturing(current_stream, &capture));
  if (capture != cudaStreamCaptureStatusNone)
    return Internal(std::string(what) + ": a host<->device copy while capturing a graph "
                    "(every replay would copy again, uncounted)");
  return Status::Ok();
}

// Queues the copy into `b` on the current stream and counts it as `phase` traffic.
static Status QueueFromHost(const DeviceBuffer& b, const void* src, size_t bytes, size_t offset,
                            TransferPhase phase) {
  FM_RETURN_IF_ERROR(CheckRange(bytes, offset, b.size(), "DeviceBuffer::CopyFromHost"));
  if (bytes == 0) return Status::Ok();
  FM_RETURN_IF_ERROR(NotCapturing("DeviceBuffer::CopyFromHost"));
  FM_CUDA_RETURN_IF_ERROR(cudaMemcpyAsync(b.as<char>() + offset, src, bytes,
                                          cudaMemcpyHostToDevice, current_stream));
  CountTransfer(b.device(), phase, TransferDirection::kHostToDevice, bytes);
  return Status::Ok();
}

Status DeviceBuffer::CopyFromHostAsync(const void* src, size_t bytes, size_t offset) {
  return QueueFromHost(*this, src, bytes, offset, TransferPhase::kStep);
}

Status DeviceBuffer::CopyFromHost(const void* src, size_t bytes, size_t offset) {
  FM_RETURN_IF_ERROR(CopyFromHostAsync(src, bytes, offset));
  FM_CUDA_RETURN_IF_ERROR(cudaStreamSynchronize(current_stream));
  return Status::Ok();
}

Status DeviceBuffer::CopyToHost(void* dst, size_t bytes, size_t offset) const {
  FM_RETURN_IF_ERROR(CheckRange(bytes, offset, size_, "DeviceBuffer::CopyToHost"));
  if (bytes == 0) return Status::Ok();
  FM_RETURN_IF_ERROR(NotCapturing("DeviceBuffer::CopyToHost"));
  FM_CUDA_RETURN_IF_ERROR(cudaMemcpyAsync(dst, static_cast<const char*>(ptr_) + offset, bytes,
                                          cudaMemcpyDeviceToHost, current_stream));
  CountTransfer(device_, TransferPhase::kStep, TransferDirection::kDeviceToHost, bytes);
  FM_CUDA_RETURN_IF_ERROR(cudaStreamSynchronize(current_stream));
  return Status::Ok();
}

Status CopyOnDevice(void* dst, const void* src, size_t bytes) {
  if (bytes == 0) return Status::Ok();
  if (!dst || !src) return InvalidArgument("CopyOnDevice: null device pointer");
  FM_CUDA_RETURN_IF_ERROR(
      cudaMemcpyAsync(dst, src, bytes, cudaMemcpyDeviceToDevice, current_stream));
  return Status::Ok();
}

Result<DeviceBuffer> Upload(const void* src, size_t bytes) {
  FM_ASSIGN_OR_RETURN(DeviceBuffer b, DeviceBuffer::Alloc(bytes));
  FM_RETURN_IF_ERROR(QueueFromHost(b, src, bytes, 0, TransferPhase::kLoad));
  FM_CUDA_RETURN_IF_ERROR(cudaStreamSynchronize(current_stream));
  return Result<DeviceBuffer>(std::move(b));
}

Result<Stream> Stream::Create() {
  Stream s;
  cudaStream_t h = nullptr;
  FM_CUDA_RETURN_IF_ERROR(cudaStreamCreate(&h));
  s.handle_ = h;
  return Result<Stream>(std::move(s));
}

Stream::~Stream() {
  if (handle_) cudaStreamDestroy(static_cast<cudaStream_t>(handle_));
}

Stream::Stream(Stream&& other) noexcept : handle_(std::exchange(other.handle_, nullptr)) {}

Stream& Stream::operator=(Stream&& other) noexcept {
  if (this != &other) {
    if (handle_) cudaStreamDestroy(static_cast<cudaStream_t>(handle_));
    handle_ = std::exchange(other.handle_, nullptr);
  }
  return *this;
}

Status Stream::Synchronize() const {
  FM_CUDA_RETURN_IF_ERROR(cudaStreamSynchronize(static_cast<cudaStream_t>(handle_)));
  return Status::Ok();
}

StreamScope::StreamScope(const Stream& stream) : saved_(current_stream) {
  current_stream = static_cast<cudaStream_t>(stream.handle());
}

StreamScope::~StreamScope() { current_stream = static_cast<cudaStream_t>(saved_); }

struct Graph::Impl {
  cudaGraphExec_t exec = nullptr;
  size_t nodes = 0;
  ~Impl() {
    if (exec) cudaGraphExecDestroy(exec);
  }
};

Graph::Graph() = default;
Graph::~Graph() = default;
Graph::Graph(Graph&& other) noexcept = default;
Graph& Graph::operator=(Graph&& other) noexcept = default;

size_t Graph::nodes() const { return impl_ ? impl_->nodes : 0; }

Result<Graph> Graph::Capture(const Stream& stream, const std::function<Status()>& body) {
  auto s = static_cast<cudaStream_t>(stream.handle());
  if (!s) return InvalidArgument("Graph::Capture: the default stream cannot be captured");
  FM_CUDA_RETURN_IF_ERROR(cudaStreamBeginCapture(s, cudaStreamCaptureModeThreadLocal));
  const Status captured = [&] {
    StreamScope scope(stream);
    return body();
  }();
  cudaGraph_t g = nullptr;
  const cudaError_t end = cudaStreamEndCapture(s, &g);  // always: it ends the capture mode
  auto impl = std::make_unique<Impl>();
  const Status st = [&]() -> Status {
    FM_RETURN_IF_ERROR(captured);
    FM_RETURN_IF_ERROR(CudaStatus(end, "cudaStreamEndCapture"));
    FM_RETURN_IF_ERROR(
        CudaStatus(cudaGraphGetNodes(g, nullptr, &impl->nodes), "cudaGraphGetNodes"));
    return CudaStatus(cudaGraphInstantiate(&impl->exec, g, 0), "cudaGraphInstantiate");
  }();
  if (g) cudaGraphDestroy(g);
  if (!st.ok()) {
    cudaGetLastError();  // a failed capture leaves the error sticky for the next launch check
    return st.Wrap("capturing a CUDA graph");
  }
  Graph graph;
  graph.impl_ = std::move(impl);
  return Result<Graph>(std::move(graph));
}

Status Graph::Launch(const Stream& stream) const {
  if (!impl_) return Internal("Graph::Launch: an empty graph");
  FM_CUDA_RETURN_IF_ERROR(cudaGraphLaunch(impl_->exec, static_cast<cudaStream_t>(stream.handle())));
  return Status::Ok();
}

}  // namespace fm::cuda
