// The device copy of a shard's layers (model/cuda/shard_model.h): each bound LayerWeights
// (model/layer.h) uploaded once in its checkpoint formats, plus the per-expert pointer arrays
// ExpertsUpGate and ExpertsDown read. Plain C++ over kernels/cuda.
#pragma once
#include <cstdint>
#include <limits>
#include <memory>
#include <vector>

#include "common/status.h"
#include "kernels/cuda/device.h"
#include "kernels/cuda/ops.h"
#include "model/layer.h"
#include "model/tp_split.h"

namespace fm {

Result<cuda::DeviceBuffer> UploadFloats(const std::vector<float>& v);
// Whether `weight_bytes` of a shard fit the `free` bytes of cuda:`device` (of `total`), before
// any upload: ResourceExhausted naming both in GiB otherwise (on a GB10 memory_gib above the
// ~121 GiB CUDA can allocate lets the planner place a shard the device cannot hold).
Status CheckShardFits(size_t weight_bytes, size_t free, size_t total, int device);
// max(n, 1) floats, uninitialized.
Result<cuda::DeviceBuffer> AllocFloats(int64_t n);

struct DevHc {  // hc_{attn,ffn,head}_{fn,base,scale}
  cuda::DeviceWeight fn;
  cuda::DeviceBuffer base;
  float head_scale = 0.0f;  // hc_head: scale[0], passed by value
  cuda::DeviceBuffer scale;       // hc_pre: scale[3]
};

// hc_* weights of hc_pre (HcPostPre: scale[3]) or of hc_head (scale[0] by value).
Result<DevHc> UploadHc(const HcWeights& w);

struct DevCompressor {
  int64_t ratio = 0, dim = 0;
  bool overlap = false;
  cuda::DeviceWeight wkv, wgate;
  cuda::DeviceBuffer ape, norm;
  int64_t width() const { return overlap ? 2 * dim : dim; }
};

// One expert projection over all E experts: the per-expert buffers and the device arrays of their
// pointers that ExpertsUpGate and ExpertsDown read.
struct DevExpertSet {
  WeightFormat format = WeightFormat::kF32;
  int64_t rows = 0, cols = 0;
  std::vector<cuda::DeviceWeight> weights;  // the uploaded experts, ascending
  std::vector<bool> present;               // [E]: expert e is uploaded
  cuda::DeviceBuffer datas, scales;        // [E] device pointers (null: not uploaded)
  cuda::DevExperts view() const {
    return cuda::DevExperts{format, rows, cols, static_cast<int64_t>(present.size()),
                            datas.as<const void* const>(), scales.as<const uint8_t* const>()};
  }
};

// The SwiGLU clamp the device expert launches take: swiglu_limit, or +inf when the model has none.
inline float DeviceSwigluLimit(const ModelConfig& cfg) {
  return cfg.swiglu_limit > 0 ? static_cast<float>(cfg.swiglu_limit)
                              : std::numeric_limits<float>::infinity();
}

// A tensor-parallel member's rows of a split weight (model/tp.h): `w` holds rows
// [row0, row0 + rows) of it at its own row `first` (an FP8 share is uploaded from the start of
// the 128-row scale block it begins in, so first may be > 0). Without tensor parallelism: the
// whole weight, first 0.
struct DevShare {
  cuda::DeviceWeight w;
  int64_t first = 0, rows = 0, whole_rows = 0;
  // The product of these rows as rows of the whole weight's product (the same bits), T rows of
  // x (stride xs) into y (stride ys, y[.., 0] = the share's first row).
  cuda::GemvTask Task(const float* x, int64_t xs, float* y, int64_t ys) const {
    return cuda::GemvTask{w.view(), x, xs, y, ys, first, rows, whole_rows};
  }
};

struct DevLayer {
  int64_t layer = 0, ratio = 0;
  DevHc hc_attn, hc_ffn;
  cuda::DeviceBuffer attn_norm, ffn_norm;
  // attention
  cuda::DeviceWeight wq_a, wkv;
  DevShare wq_b, wo_a, wo_b;  // tensor parallel: this member's heads, output groups, hidden rows
  cuda::DeviceBuffer q_norm, kv_norm, sink, freq;
  DevCompressor comp, index_comp;
  cuda::DeviceWeight index_wq_b, index_proj;
  // MoE
  bool hash = false;
  cuda::DeviceWeight gate;
  cuda::DeviceBuffer bias, tid2eid;
  DevExpertSet w1, w2, w3;  // a null pointer for an expert not uploaded
  DevShare s1, s2, s3;      // the shared expert (tensor parallel: its rows of I, I, H)
  bool all_experts = true;  // every routed expert is in this shard's selection
};

// Every tensor of one bound layer. Routed experts: the ones in the selection (all, or an
// expert-parallel or tensor-parallel member's). With tp_size > 1 only member tp_rank's rows of the split
// weights (model/tp_split.h), whose shapes must divide (CheckTensorParallel).
Result<std::unique_ptr<DevLayer>> UploadLayer(const ModelConfig& cfg, const LayerWeights& w,
                                              int tp_rank = 0, int tp_size = 1);

}  // namespace fm
