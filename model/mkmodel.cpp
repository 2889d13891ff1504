#include "model/mkmodel.h"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <functional>
#include <memory>
#include <nlohmann/json.hpp>

#include "common/log.h"
#include "common/numfmt.h"
#include "common/thread_pool.h"
#include "model/safetensors.h"
#include "model/tensor_schema.h"
#include "model/tokenizer.h"

namespace fm {
namespace {

using json = nlohmann::json;

// ---- deterministic random numbers (bit-identical on every platform: no libm) ------------

uint64_t SplitMix(uint64_t* state) {
  uint64_t z = (*state += 0x9e3779b97f4a7c15ull);
  z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
  z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
  return z ^ (z >> 31);
}

uint64_t HashName(const std::string& s, uint64_t seed) {
  uint64_t h = 0xcbf29ce484222325ull ^ seed;
  for (unsigned char c : s) h = (h ^ c) * 0x100000001b3ull;
  return h;
}

// ~N(0, 1) from 32 random bits: Irwin-Hall sum of four 8-bit uniforms, standardized
// (mean 4 * 255/2 = 510, std sqrt(4 * (256^2 - 1) / 12) = 147.80). Integer and exact float
// arithmetic only, so every platform produces the same bits.
inline float NormalFrom32(uint32_t r) {
  const uint32_t pairs = (r & 0x00ff00ffu) + ((r >> 8) & 0x00ff00ffu);
  const int sum = static_cast<int>((pairs & 0xffffu) + (pairs >> 16));
  return static_cast<float>(sum - 510) * (1.0f / 147.8017f);
}

struct Rng {
  uint64_t state;
  Rng(uint64_t tensor_seed, uint64_t stream)
      : state(tensor_seed ^ (stream * 0xd1342543de82ef95ull)) {
    SplitMix(&state);
  }
  float Normal() { return NormalFrom32(static_cast<uint32_t>(SplitMix(&state))); }
  // out[i] = scale * ~N(0, 1) for i < n, two values per 64 random bits.
  void NormalRow(float* out, int64_t n, float scale) {
    int64_t i = 0;
    for (; i + 1 < n; i += 2) {
      const uint64_t x = SplitMix(&state);
      out[i] = NormalFrom32(static_cast<uint32_t>(x)) * scale;
      out[i + 1] = NormalFrom32(static_cast<uint32_t>(x >> 32)) * scale;
    }
    if (i < n) out[i] = Normal() * scale;
  }
  uint64_t Below(uint64_t n) { return SplitMix(&state) % n; }
};

// ---- quantizers --------------------------------------------------------------------------

// Nearest e4m3 code of x (ties to even), saturating at +-448: float bit manipulation.
inline uint8_t E4m3Nearest(float x) {
  const uint8_t sign = std::signbit(x) ? 0x80 : 0;
  const float a = std::fabs(x);
  if (a >= 448.0f) return sign | 0x7E;
  if (a < 0.015625f) {  // below 2^-6: subnormal m * 2^-9, m rounded half to even
    const float m = (a * 512.0f + 8388608.0f) - 8388608.0f;
    return sign | static_cast<uint8_t>(m);  // m == 8 is the smallest normal, code 8
  }
  uint32_t u;
  std::memcpy(&u, &a, 4);
  u += 0x7FFFFu + ((u >> 20) & 1u);  // round the 23-bit mantissa to 3 bits, half to even
  return sign | static_cast<uint8_t>((u >> 20) - ((127u - 7u) << 3));
}

// Nearest e2m1 nibble; midpoints between {0, .5, 1, 1.5, 2, 3, 4, 6}, a tie to the lower.
inline uint8_t Fp4Nearest(float x) {
  const float a = std::fabs(x);
  const int m = (a > 0.25f) + (a > 0.75f) + (a > 1.25f) + (a > 1.75f) + (a > 2.5f) +
                (a > 3.5f) + (a > 5.0f);
  return static_cast<uint8_t>((std::signbit(x) ? 8 : 0) | m);
}

// Fills one tensor's bytes; rows of a tensor are generated in independent streams so that
// generation can be split across threads without changing a bit.
class TensorFiller {
 public:
  TensorFiller(const ModelConfig& cfg, uint64_t seed, ThreadPool* pool)
      : cfg_(cfg), seed_(seed), pool_(pool) {}

  // Appends the bytes of `s` to out; for a quantized weight, the bytes of its scale go to
  // *scale_out (its next spec). Float tensors go out in chunks of rows (at most kChunkBytes).
  Status Write(const TensorSpec& s, DType dt, SafetensorsWriter* out,
               std::vector<uint8_t>* scale_out);

