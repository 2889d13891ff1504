#include "model/config.h"

#include <algorithm>
#include <cmath>
#include <fstream>
#include <nlohmann/json.hpp>
#include <sstream>

#include "common/file.h"

namespace fm {
namespace {

using json = nlohmann::json;

// Field readers: each names the file and the field in its error.
class Fields {
 public:
  Fields(const json& j, std::string origin) : j_(j), origin_(std::move(origin)) {}

  Status Int(const char* key, int64_t* out, bool required = true) {
    auto it = j_.find(key);
    if (it == j_.end() || it->is_null()) return Missing(key, required);
    if (!it->is_number_integer()) return Mistyped(key, "an integer", *it);
    *out = it->get<int64_t>();
    return Status::Ok();
  }
  Status Double(const char* key, double* out, bool required = true) {
    auto it = j_.find(key);
    if (it == j_.end() || it->is_null()) return Missing(key, required);
    if (!it->is_number()) return Mistyped(key, "a number", *it);
    *out = it->get<double>();
    return Status::Ok();
  }
  Status Bool(const char* key, bool* out, bool required = true) {
    auto it = j_.find(key);
    if (it == j_.end() || it->is_null()) return Missing(key, required);
    if (!it->is_boolean()) return Mistyped(key, "a boolean", *it);
    *out = it->get<bool>();
    return Status::Ok();
  }
  Status String(const char* key, std::string* out, bool required = true) {
    auto it = j_.find(key);
    if (it == j_.end() || it->is_null()) return Missing(key, required);
    if (!it->is_string()) return Mistyped(key, "a string", *it);
    *out = it->get<std::string>();
    return Status::Ok();
  }
  Status IntList(const char* key, std::vector<int64_t>* out, bool required = true) {
    auto it = j_.find(key);
    if (it == j_.end() || it->is_null()) return Missing(key, required);
    if (!it->is_array()) return Mistyped(key, "an array of integers", *it);
    std::vector<int64_t> v;
    for (size_t i = 0; i < it->size(); ++i) {
      if (!(*it)[i].is_number_integer())
        return InvalidArgument(origin_ + ": field '" + prefix_ + key + "[" + std::to_string(i) +
                               "]' must be an integer, got " + (*it)[i].dump());
      v.push_back((*it)[i].get<int64_t>());
    }
    *out = std::move(v);
    return Status::Ok();
  }
  // Descends into an object field; returns null when it is absent and not required.
  Result<const json*> Object(const char* key, bool required) {
    auto it = j_.find(key);
    if (it == j_.end() || it->is_null()) {
      Status s = Missing(key, required);
      if (!s.ok()) return s;
      return static_cast<const json*>(nullptr);
    }
    if (!it->is_object()) return Mistyped(key, "an object", *it);
    return &*it;
  }
  void set_prefix(std::string p) { prefix_ = std::move(p); }
  Status Error(const std::string& key, const std::string& what) const {
    return InvalidArgument(origin_ + ": field '" + prefix_ + key + "' " + what);
  }

