// The routed experts of a device shard under expert parallelism (model/cuda/ep_experts.h).
#include "model/cuda/ep_experts.h"

#include <algorithm>
#include <cstring>
#include <string>

#include "kernels/cuda/ops.h"

namespace fm {

// Pairs of one expert launch (its grid has a block row a pair: CUDA allows 65535).
constexpr int64_t kMaxPairsPerLaunch = 4096;

Result<std::unique_ptr<DeviceExpertRunner>> DeviceExpertRunner::Create(
    const ModelConfig& cfg, int device, int64_t layer_begin, std::vector<const DevLayer*> layers) {
  std::unique_ptr<DeviceExpertRunner> r(
      new DeviceExpertRunner(cfg, device, layer_begin, std::move(layers)));
  FM_RETURN_IF_ERROR(cuda::SetDevice(device));
  FM_ASSIGN_OR_RETURN(r->stream_, cuda::Stream::Create());
  return r;
}

Status DeviceExpertRunner::Reserve(cuda::DeviceBuffer* b, size_t bytes) {
  if (b->size() >= bytes) return Status::Ok();
  FM_ASSIGN_OR_RETURN(*b, cuda::DeviceBuffer::Alloc(bytes));
  return Status::Ok();
}

Status DeviceExpertRunner::RunPairs(int64_t layer, const float* rows, int64_t n,
                                    const int32_t* pairs, int64_t p, float* out) {
  const int64_t H = cfg_.hidden_size, E = cfg_.n_routed_experts;
  const int64_t i = layer - begin_;
  if (i < 0 || i >= static_cast<int64_t>(layers_.size()))
    return InvalidArgument("MoE: layer " + std::to_string(layer) + " is not on this shard");
  const DevLayer& l = *layers_[i];
  // Each pair's row and expert, checked before anything moves.
  std::vector<float> x(static_cast<size_t>(p * H));
  std::vector<int32_t> ids(static_cast<size_t>(p));
  for (int64_t j = 0; j < p; ++j) {
    const int32_t row = pairs[2 * j], e = pairs[2 * j + 1];
    if (row < 0 || row >= n || e < 0 || e >= E || l.w1.present.empty() || !l.w1.present[e])
      return InvalidArgument("MoE layer " + std::to_string(layer) + ": pair " +
                             std::to_string(j) + " (row " + std::to_string(row) + " of " +
                             std::to_string(n) + ", expert " + std::to_string(e) +
                             ") is not on this device");
    std::memcpy(x.data() + j * H, rows + row * H, H * sizeof(float));
    ids[j] = e;
  }
  if (p == 0) return Status::Ok();
  const int64_t I = l.w1.rows;
  const float limit = DeviceSwigluLimit(cfg_);
  std::lock_guard<std::mutex> lock(mu_);
  FM_RETURN_IF_ERROR(cuda::SetDevice(device_));
  cuda::StreamScope on_stream(stream_);
  FM_RETURN_IF_ERROR(Reserve(&x_, x.size() * sizeof(float)));
  FM_RETURN_IF_ERROR(Reserve(&ids_, ids.size() * sizeof(int32_t)));
  const int64_t chunk = std::min(p, kMaxPairsPerLaunch);
  FM_RETURN_IF_ERROR(Reserve(&h_, static_cast<size_t>(chunk * I) * sizeof(float)));
  FM_RETURN_IF_ERROR(Reserve(&y_, x.size() * sizeof(float)));
  FM_RETURN_IF_ERROR(x_.CopyFromHostAsync(x.data(), x.size() * sizeof(float)));
  FM_RETURN_IF_ERROR(ids_.CopyFromHostAsync(ids.data(), ids.size() * sizeof(int32_t)));
  // Every pair a slot of its own (T = pairs, k = 1): each expert's weights are read once for
  // all its pairs of a launch, and a slot's bits are those of the same row in the whole shard's
  // step (a slot does not depend on the others).
  for (int64_t j0 = 0; j0 < p; j0 += kMaxPairsPerLaunch) {
    const int64_t m = std::min(kMaxPairsPerLaunch, p - j0);
    const int32_t* d_ids = ids_.as<const int32_t>() + j0;
    FM_RETURN_IF_ERROR(cuda::ExpertsUpGate(l.w1.view(), l.w3.view(), d_ids, m, 1,
                                           x_.as<float>() + j0 * H, H, limit, nullptr,
                                           h_.as<float>(), I));
    FM_RETURN_IF_ERROR(cuda::ExpertsDown(l.w2.view(), d_ids, m, 1, h_.as<float>(), I, nullptr,
                                         y_.as<float>() + j0 * H));
  }
  return y_.CopyToHost(out, x.size() * sizeof(float));
}

}  // namespace fm
