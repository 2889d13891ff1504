// Tensor (head) parallelism inside a stage (issue 20; docs/architecture.md "Tensor parallel").
// The t members of a group each hold the full manifold and every sequence's KV, run the
// replicated parts of a layer (hc mixes, wq_a, wkv, compressors, indexer, router) in full, and
// split the rest:
//   attention: heads [r*nH/t, (r+1)*nH/t) (wq_b rows), output groups [r*G/t, (r+1)*G/t) (wo_a),
//              then all-gather the o_lora outputs [N, G*R] and split wo_b by output rows;
//   shared expert: intermediate rows [r*I/t, (r+1)*I/t) of w1/w3, all-gather the mid [T, I],
//              split w2 by output rows;
//   routed experts: member r runs its own experts for every (row, k) pair that picks them.
// Members exchange only finished values (never partial sums), and every output element is
// reduced on one member in the single process's order, so a layer's result is bit-identical
// to the single process.
#pragma once
#include <cstdint>
#include <span>
#include <string>
#include <vector>

#include "common/status.h"
#include "common/tensor.h"
#include "common/thread_pool.h"
#include "model/config.h"
#include "model/tp_split.h"

namespace fm {

struct MoeWeights;

class TpGroup {
 public:
  virtual ~TpGroup() = default;
  virtual int rank() const = 0;
  virtual int size() const = 0;
  // The member holding routed expert `e` (every expert has exactly one).
  virtual int ExpertOwner(int32_t e) const = 0;
  // Every member's `mine`, in rank order (this member's own included). Every member calls the
  // same gathers in the same order; pieces may differ in length. Errors name the member.
  virtual Result<std::vector<std::vector<float>>> AllGather(std::span<const float> mine) = 0;
  // Whether AllGatherInPlace takes device memory (a group over NCCL): a device member's pieces
  // then go GPU to GPU; otherwise it gathers through the host (AllGather).
  virtual bool device_buffers() const { return false; }
  // `all`: every member's piece side by side in device memory, member r's counts[r] floats
  // after the counts before it; this member's is in place already, the others' land in theirs.
  // The same gathers in the same order as AllGather's; a piece of another length is an error
  // naming the member. Only where device_buffers() (the default refuses).
  virtual Status AllGatherInPlace(float* all, const std::vector<int64_t>& counts) {
    (void)all, (void)counts;
    return InvalidArgument("tensor-parallel gather: this group exchanges host memory only");
  }
};

// y [N, rows.size()] = rows [rows.begin, rows.end) of w . x [N, w.cols]. The same bits as those
// columns of the full product (Matmul rows are independent); when the rows start inside a
// quantization block the full product runs and the rows are kept.
void MatmulRowRange(const QWeight& w, TpRange rows, const float* x, int64_t N, float* y,
                    ThreadPool* pool);

// The pieces of an all-gather, each [N, width_r] row-major, side by side: [N, sum width_r].
// Errors when a piece's length is not N x width_r (named by member).
Result<std::vector<float>> JoinColumns(const std::vector<std::vector<float>>& pieces, int64_t N,
                                       const std::vector<int64_t>& widths);

// Every member's MoE piece (its rows [r*H/t, (r+1)*H/t) of the shared expert's output [T, H/t],
// then its routed outputs [pairs, H] in (row, k) order, pairs = the (row, k) whose expert it owns)
// back in place: contrib [T, k, H] in (row, k) slots and shared_out [T, H]. Errors name the
// member whose piece does not fit its pairs.
Status JoinMoePieces(const ModelConfig& cfg, int64_t layer,
                     const std::vector<std::vector<float>>& pieces, const int32_t* ids, int64_t T,
                     const TpGroup& tp, float* contrib, float* shared_out);

// The MoE output of one layer on a member: out [T, H] = routed + shared expert, every row in
// full, from x [T, H] (the normed MoE input) and the routing ids/weights [T, k] every member
// computed alike. This member runs its share of the shared expert and its experts' pairs; two
// all-gathers (the shared mid, then the shared output rows with the routed outputs).
Status MoeForwardTp(const ModelConfig& cfg, const MoeWeights& w, const float* x, int64_t T,
                    const int32_t* ids, const float* weights, TpGroup* tp, float* out,
                    ThreadPool* pool);

}  // namespace fm
