// mkmodel (the test fixtures library, fm_model_fixtures; no daemon links it): random but well-scaled checkpoints in exactly the official layout (config.json,
// model.safetensors.index.json, >= 2 shards, FP8/FP4 weights with their scales, tokenizer.json),
// deterministic for a given seed. Writing streams tensor by tensor, the large float tensors in
// row chunks (flash's embed and head are 1 GB each), so memory stays far below the model's size.
#pragma once
#include <cstdint>
#include <string>
#include <vector>

#include "common/status.h"
#include "model/config.h"

namespace fm {

// "tiny" (< 1 MB, unit tests), "small" (< 50 MB, integration tests), "bench" (1-3 GB),
// "flash": DeepSeek-V4-Flash's own config (configs/models/deepseek-v4-flash/config.json) cut to
// its first `layers` layers (1 .. kFlashLayers; compress_ratios and hash layers as the real
// model's first layers, its MTP block kept): per-layer costs of the real shapes on any device.
// Files: 3.6 GB a layer (256 FP4 experts), 3.6 GB the MTP block, 2.1 GB embed + head.
// `layers` is for flash only (0 = the preset's own count for the others).
std::vector<std::string> MkmodelPresets();
constexpr int64_t kFlashLayers = 43;  // the real model's num_hidden_layers
Result<ModelConfig> PresetConfig(const std::string& preset, int64_t layers = 0);

// The model whose first layers a checkpoint of config `cfg` holds: the real DeepSeek-V4-Flash
// (PresetConfig("flash", kFlashLayers)) when cfg is its geometry with fewer or all layers (the
// flash preset, or the real checkpoint), else cfg itself.
ModelConfig FullModelConfig(const ModelConfig& cfg);

// Bytes one decode step reads with the official dtypes, from the config alone: one embedding
// row, every main layer's dense tensors and top-k routed experts, the head. What `inspect`
// reports for a checkpoint in the official dtypes (every preset but tiny).
uint64_t DecodeBytesPerToken(const ModelConfig& cfg);

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
Status WritePresetCheckpoint(const std::string& dir, const std::string& preset, uint64_t seed,
                             int64_t layers = 0);

// Writes dir/tokenizer.json + dir/tokenizer_config.json: a byte-level BPE with DeepSeek-V3/V4's
// pre-tokenizer structure, the 256 byte tokens, merges learned from a built-in English text,
// and the special tokens <｜begin▁of▁sentence｜> (id 0), <｜end▁of▁sentence｜> (1), <｜User｜>,
// <｜Assistant｜>, padded with reserved added tokens to exactly vocab_size ids (>= 300).
Status WriteTestTokenizer(const std::string& dir, int64_t vocab_size);

// The quantizers mkmodel uses (fast, table based); equal to F32ToE4m3 / F32ToFp4 of
// common/numfmt.h for every finite input (tested).
uint8_t QuantizeE4m3(float x);
uint8_t QuantizeFp4(float x);

}  // namespace fm
