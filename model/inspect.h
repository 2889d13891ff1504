// inspect: what a checkpoint directory holds and what decoding with it costs (bytes read per
// token, KV-cache bytes per layer kind). Works on any official-layout checkpoint: the figures
// come from the dtypes the files actually use.
#pragma once
#include <cstdint>
#include <map>
#include <string>
#include <vector>

#include "common/status.h"
#include "model/config.h"

namespace fm {

struct InspectReport {
  ModelConfig cfg;
  std::string dir;
  uint64_t file_bytes = 0;     // sum of the shard file sizes
  uint64_t tensors = 0;
  uint64_t params = 0;         // weight elements (an FP4 byte holds 2; scales are not params)
  struct DTypeTotal {
    uint64_t tensors = 0, params = 0, bytes = 0;
  };
  std::map<std::string, DTypeTotal> by_dtype;  // safetensors dtype name -> totals

  struct Layer {
    int64_t index = 0;          // main layers, then MTP layers
    std::string kind;           // LayerKindName
    int64_t ratio = 0;
    bool hash = false, mtp = false;
    uint64_t dense_bytes = 0;   // everything but routed experts (shared expert included)
    uint64_t shared_bytes = 0;  // the shared expert
    uint64_t expert_bytes = 0;  // one routed expert (they are all the same size)
  };
  std::vector<Layer> layers;

  // Bytes read to decode one token (main model, MTP not used).
  uint64_t embed_row_bytes = 0;   // one row of embed.weight
  uint64_t dense_bytes = 0;       // attention, hc, norms, router of every main layer
  uint64_t shared_bytes = 0;      // the shared experts
  uint64_t routed_bytes = 0;      // top-k routed experts of every main layer
  uint64_t head_bytes = 0;        // norm, hc_head_*, head.weight
  uint64_t bytes_per_token() const { return unrouted_bytes_per_token() + routed_bytes; }
  // All but the routed experts: what a step reads whichever experts its rows pick.
  uint64_t unrouted_bytes_per_token() const {
    return embed_row_bytes + dense_bytes + shared_bytes + head_bytes;
  }

  // f32 KV cache of one layer of each kind (ratio): a fixed part per sequence, the
  // sliding-window ring and a compressed layer's pending rows (KvBytesPerSequence at context 0),
  // and entries per token (head_dim*4/ratio, + index_head_dim*4/4 on ratio 4).
  std::map<int64_t, double> kv_bytes_per_seq;   // ratio -> fixed bytes of one such layer
  std::map<int64_t, double> kv_bytes_per_token; // ratio -> bytes per token of one such layer
  std::map<int64_t, int64_t> layers_by_ratio;   // ratio -> count of main layers
};

// Opens dir with the full selection (so every tensor is validated) and computes the report.
Result<InspectReport> InspectCheckpoint(const std::string& dir);
std::string FormatInspectReport(const InspectReport& r);

}  // namespace fm
