// mkmodel: random but well-scaled checkpoints in exactly the official layout (config.json,
// model.safetensors.index.json, >= 2 shards, FP8/FP4 weights with their scales, tokenizer.json),
// deterministic for a given seed. Writing streams tensor by tensor (bench is 1-3 GB).
#pragma once
#include <cstdint>
#include <string>
#include <vector>

#include "common/status.h"
#include "model/config.h"

namespace fm {

// "tiny" (< 1 MB, unit tests), "small" (< 50 MB, integration tests), "bench" (1-3 GB).
std::vector<std::string> MkmodelPresets();
Result<ModelConfig> PresetConfig(const std::string& preset);

// config.json text with the official field names; ParseModelConfig(ConfigJson(c)) == c.
std::string ConfigJson(const ModelConfig& cfg);

struct MkmodelOptions {
  uint64_t seed = 0;
  int num_shards = 2;       // >= 2, as the official checkpoint is sharded
  bool tokenizer = true;    // also write tokenizer.json + tokenizer_config.json
  int threads = 0;          // generation threads (0 = all cores); output does not depend on it
  // Write the F32 small tensors (hc_*, attn_sink, ape, gate.bias) as BF16, a dtype other
  // tools use and the loader converts; the tiny preset does, to stay under 1 MB.
  bool bf16_small_tensors = false;
};

// Writes the checkpoint of `cfg` into dir (created if missing).
Status WriteRandomCheckpoint(const std::string& dir, const ModelConfig& cfg,
                             const MkmodelOptions& opt);
// Preset shortcut: the shard count grows with the preset's size; tiny uses bf16_small_tensors.
Status WritePresetCheckpoint(const std::string& dir, const std::string& preset, uint64_t seed);

// The quantizers mkmodel uses (fast, table based); equal to F32ToE4m3 / F32ToFp4 of
// common/numfmt.h for every finite input (tested).
uint8_t QuantizeE4m3(float x);
uint8_t QuantizeFp4(float x);

}  // namespace fm
