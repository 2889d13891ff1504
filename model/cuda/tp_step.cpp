// Tensor parallelism on the device shard (model/cuda/tp_step.h).
#include "model/cuda/tp_step.h"

#include <algorithm>
#include <cstring>
#include <string>
#include <vector>

#include "kernels/cuda/ops.h"

namespace fm {
namespace {

// A device path's write of `floats` f32 (or int32) into `b`: refused when it would not fit, so a
// scratch sized for another geometry is an error, not a write past its end.
Status CheckRoom(const cuda::DeviceBuffer& b, int64_t floats, const char* what) {
  if (floats < 0 || static_cast<uint64_t>(floats) * 4 > b.size())
    return Internal(std::string("tensor-parallel gather: ") + what + " needs " +
                    std::to_string(floats * 4) + " bytes, its buffer has " +
                    std::to_string(b.size()));
  return Status::Ok();
}

// On a group that takes device memory: every member's [T, w] piece side by side into dst (row
// stride dst_stride, member r's at column r w). This member's, read from src (row stride
// src_stride), goes into its place of `all`, the others' come GPU to GPU, then all are joined.
Status JoinColumnPiecesOnDevice(TpGroup* tp, const float* src, int64_t src_stride, int64_t T,
                                int64_t w, const cuda::DeviceBuffer& all, float* dst,
                                int64_t dst_stride, const char* what) {
  const int t = tp->size();
  const int64_t n = T * w;
  FM_RETURN_IF_ERROR(CheckRoom(all, t * n, what));
  float* pieces = all.as<float>();
  FM_RETURN_IF_ERROR(
      cuda::CopyRowPieces(src, src_stride, nullptr, pieces + tp->rank() * n, w, nullptr, T, w));
  FM_RETURN_IF_ERROR(cuda::SynchronizeStream());   // the group's stream reads it next
  FM_RETURN_IF_ERROR(tp->AllGatherInPlace(pieces, std::vector<int64_t>(t, n)));
  for (int r = 0; r < t; ++r)
    FM_RETURN_IF_ERROR(
        cuda::CopyRowPieces(pieces + r * n, w, nullptr, dst + r * w, dst_stride, nullptr, T, w));
  return Status::Ok();
}

}  // namespace

Status GatherColumnsOnDevice(TpGroup* tp, const cuda::DeviceBuffer& mine, int64_t T,
                             int64_t width, cuda::DeviceBuffer* full, cuda::DeviceBuffer* all) {
  const int t = tp->size();
  if (tp->device_buffers()) {
    FM_RETURN_IF_ERROR(CheckRoom(*full, t * T * width, "the joined rows"));
    return JoinColumnPiecesOnDevice(tp, mine.as<const float>(), width, T, width, *all,
                                    full->as<float>(), t * width, "the pieces");
  }
  std::vector<float> piece(static_cast<size_t>(T * width));
  FM_RETURN_IF_ERROR(mine.CopyToHost(piece.data(), piece.size() * sizeof(float)));
  FM_ASSIGN_OR_RETURN(auto pieces, tp->AllGather(piece));
  FM_ASSIGN_OR_RETURN(std::vector<float> joined,
                      JoinColumns(pieces, T, std::vector<int64_t>(t, width)));
  return full->CopyFromHost(joined.data(), joined.size() * sizeof(float));
}

namespace {

// Columns [c0, c0 + n) of rows [T, stride] -> [T, n].
std::vector<float> Columns(const std::vector<float>& rows, int64_t T, int64_t stride, int64_t c0,
                           int64_t n) {
  std::vector<float> out(static_cast<size_t>(T * n));
  for (int64_t t = 0; t < T; ++t)
    std::memcpy(out.data() + t * n, rows.data() + t * stride + c0, n * sizeof(float));
  return out;
}

// The shared expert's mid on a group that takes device memory: this member's columns
// [first, first + rows) of h's shared rows [T, hs] into its place of `all`, the gather, then
// every member's [T, rows] side by side into columns [0, Is) of those rows.
Status GatherMidOnDevice(const DevLayer& l, TpGroup* tp, int64_t T, int64_t k,
                         const MoeTpBuffers& b) {
  const int64_t hs = b.hs;
  FM_RETURN_IF_ERROR(CheckRoom(*b.h, T * (k + 1) * hs, "the shared mid"));
  float* shared = b.h->as<float>() + T * k * hs;
  return JoinColumnPiecesOnDevice(tp, shared + l.s1.first, hs, T, l.s1.rows, *b.all, shared, hs,
                                  "the shared mid's pieces");
}

// The MoE pieces on a group that takes device memory (JoinMoePieces' device twin): this
// member's piece (its rows of the shared output, then its pairs' outputs in (row, k) order) into
// its place of `all`, the gather, then every member's shared rows into its column block of each
// row's shared slot and its pairs' outputs into their (row, k) slots: contrib [T, k + 1, H].
Status JoinMoeOnDevice(const ModelConfig& cfg, const DevLayer& l, TpGroup* tp, int64_t T,
                       const std::vector<int32_t>& ids, const MoeTpBuffers& b) {
  const int64_t H = cfg.hidden_size, k = cfg.num_experts_per_tok;
  const int t = tp->size(), me = tp->rank();
  const int64_t w = H / t;   // every member's rows of the shared output
  if (l.s2.rows != w)
    return InvalidArgument("MoE layer " + std::to_string(l.layer) + ": " +
                           std::to_string(l.s2.rows) + " rows of the shared output, not H/t = " +
                           std::to_string(w));
  // Each member's pairs: the (row, k) slots whose expert it owns, ascending (checked before).
  std::vector<std::vector<int32_t>> slots_of(t);
  for (size_t i = 0; i < ids.size(); ++i)
    slots_of[tp->ExpertOwner(ids[i])].push_back(static_cast<int32_t>(i));
  std::vector<int64_t> counts(t), at(t + 1, 0);
  for (int r = 0; r < t; ++r) {
    counts[r] = T * w + static_cast<int64_t>(slots_of[r].size()) * H;
    at[r + 1] = at[r] + counts[r];
  }
  FM_RETURN_IF_ERROR(CheckRoom(*b.all, at[t], "the MoE pieces"));
  FM_RETURN_IF_ERROR(CheckRoom(*b.contrib, T * (k + 1) * H, "the MoE slots"));
  FM_RETURN_IF_ERROR(CheckRoom(*b.rows, T * k, "the MoE row indices"));
  float* pieces = b.all->as<float>();
  float* contrib = b.contrib->as<float>();
  float* mine = pieces + at[me];
  int32_t* rows = b.rows->as<int32_t>();
  const int64_t p = static_cast<int64_t>(slots_of[me].size());
  FM_RETURN_IF_ERROR(cuda::CopyRowPieces(contrib + T * k * H + l.s2.first, l.s2.w.rows, nullptr,
                                         mine, w, nullptr, T, w));
  FM_RETURN_IF_ERROR(b.rows->CopyFromHostAsync(slots_of[me].data(), p * sizeof(int32_t)));
  FM_RETURN_IF_ERROR(cuda::CopyRowPieces(contrib, H, rows, mine + T * w, H, nullptr, p, H));
  FM_RETURN_IF_ERROR(cuda::SynchronizeStream());   // the group's stream reads it next
  FM_RETURN_IF_ERROR(tp->AllGatherInPlace(pieces, counts));
  // Slot (row, j) of [T, k] is row row (k + 1) + j of contrib.
  std::vector<int32_t> dst;
  for (int r = 0; r < t; ++r)
    for (const int32_t i : slots_of[r])
      dst.push_back(static_cast<int32_t>((i / k) * (k + 1) + i % k));
  FM_RETURN_IF_ERROR(b.rows->CopyFromHostAsync(dst.data(), dst.size() * sizeof(int32_t)));
  int64_t first = 0;
  for (int r = 0; r < t; ++r) {
    const int64_t pr = static_cast<int64_t>(slots_of[r].size());
    FM_RETURN_IF_ERROR(cuda::CopyRowPieces(pieces + at[r], w, nullptr, contrib + k * H + r * w,
                                           (k + 1) * H, nullptr, T, w));
    FM_RETURN_IF_ERROR(cuda::CopyRowPieces(pieces + at[r] + T * w, H, nullptr, contrib, H,
                                           rows + first, pr, H));
    first += pr;
  }
  return Status::Ok();
}

}  // namespace

Status MoeTpOnDevice(const ModelConfig& cfg, const DevLayer& l, TpGroup* tp, int64_t T,
                     const MoeTpBuffers& b) {
  const int64_t H = cfg.hidden_size, E = cfg.n_routed_experts, k = cfg.num_experts_per_tok;
  const int me = tp->rank(), t = tp->size();
  const float limit = DeviceSwigluLimit(cfg);
  const std::string where = "MoE layer " + std::to_string(l.layer);
  // The routing every member computed alike; the pairs of other members' experts are masked
  // (an id outside [0, E): the expert launches write a NaN row and read no weight).
  std::vector<int32_t> ids(static_cast<size_t>(T * k)), masked(ids.size());
  FM_RETURN_IF_ERROR(b.ids->CopyToHost(ids.data(), ids.size() * sizeof(int32_t)));
  std::vector<int64_t> pairs;  // this member's (row, k) slots, ascending
  for (size_t i = 0; i < ids.size(); ++i) {
    const int32_t e = ids[i];
    if (e < 0 || e >= E)
      return InvalidArgument(where + ": row " + std::to_string(i / k) + " routes to expert " +
                             std::to_string(e));
    const bool mine = tp->ExpertOwner(e) == me;
    if (mine && !l.w1.present[e])
      return InvalidArgument(where + ": expert " + std::to_string(e) +
                             " is this member's but not on the device");
    masked[i] = mine ? e : -1;
    if (mine) pairs.push_back(static_cast<int64_t>(i));
  }
  FM_RETURN_IF_ERROR(b.ids->CopyFromHost(masked.data(), masked.size() * sizeof(int32_t)));

  // Up: this member's pairs, then its rows of the shared expert (the rows of h after the pairs').
  const int64_t hs = b.hs, shared_h = T * k * hs;
  float* h = b.h->as<float>();
  const cuda::DevExperts none;
  const cuda::SharedExpert shared{l.s1.w.view(), l.s3.w.view(), l.s2.w.view()};
  FM_RETURN_IF_ERROR(cuda::ExpertsUpGate(l.w1.view(), l.w3.view(), b.ids->as<int32_t>(), T, k,
                                         b.y, H, limit, nullptr, h, hs));
  FM_RETURN_IF_ERROR(
      cuda::ExpertsUpGate(none, none, nullptr, T, 0, b.y, H, limit, &shared, h + shared_h, hs));
  // The shared expert's mid [T, Is] from every member's rows, back into the shared rows of h.
  if (tp->device_buffers()) {
    FM_RETURN_IF_ERROR(GatherMidOnDevice(l, tp, T, k, b));
  } else {
    std::vector<float> hrows(static_cast<size_t>(T * hs));
    FM_RETURN_IF_ERROR(b.h->CopyToHost(hrows.data(), hrows.size() * sizeof(float),
                                       shared_h * sizeof(float)));
    FM_ASSIGN_OR_RETURN(auto mids, tp->AllGather(Columns(hrows, T, hs, l.s1.first, l.s1.rows)));
    FM_ASSIGN_OR_RETURN(std::vector<float> mid,
                        JoinColumns(mids, T, std::vector<int64_t>(t, l.s1.rows)));
    const int64_t Is = l.s1.whole_rows;
    for (int64_t r = 0; r < T; ++r)
      std::memcpy(hrows.data() + r * hs, mid.data() + r * Is, Is * sizeof(float));
    FM_RETURN_IF_ERROR(b.h->CopyFromHost(hrows.data(), hrows.size() * sizeof(float),
                                         shared_h * sizeof(float)));
  }

  // Down: the pairs' outputs [T k, H], then this member's rows of the shared output.
  float* contrib = b.contrib->as<float>();
  const int64_t s2_rows = l.s2.w.rows;
  FM_RETURN_IF_ERROR(cuda::ExpertsDown(l.w2.view(), b.ids->as<int32_t>(), T, k, h, hs, nullptr,
                                       contrib));
  FM_RETURN_IF_ERROR(
      cuda::ExpertsDown(none, nullptr, T, 0, h + shared_h, hs, &shared, contrib + T * k * H));
  if (tp->device_buffers()) {
    FM_RETURN_IF_ERROR(JoinMoeOnDevice(cfg, l, tp, T, ids, b));
    return cuda::MoeCombine(contrib, b.rw, T, k, H, b.out, /*add_shared=*/true);
  }
  std::vector<float> routed(static_cast<size_t>(T * k * H)), shared_rows(T * s2_rows);
  FM_RETURN_IF_ERROR(b.contrib->CopyToHost(routed.data(), routed.size() * sizeof(float)));
  FM_RETURN_IF_ERROR(b.contrib->CopyToHost(shared_rows.data(), shared_rows.size() * sizeof(float),
                                           T * k * H * sizeof(float)));
  // The piece MoeForwardTp sends: the shared output's rows, then the pairs' outputs.
  std::vector<float> piece = Columns(shared_rows, T, s2_rows, l.s2.first, l.s2.rows);
  for (const int64_t i : pairs)
    piece.insert(piece.end(), routed.begin() + i * H, routed.begin() + (i + 1) * H);
  FM_ASSIGN_OR_RETURN(auto pieces, tp->AllGather(piece));
  std::vector<float> all_routed(routed.size()), shared_out(static_cast<size_t>(T * H));
  FM_RETURN_IF_ERROR(JoinMoePieces(cfg, l.layer, pieces, ids.data(), T, *tp, all_routed.data(),
                                   shared_out.data()));
  // [T, k + 1, H]: each row's k outputs, then its shared output (MoeCombine's layout).
  std::vector<float> slots(static_cast<size_t>(T * (k + 1) * H));
  for (int64_t r = 0; r < T; ++r) {
    std::memcpy(slots.data() + r * (k + 1) * H, all_routed.data() + r * k * H,
                k * H * sizeof(float));
    std::memcpy(slots.data() + (r * (k + 1) + k) * H, shared_out.data() + r * H, H * sizeof(float));
  }
  FM_RETURN_IF_ERROR(b.contrib->CopyFromHost(slots.data(), slots.size() * sizeof(float)));
  return cuda::MoeCombine(contrib, b.rw, T, k, H, b.out, /*add_shared=*/true);
}

}  // namespace fm
