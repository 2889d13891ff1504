#include "model/checkpoint.h"

#include <sys/stat.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <fstream>
#include <map>
#include <set>
#include <nlohmann/json.hpp>
#include <sstream>
#include <unordered_map>

#include "common/file.h"
#include "common/log.h"
#include "model/tp_split.h"
#include "common/numfmt.h"
#include "model/safetensors.h"
#include "model/tensor_schema.h"

namespace fm {
namespace {

using json = nlohmann::json;

std::string DTypeList(const std::vector<DType>& ts) {
  std::string s;
  for (size_t i = 0; i < ts.size(); ++i) s += (i ? " or " : "") + std::string(DTypeName(ts[i]));
  return s;
}

bool FileExists(const std::string& path, uint64_t* size) {
  struct stat st;
  if (::stat(path.c_str(), &st) != 0 || !S_ISREG(st.st_mode)) return false;
  *size = static_cast<uint64_t>(st.st_size);
  return true;
}

// weight_map of model.safetensors.index.json: tensor name -> shard file name.
Result<std::map<std::string, std::string>> ReadIndex(const std::string& path) {
  FM_ASSIGN_OR_RETURN(const std::string text, ReadSmallFile(path, 256u << 20));
  json j = json::parse(text, nullptr, /*allow_exceptions=*/false);
  if (j.is_discarded()) return InvalidArgument(path + ": not valid JSON");
  if (!j.is_object()) return InvalidArgument(path + ": top level must be a JSON object");
  auto wm = j.find("weight_map");
  if (wm == j.end()) return InvalidArgument(path + ": missing required field 'weight_map'");
  if (!wm->is_object()) return InvalidArgument(path + ": field 'weight_map' must be an object");
  std::map<std::string, std::string> out;
  for (auto it = wm->begin(); it != wm->end(); ++it) {
    if (!it->is_string())
      return InvalidArgument(path + ": field 'weight_map." + it.key() + "' must be a string");
    const std::string file = it->get<std::string>();
    if (file.empty() || file.find('/') != std::string::npos || file == "." || file == "..")
      return InvalidArgument(path + ": field 'weight_map." + it.key() +
                             "' names shard '" + file + "', which is not a file name in " +
                             "the checkpoint directory");
    out[it.key()] = file;
  }
  return out;
}

// Config constraints that the tensor layout itself relies on (FP4 packing, head groups).
Status CheckLayoutConfig(const ModelConfig& c, const std::string& origin) {
  auto field = [&](const char* k, const std::string& what) {
    return InvalidArgument(origin + ": field '" + std::string(k) + "' " + what);
  };
  if (c.expert_dtype == "fp4") {
    if (c.hidden_size % 32 != 0)
      return field("hidden_size", "must be a multiple of 32 for expert_dtype fp4");
    if (c.moe_intermediate_size % 32 != 0)
      return field("moe_intermediate_size", "must be a multiple of 32 for expert_dtype fp4");
  } else if (c.expert_dtype != "fp8") {
    return field("expert_dtype", "must be \"fp4\" or \"fp8\", got \"" + c.expert_dtype + "\"");
  }
  if ((c.num_attention_heads * c.head_dim) % c.o_groups != 0)
    return field("o_groups", "must divide num_attention_heads * head_dim");
  for (size_t i = 0; i < c.compress_ratios.size(); ++i) {
    const int64_t r = c.compress_ratios[i];
    if (r != 0 && r != 4 && r != 128)
      return field("compress_ratios", "entry " + std::to_string(i) + " is " + std::to_string(r) +
                                          "; the checkpoint layout knows 0, 4 and 128");
  }
  return Status::Ok();
}

class CheckpointImpl final : public Checkpoint {
 public:
  struct Entry {
    TensorView view;
    const SafetensorsFile* file = nullptr;
    uint64_t load_begin = 0, load_end = 0;   // the bytes read, from the tensor's first
  };

  static Result<std::unique_ptr<Checkpoint>> Open(const std::string& dir,
                                                  const ShardSelection& sel_in, TensorBytes where);

