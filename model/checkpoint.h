// Checkpoint: an official-layout DeepSeek-V4 checkpoint directory (config.json,
// model.safetensors.index.json, *.safetensors shards, tokenizer.json), read-only.
// Only the tensors of the selected shard (layer range, expert subset, embed/head/MTP) are
// read; weights stay quantized (QWeight views straight into the loaded bytes).
#pragma once
#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "common/status.h"
#include "common/tensor.h"
#include "model/config.h"
#include "model/safetensors.h"

namespace fm {

// Whether a worker's shard loads the MTP block (mtp.*): not while MTP speculative decoding is
// not served. The planner counts a last stage's bytes by it too.
inline constexpr bool kServeMtp = false;

// Which part of the model a process loads. Default: everything.
struct ShardSelection {
  int64_t layer_begin = 0;
  int64_t layer_end = -1;          // exclusive; -1 = num_hidden_layers
  bool embed = true;               // embed.weight
  bool head = true;                // norm, head, hc_head_* (last stage)
  bool mtp = true;                 // mtp.* layers (last stage)
  std::vector<int64_t> experts;    // routed experts to load; empty = all
  // Tensor parallelism (model/tp.h): of the main layers' split tensors (wq_b, wo_a, wo_b, the
  // shared expert) only member tp_rank's rows are read into memory (kPrivate); the views keep
  // their full shapes and the other rows are never read by that member.
  int tp_rank = 0, tp_size = 1;
};

class Checkpoint {
 public:
  // Opens dir, parses config.json and the index, validates every selected tensor's presence,
  // dtype and shape against config.json (errors name the file and the tensor), and reads the
  // selected tensors into private memory (or, kMapped, maps the shards: shapes-only tools).
  static Result<std::unique_ptr<Checkpoint>> Open(const std::string& dir,
                                                  const ShardSelection& sel = {},
                                                  TensorBytes where = TensorBytes::kPrivate);
  virtual ~Checkpoint() = default;

  virtual const ModelConfig& config() const = 0;
  virtual const ShardSelection& selection() const = 0;
  virtual const std::string& dir() const = 0;

  virtual bool Has(const std::string& name) const = 0;
  // A view of one tensor of the selection; NotFound naming the tensor otherwise.
  virtual Result<TensorView> Get(const std::string& name) const = 0;
  // The matvec weight `prefix`.weight (+ `prefix`.scale for FP8/FP4); format from the dtypes:
  // F8_E4M3 + scale -> kFP8Block, I8/U8 packed + scale -> kFP4Block32, BF16, F32.
  virtual Result<QWeight> Weight(const std::string& prefix) const = 0;
  // Small tensors converted to f32 / int64 copies (norms, hc_*, sinks, ape, bias, tid2eid).
  virtual Result<std::vector<float>> GetF32(const std::string& name) const = 0;
  virtual Result<std::vector<int64_t>> GetI64(const std::string& name) const = 0;

  // Bytes of the selected tensors (what this shard keeps resident) and of the whole model.
  virtual size_t selected_bytes() const = 0;
  virtual size_t total_bytes() const = 0;
  // Names of every tensor of the selection, in ExpectedTensors (model/tensor_schema.h) order.
  virtual std::vector<std::string> tensor_names() const = 0;
  // Bytes of the mapped shard files resident in the page cache (mincore): with a cold cache,
  // this shows that only the selection was read. Only shards holding selected tensors are mapped.
  virtual size_t resident_bytes() const = 0;
  virtual size_t mapped_bytes() const = 0;
};

// The files of the checkpoint in `dir` that a shard's load reads, by name within dir:
// config.json, then model.safetensors.index.json and the shard files it names, or the single
// model.safetensors. Only files that exist are listed (Open names a missing one), or with
// `shards_that_exist_only` false every shard the index names; an index that does not parse
// lists no shard.
std::vector<std::string> CheckpointFiles(const std::string& dir, bool shards_that_exist_only = true);

}  // namespace fm
