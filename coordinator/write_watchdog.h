// Cancels a gRPC call whose stream write waits too long. A synchronous ServerWriter::Write has no
// timeout: once a client stops reading and its HTTP/2 window is full, the write waits until the
// connection dies, holding the handler's thread and the client's stream slot
// (limits.max_streams_per_client) for good. One thread checks the writes in progress and calls
// TryCancel on a call whose write has lasted past the limit, which ends that write.
#pragma once
#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <map>
#include <mutex>
#include <thread>

#include <grpcpp/server_context.h>

namespace fm {

class WriteWatchdog {
 public:
  explicit WriteWatchdog(std::chrono::milliseconds limit);
  ~WriteWatchdog();
  WriteWatchdog(const WriteWatchdog&) = delete;
  WriteWatchdog& operator=(const WriteWatchdog&) = delete;

  // A write of `ctx`'s call in progress from construction to destruction.
  class Write {
   public:
    Write(WriteWatchdog* dog, grpc::ServerContext* ctx);
    ~Write();
    Write(const Write&) = delete;
    Write& operator=(const Write&) = delete;

   private:
    WriteWatchdog* dog_;
    uint64_t id_;
  };

 private:
  using Clock = std::chrono::steady_clock;
  struct Watched {
    grpc::ServerContext* ctx;
    Clock::time_point since;
  };
  void Run();

  const std::chrono::milliseconds limit_;
  std::mutex mu_;   // guards everything below; a call is cancelled under it, while it is watched
  std::condition_variable cv_;
  bool stop_ = false;
  uint64_t next_id_ = 0;
  std::map<uint64_t, Watched> writes_;
  std::thread thread_;
};

}  // namespace fm
