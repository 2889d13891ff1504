// The stage-to-stage data plane of a worker (DESIGN.md §3, §6) over a net::Transport: stage s
// sends each micro-batch's manifold [T, hc*H] as one ACTIVATION frame to stage s+1 (header +
// the executor's own buffer, no copy for f32), and a receiver thread hands every frame from
// stage s-1 to the StageExecutor. By the transport's convention the lower stage dials.
#pragma once
#include <condition_variable>
#include <memory>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

#include "net/frame.h"
#include "net/transport.h"
#include "worker/stage_executor.h"

namespace fm {

// Sends to the next stage's peer `peer` at data address `address`; dials on first use and
// again after the connection broke (the next worker restarted), one dial per Send at most.
std::unique_ptr<ActivationSink> NewTransportActivationSink(net::Transport* transport,
                                                           std::string peer, std::string address,
                                                           net::FrameDType dtype);

// Hands ACTIVATION frames from the previous stage to an executor. A frame that is not a
// [rows, hc*H] f32/bf16 activation is logged and drops that connection (the sender is broken or
// hostile); the worker keeps serving.
class ActivationReceiver {
 public:
  ActivationReceiver(net::Transport* transport, StageExecutor* executor);
  ~ActivationReceiver();
  // The peer name of the previous stage; "" on stage 0 (nothing to receive).
  void SetPeer(std::string peer);
  uint64_t frames_rejected() const;

 private:
  void Loop();
  Status Deliver(const net::Frame& f);

  net::Transport* transport_;
  StageExecutor* executor_;
  mutable std::mutex mu_;
  std::condition_variable cv_;
  std::string peer_;
  uint64_t rejected_ = 0;
  bool stop_ = false;
  std::thread thread_;
};

// "f32" / "bf16" (cluster YAML `activation_dtype`) to the frame dtype; errors name the value.
Result<net::FrameDType> ParseActivationDType(const std::string& name);

}  // namespace fm
