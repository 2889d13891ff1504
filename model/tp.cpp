// Tensor parallelism (model/tp.h): the row-range product, the column join of gathered pieces,
// and a member's MoE step.
#include "model/tp.h"

#include <algorithm>
#include <cstring>
#include <string>

#include "kernels/cpu/matvec.h"
#include "kernels/cpu/swiglu.h"
#include "model/moe.h"

namespace fm {

void MatmulRowRange(const QWeight& w, TpRange rows, const float* x, int64_t N, float* y,
                    ThreadPool* pool) {
  QWeight slice;
  if (SliceRows(w, rows.begin, rows.size(), &slice)) {
    Matmul(slice, x, N, y, pool);
    return;
  }
  std::vector<float> full(static_cast<size_t>(N * w.rows));
  Matmul(w, x, N, full.data(), pool);
  for (int64_t n = 0; n < N; ++n)
    std::memcpy(y + n * rows.size(), full.data() + n * w.rows + rows.begin,
                rows.size() * sizeof(float));
}

Result<std::vector<float>> JoinColumns(const std::vector<std::vector<float>>& pieces, int64_t N,
                                       const std::vector<int64_t>& widths) {
  if (pieces.size() != widths.size())
    return Internal("tensor-parallel gather: " + std::to_string(pieces.size()) + " pieces for " +
                    std::to_string(widths.size()) + " members");
  int64_t total = 0;
  for (int64_t w : widths) total += w;
  std::vector<float> out(static_cast<size_t>(N * total));
  int64_t col = 0;
  for (size_t r = 0; r < pieces.size(); ++r) {
    const int64_t w = widths[r];
    if (static_cast<int64_t>(pieces[r].size()) != N * w)
      return InvalidArgument("tensor-parallel gather: member " + std::to_string(r) + " sent " +
                             std::to_string(pieces[r].size()) + " values, expected " +
                             std::to_string(N) + " x " + std::to_string(w));
    for (int64_t n = 0; n < N; ++n)
      std::memcpy(out.data() + n * total + col, pieces[r].data() + n * w, w * sizeof(float));
    col += w;
  }
  return out;
}

Status JoinMoePieces(const ModelConfig& cfg, int64_t layer,
                     const std::vector<std::vector<float>>& pieces, const int32_t* ids, int64_t T,
                     const TpGroup& tp, float* contrib, float* shared_out) {
  const int64_t k = cfg.num_experts_per_tok, H = cfg.hidden_size;
  const int t = tp.size();
  const int64_t hid = H / t;
  if (static_cast<int>(pieces.size()) != t)
    return Internal("MoE layer " + std::to_string(layer) + ": " + std::to_string(pieces.size()) +
                    " pieces for " + std::to_string(t) + " members");
  // Every member's shared rows side by side; the routed outputs into their (row, k) slots.
  std::vector<std::vector<float>> shared_pieces(t);
  for (int r = 0; r < t; ++r) {
    if (static_cast<int64_t>(pieces[r].size()) < T * hid)
      return InvalidArgument("MoE layer " + std::to_string(layer) + ": member " +
                             std::to_string(r) + " sent " + std::to_string(pieces[r].size()) +
                             " values, fewer than its shared expert rows");
    shared_pieces[r].assign(pieces[r].begin(), pieces[r].begin() + T * hid);
  }
  FM_ASSIGN_OR_RETURN(std::vector<float> joined,
                      JoinColumns(shared_pieces, T, std::vector<int64_t>(t, hid)));
  std::copy(joined.begin(), joined.end(), shared_out);
  std::vector<int64_t> next(t, T * hid);
  for (int64_t i = 0; i < T * k; ++i) {
    const int r = ids[i] >= 0 && ids[i] < cfg.n_routed_experts ? tp.ExpertOwner(ids[i]) : -1;
    if (r < 0 || r >= t)
      return InvalidArgument("MoE layer " + std::to_string(layer) + ": row " +
                             std::to_string(i / k) + " routes to expert " + std::to_string(ids[i]));
    if (next[r] + H > static_cast<int64_t>(pieces[r].size()))
      return InvalidArgument("MoE layer " + std::to_string(layer) + ": member " +
                             std::to_string(r) + " sent fewer routed outputs than its pairs");
    std::memcpy(contrib + i * H, pieces[r].data() + next[r], H * sizeof(float));
    next[r] += H;
  }
  for (int r = 0; r < t; ++r)
    if (next[r] != static_cast<int64_t>(pieces[r].size()))
      return InvalidArgument("MoE layer " + std::to_string(layer) + ": member " +
                             std::to_string(r) + " sent more routed outputs than its pairs");
  return Status::Ok();
}

Status MoeForwardTp(const ModelConfig& cfg, const MoeWeights& w, const float* x, int64_t T,
                    const int32_t* ids, const float* weights, TpGroup* tp, float* out,
                    ThreadPool* pool) {
  const int64_t E = cfg.n_routed_experts, k = cfg.num_experts_per_tok, H = cfg.hidden_size;
  const int me = tp->rank(), t = tp->size();
  const float limit = static_cast<float>(cfg.swiglu_limit);
  const ExpertWeights& shared = w.shared;
  const int64_t I = shared.w1.rows;
  if (I % t != 0 || H % t != 0)
    return InvalidArgument("MoE layer " + std::to_string(w.layer) + ": tensor_parallel " +
                           std::to_string(t) + " does not divide the shared expert's " +
                           std::to_string(I) + " rows or hidden " + std::to_string(H));
  const TpRange mid = TpShare(I, me, t), hid = TpShare(H, me, t);

  // Shared expert, rows `mid` of w1/w3 (the single process's RunExpertFfn, row by row).
  std::vector<float> gate(T * mid.size()), up(T * mid.size());
  MatmulRowRange(shared.w1, mid, x, T, gate.data(), pool);
  MatmulRowRange(shared.w3, mid, x, T, up.data(), pool);
  SwigluClamp_n(gate.data(), up.data(), T * mid.size(), limit, gate.data());

  // This member's (row, k) pairs, in (row, k) order: its piece of the routed outputs.
  std::vector<std::vector<ExpertRowPair>> by_expert(E);
  int64_t pairs = 0;
  for (int64_t i = 0; i < T * k; ++i) {
    const int32_t e = ids[i];
    if (e < 0 || e >= E)
      return InvalidArgument("MoE layer " + std::to_string(w.layer) + ": row " +
                             std::to_string(i / k) + " routes to expert " + std::to_string(e));
    if (tp->ExpertOwner(e) != me) continue;
    if (!w.experts[e].loaded)
      return InvalidArgument("MoE layer " + std::to_string(w.layer) + ": expert " +
                             std::to_string(e) + " is this member's but not loaded");
    by_expert[e].push_back({i / k, pairs++});
  }

  FM_ASSIGN_OR_RETURN(auto mids, tp->AllGather(gate));
  FM_ASSIGN_OR_RETURN(std::vector<float> full_mid,
                      JoinColumns(mids, T, std::vector<int64_t>(t, mid.size())));
  // Piece: rows `hid` of the shared expert's output [T, H/t], then the routed outputs [pairs, H].
  std::vector<float> piece(T * hid.size() + pairs * H);
  MatmulRowRange(shared.w2, hid, full_mid.data(), T, piece.data(), pool);
  RunExpertGroups(w, limit, by_expert, H, x, piece.data() + T * hid.size(), pool);
  FM_ASSIGN_OR_RETURN(auto pieces, tp->AllGather(piece));

  std::vector<float> contrib(T * k * H), shared_out(T * H);
  FM_RETURN_IF_ERROR(JoinMoePieces(cfg, w.layer, pieces, ids, T, *tp, contrib.data(),
                                   shared_out.data()));
  for (int64_t row = 0; row < T; ++row)
    MoeCombine_kH(contrib.data() + row * k * H, weights + row * k, k, H, out + row * H);
  for (int64_t i = 0; i < T * H; ++i) out[i] = out[i] + shared_out[i];
  return Status::Ok();
}

}  // namespace fm
