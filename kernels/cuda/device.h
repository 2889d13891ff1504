// CUDA device discovery and device memory. Safe to call on machines without a GPU or driver:
// every fallible call returns a Status naming the CUDA call and its error, never aborts.
// No CUDA types here, so plain C++ code can include it.
#pragma once
#include <algorithm>
#include <cstddef>
#include <functional>
#include <memory>
#include <string>

#include "common/status.h"

namespace fm::cuda {
// Number of usable CUDA devices; 0 when there is no driver or no GPU.
int DeviceCount();
// "NVIDIA H200 (sm_90, 139.8 GiB)" for device `index`, or the CUDA error text.
std::string DeviceDescription(int index);
// Waits for all work queued on the current device; reports the first asynchronous error.
Status Synchronize();
// Waits for the work queued on this thread's current stream (StreamScope below): before
// another stream (a communicator's) reads what it wrote.
Status SynchronizeStream();
// Free and total bytes of the current device (cudaMemGetInfo).
struct DeviceMemory {
  size_t free = 0, total = 0;
};
Result<DeviceMemory> MemoryInfo();
// Makes device `index` current for this thread (its allocations and launches go there);
// InvalidArgument naming the index and the device count when there is no such device.
Status SetDevice(int index);
// After a failed call: OK when device `index` still works (the error was that call's own),
// else the error that ended this process's context on it (an illegal address, a launch
// failure, an uncorrectable ECC error: "sticky", every later call fails alike until the
// process restarts). Does not wait for the device's queued work.
Status DeviceHealth(int index);
// Kernels this process has launched so far through kernels/cuda (each launcher's launch counts
// once when it is issued: a capture counts its kernels, a graph replay counts none).
int64_t KernelLaunches();

// Owns `size()` bytes of device memory (cudaMalloc'd, so 256-byte aligned) on the device that
// was current at Alloc; move-only. Every copy counts its bytes for that device
// (common/device_transfers.h): Upload as load traffic, the copies below as step traffic.
class DeviceBuffer {
 public:
  DeviceBuffer() = default;
  // bytes == 0 gives an empty buffer with data() == nullptr.
  static Result<DeviceBuffer> Alloc(size_t bytes);
  ~DeviceBuffer();
  DeviceBuffer(DeviceBuffer&& other) noexcept;
  DeviceBuffer& operator=(DeviceBuffer&& other) noexcept;
  DeviceBuffer(const DeviceBuffer&) = delete;
  DeviceBuffer& operator=(const DeviceBuffer&) = delete;

  void* data() const { return ptr_; }
  size_t size() const { return size_; }
  int device() const { return device_; }
  template <typename T>
  T* as() const { return static_cast<T*>(ptr_); }

  // Copies of `bytes` at byte `offset` of this buffer on this thread's current stream
  // (StreamScope below), blocking until done; OutOfRange past size(). Refused while the stream
  // is being captured into a graph: every replay would copy again, uncounted.
  Status CopyFromHost(const void* src, size_t bytes, size_t offset = 0);
  Status CopyToHost(void* dst, size_t bytes, size_t offset = 0) const;
  // Queued on the current stream after the work before it; returns once `src` may be reused.
  Status CopyFromHostAsync(const void* src, size_t bytes, size_t offset = 0);

 private:
  void* ptr_ = nullptr;
  size_t size_ = 0;
  int device_ = 0;
};

// A buffer of at least `bytes` in place of `old`, whose contents are dropped. `old` is freed
// first (growing must not need the old and the new size at once), and the new one is at least
// double the old when that fits: a prefill that grows it once does not make every later step
// grow it. When the doubled size does not fit, exactly `bytes`. On failure `old` is gone too.
inline Result<DeviceBuffer> GrowBuffer(DeviceBuffer old, size_t bytes) {
  const size_t doubled = std::max(bytes, 2 * old.size());
  old = DeviceBuffer();
  Result<DeviceBuffer> b = DeviceBuffer::Alloc(doubled);
  if (b.ok() || doubled == bytes) return b;
  return DeviceBuffer::Alloc(bytes);
}

// Allocates a buffer and fills it with `bytes` from host memory: load traffic (a shard's weights
// and constants), counted apart from the steps' copies.
Result<DeviceBuffer> Upload(const void* src, size_t bytes);

// Copies `bytes` from device memory src to device memory dst (no overlap) on the current
// stream, queued after the work before it; returns at once (stream order keeps it consistent).
Status CopyOnDevice(void* dst, const void* src, size_t bytes);

// A CUDA stream of the current device (blocking flavour: it orders with the legacy default
// stream, so code that still uses the default stream stays correct); move-only.
class Stream {
 public:
  static Result<Stream> Create();
  Stream() = default;
  ~Stream();
  Stream(Stream&& other) noexcept;
  Stream& operator=(Stream&& other) noexcept;
  Stream(const Stream&) = delete;
  Stream& operator=(const Stream&) = delete;

  void* handle() const { return handle_; }  // the cudaStream_t; null is the default stream
  // Waits for everything queued on it; reports the first asynchronous error.
  Status Synchronize() const;

 private:
  void* handle_ = nullptr;
};

// While it lives, every launcher of ops.h and every DeviceBuffer copy on this thread goes to
// `stream` (the default stream otherwise); scopes nest.
class StreamScope {
 public:
  explicit StreamScope(const Stream& stream);
  ~StreamScope();
  StreamScope(const StreamScope&) = delete;
  StreamScope& operator=(const StreamScope&) = delete;

 private:
  void* saved_;
};

// A CUDA graph: the kernels `body` launches on `stream` (made current for it) are recorded, not
// run, then instantiated once; Launch replays them on a stream, reading whatever device memory
// holds at that time. Only stream-ordered work may happen inside `body` (no blocking copies, no
// allocation): CUDA refuses the rest, and the capture then fails with that error.
class Graph {
 public:
  static Result<Graph> Capture(const Stream& stream, const std::function<Status()>& body);
  Graph();
  ~Graph();
  Graph(Graph&& other) noexcept;
  Graph& operator=(Graph&& other) noexcept;

  bool empty() const { return impl_ == nullptr; }
  size_t nodes() const;  // kernels recorded
  Status Launch(const Stream& stream) const;

  struct Impl;

 private:
  std::unique_ptr<Impl> impl_;
};
}  // namespace fm::cuda
