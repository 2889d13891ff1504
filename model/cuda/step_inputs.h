// The position-dependent inputs of the device step (model/cuda/shard_model.cpp): for each row
// (token) of a step, its position and id and everything the kernels derive from the position
// (ring row, window, compressor slots, entry counts). The host fills a StepInputs and copies it to
// the device before the step; the kernels read these fields instead of taking them by value, so
// a decode step is captured once as a CUDA graph (per batch-size bucket) and replayed at every
// position. Plain C++ (the device buffer has exactly this layout).
#pragma once
#include <cstddef>
#include <cstdint>
#include <iterator>
#include <span>

#include "kernels/cuda/device.h"
#include "kernels/cuda/ops.h"
#include "model/config.h"

namespace fm {

constexpr int kMaxStepRows = 32;  // tokens of one device step (longer prefills run in chunks)
constexpr int kMaxRatios = 4;     // distinct compress ratios > 1 in one shard

// The row counts of the captured decode steps (vLLM's batch-size buckets): a decode step of B
// sequences runs as the smallest bucket >= B, the rows past B padding. Powers of two: at most
// half a step is padding, and six graphs cover every B.
constexpr int kStepBuckets[] = {1, 2, 4, 8, 16, 32};
static_assert(kStepBuckets[std::size(kStepBuckets) - 1] == kMaxStepRows);
int StepBucket(int64_t rows);       // the smallest bucket >= rows (1 <= rows <= kMaxStepRows)
int StepBucketIndex(int64_t rows);  // its index in kStepBuckets

// One compress ratio's values at a position.
struct RatioScalars {
  cuda::CompressorStep comp;
  int32_t visible;  // entries that exist: (pos + 1) / r
  int32_t entries;  // entries attended: visible, at most index_topk on ratio 4
  int32_t keys;     // nwin + entries: the attention's key rows
};

struct RowScalars {
  int32_t ring_row;         // pos % sliding_window: where this token's kv goes
  int32_t win_start, nwin;  // the window rows the query sees (SinkAttentionRows reads the pair)
  RatioScalars ratio[kMaxRatios];  // in the order of the shard's ratio list
};

struct StepInputs {
  int32_t pos[kMaxStepRows];    // RoPE reads them as one array
  int32_t token[kMaxStepRows];  // the hash router too
  RowScalars row[kMaxStepRows];
};

// Row t of `in`: the token `token` at position `pos`; `ratios` are the shard's compress ratios.
void SetStepRow(const ModelConfig& cfg, std::span<const int64_t> ratios, int t, int64_t pos,
                int32_t token, StepInputs* in);

// Device addresses of the fields of a StepInputs in device memory.
class DevStepInputs {
 public:
  explicit DevStepInputs(const cuda::DeviceBuffer& b) : base_(b.as<const char>()) {}
  const int32_t* pos() const { return Int(offsetof(StepInputs, pos)); }
  const int32_t* tokens() const { return Int(offsetof(StepInputs, token)); }
  const int32_t* ring_row(int t) const { return Int(Row(t) + offsetof(RowScalars, ring_row)); }
  const int32_t* window(int t) const { return Int(Row(t) + offsetof(RowScalars, win_start)); }
  const int32_t* nwin(int t) const { return Int(Row(t) + offsetof(RowScalars, nwin)); }
  const cuda::CompressorStep* comp(int t, int i) const {
    return At<cuda::CompressorStep>(Ratio(t, i) + offsetof(RatioScalars, comp));
  }
  const int32_t* visible(int t, int i) const {
    return InRatio(t, i, offsetof(RatioScalars, visible));
  }
  const int32_t* entries(int t, int i) const {
    return InRatio(t, i, offsetof(RatioScalars, entries));
  }
  const int32_t* keys(int t, int i) const { return InRatio(t, i, offsetof(RatioScalars, keys)); }

 private:
  static size_t Row(int t) { return offsetof(StepInputs, row) + t * sizeof(RowScalars); }
  static size_t Ratio(int t, int i) {
    return Row(t) + offsetof(RowScalars, ratio) + i * sizeof(RatioScalars);
  }
  template <class T>
  const T* At(size_t offset) const { return reinterpret_cast<const T*>(base_ + offset); }
  const int32_t* Int(size_t offset) const { return At<int32_t>(offset); }
  const int32_t* InRatio(int t, int i, size_t off) const { return Int(Ratio(t, i) + off); }
  const char* base_;
};

}  // namespace fm
