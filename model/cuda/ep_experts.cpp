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
  FM_ASSIGN_OR_RETURN(*b, cuda::GrowBuffer(std::move(*b), bytes));
  return Status::Ok();
}

Result<const DevLayer*> DeviceExpertRunner::CheckPairs(int64_t layer, int64_t n,
                                                       const int32_t* pairs, int64_t p) const {
  const int64_t E = cfg_.n_routed_experts;
  const int64_t i = layer - begin_;
  if (i < 0 || i >= static_cast<int64_t>(layers_.size()))
    return InvalidArgument("MoE: layer " + std::to_string(layer) + " is not on this shard");
  const DevLayer& l = *layers_[i];
  for (int64_t j = 0; j < p; ++j) {
    const int32_t row = pairs[2 * j], e = pairs[2 * j + 1];
    if (row < 0 || row >= n || e < 0 || e >= E || l.w1.present.empty() || !l.w1.present[e])
      return InvalidArgument("MoE layer " + std::to_string(layer) + ": pair " +
                             std::to_string(j) + " (row " + std::to_string(row) + " of " +
                             std::to_string(n) + ", expert " + std::to_string(e) +
                             ") is not on this device");
  }
  return &l;
}

Status DeviceExpertRunner::Launch(const DevLayer& l, int64_t p, float* out) {
  const int64_t H = cfg_.hidden_size, I = l.w1.rows;
  const float limit = DeviceSwigluLimit(cfg_);
  FM_RETURN_IF_ERROR(Reserve(&h_, static_cast<size_t>(std::min(p, kMaxPairsPerLaunch) * I) *
                                      sizeof(float)));
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
                                         out + j0 * H));
  }
  return Status::Ok();
}

Status DeviceExpertRunner::RunPairs(int64_t layer, const float* rows, int64_t n,
                                    const int32_t* pairs, int64_t p, float* out) {
  const int64_t H = cfg_.hidden_size;
  FM_ASSIGN_OR_RETURN(const DevLayer* l, CheckPairs(layer, n, pairs, p));
  if (p == 0) return Status::Ok();
  std::vector<float> x(static_cast<size_t>(p * H));
  std::vector<int32_t> ids(static_cast<size_t>(p));
  for (int64_t j = 0; j < p; ++j) {
    std::memcpy(x.data() + j * H, rows + pairs[2 * j] * H, H * sizeof(float));
    ids[j] = pairs[2 * j + 1];
  }
  std::lock_guard<std::mutex> lock(mu_);
  FM_RETURN_IF_ERROR(cuda::SetDevice(device_));
  cuda::StreamScope on_stream(stream_);
  FM_RETURN_IF_ERROR(Reserve(&x_, x.size() * sizeof(float)));
  FM_RETURN_IF_ERROR(Reserve(&ids_, ids.size() * sizeof(int32_t)));
  FM_RETURN_IF_ERROR(Reserve(&y_, x.size() * sizeof(float)));
  FM_RETURN_IF_ERROR(x_.CopyFromHostAsync(x.data(), x.size() * sizeof(float)));
  FM_RETURN_IF_ERROR(ids_.CopyFromHostAsync(ids.data(), ids.size() * sizeof(int32_t)));
  FM_RETURN_IF_ERROR(Launch(*l, p, y_.as<float>()));
  return y_.CopyToHost(out, x.size() * sizeof(float));
}

Status DeviceExpertRunner::RunPairsOnDevice(int64_t layer, const float* rows, int64_t n,
                                            const int32_t* pairs, int64_t p, float* out) {
  const int64_t H = cfg_.hidden_size;
  FM_ASSIGN_OR_RETURN(const DevLayer* l, CheckPairs(layer, n, pairs, p));
  if (p == 0) return Status::Ok();
  std::vector<int32_t> row_of(static_cast<size_t>(p)), ids(static_cast<size_t>(p));
  for (int64_t j = 0; j < p; ++j) {
    row_of[j] = pairs[2 * j];
    ids[j] = pairs[2 * j + 1];
  }
  std::lock_guard<std::mutex> lock(mu_);
  FM_RETURN_IF_ERROR(cuda::SetDevice(device_));
  cuda::StreamScope on_stream(stream_);
  FM_RETURN_IF_ERROR(Reserve(&x_, static_cast<size_t>(p * H) * sizeof(float)));
  FM_RETURN_IF_ERROR(Gather(rows, n, row_of.data(), p, x_.as<float>()));
  FM_RETURN_IF_ERROR(Reserve(&ids_, ids.size() * sizeof(int32_t)));
  FM_RETURN_IF_ERROR(ids_.CopyFromHostAsync(ids.data(), ids.size() * sizeof(int32_t)));
  return Launch(*l, p, out);
}