  const ModelConfig& config() const override { return cfg_; }
  const ShardSelection& selection() const override { return sel_; }
  const std::string& dir() const override { return dir_; }
  bool Has(const std::string& name) const override { return entries_.count(name) > 0; }
  Result<TensorView> Get(const std::string& name) const override {
    FM_ASSIGN_OR_RETURN(const Entry* e, Find(name));
    return e->view;
  }
  Result<QWeight> Weight(const std::string& prefix) const override;
  Result<std::vector<float>> GetF32(const std::string& name) const override;
  Result<std::vector<int64_t>> GetI64(const std::string& name) const override;
  size_t selected_bytes() const override { return selected_bytes_; }
  size_t total_bytes() const override { return total_bytes_; }
  std::vector<std::string> tensor_names() const override { return order_; }
  size_t resident_bytes() const override {
    size_t n = 0;
    for (const auto& f : files_) n += f->ResidentBytes();
    return n;
  }
  size_t mapped_bytes() const override {
    size_t n = 0;
    for (const auto& f : files_) n += f->file_size();
    return n;
  }

 private:
  Result<const Entry*> Find(const std::string& name) const {
    auto it = entries_.find(name);
    if (it == entries_.end())
      return NotFound(dir_ + ": tensor '" + name + "' is not in the loaded selection");
    return &it->second;
  }
  Status CheckTid2eid(const Entry& e) const;
  static Status CheckFp8NanCodes(const Entry& e);

