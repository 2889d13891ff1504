#include "worker/ep_expert_executor.h"

#include <algorithm>
#include <cstring>

namespace fm {
namespace {

// Tags of one layer's three exchanges (step id in the frame header separates steps).
uint32_t Tag(int64_t layer, uint32_t part) { return static_cast<uint32_t>(layer) * 4 + part; }
constexpr uint32_t kPairsPart = 0, kRowsPart = 1, kOutPart = 2;

// Per destination rank: the distinct rows it needs (local row ids, ascending) and the pairs.
struct Outgoing {
  std::vector<int32_t> row_ids;   // local rows sent, in order
  std::vector<float> rows;        // [row_ids.size(), H]
  std::vector<int32_t> pairs;     // [p, 2]: (index into row_ids, expert)
  std::vector<int64_t> slots;     // [p]: row * k + j of the pair in the requester's layout
};

}  // namespace

EpExpertExecutor::EpExpertExecutor(const ModelConfig& cfg, std::vector<const MoeWeights*> layers,
                                   net::Communicator* comm, std::vector<int64_t> expert_begin,
                                   ThreadPool* pool, net::Millis timeout)
    : cfg_(cfg),
      layers_(std::move(layers)),
      comm_(comm),
      expert_begin_(std::move(expert_begin)),
      pool_(pool),
      timeout_(timeout) {
  stats_.tokens_per_expert.assign(cfg.n_routed_experts, 0);
}

int EpExpertExecutor::Owner(int32_t expert) const {
  // expert_begin_ is ascending; the owner is the last rank whose range starts at or below it.
  auto it = std::upper_bound(expert_begin_.begin(), expert_begin_.end(), expert);
  return static_cast<int>(it - expert_begin_.begin()) - 1;
}

Status EpExpertExecutor::Compute(const MoeWeights& w, const float* rows, int64_t n,
                                 const int32_t* pairs, int64_t p, std::vector<float>* out) const {
  const int64_t H = cfg_.hidden_size, E = cfg_.n_routed_experts;
  const int me = comm_->rank();
  out->assign(p * H, 0.0f);
  std::vector<std::vector<ExpertRowPair>> by_expert(E);
  for (int64_t i = 0; i < p; ++i) {
    const int32_t row = pairs[2 * i], e = pairs[2 * i + 1];
    if (row < 0 || row >= n || e < expert_begin_[me] || e >= expert_begin_[me + 1] ||
        !w.experts[e].loaded)
      return InvalidArgument("EP dispatch for layer " + std::to_string(w.layer) + ": pair " +
                             std::to_string(i) + " (row " + std::to_string(row) + ", expert " +
                             std::to_string(e) + ") is not this member's (experts [" +
                             std::to_string(expert_begin_[me]) + ", " +
                             std::to_string(expert_begin_[me + 1]) + "), " + std::to_string(n) +
                             " rows)");
    by_expert[e].push_back({row, i});
  }
  RunExpertGroups(w, static_cast<float>(cfg_.swiglu_limit), by_expert, H, rows, out->data(), pool_);
  return Status::Ok();
}

Status EpExpertExecutor::RunRouted(int64_t layer, const float* x, int64_t T,
                                   const int32_t* expert_ids, const float* weights,
                                   float* routed) {
  FM_ASSIGN_OR_RETURN(const MoeWeights* w, RoutedLayer(layers_, layer));
  const int64_t E = cfg_.n_routed_experts, k = cfg_.num_experts_per_tok, H = cfg_.hidden_size;
  const int R = comm_->size(), me = comm_->rank();
  std::vector<Outgoing> out(R);
  std::vector<int32_t> last_row(R, -1);
  std::unique_lock<std::mutex> stats_lock(stats_mu_);   // the routing loop counts experts
  for (int64_t row = 0; row < T; ++row)
    for (int64_t j = 0; j < k; ++j) {
      const int32_t e = expert_ids[row * k + j];
      if (e < 0 || e >= E)
        return InvalidArgument("MoE layer " + std::to_string(layer) + ": row " +
                               std::to_string(row) + " routes to expert " + std::to_string(e));
      ++stats_.tokens_per_expert[e];
      const int r = Owner(e);
      Outgoing& o = out[r];
      if (last_row[r] != row) {
        last_row[r] = static_cast<int32_t>(row);
        o.row_ids.push_back(static_cast<int32_t>(row));
        o.rows.insert(o.rows.end(), x + row * H, x + (row + 1) * H);
      }
      o.pairs.push_back(static_cast<int32_t>(o.row_ids.size() - 1));
      o.pairs.push_back(e);
      o.slots.push_back(row * k + j);
    }

  // Dispatch: pairs, then rows.
  std::vector<net::CommBuffer> send_pairs(R), send_rows(R);
  for (int r = 0; r < R; ++r) {
    const Outgoing& o = out[r];
    send_pairs[r] = {net::FrameDType::kI32, {static_cast<uint32_t>(o.slots.size()), 2},
                     o.pairs.data(), o.pairs.size() * sizeof(int32_t)};
    send_rows[r] = {net::FrameDType::kF32, {static_cast<uint32_t>(o.row_ids.size()),
                                            static_cast<uint32_t>(H)},
                    o.rows.data(), o.rows.size() * sizeof(float)};
    if (r != me) stats_.dispatch_bytes += send_pairs[r].nbytes + send_rows[r].nbytes;
  }
  stats_lock.unlock();
  const std::string what = "EP layer " + std::to_string(layer) + " step " + std::to_string(step_);
  FM_ASSIGN_OR_RETURN(auto in_pairs, comm_->AllToAllV(net::FrameKind::kEpDispatch, step_,
                                                      Tag(layer, kPairsPart), send_pairs, timeout_));
  FM_ASSIGN_OR_RETURN(auto in_rows, comm_->AllToAllV(net::FrameKind::kEpDispatch, step_,
                                                     Tag(layer, kRowsPart), send_rows, timeout_));

  // Compute every request (own rows directly), then combine.
  std::vector<std::vector<float>> results(R);
  for (int r = 0; r < R; ++r) {
    if (r == me) {
      const Outgoing& o = out[me];
      FM_RETURN_IF_ERROR(Compute(*w, o.rows.data(), static_cast<int64_t>(o.row_ids.size()),
                                 o.pairs.data(), static_cast<int64_t>(o.slots.size()), &results[r]));
      continue;
    }
    const net::Frame& fp = in_pairs[r];
    const net::Frame& fr = in_rows[r];
    if (fp.header.dtype != net::FrameDType::kI32 || fp.header.rank != 2 || fp.header.dims[1] != 2 ||
        fr.header.dtype != net::FrameDType::kF32 || fr.header.rank != 2 ||
        fr.header.dims[1] != static_cast<uint32_t>(H))
      return InvalidArgument(what + ": malformed dispatch from rank " + std::to_string(r) + " (" +
                             comm_->name(r) + ")");
    // A rank that routed nothing here sends empty frames: no memcpy from a null pointer.
    std::vector<int32_t> pairs(fp.header.numel());
    if (!fp.payload.empty()) std::memcpy(pairs.data(), fp.payload.data(), fp.payload.size());
    std::vector<float> rows(fr.header.numel());
    if (!fr.payload.empty()) std::memcpy(rows.data(), fr.payload.data(), fr.payload.size());
    FM_RETURN_IF_ERROR(Compute(*w, rows.data(), fr.header.dims[0], pairs.data(), fp.header.dims[0],
                               &results[r])
                           .Wrap("from rank " + std::to_string(r) + " (" + comm_->name(r) + ")"));
  }
  std::vector<net::CommBuffer> send_out(R);
  for (int r = 0; r < R; ++r) {
    send_out[r] = {net::FrameDType::kF32,
                   {static_cast<uint32_t>(results[r].size() / std::max<int64_t>(H, 1)),
                    static_cast<uint32_t>(H)},
                   results[r].data(), results[r].size() * sizeof(float)};
    if (r != me) {
      std::lock_guard<std::mutex> lock(stats_mu_);
      stats_.combine_bytes += send_out[r].nbytes;
    }
  }
  FM_ASSIGN_OR_RETURN(auto in_out, comm_->AllToAllV(net::FrameKind::kEpCombine, step_,
                                                    Tag(layer, kOutPart), send_out, timeout_));

  // Scatter each pair's output to its (row, j) slot and sum in k order.
  std::vector<float> contrib(T * k * H, 0.0f);
  for (int r = 0; r < R; ++r) {
    const Outgoing& o = out[r];
    const float* y = results[r].data();
    if (r != me) {
      const net::Frame& f = in_out[r];
      if (f.header.dtype != net::FrameDType::kF32 || f.header.numel() != o.slots.size() * H)
        return InvalidArgument(what + ": combine from rank " + std::to_string(r) + " (" +
                               comm_->name(r) + ") has " + std::to_string(f.header.numel()) +
                               " values, expected " + std::to_string(o.slots.size() * H));
      y = reinterpret_cast<const float*>(f.payload.data());
    }
    for (size_t i = 0; i < o.slots.size(); ++i)
      std::memcpy(contrib.data() + o.slots[i] * H, y + i * H, H * sizeof(float));
  }
  CombineRouted(contrib.data(), weights, T, k, H, routed);
  return Status::Ok();
}

}  // namespace fm
