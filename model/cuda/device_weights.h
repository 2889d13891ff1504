// The device copy of a shard's layers (model/cuda/shard_model.h): each bound LayerWeights
// (model/layer.h) uploaded once in its checkpoint formats, plus the per-expert pointer arrays
// ExpertsUpGate and ExpertsDown read. Plain C++ over kernels/cuda.
#pragma once
#include <cstdint>
#include <memory>
#include <vector>

#include "common/status.h"
#include "kernels/cuda/device.h"
#include "kernels/cuda/ops.h"
#include "model/layer.h"

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
  std::vector<cuda::DeviceWeight> weights;
  cuda::DeviceBuffer datas, scales;  // [E] device pointers
};

struct DevLayer {
  int64_t layer = 0, ratio = 0;
  DevHc hc_attn, hc_ffn;
  cuda::DeviceBuffer attn_norm, ffn_norm;
  // attention
  cuda::DeviceWeight wq_a, wq_b, wkv, wo_a, wo_b;
  cuda::DeviceBuffer q_norm, kv_norm, sink, freq;
  DevCompressor comp, index_comp;
  cuda::DeviceWeight index_wq_b, index_proj;
  // MoE
  bool hash = false;
  cuda::DeviceWeight gate;
  cuda::DeviceBuffer bias, tid2eid;
  DevExpertSet w1, w2, w3;
  cuda::DeviceWeight s1, s2, s3;  // the shared expert
  bool all_experts = true;  // every routed expert is in this shard's selection
};

// Every tensor of one bound layer; routed experts only when all are in the selection.
Result<std::unique_ptr<DevLayer>> UploadLayer(const LayerWeights& w);

}  // namespace fm