Result<float*> DeviceExpertRunner::Buffer(int which, int64_t floats) {
  if (which < 0 || which > 1 || floats < 0)
    return InvalidArgument("DeviceRows::Buffer(" + std::to_string(which) + ", " +
                           std::to_string(floats) + ")");
  std::lock_guard<std::mutex> lock(mu_);
  FM_RETURN_IF_ERROR(cuda::SetDevice(device_));
  // A buffer the stream may still read is replaced only once that work is done.
  if (rows_[which].size() < static_cast<size_t>(floats) * sizeof(float))
    FM_RETURN_IF_ERROR(stream_.Synchronize());
  FM_RETURN_IF_ERROR(Reserve(&rows_[which], static_cast<size_t>(floats) * sizeof(float)));
  return rows_[which].as<float>();
}

Status DeviceExpertRunner::GatherRows(const float* src, int64_t src_rows, const int32_t* idx,
                                      int64_t n, float* dst) {
  for (int64_t i = 0; i < n; ++i)
    if (idx[i] < 0 || idx[i] >= src_rows)
      return InvalidArgument("GatherRows: index " + std::to_string(i) + " is row " +
                             std::to_string(idx[i]) + " of " + std::to_string(src_rows));
  if (n == 0) return Status::Ok();
  std::lock_guard<std::mutex> lock(mu_);
  FM_RETURN_IF_ERROR(cuda::SetDevice(device_));
  cuda::StreamScope on_stream(stream_);
  return Gather(src, src_rows, idx, n, dst);
}

// Under mu_, on stream_, the indices checked by the caller.
Status DeviceExpertRunner::Gather(const float* src, int64_t src_rows, const int32_t* idx,
                                  int64_t n, float* dst) {
  const int64_t H = cfg_.hidden_size;
  FM_RETURN_IF_ERROR(Reserve(&idx_, static_cast<size_t>(n) * sizeof(int32_t)));
  FM_RETURN_IF_ERROR(idx_.CopyFromHostAsync(idx, static_cast<size_t>(n) * sizeof(int32_t)));
  // The embedding lookup's kernel on an f32 table of src_rows rows, one stream (a launch takes
  // at most 65535 rows).
  for (int64_t i0 = 0; i0 < n; i0 += 65535)
    FM_RETURN_IF_ERROR(cuda::EmbedRows(src, /*bf16=*/false, src_rows, H,
                                       idx_.as<const int32_t>() + i0,
                                       std::min<int64_t>(65535, n - i0), 1, dst + i0 * H));
  return Status::Ok();
}

cuda::DeviceBuffer* DeviceExpertRunner::Holding(const void* p, size_t bytes, size_t* offset) {
  for (cuda::DeviceBuffer& b : rows_) {
    const char* base = b.as<const char>();
    const char* q = static_cast<const char*>(p);
    if (base && q >= base && q + bytes <= base + b.size()) {
      *offset = static_cast<size_t>(q - base);
      return &b;
    }
  }
  return nullptr;
}

Status DeviceExpertRunner::ToHost(const void* src, void* dst, size_t bytes) {
  if (bytes == 0) return Status::Ok();
  std::lock_guard<std::mutex> lock(mu_);
  size_t offset = 0;
  cuda::DeviceBuffer* b = Holding(src, bytes, &offset);
  if (!b) return InvalidArgument("DeviceRows::ToHost: not a range of its buffers");
  FM_RETURN_IF_ERROR(cuda::SetDevice(device_));
  cuda::StreamScope on_stream(stream_);
  return b->CopyToHost(dst, bytes, offset);
}

Status DeviceExpertRunner::FromHost(const void* src, void* dst, size_t bytes) {
  if (bytes == 0) return Status::Ok();
  std::lock_guard<std::mutex> lock(mu_);
  size_t offset = 0;
  cuda::DeviceBuffer* b = Holding(dst, bytes, &offset);
  if (!b) return InvalidArgument("DeviceRows::FromHost: not a range of its buffers");
  FM_RETURN_IF_ERROR(cuda::SetDevice(device_));
  cuda::StreamScope on_stream(stream_);
  return b->CopyFromHost(src, bytes, offset);
}

Status DeviceExpertRunner::Wait() {
  std::lock_guard<std::mutex> lock(mu_);
  FM_RETURN_IF_ERROR(cuda::SetDevice(device_));
  return stream_.Synchronize();
}

}  // namespace fm
