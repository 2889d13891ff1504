// The stage-to-stage data plane of a worker (docs/architecture.md "Data plane") over a net::Transport: stage s
// sends each micro-batch's manifold [T, hc*H] as one ACTIVATION frame to stage s+1 (header +
// the executor's own buffer, no copy for f32 on a CPU shard; one device-to-host copy on a
// device shard), and a receiver thread hands every frame from stage s-1 to the StageExecutor
// (which copies its payload into the shard's activations when the step runs). By the
// transport's convention the lower stage dials.
// With `transport: nccl` each hop is instead a two-member net::Communicator (sender rank 0,
// receiver rank 1): the sender's Send and the receiving stage's Receive of the same step meet
// (NCCL is rendezvous), the receiving stage posting its receive when it runs that step.
#pragma once
#include <condition_variable>
#include <memory>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

#include "flashmesh/v1/worker.pb.h"
#include "net/communicator.h"
#include "net/frame.h"
#include "net/transport.h"
#include "worker/stage_executor.h"

namespace fm {

// Sends to the next stage's peer `peer` at data address `address`; dials on first use and
// again after the connection broke (the next worker restarted), one dial per Send at most.
std::unique_ptr<ActivationSink> NewTransportActivationSink(net::Transport* transport,
                                                           std::string peer, std::string address,
                                                           net::FrameDType dtype);

// A hop over a communicator (`comm` outlives the sink/source): the sink sends each step's
// manifold to rank `peer` as an ACTIVATION frame (dtype f32 or bf16); the source receives step
// k's frame from rank `peer` (sent with `dtype`) and checks it is a [rows, hc*H] activation of
// step k. On a communicator that takes device buffers (NCCL) a device X of f32 frames is sent
// and received in place (ncclSend/ncclRecv on the shard's buffer), with no host copy.
std::unique_ptr<ActivationSink> NewCommActivationSink(net::Communicator* comm, int peer,
                                                      net::FrameDType dtype);
std::unique_ptr<ActivationSource> NewCommActivationSource(net::Communicator* comm, int peer,
                                                          net::FrameDType dtype);

// Hands ACTIVATION frames from the previous stage to an executor. A frame that is not a
// [rows, hc*H] f32/bf16 activation, or one the executor's inbox has no room for, is logged and
// drops that connection (the sender is broken or hostile), and the step it was for fails if it
// waits; the worker keeps serving.
class ActivationReceiver {
 public:
  ActivationReceiver(net::Transport* transport, StageExecutor* executor);
  ~ActivationReceiver();
  // The peer name of the previous stage; "" on stage 0 (nothing to receive).
  void SetPeer(std::string peer);
  uint64_t frames_rejected() const;

 private:
  void Loop();
  Status Deliver(net::Frame f);

  net::Transport* transport_;
  StageExecutor* executor_;
  mutable std::mutex mu_;
  std::condition_variable cv_;
  std::string peer_;
  uint64_t rejected_ = 0;
  bool stop_ = false;
  std::thread thread_;
};

// ShardSpec.activation_dtype (the cluster YAML's `activation_dtype`) to the frame dtype; an
// unknown value (a newer coordinator's) is an error naming it.
Result<net::FrameDType> ActivationFrameDType(flashmesh::v1::ActivationDType dtype);

}  // namespace fm
