// AppendLogitEdits (logit_edits.h): a sampler's Adjusted, as per-id edits for the device.
#include "model/cuda/logit_edits.h"

#include <algorithm>
#include <unordered_map>
#include <utility>

namespace fm {

bool AppendLogitEdits(const Sampler& s, int32_t row, int64_t vocab, size_t max_edits,
                      size_t max_biases, LogitEditBatch* batch) {
  const SamplerConfig& c = s.config();
  auto in_range = [&](int32_t id) { return id >= 0 && id < vocab; };
  std::vector<cuda::LogitEdit> edits;
  std::unordered_map<int32_t, size_t> at;  // id -> its edit
  auto edit = [&](int32_t id) -> cuda::LogitEdit& {
    auto [it, fresh] = at.try_emplace(id, edits.size());
    if (fresh) edits.push_back(cuda::LogitEdit{id});
    return edits[it->second];
  };
  // Each id's biases together, in the request's order (Adjusted adds them one at a time).
  std::vector<std::pair<int32_t, float>> bias;
  for (const auto& [id, b] : c.logit_bias)
    if (in_range(id)) bias.emplace_back(id, b);
  std::stable_sort(bias.begin(), bias.end(), [](const auto& a, const auto& b) { return a.first < b.first; });
  if (bias.size() > max_biases) return false;
  const size_t bias0 = batch->biases.size();
  for (size_t i = 0; i < bias.size(); ++i) {
    cuda::LogitEdit& e = edit(bias[i].first);
    if (e.bias_begin == e.bias_end) e.bias_begin = static_cast<int32_t>(bias0 + i);
    e.bias_end = static_cast<int32_t>(bias0 + i + 1);
  }
  const bool mask = s.masks_min_tokens();
  if (mask)
    for (int32_t id : c.min_tokens_ids)
      if (in_range(id)) edit(id).held = 1;
  for (int32_t id : s.seen())
    if (in_range(id)) edit(id).seen = 1;
  for (const auto& [id, count] : s.generated())
    if (in_range(id)) {
      cuda::LogitEdit& e = edit(id);
      e.generated = 1;
      e.subtract = s.penalty_subtraction(count);
    }
  if (edits.size() > max_edits) return false;
  cuda::AdjustRow r;
  r.row = row;
  r.edit_begin = static_cast<int32_t>(batch->edits.size());
  r.edit_end = static_cast<int32_t>(batch->edits.size() + edits.size());
  r.mask = mask ? 1 : 0;
  r.repetition = c.repetition_penalty;
  r.min_p = !s.is_greedy() && c.min_p > 0.0f ? 1 : 0;
  const Sampler::MinPCut cut = s.min_p_cut();
  r.inv_t = cut.inv_t;
  r.floor = cut.floor;
  for (const auto& [id, b] : bias) batch->biases.push_back(b);
  batch->edits.insert(batch->edits.end(), edits.begin(), edits.end());
  batch->rows.push_back(r);
  return true;
}

}  // namespace fm
