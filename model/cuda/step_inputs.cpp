#include "model/cuda/step_inputs.h"

#include <algorithm>

namespace fm {

void SetStepRow(const ModelConfig& cfg, std::span<const int64_t> ratios, int t, int64_t pos,
                int32_t token, StepInputs* in) {
  const int64_t W = cfg.sliding_window;
  in->pos[t] = static_cast<int32_t>(pos);
  in->token[t] = token;
  RowScalars& s = in->row[t];
  s.ring_row = static_cast<int32_t>(pos % W);
  s.nwin = static_cast<int32_t>(std::min(pos + 1, W));
  s.win_start = static_cast<int32_t>(pos + 1 - s.nwin);
  for (size_t i = 0; i < ratios.size(); ++i) {
    const int64_t r = ratios[i];
    RatioScalars& v = s.ratio[i];
    v.comp.slot = static_cast<int32_t>(pos % r);
    v.comp.parity = static_cast<int32_t>((pos / r) % 2);
    v.comp.has_prev = pos >= r;
    v.comp.emit = v.comp.slot == r - 1;
    v.comp.entry = v.comp.emit ? static_cast<int32_t>(pos / r) : -1;
    v.comp.window_pos = static_cast<int32_t>(pos + 1 - r);
    v.visible = static_cast<int32_t>((pos + 1) / r);
    v.entries = r == 4 ? std::min(v.visible, static_cast<int32_t>(cfg.index_topk)) : v.visible;
    v.keys = s.nwin + v.entries;
  }
}

int StepBucketIndex(int64_t rows) {
  int i = 0;
  while (i + 1 < static_cast<int>(std::size(kStepBuckets)) && kStepBuckets[i] < rows) ++i;
  return i;
}

int StepBucket(int64_t rows) { return kStepBuckets[StepBucketIndex(rows)]; }

}  // namespace fm