 private:
  static constexpr size_t kChunkBytes = size_t{64} << 20;
  std::vector<uint8_t> Floats(const TensorSpec& s, DType dt, int64_t row_begin, int64_t row_end);
  std::vector<uint8_t> Tid2eid(const TensorSpec& s);
  void Fp8(const TensorSpec& s, std::vector<uint8_t>* w, std::vector<uint8_t>* scale);
  void Fp4(const TensorSpec& s, std::vector<uint8_t>* w, std::vector<uint8_t>* scale);
  void ForRows(int64_t rows, const std::function<void(int64_t)>& fn) {
    pool_->ParallelFor(static_cast<size_t>(rows), 1, [&](size_t a, size_t b) {
      for (size_t r = a; r < b; ++r) fn(static_cast<int64_t>(r));
    });
  }

  const ModelConfig& cfg_;
  uint64_t seed_;
  ThreadPool* pool_;
};

// Value of element i of a float tensor by role (well scaled: matvec outputs ~ N(0, 1)).
float SmallValue(TensorRole role, Rng& rng, int64_t in, int64_t i, const ModelConfig& c) {
  switch (role) {
    case TensorRole::kNorm: return 1.0f + 0.1f * rng.Normal();
    case TensorRole::kEmbedding: return rng.Normal();
    case TensorRole::kHcFn:
      return rng.Normal() * 0.02f / std::sqrt(static_cast<float>(c.hc_mult * c.hidden_size));
    case TensorRole::kHcBase: return rng.Normal();
    case TensorRole::kHcScale: return 1.0f + 0.25f * rng.Normal();
    case TensorRole::kSink: return rng.Normal();
    case TensorRole::kApe: return 0.5f * rng.Normal();
    case TensorRole::kBias: return 0.01f * rng.Normal();
    default: return rng.Normal() / std::sqrt(static_cast<float>(in));
  }
}

int64_t FloatRows(const TensorSpec& s) { return s.shape.size() == 2 ? s.shape[0] : 1; }
int64_t FloatCols(const TensorSpec& s) { return s.shape.size() == 2 ? s.shape[1] : s.shape.at(0); }

// Rows [row_begin, row_end) of a float tensor (a 1-D tensor is one row).
std::vector<uint8_t> TensorFiller::Floats(const TensorSpec& s, DType dt, int64_t row_begin,
                                          int64_t row_end) {
  const int64_t cols = FloatCols(s);
  const size_t es = DTypeSize(dt);
  std::vector<uint8_t> out(static_cast<size_t>((row_end - row_begin) * cols) * es);
  const uint64_t tseed = HashName(s.name, seed_);
  ForRows(row_end - row_begin, [&](int64_t i_row) {
    const int64_t r = row_begin + i_row;
    Rng rng(tseed, static_cast<uint64_t>(r));
    for (int64_t i = 0; i < cols; ++i) {
      const float v = SmallValue(s.role, rng, cols, i, cfg_);
      uint8_t* p = out.data() + static_cast<size_t>(i_row * cols + i) * es;
      if (dt == DType::kBF16) {
        const uint16_t b = F32ToBf16(v);
        std::memcpy(p, &b, 2);
      } else {
        std::memcpy(p, &v, 4);
      }
    }
  });
  return out;
}

// Each row: top-k distinct experts (partial Fisher-Yates over [0, E)).
std::vector<uint8_t> TensorFiller::Tid2eid(const TensorSpec& s) {
  const int64_t V = s.shape[0], k = s.shape[1], E = cfg_.n_routed_experts;
  std::vector<int64_t> ids(static_cast<size_t>(V * k));
  const uint64_t tseed = HashName(s.name, seed_);
  ForRows(V, [&](int64_t r) {
    Rng rng(tseed, static_cast<uint64_t>(r));
    std::vector<int64_t> perm(static_cast<size_t>(E));
    for (int64_t e = 0; e < E; ++e) perm[e] = e;
    for (int64_t j = 0; j < k; ++j) {
      const int64_t pick = j + static_cast<int64_t>(rng.Below(static_cast<uint64_t>(E - j)));
      std::swap(perm[j], perm[pick]);
      ids[static_cast<size_t>(r * k + j)] = perm[j];
    }
  });
  std::vector<uint8_t> out(ids.size() * 8);
  std::memcpy(out.data(), ids.data(), out.size());
  return out;
}

// W[out, in] ~ N(0, 1/in); 128x128 blocks share scale 2^ceil(log2(blockmax / 448)).
void TensorFiller::Fp8(const TensorSpec& s, std::vector<uint8_t>* w,
                       std::vector<uint8_t>* scale) {
  const int64_t rows = s.shape[0], cols = s.shape[1];
  const int64_t rb = (rows + 127) / 128, cb = (cols + 127) / 128;
  w->assign(static_cast<size_t>(rows * cols), 0);
  scale->assign(static_cast<size_t>(rb * cb), 0);
  const uint64_t tseed = HashName(s.name, seed_);
  const float inv_sqrt_in = 1.0f / std::sqrt(static_cast<float>(cols));
  ForRows(rb, [&](int64_t b) {
    const int64_t r0 = b * 128, r1 = std::min(rows, r0 + 128);
    std::vector<float> v(static_cast<size_t>((r1 - r0) * cols));
    for (int64_t r = r0; r < r1; ++r)
      Rng(tseed, static_cast<uint64_t>(r)).NormalRow(&v[(r - r0) * cols], cols, inv_sqrt_in);
    for (int64_t c = 0; c < cb; ++c) {
      const int64_t c0 = c * 128, c1 = std::min(cols, c0 + 128);
      float mx = 0.0f;
      for (int64_t r = r0; r < r1; ++r)
        for (int64_t i = c0; i < c1; ++i) mx = std::max(mx, std::fabs(v[(r - r0) * cols + i]));
      const uint8_t e = F32ToE8m0Ceil(mx / 448.0f);
      (*scale)[b * cb + c] = e;
      const float inv = std::ldexp(1.0f, 127 - e);  // exact: a power of two
      for (int64_t r = r0; r < r1; ++r)
        for (int64_t i = c0; i < c1; ++i)
          (*w)[r * cols + i] = E4m3Nearest(v[(r - r0) * cols + i] * inv);
    }
  });
}

// W[out, in] ~ N(0, 1/in); 32 inputs of a row share scale 2^ceil(log2(blockmax / 6)).
void TensorFiller::Fp4(const TensorSpec& s, std::vector<uint8_t>* w,
                       std::vector<uint8_t>* scale) {
  const int64_t rows = s.shape[0], cols = s.shape[1] * 2;
  w->assign(static_cast<size_t>(rows * cols / 2), 0);
  scale->assign(static_cast<size_t>(rows * cols / 32), 0);
  const uint64_t tseed = HashName(s.name, seed_);
  const float inv_sqrt_in = 1.0f / std::sqrt(static_cast<float>(cols));
  ForRows(rows, [&](int64_t r) {
    Rng rng(tseed, static_cast<uint64_t>(r));
    float v[32];
    for (int64_t b = 0; b < cols / 32; ++b) {
      rng.NormalRow(v, 32, inv_sqrt_in);
      float mx = 0.0f;
      for (int i = 0; i < 32; ++i) mx = std::max(mx, std::fabs(v[i]));
      const uint8_t e = F32ToE8m0Ceil(mx / 6.0f);
      (*scale)[r * (cols / 32) + b] = e;
      const float inv = std::ldexp(1.0f, 127 - e);  // exact: a power of two
      uint8_t* dst = w->data() + r * (cols / 2) + b * 16;
      for (int i = 0; i < 16; ++i)
        dst[i] = static_cast<uint8_t>(Fp4Nearest(v[2 * i] * inv) |
                                      (Fp4Nearest(v[2 * i + 1] * inv) << 4));
    }
  });
}

Status TensorFiller::Write(const TensorSpec& s, DType dt, SafetensorsWriter* out,
                           std::vector<uint8_t>* scale_out) {
  std::vector<uint8_t> w;
  switch (s.role) {
    case TensorRole::kFp8Weight: Fp8(s, &w, scale_out); break;
    case TensorRole::kFp4Weight: Fp4(s, &w, scale_out); break;
    case TensorRole::kTid2eid: w = Tid2eid(s); break;
    default: {
      const int64_t rows = FloatRows(s);
      const size_t row_bytes = static_cast<size_t>(FloatCols(s)) * DTypeSize(dt);
      const int64_t chunk = std::max<int64_t>(1, static_cast<int64_t>(kChunkBytes / row_bytes));
      for (int64_t r = 0; r < rows; r += chunk) {
        w = Floats(s, dt, r, std::min(rows, r + chunk));
        FM_RETURN_IF_ERROR(out->Append(w.data(), w.size()));
      }
      return Status::Ok();
    }
  }
  return out->Append(w.data(), w.size());
}

// The output directory and any missing parents (`mkmodel ... out/small` on a fresh clone).
Status MakeDir(const std::string& dir) {
  std::error_code ec;
  std::filesystem::create_directories(dir, ec);
  if (ec) return Internal(dir + ": cannot create directory: " + ec.message());
  return Status::Ok();
}

Status WriteText(const std::string& path, const std::string& text) {
  std::ofstream out(path, std::ios::binary | std::ios::trunc);
  if (!out) return Internal(path + ": cannot create");
  out << text;
  out.close();
  if (!out) return Internal(path + ": write failed");
  return Status::Ok();
}

ModelConfig BaseConfig() {
  ModelConfig c;
  c.num_key_value_heads = 1;
  c.n_shared_experts = 1;
  c.routed_scaling_factor = 1.5;
  c.swiglu_limit = 10.0;
  c.hc_mult = 4;
  c.hc_sinkhorn_iters = 20;
  c.hc_eps = 1e-6;
  c.rms_norm_eps = 1e-6;
  c.rope_theta = 10000.0;
  c.compress_rope_theta = 160000.0;
  c.num_nextn_predict_layers = 1;
  c.max_position_embeddings = 1048576;
  return c;
}

}  // namespace

uint8_t QuantizeE4m3(float x) { return E4m3Nearest(x); }
uint8_t QuantizeFp4(float x) { return Fp4Nearest(x); }

std::vector<std::string> MkmodelPresets() { return {"tiny", "small", "bench", "flash"}; }

Result<ModelConfig> PresetConfig(const std::string& preset, int64_t layers) {
  ModelConfig c = BaseConfig();
  if (preset != "flash" && layers != 0)
    return InvalidArgument("mkmodel: --layers is only for --preset flash ('" + preset +
                           "' has a fixed layer count)");
  if (preset == "flash") {
    if (layers < 1 || layers > kFlashLayers)
      return InvalidArgument("mkmodel: --preset flash needs --layers N in [1, " +
                             std::to_string(kFlashLayers) + "] (the real model's first N layers), got " +
                             std::to_string(layers));
    c.vocab_size = 129280, c.hidden_size = 4096, c.num_hidden_layers = layers;
    // The real model's first `layers` layers: window-only 0-1, then ratio 4 / 128 alternating;
    // hash routed 0-2. The MTP block (window-only) follows.
    for (int64_t l = 0; l < layers; ++l) c.compress_ratios.push_back(l < 2 ? 0 : l % 2 ? 128 : 4);
    c.compress_ratios.push_back(0);
    c.num_hash_layers = std::min<int64_t>(3, layers), c.num_attention_heads = 64;
    c.head_dim = 512, c.qk_rope_head_dim = 64;
    c.q_lora_rank = 1024, c.o_lora_rank = 1024, c.o_groups = 8;
    c.n_routed_experts = 256, c.num_experts_per_tok = 6, c.moe_intermediate_size = 2048;
    c.sliding_window = 128, c.index_n_heads = 64, c.index_head_dim = 128, c.index_topk = 512;
  } else if (preset == "tiny") {
    c.vocab_size = 512, c.hidden_size = 64, c.num_hidden_layers = 6;
    c.compress_ratios = {0, 0, 4, 128, 4, 128, 0};
    c.num_hash_layers = 2, c.num_attention_heads = 4, c.head_dim = 32, c.qk_rope_head_dim = 16;
    c.q_lora_rank = 32, c.o_lora_rank = 32, c.o_groups = 2;
    c.n_routed_experts = 8, c.num_experts_per_tok = 2, c.moe_intermediate_size = 32;
    c.sliding_window = 16, c.index_n_heads = 2, c.index_head_dim = 32, c.index_topk = 4;
  } else if (preset == "small") {
    c.vocab_size = 4096, c.hidden_size = 256, c.num_hidden_layers = 8;
    c.compress_ratios = {0, 0, 4, 128, 4, 128, 4, 128, 0};
    c.num_hash_layers = 3, c.num_attention_heads = 8, c.head_dim = 128, c.qk_rope_head_dim = 32;
    c.q_lora_rank = 192, c.o_lora_rank = 160, c.o_groups = 4;
    c.n_routed_experts = 32, c.num_experts_per_tok = 4, c.moe_intermediate_size = 224;
    c.sliding_window = 32, c.index_n_heads = 4, c.index_head_dim = 64, c.index_topk = 8;
  } else if (preset == "bench") {
    c.vocab_size = 16384, c.hidden_size = 2048, c.num_hidden_layers = 8;
    c.compress_ratios = {0, 0, 4, 128, 4, 128, 4, 128, 0};
    c.num_hash_layers = 2, c.num_attention_heads = 16, c.head_dim = 256, c.qk_rope_head_dim = 64;
    c.q_lora_rank = 704, c.o_lora_rank = 512, c.o_groups = 4;
    c.n_routed_experts = 64, c.num_experts_per_tok = 6, c.moe_intermediate_size = 1024;
    c.sliding_window = 128, c.index_n_heads = 8, c.index_head_dim = 128, c.index_topk = 64;
  } else {
    return InvalidArgument("mkmodel: unknown preset '" + preset +
                           "' (want tiny, small, bench or flash)");
  }
  return c;
}

std::string ConfigJson(const ModelConfig& c) {
  json j = {
      {"architectures", {"DeepseekV4ForCausalLM"}},
      {"model_type", "deepseek_v4"},
      {"torch_dtype", "bfloat16"},
      {"vocab_size", c.vocab_size},
      {"hidden_size", c.hidden_size},
      {"num_hidden_layers", c.num_hidden_layers},
      {"num_attention_heads", c.num_attention_heads},
      {"num_key_value_heads", c.num_key_value_heads},
      {"head_dim", c.head_dim},
      {"qk_rope_head_dim", c.qk_rope_head_dim},
      {"q_lora_rank", c.q_lora_rank},
      {"o_lora_rank", c.o_lora_rank},
      {"o_groups", c.o_groups},
      {"n_routed_experts", c.n_routed_experts},
      {"n_shared_experts", c.n_shared_experts},
      {"num_experts_per_tok", c.num_experts_per_tok},
      {"moe_intermediate_size", c.moe_intermediate_size},
      {"routed_scaling_factor", c.routed_scaling_factor},
      {"scoring_func", c.scoring_func},
      {"topk_method", c.topk_method},
      {"norm_topk_prob", c.norm_topk_prob},
      {"swiglu_limit", c.swiglu_limit},
      {"sliding_window", c.sliding_window},
      {"num_hash_layers", c.num_hash_layers},
      {"hc_mult", c.hc_mult},
      {"hc_sinkhorn_iters", c.hc_sinkhorn_iters},
      {"hc_eps", c.hc_eps},
      {"index_n_heads", c.index_n_heads},
      {"index_head_dim", c.index_head_dim},
      {"index_topk", c.index_topk},
      {"rope_theta", c.rope_theta},
      {"compress_rope_theta", c.compress_rope_theta},
      {"rope_scaling",
       {{"type", c.rope_scaling.type},
        {"factor", c.rope_scaling.factor},
        {"beta_fast", c.rope_scaling.beta_fast},
        {"beta_slow", c.rope_scaling.beta_slow},
        {"original_max_position_embeddings", c.rope_scaling.original_max_position_embeddings}}},
      {"rms_norm_eps", c.rms_norm_eps},
      {"num_nextn_predict_layers", c.num_nextn_predict_layers},
      {"max_position_embeddings", c.max_position_embeddings},
      {"compress_ratios", c.compress_ratios},
      {"quantization_config",
       {{"quant_method", c.quant_method},
        {"fmt", c.quant_fmt},
        {"scale_fmt", c.quant_scale_fmt},
        {"weight_block_size", c.weight_block_size}}},
      {"expert_dtype", c.expert_dtype},
  };
  return j.dump(2) + "\n";
}

Status WriteRandomCheckpoint(const std::string& dir, const ModelConfig& cfg,
                             const MkmodelOptions& opt) {
  if (opt.num_shards < 2) return InvalidArgument("mkmodel: num_shards must be >= 2");
  FM_RETURN_IF_ERROR(MakeDir(dir));
  const std::vector<TensorSpec> specs = ExpectedTensors(cfg);
  std::vector<DType> dtype(specs.size());
  std::vector<uint64_t> bytes(specs.size());
  uint64_t total = 0;
  for (size_t i = 0; i < specs.size(); ++i) {
    const auto& dts = specs[i].dtypes;
    const bool to_bf16 = opt.bf16_small_tensors && dts[0] == DType::kF32 &&
                         std::find(dts.begin(), dts.end(), DType::kBF16) != dts.end();
    dtype[i] = to_bf16 ? DType::kBF16 : dts[0];
    TensorNbytes(dtype[i], specs[i].shape, &bytes[i]);
    total += bytes[i];
  }

  // Shard k takes the tensors whose first byte falls in [k, k+1) * total / num_shards; a
  // scale stays with its weight.
  const int n = opt.num_shards;
  std::vector<std::vector<size_t>> shard_specs(static_cast<size_t>(n));
  uint64_t before = 0;
  int shard = 0;
  for (size_t i = 0; i < specs.size(); ++i) {
    const bool is_scale = specs[i].role == TensorRole::kFp8Scale ||
                          specs[i].role == TensorRole::kFp4Scale;
    if (!is_scale) shard = static_cast<int>(std::min<uint64_t>(before * n / total, n - 1));
    shard_specs[static_cast<size_t>(shard)].push_back(i);
    before += bytes[i];
  }
  auto shard_name = [n](int k) {
    char buf[64];
    std::snprintf(buf, sizeof buf, "model-%05d-of-%05d.safetensors", k + 1, n);
    return std::string(buf);
  };

  ThreadPool pool(opt.threads);
  TensorFiller filler(cfg, opt.seed, &pool);
  json weight_map = json::object();
  for (int k = 0; k < n; ++k) {
    const std::string path = dir + "/" + shard_name(k);
    std::vector<SafetensorsDecl> decls;
    for (size_t i : shard_specs[static_cast<size_t>(k)]) {
      decls.push_back({specs[i].name, dtype[i], specs[i].shape});
      weight_map[specs[i].name] = shard_name(k);
    }
    FM_ASSIGN_OR_RETURN(auto writer, SafetensorsWriter::Create(path, decls, {{"format", "pt"}}));
    std::vector<uint8_t> pending_scale;
    for (size_t i : shard_specs[static_cast<size_t>(k)]) {
      const TensorSpec& s = specs[i];
      if (s.role == TensorRole::kFp8Scale || s.role == TensorRole::kFp4Scale) {
        FM_RETURN_IF_ERROR(writer->Append(pending_scale.data(), pending_scale.size()));
        continue;
      }
      FM_RETURN_IF_ERROR(filler.Write(s, dtype[i], writer.get(), &pending_scale));
    }
    FM_RETURN_IF_ERROR(writer->Finish());
  }
  json index = {{"metadata", {{"total_size", total}}}, {"weight_map", weight_map}};
  FM_RETURN_IF_ERROR(WriteText(dir + "/model.safetensors.index.json", index.dump(1) + "\n"));
  FM_RETURN_IF_ERROR(WriteText(dir + "/config.json", ConfigJson(cfg)));
  if (opt.tokenizer) FM_RETURN_IF_ERROR(WriteTestTokenizer(dir, cfg.vocab_size));
  FM_LOG(kInfo, "mkmodel") << dir << ": " << specs.size() << " tensors, " << total
                           << " bytes in " << n << " shards";
  return Status::Ok();
}

ModelConfig FullModelConfig(const ModelConfig& cfg) {
  if (cfg.num_hidden_layers < 1 || cfg.num_hidden_layers > kFlashLayers) return cfg;
  const Result<ModelConfig> prefix = PresetConfig("flash", cfg.num_hidden_layers);
  if (!prefix.ok() || ConfigJson(*prefix) != ConfigJson(cfg)) return cfg;
  return *PresetConfig("flash", kFlashLayers);
}

uint64_t DecodeBytesPerToken(const ModelConfig& cfg) {
  const ModelBytes b = ComputeModelBytes(cfg);
  uint64_t total = b.embed / static_cast<uint64_t>(cfg.vocab_size) + b.head;
  for (int64_t l = 0; l < cfg.num_hidden_layers; ++l)
    total += b.layer_total(l, cfg.num_experts_per_tok);
  return total;
}

Status WritePresetCheckpoint(const std::string& dir, const std::string& preset, uint64_t seed,
                             int64_t layers) {
  FM_ASSIGN_OR_RETURN(ModelConfig cfg, PresetConfig(preset, layers));
  MkmodelOptions opt;
  opt.seed = seed;
  // ~3.6 GB a flash shard (about a layer), as the official shards are a few GB each.
  opt.num_shards = preset == "flash"  ? static_cast<int>(layers) + 2
                   : preset == "bench" ? 4
                   : preset == "small" ? 3
                                       : 2;
  opt.bf16_small_tensors = preset == "tiny";
  return WriteRandomCheckpoint(dir, cfg, opt);
}

}  // namespace fm
