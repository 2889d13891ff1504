// ModelConfig: config.json of the official DeepSeek-V4-Flash checkpoint (MODEL.md "Real model").
#pragma once
#include <cstdint>
#include <string>
#include <vector>

#include "common/status.h"

namespace fm {

struct RopeScaling {        // rope_scaling {type yarn, factor, beta_fast, beta_slow, original_max...}
  std::string type = "yarn";
  double factor = 16.0;
  double beta_fast = 32.0;
  double beta_slow = 1.0;
  int64_t original_max_position_embeddings = 65536;
};

struct ModelConfig {
  int64_t vocab_size = 0;
  int64_t hidden_size = 0;            // H
  int64_t num_hidden_layers = 0;      // L (main layers; MTP layers extra)
  int64_t num_attention_heads = 0;    // nH
  int64_t num_key_value_heads = 1;
  int64_t head_dim = 0;               // D
  int64_t qk_rope_head_dim = 0;       // rd
  int64_t q_lora_rank = 0;
  int64_t o_lora_rank = 0;
  int64_t o_groups = 0;               // G
  int64_t n_routed_experts = 0;       // E
  int64_t n_shared_experts = 1;
  int64_t num_experts_per_tok = 0;    // top-k
  int64_t moe_intermediate_size = 0;  // I
  double routed_scaling_factor = 1.0;
  std::string scoring_func = "sqrtsoftplus";
  std::string topk_method = "noaux_tc";
  bool norm_topk_prob = true;
  double swiglu_limit = 0.0;
  int64_t sliding_window = 0;         // W
  int64_t num_hash_layers = 0;
  int64_t hc_mult = 4;                // n
  int64_t hc_sinkhorn_iters = 20;
  double hc_eps = 1e-6;
  int64_t index_n_heads = 0;          // nI
  int64_t index_head_dim = 0;         // dI
  int64_t index_topk = 0;
  double rope_theta = 10000.0;
  double compress_rope_theta = 160000.0;
  RopeScaling rope_scaling;
  double rms_norm_eps = 1e-6;
  int64_t num_nextn_predict_layers = 0;
  int64_t max_position_embeddings = 0;   // optional in the file; 0 = unknown
  std::vector<int64_t> compress_ratios;  // L + num_nextn_predict_layers entries
  // quantization_config
  std::string quant_method = "fp8";
  std::string quant_fmt = "e4m3";
  std::string quant_scale_fmt = "ue8m0";
  std::vector<int64_t> weight_block_size = {128, 128};
  std::string expert_dtype = "fp4";

  int64_t compress_ratio(int64_t layer) const { return compress_ratios.at(layer); }
  bool is_hash_layer(int64_t layer) const { return layer < num_hash_layers; }
};

// Parses and validates config.json; errors name the file and the field.
Result<ModelConfig> LoadModelConfig(const std::string& path);
Result<ModelConfig> ParseModelConfig(const std::string& json_text, const std::string& origin);

// Decode-state bytes of one sequence at `context` tokens in `layer` (main or MTP index), f32:
// the window ring, compressed entries, indexer entries (ratio 4) and pending compressor rows.
// What the planner sizes memory by and a worker's KV budget charges a sequence at its start.
uint64_t KvBytesPerSequence(const ModelConfig& model, int64_t layer, int64_t context);

}  // namespace fm
