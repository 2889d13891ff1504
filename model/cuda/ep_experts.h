// The routed experts of a device shard under expert parallelism (docs/gpu.md "Expert parallel
// on the device"): an ExpertRunner over the experts the shard uploaded, so the EP executor runs
// every member's requests for this member's experts on its GPU, in one ExpertsUpGate and one
// ExpertsDown launch a layer (W1 and W3 in one pass), never on the CPU; as DeviceRows it keeps
// the executor's rows and outputs in this GPU's memory.
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

class DeviceExpertRunner : public ExpertRunner, public DeviceRows {
 public:
  // layers: the shard's uploaded layers [layer_begin, layer_begin + layers.size()), outliving
  // the runner. Runs on its own stream of cuda:`device`.
  static Result<std::unique_ptr<DeviceExpertRunner>> Create(const ModelConfig& cfg, int device,
                                                            int64_t layer_begin,
                                                            std::vector<const DevLayer*> layers);
  // Host rows in, host outputs out (one copy each way): an EP executor given host rows.
  Status RunPairs(int64_t layer, const float* rows, int64_t n, const int32_t* pairs, int64_t p,
                  float* out) override;
  DeviceRows* device_rows() override { return this; }

  // DeviceRows (model/forward.h): what keeps the EP executor's rows on this GPU.
  Result<float*> Buffer(int which, int64_t floats) override;
  Status GatherRows(const float* src, int64_t src_rows, const int32_t* idx, int64_t n,
                    float* dst) override;
  Status ToHost(const void* src, void* dst, size_t bytes) override;
  Status FromHost(const void* src, void* dst, size_t bytes) override;
  Status RunPairsOnDevice(int64_t layer, const float* rows, int64_t n, const int32_t* pairs,
                          int64_t p, float* out) override;
  Status Wait() override;

 private:
  DeviceExpertRunner(const ModelConfig& cfg, int device, int64_t layer_begin,
                     std::vector<const DevLayer*> layers)
      : cfg_(cfg), device_(device), begin_(layer_begin), layers_(std::move(layers)) {}
  // Grows *b to hold `bytes` (buffers are reused from one call to the next).
  static Status Reserve(cuda::DeviceBuffer* b, size_t bytes);
  // The layer's uploaded experts, after checking every pair's row (< n) and expert (held here).
  Result<const DevLayer*> CheckPairs(int64_t layer, int64_t n, const int32_t* pairs, int64_t p) const;
  // out [p, H] = expert ids_[j] of row x_[j] for every pair j: ExpertsUpGate + ExpertsDown.
  Status Launch(const DevLayer& l, int64_t p, float* out);
  // dst [n, H] = src rows idx (checked), into device memory: GatherRows under mu_ on stream_.
  Status Gather(const float* src, int64_t src_rows, const int32_t* idx, int64_t n, float* dst);
  // Which of the two buffers holds [p, p + bytes), and at which offset; null when neither does.
  cuda::DeviceBuffer* Holding(const void* p, size_t bytes, size_t* offset);

  const ModelConfig& cfg_;
  int device_;
  int64_t begin_;
  std::vector<const DevLayer*> layers_;
  std::mutex mu_;  // one call at a time: the buffers are shared
  cuda::Stream stream_;
  cuda::DeviceBuffer x_, ids_, h_, y_;  // a call's pair rows, expert ids, mids and outputs
  cuda::DeviceBuffer idx_;              // GatherRows' row indices
  cuda::DeviceBuffer rows_[2];          // DeviceRows::Buffer
};

}  // namespace fm
