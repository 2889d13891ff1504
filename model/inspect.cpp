#include "model/inspect.h"

#include <cstdio>

#include "model/checkpoint.h"
#include "model/tensor_schema.h"

namespace fm {
namespace {

std::string Bytes(double b) {
  const char* units[] = {"B", "KiB", "MiB", "GiB", "TiB"};
  int u = 0;
  while (b >= 1024.0 && u < 4) {
    b /= 1024.0;
    ++u;
  }
  char buf[64];
  std::snprintf(buf, sizeof buf, u == 0 ? "%.0f %s" : "%.2f %s", b, units[u]);
  return buf;
}

std::string Count(uint64_t n) {
  char buf[64];
  if (n >= 1000000000ull) std::snprintf(buf, sizeof buf, "%.2fB", n / 1e9);
  else if (n >= 1000000ull) std::snprintf(buf, sizeof buf, "%.2fM", n / 1e6);
  else std::snprintf(buf, sizeof buf, "%llu", static_cast<unsigned long long>(n));
  return buf;
}

bool IsScale(TensorRole r) { return r == TensorRole::kFp8Scale || r == TensorRole::kFp4Scale; }

}  // namespace

Result<InspectReport> InspectCheckpoint(const std::string& dir) {
  FM_ASSIGN_OR_RETURN(auto ck, Checkpoint::Open(dir, {}, TensorBytes::kMapped));  // shapes only
  const ModelConfig& c = ck->config();
  InspectReport r;
  r.cfg = c;
  r.dir = dir;
  r.file_bytes = ck->total_bytes();
  const int64_t L = c.num_hidden_layers, all_layers = L + c.num_nextn_predict_layers;
  r.layers.resize(static_cast<size_t>(all_layers));
  for (int64_t l = 0; l < all_layers; ++l) {
    auto& info = r.layers[static_cast<size_t>(l)];
    info.index = l;
    info.kind = LayerKindName(c, l);
    info.ratio = c.compress_ratio(l);
    info.mtp = l >= L;
    info.hash = !info.mtp && c.is_hash_layer(l);
  }
  for (const auto& s : ExpectedTensors(c)) {
    FM_ASSIGN_OR_RETURN(TensorView v, ck->Get(s.name));
    const uint64_t params = IsScale(s.role) ? 0
                            : s.role == TensorRole::kFp4Weight
                                ? 2 * static_cast<uint64_t>(v.numel())
                                : static_cast<uint64_t>(v.numel());
    auto& d = r.by_dtype[DTypeName(v.dtype)];
    d.tensors += 1;
    d.params += params;
    d.bytes += v.nbytes;
    r.tensors += 1;
    r.params += params;
    if (s.group == TensorGroup::kEmbed) {
      r.embed_row_bytes += v.nbytes / static_cast<uint64_t>(c.vocab_size);
      continue;
    }
    if (s.group == TensorGroup::kHead) {
      r.head_bytes += v.nbytes;
      continue;
    }
    auto& info = r.layers[static_cast<size_t>(s.layer)];
    const bool shared = s.name.find(".shared_experts.") != std::string::npos;
    if (s.expert == 0) info.expert_bytes += v.nbytes;
    if (s.expert >= 0) continue;
    info.dense_bytes += v.nbytes;
    if (shared) info.shared_bytes += v.nbytes;
  }
  for (const auto& info : r.layers) {
    if (info.mtp) continue;
    r.dense_bytes += info.dense_bytes - info.shared_bytes;
    r.shared_bytes += info.shared_bytes;
    r.routed_bytes += info.expert_bytes * static_cast<uint64_t>(c.num_experts_per_tok);
    r.layers_by_ratio[info.ratio] += 1;
  }
  const double ring = static_cast<double>(c.sliding_window * c.head_dim * 4);
  for (const auto& [ratio, n] : r.layers_by_ratio) {
    size_t layer = 0;   // the first main layer of this kind
    while (r.layers[layer].mtp || r.layers[layer].ratio != ratio) ++layer;
    r.kv_bytes_per_seq[ratio] =
        ring + static_cast<double>(KvBytesPerSequence(c, static_cast<int64_t>(layer), 0));
    double per_token = 0;
    if (ratio > 0) per_token = c.head_dim * 4.0 / static_cast<double>(ratio);
    if (ratio == 4) per_token += c.index_head_dim * 4.0 / 4.0;
    r.kv_bytes_per_token[ratio] = per_token;
  }
  return r;
}

std::string FormatInspectReport(const InspectReport& r) {
  const ModelConfig& c = r.cfg;
  std::string o;
  char buf[512];
  auto line = [&](const char* fmt, auto... args) {
    std::snprintf(buf, sizeof buf, fmt, args...);
    o += buf;
    o += "\n";
  };
  line("checkpoint  %s", r.dir.c_str());
  line("files       %s in shards, %llu tensors", Bytes(static_cast<double>(r.file_bytes)).c_str(),
       static_cast<unsigned long long>(r.tensors));
  line("parameters  %s (%llu)", Count(r.params).c_str(), static_cast<unsigned long long>(r.params));
  line("vocab       %lld, hidden %lld, %lld layers + %lld MTP",
       static_cast<long long>(c.vocab_size),
       static_cast<long long>(c.hidden_size), static_cast<long long>(c.num_hidden_layers),
       static_cast<long long>(c.num_nextn_predict_layers));
  line("experts     %lld routed (top-%lld, %s) + %lld shared, intermediate %lld",
       static_cast<long long>(c.n_routed_experts), static_cast<long long>(c.num_experts_per_tok),
       c.expert_dtype.c_str(), static_cast<long long>(c.n_shared_experts),
       static_cast<long long>(c.moe_intermediate_size));
  o += "\nby dtype    tensors  parameters        bytes\n";
  for (const auto& [name, d] : r.by_dtype)
    line("  %-9s %7llu  %10s  %11s", name.c_str(), static_cast<unsigned long long>(d.tensors),
         Count(d.params).c_str(), Bytes(static_cast<double>(d.bytes)).c_str());
  o += "\nlayer  kind                             dense       one expert\n";
  for (const auto& l : r.layers)
    line("  %3lld  %-30s %11s  %11s", static_cast<long long>(l.index), l.kind.c_str(),
         Bytes(static_cast<double>(l.dense_bytes)).c_str(),
         Bytes(static_cast<double>(l.expert_bytes)).c_str());
  o += "\nbytes read per decoded token (main model)\n";
  line("  embed row        %11s", Bytes(static_cast<double>(r.embed_row_bytes)).c_str());
  line("  dense layers     %11s", Bytes(static_cast<double>(r.dense_bytes)).c_str());
  line("  shared experts   %11s", Bytes(static_cast<double>(r.shared_bytes)).c_str());
  line("  routed top-%-3lld   %11s", static_cast<long long>(c.num_experts_per_tok),
       Bytes(static_cast<double>(r.routed_bytes)).c_str());
  line("  head             %11s", Bytes(static_cast<double>(r.head_bytes)).c_str());
  line("  total            %11s (%llu bytes)",
       Bytes(static_cast<double>(r.bytes_per_token())).c_str(),
       static_cast<unsigned long long>(r.bytes_per_token()));
  o += "\nKV cache (f32) per layer kind     layers  per sequence   per token\n";
  double fixed = 0, per_token = 0;
  for (const auto& [ratio, n] : r.layers_by_ratio) {
    const double t = r.kv_bytes_per_token.at(ratio);
    const std::string kind = ratio == 0 ? "window" : ratio == 4 ? "ratio-4 + indexer"
                                                                : "ratio-" + std::to_string(ratio);
    line("  %-30s %7lld  %11s  %8.2f B", kind.c_str(), static_cast<long long>(n),
         Bytes(r.kv_bytes_per_seq.at(ratio)).c_str(), t);
    fixed += r.kv_bytes_per_seq.at(ratio) * static_cast<double>(n);
    per_token += t * static_cast<double>(n);
  }
  line("  all main layers                        %11s  %8.2f B", Bytes(fixed).c_str(), per_token);
  o += "  (per sequence: every layer's sliding-window ring of sliding_window rows, and a\n"
       "   compressed layer's rows pending for its next entry; plan and kv_cache_gib charge\n"
       "   the same)\n";
  return o;
}

}  // namespace fm
