// The expected tensor list of a config (MODEL.md "Checkpoint layout"): names, shapes, accepted
// dtypes, and which layer / expert each belongs to. The one place used by the loader's
// validation, mkmodel, inspect, and the planner's byte math (works for the real model's sizes
// from config.json alone).
#pragma once
#include <cstdint>
#include <string>
#include <vector>

#include "common/tensor.h"
#include "model/checkpoint.h"
#include "model/config.h"

namespace fm {

enum class TensorGroup { kEmbed, kHead, kLayer, kMtp };

// How mkmodel fills a tensor and what it is to the kernels.
enum class TensorRole {
  kMatrix,     // BF16/F32 matvec weight [out, in]
  kFp8Weight,  // F8_E4M3 [out, in], scale is the next spec
  kFp8Scale,   // F8_E8M0 [ceil(out/128), ceil(in/128)]
  kFp4Weight,  // I8 packed [out, in/2], scale is the next spec
  kFp4Scale,   // F8_E8M0 [out, in/32]
  kNorm,       // RMSNorm gain [n]
  kEmbedding,  // embed.weight
  kHcFn,       // hc_*_fn mixing weights
  kHcBase,     // hc_*_base
  kHcScale,    // hc_*_scale
  kSink,       // attn_sink
  kApe,        // compressor ape
  kBias,       // gate.bias
  kTid2eid,    // hash routing table [V, topk]
};

struct TensorSpec {
  std::string name;
  std::vector<int64_t> shape;
  std::vector<DType> dtypes;  // accepted; dtypes[0] is what the official checkpoint uses
  TensorGroup group = TensorGroup::kLayer;
  TensorRole role = TensorRole::kMatrix;
  int64_t layer = -1;   // main layer N, or num_hidden_layers + K for mtp.K; -1 for embed/head
  int64_t expert = -1;  // routed expert index; -1 for everything else
  // Bytes with the official dtype.
  uint64_t bytes() const;
};

// Every tensor of the checkpoint described by cfg, in a stable order (embed, layers, head,
// mtp; a quantized weight is followed by its scale).
std::vector<TensorSpec> ExpectedTensors(const ModelConfig& cfg);

// The layer-kind of layer `layer` (main layers and MTP layers) as inspect prints it.
std::string LayerKindName(const ModelConfig& cfg, int64_t layer);

// Whether a tensor belongs to a shard selection (layer_end already resolved, experts sorted).
bool InSelection(const TensorSpec& spec, const ShardSelection& sel, const ModelConfig& cfg);

// Byte totals with the official dtypes, from config.json alone.
struct ModelBytes {
  uint64_t embed = 0;                 // embed.weight
  uint64_t head = 0;                  // norm, head, hc_head_*
  std::vector<uint64_t> layer_dense;  // per layer (main then MTP): everything but routed experts
  std::vector<uint64_t> expert;       // per layer: one routed expert (w1+w2+w3 and scales)
  uint64_t total = 0;
  uint64_t layer_total(int64_t layer, int64_t n_experts) const {
    return layer_dense.at(layer) + expert.at(layer) * static_cast<uint64_t>(n_experts);
  }
};
ModelBytes ComputeModelBytes(const ModelConfig& cfg);

}  // namespace fm
