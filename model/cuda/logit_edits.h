// The device form of a sampler's logit adjustments (model/sampler.h Sampler::Adjusted, applied by
// kernels/cuda/sample_ops.h AdjustLogits): for each row of a step whose sampler adjusts its
// logits, the ids its rules touch, each once, with that id's changes.
#pragma once
#include <cstddef>
#include <cstdint>
#include <vector>

#include "kernels/cuda/sample_ops.h"
#include "model/sampler.h"

namespace fm {

struct LogitEditBatch {
  std::vector<cuda::AdjustRow> rows;
  std::vector<cuda::LogitEdit> edits;
  std::vector<float> biases;
};

// Appends the adjustments `s` makes to logits row `row` of a [*, vocab] step (ids outside the
// vocabulary left out, as Adjusted skips them). False, with nothing appended, when the row takes
// more than max_edits edits or max_biases biases (the row is then drawn on the host).
bool AppendLogitEdits(const Sampler& s, int32_t row, int64_t vocab, size_t max_edits,
                      size_t max_biases, LogitEditBatch* batch);

}  // namespace fm
