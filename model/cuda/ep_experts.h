// The routed experts of a device shard under expert parallelism (docs/gpu.md "Expert parallel
// on the device"): an ExpertRunner over the experts the shard uploaded, so the EP executor runs
// every member's requests for this member's experts on its GPU, in one ExpertsUpGate and one
// ExpertsDown launch a layer (W1 and W3 in one pass), never on the CPU.
#pragma once
#include <cstdint>
#include <memory>
#include <mutex>
#include <vector>

#include "kernels/cuda/device.h"
#include "model/config.h"
#include "model/cuda/device_weights.h"
#include "model/forward.h"

namespace fm {

class DeviceExpertRunner : public ExpertRunner {
 public:
  // layers: the shard's uploaded layers [layer_begin, layer_begin + layers.size()), outliving
  // the runner. Runs on its own stream of cuda:`device`, so a member serves the others' requests
  // while its own step waits in the exchange.
  static Result<std::unique_ptr<DeviceExpertRunner>> Create(const ModelConfig& cfg, int device,
                                                            int64_t layer_begin,
                                                            std::vector<const DevLayer*> layers);
  Status RunPairs(int64_t layer, const float* rows, int64_t n, const int32_t* pairs, int64_t p,
                  float* out) override;

 private:
  DeviceExpertRunner(const ModelConfig& cfg, int device, int64_t layer_begin,
                     std::vector<const DevLayer*> layers)
      : cfg_(cfg), device_(device), begin_(layer_begin), layers_(std::move(layers)) {}
  // Grows *b to hold `bytes` (buffers are reused from one call to the next).
  static Status Reserve(cuda::DeviceBuffer* b, size_t bytes);

  const ModelConfig& cfg_;
  int device_;
  int64_t begin_;
  std::vector<const DevLayer*> layers_;
  std::mutex mu_;  // one call at a time: the buffers are shared
  cuda::Stream stream_;
  cuda::DeviceBuffer x_, ids_, h_, y_;  // a call's pair rows, expert ids, mids and outputs
};

}  // namespace fm
