// Which rows of each layer tensor a tensor-parallel member holds (model/tp.h has the math):
// pure functions of config.json, so the checkpoint reader and the planner use them without
// linking the forward math.
#pragma once
#include <cstdint>
#include <string>

#include "common/status.h"
#include "model/config.h"

namespace fm {

// Why `t` members cannot split this model's layers (heads, groups, hidden, shared expert and
// routed experts must divide by t), or Ok.
Status CheckTensorParallel(const ModelConfig& cfg, int t);

// The [begin, end) share of member `rank` of `size` in `n` items (n divisible by size).
struct TpRange {
  int64_t begin = 0, end = 0;
  int64_t size() const { return end - begin; }
};
inline TpRange TpShare(int64_t n, int rank, int size) {
  return {n / size * rank, n / size * (rank + 1)};
}

// The rows member `rank` of `size` reads of main-layer tensor `name` (wq_b, wo_a, wo_b and the
// shared expert's w1/w2/w3: "layers.N.attn.wq_b.weight", ...; the weight's rows also for its
// ".scale"). False for every other tensor (replicated or routed: read whole).
bool TpSplitRows(const ModelConfig& cfg, const std::string& name, int rank, int size,
                 TpRange* rows);

}  // namespace fm