 private:
  Status Missing(const char* key, bool required) const {
    if (!required) return Status::Ok();
    return InvalidArgument(origin_ + ": missing required field '" + prefix_ + key + "'");
  }
  Status Mistyped(const char* key, const char* want, const json& got) const {
    std::string g = got.dump();
    if (g.size() > 40) g = g.substr(0, 40) + "...";
    return InvalidArgument(origin_ + ": field '" + prefix_ + key + "' must be " + want +
                           ", got " + g);
  }
  const json& j_;
  std::string origin_;
  std::string prefix_;
};

// A count in [1, max]. The bounds are far above any model of this architecture (DeepSeek-V4-
// Flash's values are a fraction of each) and keep a wrong value an error naming the field: the
// loader lists layers x experts tensors, caches size by the window, steps loop the Sinkhorn.
Status InRange(Fields& f, const char* key, int64_t v, int64_t max) {
  if (v > 0 && v <= max) return Status::Ok();
  return f.Error(key, "must be in [1, " + std::to_string(max) + "], got " + std::to_string(v));
}

// A finite real in (lo, hi] (lo_open) or [lo, hi].
Status RealInRange(Fields& f, const std::string& key, double v, double lo, double hi, bool lo_open) {
  if (std::isfinite(v) && (lo_open ? v > lo : v >= lo) && v <= hi) return Status::Ok();
  std::ostringstream what;
  what << "must be finite and in " << (lo_open ? "(" : "[") << lo << ", " << hi << "], got " << v;
  return f.Error(key, what.str());
}

}  // namespace

Result<ModelConfig> ParseModelConfig(const std::string& text, const std::string& origin) {
  json j;
  try {
    j = json::parse(text);
  } catch (const json::parse_error& e) {
    // e.byte: 1-based offset of the character where parsing stopped; name its line:column.
    const size_t at = std::min<size_t>(e.byte > 0 ? e.byte - 1 : 0, text.size());
    size_t line = 1, column = 1;
    for (size_t i = 0; i < at; ++i) {
      if (text[i] == '\n') {
        ++line;
        column = 1;
      } else {
        ++column;
      }
    }
    return InvalidArgument(origin + ":" + std::to_string(line) + ":" + std::to_string(column) +
                           ": not valid JSON");
  } catch (const json::exception& e) {   // out_of_range: a number beyond a double (1e400)
    return InvalidArgument(origin + ": not valid JSON (" + e.what() + ")");
  }
  if (!j.is_object()) return InvalidArgument(origin + ": top level must be a JSON object");
  ModelConfig c;
  Fields f(j, origin);
  FM_RETURN_IF_ERROR(f.Int("vocab_size", &c.vocab_size));
  FM_RETURN_IF_ERROR(f.Int("hidden_size", &c.hidden_size));
  FM_RETURN_IF_ERROR(f.Int("num_hidden_layers", &c.num_hidden_layers));
  FM_RETURN_IF_ERROR(f.Int("num_attention_heads", &c.num_attention_heads));
  FM_RETURN_IF_ERROR(f.Int("num_key_value_heads", &c.num_key_value_heads));
  FM_RETURN_IF_ERROR(f.Int("head_dim", &c.head_dim));
  FM_RETURN_IF_ERROR(f.Int("qk_rope_head_dim", &c.qk_rope_head_dim));
  FM_RETURN_IF_ERROR(f.Int("q_lora_rank", &c.q_lora_rank));
  FM_RETURN_IF_ERROR(f.Int("o_lora_rank", &c.o_lora_rank));
  FM_RETURN_IF_ERROR(f.Int("o_groups", &c.o_groups));
  FM_RETURN_IF_ERROR(f.Int("n_routed_experts", &c.n_routed_experts));
  FM_RETURN_IF_ERROR(f.Int("n_shared_experts", &c.n_shared_experts));
  FM_RETURN_IF_ERROR(f.Int("num_experts_per_tok", &c.num_experts_per_tok));
  FM_RETURN_IF_ERROR(f.Int("moe_intermediate_size", &c.moe_intermediate_size));
  FM_RETURN_IF_ERROR(f.Double("routed_scaling_factor", &c.routed_scaling_factor));
  FM_RETURN_IF_ERROR(f.String("scoring_func", &c.scoring_func));
  FM_RETURN_IF_ERROR(f.String("topk_method", &c.topk_method));
  FM_RETURN_IF_ERROR(f.Bool("norm_topk_prob", &c.norm_topk_prob));
  FM_RETURN_IF_ERROR(f.Double("swiglu_limit", &c.swiglu_limit));
  FM_RETURN_IF_ERROR(f.Int("sliding_window", &c.sliding_window));
  FM_RETURN_IF_ERROR(f.Int("num_hash_layers", &c.num_hash_layers));
  FM_RETURN_IF_ERROR(f.Int("hc_mult", &c.hc_mult));
  FM_RETURN_IF_ERROR(f.Int("hc_sinkhorn_iters", &c.hc_sinkhorn_iters));
  FM_RETURN_IF_ERROR(f.Double("hc_eps", &c.hc_eps));
  FM_RETURN_IF_ERROR(f.Int("index_n_heads", &c.index_n_heads));
  FM_RETURN_IF_ERROR(f.Int("index_head_dim", &c.index_head_dim));
  FM_RETURN_IF_ERROR(f.Int("index_topk", &c.index_topk));
  FM_RETURN_IF_ERROR(f.Double("rope_theta", &c.rope_theta));
  FM_RETURN_IF_ERROR(f.Double("compress_rope_theta", &c.compress_rope_theta));
  FM_RETURN_IF_ERROR(f.Double("rms_norm_eps", &c.rms_norm_eps));
  FM_RETURN_IF_ERROR(f.Int("num_nextn_predict_layers", &c.num_nextn_predict_layers));
  FM_RETURN_IF_ERROR(f.Int("max_position_embeddings", &c.max_position_embeddings, false));
  FM_RETURN_IF_ERROR(f.IntList("compress_ratios", &c.compress_ratios));

  FM_ASSIGN_OR_RETURN(const json* rs, f.Object("rope_scaling", true));
  {
    Fields r(*rs, origin);
    r.set_prefix("rope_scaling.");
    std::string type;
    if (rs->contains("type")) FM_RETURN_IF_ERROR(r.String("type", &type));
    else FM_RETURN_IF_ERROR(r.String("rope_type", &type));
    if (type != "yarn") return r.Error("type", "must be \"yarn\", got \"" + type + "\"");
    c.rope_scaling.type = type;
    FM_RETURN_IF_ERROR(r.Double("factor", &c.rope_scaling.factor));
    FM_RETURN_IF_ERROR(r.Double("beta_fast", &c.rope_scaling.beta_fast, false));
    FM_RETURN_IF_ERROR(r.Double("beta_slow", &c.rope_scaling.beta_slow, false));
    FM_RETURN_IF_ERROR(r.Int("original_max_position_embeddings",
                             &c.rope_scaling.original_max_position_embeddings));
  }
  FM_ASSIGN_OR_RETURN(const json* qc, f.Object("quantization_config", false));
  if (qc) {
    Fields q(*qc, origin);
    q.set_prefix("quantization_config.");
    FM_RETURN_IF_ERROR(q.String("quant_method", &c.quant_method, false));
    FM_RETURN_IF_ERROR(q.String("fmt", &c.quant_fmt, false));
    FM_RETURN_IF_ERROR(q.String("scale_fmt", &c.quant_scale_fmt, false));
    FM_RETURN_IF_ERROR(q.IntList("weight_block_size", &c.weight_block_size, false));
    if (c.weight_block_size != std::vector<int64_t>{128, 128})
      return q.Error("weight_block_size", "must be [128, 128]");
  }
  FM_RETURN_IF_ERROR(f.String("expert_dtype", &c.expert_dtype, false));

  // Semantic checks: every one names the field.
  struct { const char* k; int64_t v, max; } counts[] = {
      {"vocab_size", c.vocab_size, 1 << 22}, {"hidden_size", c.hidden_size, 1 << 16},
      {"num_hidden_layers", c.num_hidden_layers, 256},
      {"num_attention_heads", c.num_attention_heads, 1024}, {"head_dim", c.head_dim, 1024},
      {"qk_rope_head_dim", c.qk_rope_head_dim, 1024}, {"q_lora_rank", c.q_lora_rank, 1 << 16},
      {"o_lora_rank", c.o_lora_rank, 1 << 16}, {"o_groups", c.o_groups, 1024},
      {"n_routed_experts", c.n_routed_experts, 1024},
      {"num_experts_per_tok", c.num_experts_per_tok, 1024},
      {"moe_intermediate_size", c.moe_intermediate_size, 1 << 16},
      {"sliding_window", c.sliding_window, 8192}, {"hc_mult", c.hc_mult, 16},
      {"hc_sinkhorn_iters", c.hc_sinkhorn_iters, 1000}, {"index_n_heads", c.index_n_heads, 1024},
      {"index_head_dim", c.index_head_dim, 1024}, {"index_topk", c.index_topk, 1 << 20}};
  for (auto& n : counts) FM_RETURN_IF_ERROR(InRange(f, n.k, n.v, n.max));
  // Reals: NaN, 0 or a huge value here loads fine and gives NaN or garbage logits at the first
  // request, naming nothing.
  FM_RETURN_IF_ERROR(RealInRange(f, "rms_norm_eps", c.rms_norm_eps, 0, 1, true));
  FM_RETURN_IF_ERROR(RealInRange(f, "hc_eps", c.hc_eps, 0, 1, true));
  FM_RETURN_IF_ERROR(RealInRange(f, "rope_theta", c.rope_theta, 0, 1e12, true));
  FM_RETURN_IF_ERROR(RealInRange(f, "compress_rope_theta", c.compress_rope_theta, 0, 1e12, true));
  FM_RETURN_IF_ERROR(RealInRange(f, "routed_scaling_factor", c.routed_scaling_factor, 0, 1e6, true));
  FM_RETURN_IF_ERROR(RealInRange(f, "swiglu_limit", c.swiglu_limit, 0, 1e6, false));
  FM_RETURN_IF_ERROR(RealInRange(f, "rope_scaling.factor", c.rope_scaling.factor, 1, 1e6, false));
  FM_RETURN_IF_ERROR(RealInRange(f, "rope_scaling.beta_fast", c.rope_scaling.beta_fast, 0, 1e6, true));
  FM_RETURN_IF_ERROR(RealInRange(f, "rope_scaling.beta_slow", c.rope_scaling.beta_slow, 0, 1e6, true));
  FM_RETURN_IF_ERROR(InRange(f, "rope_scaling.original_max_position_embeddings",
                             c.rope_scaling.original_max_position_embeddings, 1 << 30));
  if (c.max_position_embeddings != 0)
    FM_RETURN_IF_ERROR(InRange(f, "max_position_embeddings", c.max_position_embeddings, 1 << 30));
  if (c.num_key_value_heads != 1)
    return f.Error("num_key_value_heads", "must be 1 (one shared KV head)");
  if (c.qk_rope_head_dim % 2 != 0 || c.qk_rope_head_dim > c.head_dim)
    return f.Error("qk_rope_head_dim", "must be even and <= head_dim");
  if (c.qk_rope_head_dim > c.index_head_dim)
    return f.Error("qk_rope_head_dim", "must be <= index_head_dim");
  if (c.num_attention_heads % c.o_groups != 0)
    return f.Error("o_groups", "must divide num_attention_heads");
  if (c.num_experts_per_tok > c.n_routed_experts)
    return f.Error("num_experts_per_tok", "must be <= n_routed_experts");
  if (c.num_hash_layers < 0 || c.num_hash_layers > c.num_hidden_layers)
    return f.Error("num_hash_layers", "must be in [0, num_hidden_layers]");
  // The official checkpoint has 1; a bound keeps a wrong value an error, not terabytes of
  // compress_ratios padding (bad_alloc).
  if (c.num_nextn_predict_layers < 0 || c.num_nextn_predict_layers > 64)
    return f.Error("num_nextn_predict_layers", "must be in [0, 64]");
  if (c.scoring_func != "sqrtsoftplus")
    return f.Error("scoring_func", "must be \"sqrtsoftplus\", got \"" + c.scoring_func + "\"");
  const size_t want = static_cast<size_t>(c.num_hidden_layers + c.num_nextn_predict_layers);
  if (c.compress_ratios.size() != want && c.compress_ratios.size() != static_cast<size_t>(c.num_hidden_layers))
    return f.Error("compress_ratios", "has " + std::to_string(c.compress_ratios.size()) +
                                          " entries, want num_hidden_layers + "
                                          "num_nextn_predict_layers = " + std::to_string(want));
  while (c.compress_ratios.size() < want) c.compress_ratios.push_back(0);  // MTP: window only
  for (size_t i = 0; i < c.compress_ratios.size(); ++i)
    if (c.compress_ratios[i] < 0 || c.compress_ratios[i] == 1)
      return f.Error("compress_ratios[" + std::to_string(i) + "]",
                     "must be 0 or >= 2, got " + std::to_string(c.compress_ratios[i]));
  return c;
}

Result<ModelConfig> LoadModelConfig(const std::string& path) {
  FM_ASSIGN_OR_RETURN(const std::string text, ReadSmallFile(path, 16u << 20));
  return ParseModelConfig(text, path);
}

uint64_t KvBytesPerSequence(const ModelConfig& m, int64_t layer, int64_t context) {
  const uint64_t D = m.head_dim, dI = m.index_head_dim, f = sizeof(float);
  const uint64_t ctx = static_cast<uint64_t>(std::max<int64_t>(context, 0));
  uint64_t bytes = std::min<uint64_t>(ctx, m.sliding_window) * D * f;  // raw kv ring
  const int64_t r = layer < static_cast<int64_t>(m.compress_ratios.size())
                        ? m.compress_ratios[layer] : 0;
  if (r <= 0) return bytes;
  const uint64_t ratio = static_cast<uint64_t>(r);
  const uint64_t c = ratio == 4 ? 2 : 1;          // overlapping windows: 2d-wide projections
  const uint64_t pending_windows = ratio == 4 ? 2 : 1;  // ratio 4 keeps the previous window too
  bytes += ctx / ratio * D * f;                                   // compressed entries
  bytes += pending_windows * ratio * 2 * c * D * f;               // pending (a, z) rows
  if (ratio == 4) {
    bytes += ctx / ratio * dI * f;                                // indexer entries
    bytes += pending_windows * ratio * 2 * c * dI * f;            // indexer pending rows
  }
  return bytes;
}

}  // namespace fm