  ModelConfig cfg_;
  ShardSelection sel_;
  std::string dir_;
  std::vector<std::unique_ptr<SafetensorsFile>> files_;
  std::unordered_map<std::string, Entry> entries_;
  std::vector<std::string> order_;
  size_t selected_bytes_ = 0, total_bytes_ = 0;
};

Result<std::unique_ptr<Checkpoint>> CheckpointImpl::Open(const std::string& dir,
                                                         const ShardSelection& sel_in,
                                                         TensorBytes where) {
  std::unique_ptr<CheckpointImpl> ck(new CheckpointImpl());
  ck->dir_ = dir;
  const std::string config_path = dir + "/config.json";
  FM_ASSIGN_OR_RETURN(ck->cfg_, LoadModelConfig(config_path));
  const ModelConfig& cfg = ck->cfg_;
  FM_RETURN_IF_ERROR(CheckLayoutConfig(cfg, config_path));

  ShardSelection sel = sel_in;
  if (sel.layer_end < 0) sel.layer_end = cfg.num_hidden_layers;
  if (sel.layer_begin < 0 || sel.layer_begin > sel.layer_end ||
      sel.layer_end > cfg.num_hidden_layers)
    return InvalidArgument(dir + ": layer range [" + std::to_string(sel.layer_begin) + ", " +
                           std::to_string(sel.layer_end) + ") is outside the model's " +
                           std::to_string(cfg.num_hidden_layers) + " layers");
  if (sel.tp_size > 1) {
    FM_RETURN_IF_ERROR(CheckTensorParallel(cfg, sel.tp_size).Wrap(dir));
    if (sel.tp_rank < 0 || sel.tp_rank >= sel.tp_size)
      return InvalidArgument(dir + ": tensor-parallel rank " + std::to_string(sel.tp_rank) +
                             " outside [0, " + std::to_string(sel.tp_size) + ")");
  }
  std::sort(sel.experts.begin(), sel.experts.end());
  sel.experts.erase(std::unique(sel.experts.begin(), sel.experts.end()), sel.experts.end());
  for (int64_t e : sel.experts)
    if (e < 0 || e >= cfg.n_routed_experts)
      return InvalidArgument(dir + ": expert " + std::to_string(e) + " is outside [0, " +
                             std::to_string(cfg.n_routed_experts) + ")");
  ck->sel_ = sel;

  // The index (or a single model.safetensors holding everything).
  const std::string index_path = dir + "/model.safetensors.index.json";
  std::map<std::string, std::string> weight_map;
  uint64_t size = 0;
  if (FileExists(index_path, &size)) {
    FM_ASSIGN_OR_RETURN(weight_map, ReadIndex(index_path));
  } else if (FileExists(dir + "/model.safetensors", &size)) {
    FM_ASSIGN_OR_RETURN(auto only, SafetensorsFile::Open(dir + "/model.safetensors"));
    for (const auto& t : only->header().tensors) weight_map[t.name] = "model.safetensors";
  } else {
    return NotFound(dir + ": neither model.safetensors.index.json nor model.safetensors found");
  }
  const std::string index_name = FileExists(index_path, &size) ? index_path : dir;

  // Every shard the index names must exist; the model's bytes are their sizes.
  std::map<std::string, uint64_t> shard_sizes;
  for (const auto& [name, file] : weight_map) {
    if (shard_sizes.count(file)) continue;
    if (!FileExists(dir + "/" + file, &size))
      return NotFound(dir + "/" + file + ": shard file named in " + index_name +
                      " (for tensor '" + name + "') does not exist");
    shard_sizes[file] = size;
  }
  for (const auto& [file, bytes] : shard_sizes) ck->total_bytes_ += bytes;

  // Every expected tensor must be in the index; the selected ones are opened and checked.
  const std::vector<TensorSpec> specs = ExpectedTensors(cfg);
  std::map<std::string, std::vector<const TensorSpec*>> by_shard;
  size_t known = 0;
  for (const auto& s : specs) {
    auto it = weight_map.find(s.name);
    if (it == weight_map.end())
      return NotFound(index_name + ": missing tensor '" + s.name + "' (expected from " +
                      config_path + ")");
    ++known;
    if (InSelection(s, sel, cfg)) by_shard[it->second].push_back(&s);
  }
  if (known < weight_map.size()) {
    FM_LOG(kWarn, "checkpoint") << index_name << ": " << weight_map.size() - known
                                << " tensors not described by config.json are ignored";
  }

  std::unordered_map<const TensorSpec*, Entry> found;
  for (const auto& [file, list] : by_shard) {
    const std::string path = dir + "/" + file;
    FM_ASSIGN_OR_RETURN(auto shard, SafetensorsFile::Open(path, where));
    for (const TensorSpec* s : list) {
      const SafetensorsTensor* t = shard->header().Find(s->name);
      if (!t)
        return NotFound(path + ": tensor '" + s->name + "' is listed in " + index_name +
                        " but not in the shard's header");
      if (std::find(s->dtypes.begin(), s->dtypes.end(), t->dtype) == s->dtypes.end())
        return InvalidArgument(path + ": tensor '" + s->name + "' has dtype " +
                               DTypeName(t->dtype) + ", want " + DTypeList(s->dtypes));
      if (t->shape != s->shape)
        return InvalidArgument(path + ": tensor '" + s->name + "' has shape " +
                               ShapeString(t->shape) + ", but " + config_path + " implies " +
                               ShapeString(s->shape));
      Entry e;
      e.view.name = s->name;
      e.view.dtype = t->dtype;
      e.view.shape = t->shape;
      e.view.data = shard->data(*t);
      e.view.nbytes = t->end - t->begin;
      e.file = shard.get();
      found[s] = e;
    }
    ck->files_.push_back(std::move(shard));
  }
  for (const auto& s : specs) {
    auto it = found.find(&s);
    if (it == found.end()) continue;
    Entry& e = it->second;
    e.load_end = e.view.nbytes;
    TpRange rows;
    if (TpSplitRows(cfg, s.name, sel.tp_rank, sel.tp_size, &rows)) {
      // A tensor-parallel member's rows of a split weight (an FP8 scale: their 128-row blocks).
      const int64_t n = e.view.shape.empty() ? 0 : e.view.shape[0];
      if (s.role == TensorRole::kFp8Scale) rows = {rows.begin / 128, (rows.end + 127) / 128};
      const uint64_t row_bytes = n > 0 ? e.view.nbytes / static_cast<uint64_t>(n) : 0;
      e.load_begin = static_cast<uint64_t>(rows.begin) * row_bytes;
      e.load_end = static_cast<uint64_t>(std::min(rows.end, n)) * row_bytes;
    }
    ck->selected_bytes_ += e.load_end - e.load_begin;
    ck->order_.push_back(s.name);
    ck->entries_.emplace(s.name, std::move(it->second));
  }
  // Read the selection in file order, coalescing neighbours.
  for (const auto& f : ck->files_) {
    std::vector<std::pair<uint64_t, uint64_t>> runs;
    for (const auto& t : f->header().tensors) {
      auto e = ck->entries_.find(t.name);
      if (e == ck->entries_.end()) continue;
      const uint64_t a = t.begin + e->second.load_begin, b = t.begin + e->second.load_end;
      if (runs.empty() || a > runs.back().second) runs.push_back({a, b});
      else runs.back().second = std::max(runs.back().second, b);
    }
    FM_RETURN_IF_ERROR(f->Load(runs));
  }
  for (const auto& s : specs)
    if (s.role == TensorRole::kTid2eid && ck->entries_.count(s.name))
      FM_RETURN_IF_ERROR(ck->CheckTid2eid(ck->entries_.at(s.name)));
  for (const auto& [name, e] : ck->entries_)
    if (e.view.dtype == DType::kF8E4M3 || e.view.dtype == DType::kF8E8M0)
      FM_RETURN_IF_ERROR(CheckFp8NanCodes(e));
  FM_LOG(kInfo, "checkpoint") << dir << ": " << ck->order_.size() << " tensors, "
                              << ck->selected_bytes_ << " of " << ck->total_bytes_
                              << " bytes selected from " << ck->files_.size() << " shard(s)";
  return std::unique_ptr<Checkpoint>(std::move(ck));
}

// Hash routing indexes experts directly: every entry must name an existing expert.
Status CheckpointImpl::CheckTid2eid(const Entry& e) const {
  const int64_t n = e.view.numel();
  for (int64_t i = 0; i < n; ++i) {
    int64_t v;
    if (e.view.dtype == DType::kI64) std::memcpy(&v, e.view.data + 8 * i, 8);
    else {
      int32_t w;
      std::memcpy(&w, e.view.data + 4 * i, 4);
      v = w;
    }
    if (v < 0 || v >= cfg_.n_routed_experts)
      return InvalidArgument(e.file->path() + ": tensor '" + e.view.name + "' entry " +
                             std::to_string(i) + " is expert " + std::to_string(v) +
                             ", outside [0, " + std::to_string(cfg_.n_routed_experts) + ")");
  }
  return Status::Ok();
}

// e4m3 has no infinities; 0x7F and 0xFF are NaN. A weight never is: such a byte is a damaged
// file, and the CPU's exact decode would read it as +-480 where a GPU reads NaN, so one kind of
// worker would quietly disagree with the other. One pass over the loaded bytes (vectorized).
Status CheckpointImpl::CheckFp8NanCodes(const Entry& e) {
  // e4m3: S.1111.111 (0x7F, 0xFF); an e8m0 scale: 0xFF alone (2^128 does not exist).
  const bool e8m0 = e.view.dtype == DType::kF8E8M0;
  const uint8_t mask = e8m0 ? 0xFF : 0x7F, code = e8m0 ? 0xFF : 0x7F;
  const uint8_t* p = e.view.data + e.load_begin;
  const uint64_t n = e.load_end - e.load_begin;
  uint8_t nan = 0;
  for (uint64_t i = 0; i < n; ++i) nan |= static_cast<uint8_t>((p[i] & mask) == code);
  if (!nan) return Status::Ok();
  uint64_t at = 0;
  while ((p[at] & mask) != code) ++at;
  return InvalidArgument(e.file->path() + ": tensor '" + e.view.name + "' byte " +
                         std::to_string(e.load_begin + at) + " is an " + (e8m0 ? "e8m0" : "e4m3") +
                         " NaN code (0x" + (p[at] == 0x7F ? "7F" : "FF") + "): the file is damaged");
}

Result<QWeight> CheckpointImpl::Weight(const std::string& prefix) const {
  FM_ASSIGN_OR_RETURN(const Entry* w, Find(prefix + ".weight"));
  const TensorView& v = w->view;
  if (v.shape.size() != 2)
    return InvalidArgument(w->file->path() + ": tensor '" + v.name + "' is not 2-D");
  QWeight q;
  q.rows = v.shape[0];
  q.cols = v.shape[1];
  q.data = v.data;
  switch (v.dtype) {
    case DType::kF32: q.format = WeightFormat::kF32; return q;
    case DType::kBF16: q.format = WeightFormat::kBF16; return q;
    case DType::kF8E4M3: q.format = WeightFormat::kFP8Block; break;
    case DType::kI8: case DType::kU8:
      q.format = WeightFormat::kFP4Block32;
      q.cols = v.shape[1] * 2;
      break;
    default:
      return InvalidArgument(w->file->path() + ": tensor '" + v.name + "' has dtype " +
                             DTypeName(v.dtype) + ", which is not a matvec weight format");
  }
  // The scale's shape was checked against config.json at Open.
  FM_ASSIGN_OR_RETURN(const Entry* s, Find(prefix + ".scale"));
  q.scale = s->view.data;
  return q;
}

Result<std::vector<float>> CheckpointImpl::GetF32(const std::string& name) const {
  FM_ASSIGN_OR_RETURN(const Entry* e, Find(name));
  const TensorView& v = e->view;
  std::vector<float> out(static_cast<size_t>(v.numel()));
  if (v.dtype == DType::kF32) {
    std::memcpy(out.data(), v.data, out.size() * 4);
  } else if (v.dtype == DType::kBF16) {
    for (size_t i = 0; i < out.size(); ++i) {
      uint16_t b;
      std::memcpy(&b, v.data + 2 * i, 2);
      out[i] = Bf16ToF32(b);
    }
  } else {
    return InvalidArgument(e->file->path() + ": tensor '" + name + "' has dtype " +
                           DTypeName(v.dtype) + ", not a float type");
  }
  // These small tensors (norms, biases, mixes, sinks) steer routing and scaling: a NaN or an
  // infinity gives other tokens without an error (and CPU and GPU top-k treat NaN apart).
  for (size_t i = 0; i < out.size(); ++i)
    if (!std::isfinite(out[i]))
      return InvalidArgument(e->file->path() + ": tensor '" + name + "' element " +
                             std::to_string(i) + " is " + (std::isnan(out[i]) ? "NaN" : "infinite") +
                             ": the file is damaged");
  return out;
}

Result<std::vector<int64_t>> CheckpointImpl::GetI64(const std::string& name) const {
  FM_ASSIGN_OR_RETURN(const Entry* e, Find(name));
  const TensorView& v = e->view;
  std::vector<int64_t> out(static_cast<size_t>(v.numel()));
  if (v.dtype == DType::kI64) {
    std::memcpy(out.data(), v.data, out.size() * 8);
  } else if (v.dtype == DType::kI32) {
    for (size_t i = 0; i < out.size(); ++i) {
      int32_t w;
      std::memcpy(&w, v.data + 4 * i, 4);
      out[i] = w;
    }
  } else {
    return InvalidArgument(e->file->path() + ": tensor '" + name + "' has dtype " +
                           DTypeName(v.dtype) + ", not an integer type");
  }
  return out;
}

}  // namespace

Result<std::unique_ptr<Checkpoint>> Checkpoint::Open(const std::string& dir,
                                                     const ShardSelection& sel, TensorBytes where) {
  return CheckpointImpl::Open(dir, sel, where);
}

std::vector<std::string> CheckpointFiles(const std::string& dir, bool shards_that_exist_only) {
  std::vector<std::string> files;
  uint64_t size = 0;
  if (FileExists(dir + "/config.json", &size)) files.push_back("config.json");
  const std::string index = "model.safetensors.index.json";
  if (FileExists(dir + "/" + index, &size)) {
    files.push_back(index);
    Result<std::map<std::string, std::string>> weight_map = ReadIndex(dir + "/" + index);
    if (!weight_map.ok()) return files;
    std::set<std::string> shards;
    for (const auto& [tensor, file] : *weight_map) shards.insert(file);
    for (const std::string& f : shards)
      if (!shards_that_exist_only || FileExists(dir + "/" + f, &size)) files.push_back(f);
  } else if (FileExists(dir + "/model.safetensors", &size)) {
    files.push_back("model.safetensors");
  }
  return files;
}

}  // namespace fm
