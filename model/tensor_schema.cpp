#include "model/tensor_schema.h"

#include <algorithm>

#include "model/safetensors.h"

namespace fm {
namespace {

int64_t CeilDiv(int64_t a, int64_t b) { return (a + b - 1) / b; }

// Appends specs for one group/layer/expert; the helpers below name the roles.
class Builder {
 public:
  explicit Builder(std::vector<TensorSpec>* out) : out_(out) {}
  void Scope(TensorGroup g, int64_t layer, int64_t expert = -1) {
    group_ = g;
    layer_ = layer;
    expert_ = expert;
  }
  void Add(std::string name, std::vector<int64_t> shape, std::vector<DType> dtypes,
           TensorRole role) {
    TensorSpec s;
    s.name = std::move(name);
    s.shape = std::move(shape);
    s.dtypes = std::move(dtypes);
    s.group = group_;
    s.role = role;
    s.layer = layer_;
    s.expert = expert_;
    out_->push_back(std::move(s));
  }
  // Small tensors: the official dtype first, the other float accepted and converted on load.
  void Bf16(const std::string& n, std::vector<int64_t> shape, TensorRole role) {
    Add(n, std::move(shape), {DType::kBF16, DType::kF32}, role);
  }
  void F32(const std::string& n, std::vector<int64_t> shape, TensorRole role) {
    Add(n, std::move(shape), {DType::kF32, DType::kBF16}, role);
  }
  // prefix.weight F8_E4M3 [out, in] + prefix.scale F8_E8M0 [ceil(out/128), ceil(in/128)].
  void Fp8(const std::string& prefix, int64_t out, int64_t in) {
    Add(prefix + ".weight", {out, in}, {DType::kF8E4M3}, TensorRole::kFp8Weight);
    Add(prefix + ".scale", {CeilDiv(out, 128), CeilDiv(in, 128)}, {DType::kF8E8M0},
        TensorRole::kFp8Scale);
  }
  // prefix.weight I8 [out, in/2] (two e2m1 per byte) + prefix.scale F8_E8M0 [out, in/32].
  void Fp4(const std::string& prefix, int64_t out, int64_t in) {
    Add(prefix + ".weight", {out, in / 2}, {DType::kI8, DType::kU8}, TensorRole::kFp4Weight);
    Add(prefix + ".scale", {out, in / 32}, {DType::kF8E8M0}, TensorRole::kFp4Scale);
  }

 private:
  std::vector<TensorSpec>* out_;
  TensorGroup group_ = TensorGroup::kEmbed;
  int64_t layer_ = -1, expert_ = -1;
};

void AddHc(Builder& b, const ModelConfig& c, const std::string& p) {
  const int64_t n = c.hc_mult, H = c.hidden_size;
  b.F32(p + "_fn", {(2 + n) * n, n * H}, TensorRole::kHcFn);
  b.F32(p + "_base", {(2 + n) * n}, TensorRole::kHcBase);
  b.F32(p + "_scale", {3}, TensorRole::kHcScale);
}

void AddCompressor(Builder& b, const std::string& p, int64_t width, int64_t ratio, int64_t H,
                   int64_t norm_dim) {
  b.Bf16(p + ".wkv.weight", {width, H}, TensorRole::kMatrix);
  b.Bf16(p + ".wgate.weight", {width, H}, TensorRole::kMatrix);
  b.F32(p + ".ape", {ratio, width}, TensorRole::kApe);
  b.Bf16(p + ".norm.weight", {norm_dim}, TensorRole::kNorm);
}

// One transformer block under prefix p ("layers.N" or "mtp.K"); `index` is the layer index
// used for compress_ratios and hash routing.
void AddBlock(Builder& b, const ModelConfig& c, const std::string& p, int64_t index,
              bool is_mtp) {
  const int64_t H = c.hidden_size, D = c.head_dim, nH = c.num_attention_heads;
  const int64_t G = c.o_groups, E = c.n_routed_experts, I = c.moe_intermediate_size;
  const TensorGroup g = is_mtp ? TensorGroup::kMtp : TensorGroup::kLayer;
  b.Scope(g, index);
  b.Bf16(p + ".attn_norm.weight", {H}, TensorRole::kNorm);
  b.Bf16(p + ".ffn_norm.weight", {H}, TensorRole::kNorm);
  AddHc(b, c, p + ".hc_attn");
  AddHc(b, c, p + ".hc_ffn");
  const std::string a = p + ".attn";
  b.Fp8(a + ".wq_a", c.q_lora_rank, H);
  b.Bf16(a + ".q_norm.weight", {c.q_lora_rank}, TensorRole::kNorm);
  b.Fp8(a + ".wq_b", nH * D, c.q_lora_rank);
  b.Fp8(a + ".wkv", D, H);
  b.Bf16(a + ".kv_norm.weight", {D}, TensorRole::kNorm);
  b.Fp8(a + ".wo_a", G * c.o_lora_rank, nH * D / G);
  b.Fp8(a + ".wo_b", H, G * c.o_lora_rank);
  b.Add(a + ".attn_sink", {nH}, {DType::kF32, DType::kBF16}, TensorRole::kSink);
  const int64_t ratio = c.compress_ratio(index);
  if (ratio > 0) {
    const int64_t mult = ratio == 4 ? 2 : 1;
    AddCompressor(b, a + ".compressor", mult * D, ratio, H, D);
  }
  if (ratio == 4) {
    const int64_t nI = c.index_n_heads, dI = c.index_head_dim;
    b.Fp8(a + ".indexer.wq_b", nI * dI, c.q_lora_rank);
    b.Bf16(a + ".indexer.weights_proj.weight", {nI, H}, TensorRole::kMatrix);
    AddCompressor(b, a + ".indexer.compressor", 2 * dI, 4, H, dI);
  }
  const std::string f = p + ".ffn";
  b.Bf16(f + ".gate.weight", {E, H}, TensorRole::kMatrix);
  if (!is_mtp && c.is_hash_layer(index))
    b.Add(f + ".gate.tid2eid", {c.vocab_size, c.num_experts_per_tok},
          {DType::kI64, DType::kI32}, TensorRole::kTid2eid);
  else
    b.F32(f + ".gate.bias", {E}, TensorRole::kBias);
  const bool fp4 = c.expert_dtype == "fp4";
  for (int64_t e = 0; e < E; ++e) {
    b.Scope(g, index, e);
    const std::string x = f + ".experts." + std::to_string(e);
    for (const char* w : {".w1", ".w2", ".w3"}) {
      const bool down = w[2] == '2';
      const int64_t out = down ? H : I, in = down ? I : H;
      if (fp4) b.Fp4(x + w, out, in);
      else b.Fp8(x + w, out, in);
    }
  }
  b.Scope(g, index);
  const int64_t Is = I * std::max<int64_t>(c.n_shared_experts, 1);
  b.Fp8(f + ".shared_experts.w1", Is, H);
  b.Fp8(f + ".shared_experts.w2", H, Is);
  b.Fp8(f + ".shared_experts.w3", Is, H);
}

}  // namespace

uint64_t TensorSpec::bytes() const {
  uint64_t n = 0;
  return TensorNbytes(dtypes.at(0), shape, &n) ? n : 0;
}

std::vector<TensorSpec> ExpectedTensors(const ModelConfig& c) {
  std::vector<TensorSpec> out;
  Builder b(&out);
  const int64_t H = c.hidden_size, V = c.vocab_size, n = c.hc_mult;
  b.Scope(TensorGroup::kEmbed, -1);
  b.Add("embed.weight", {V, H}, {DType::kBF16, DType::kF32}, TensorRole::kEmbedding);
  for (int64_t l = 0; l < c.num_hidden_layers; ++l)
    AddBlock(b, c, "layers." + std::to_string(l), l, false);
  b.Scope(TensorGroup::kHead, -1);
  b.Bf16("norm.weight", {H}, TensorRole::kNorm);
  b.Bf16("head.weight", {V, H}, TensorRole::kMatrix);
  b.F32("hc_head_fn", {n, n * H}, TensorRole::kHcFn);
  b.F32("hc_head_base", {n}, TensorRole::kHcBase);
  b.F32("hc_head_scale", {1}, TensorRole::kHcScale);
  for (int64_t k = 0; k < c.num_nextn_predict_layers; ++k) {
    const int64_t index = c.num_hidden_layers + k;
    const std::string p = "mtp." + std::to_string(k);
    AddBlock(b, c, p, index, true);
    b.Scope(TensorGroup::kMtp, index);
    b.Fp8(p + ".e_proj", H, H);
    b.Fp8(p + ".h_proj", H, H);
    b.Bf16(p + ".enorm.weight", {H}, TensorRole::kNorm);
    b.Bf16(p + ".hnorm.weight", {H}, TensorRole::kNorm);
    b.Bf16(p + ".norm.weight", {H}, TensorRole::kNorm);
    b.F32(p + ".hc_head_fn", {n, n * H}, TensorRole::kHcFn);
    b.F32(p + ".hc_head_base", {n}, TensorRole::kHcBase);
    b.F32(p + ".hc_head_scale", {1}, TensorRole::kHcScale);
  }
  return out;
}

std::string LayerKindName(const ModelConfig& c, int64_t layer) {
  const int64_t r = c.compress_ratio(layer);
  std::string kind = r == 0 ? "window" : r == 4 ? "ratio-4+indexer" : "ratio-" + std::to_string(r);
  const bool mtp = layer >= c.num_hidden_layers;
  return kind + ((!mtp && c.is_hash_layer(layer)) ? ", hash-routed" : ", score-routed") +
         (mtp ? ", MTP" : "");
}

bool InSelection(const TensorSpec& s, const ShardSelection& sel, const ModelConfig& c) {
  switch (s.group) {
    case TensorGroup::kEmbed: return sel.embed;
    case TensorGroup::kHead: return sel.head;
    case TensorGroup::kMtp: if (!sel.mtp) return false; break;
    case TensorGroup::kLayer:
      if (s.layer < sel.layer_begin || s.layer >= sel.layer_end) return false;
      break;
  }
  return s.expert < 0 || sel.experts.empty() ||
         std::binary_search(sel.experts.begin(), sel.experts.end(), s.expert);
}

ModelBytes ComputeModelBytes(const ModelConfig& c) {
  ModelBytes m;
  const size_t layers = static_cast<size_t>(c.num_hidden_layers + c.num_nextn_predict_layers);
  m.layer_dense.assign(layers, 0);
  m.expert.assign(layers, 0);
  for (const auto& s : ExpectedTensors(c)) {
    const uint64_t n = s.bytes();
    m.total += n;
    if (s.group == TensorGroup::kEmbed) m.embed += n;
    else if (s.group == TensorGroup::kHead) m.head += n;
    else if (s.expert == 0) m.expert[static_cast<size_t>(s.layer)] += n;
    else if (s.expert < 0) m.layer_dense[static_cast<size_t>(s.layer)] += n;
  }
  return m;
}

}  // namespace fm
