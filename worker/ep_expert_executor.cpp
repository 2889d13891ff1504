#include "worker/ep_expert_executor.h"

#include <algorithm>
#include <cstring>

namespace fm {
namespace {

// Tags of one layer's three exchanges (step id in the frame header separates steps).
uint32_t Tag(int64_t layer, uint32_t part) { return static_cast<uint32_t>(layer) * 4 + part; }
constexpr uint32_t kPairsPart = 0, kRowsPart = 1, kOutPart = 2;
constexpr uint32_t kRoundsTag = 0xFFFFFFFEu;   // a step's round count (the barrier's is ~0)

// Per destination rank: the distinct rows it needs (local row ids, ascending) and the pairs.
struct Outgoing {
  std::vector<int32_t> row_ids;   // local rows sent, in order
  std::vector<float> rows;        // [row_ids.size(), H]
  std::vector<int32_t> pairs;     // [p, 2]: (index into row_ids, expert)
  std::vector<int64_t> slots;     // [p]: row * k + j of the pair in the requester's layout
};

}  // namespace

EpExpertExecutor::EpExpertExecutor(const ModelConfig& cfg, ExpertRunner* runner,
                                   net::Communicator* comm, std::vector<int64_t> expert_begin,
                                   net::Millis timeout)
    : cfg_(cfg),
      runner_(runner),
      comm_(comm),
      expert_begin_(std::move(expert_begin)),
      timeout_(timeout) {
  stats_.tokens_per_expert.assign(cfg.n_routed_experts, 0);
}

int EpExpertExecutor::Owner(int32_t expert) const {
  // expert_begin_ is ascending; the owner is the last rank whose range starts at or below it.
  auto it = std::upper_bound(expert_begin_.begin(), expert_begin_.end(), expert);
  return static_cast<int>(it - expert_begin_.begin()) - 1;
}

Result<int64_t> EpExpertExecutor::AgreeRounds(int64_t rounds) {
  const int R = comm_->size(), me = comm_->rank();
  const int32_t mine = static_cast<int32_t>(std::clamp<int64_t>(rounds, 0, 1 << 20));
  std::vector<net::CommBuffer> send(R, {net::FrameDType::kI32, {1}, &mine, sizeof mine});
  FM_ASSIGN_OR_RETURN(auto in, comm_->AllToAllV(net::FrameKind::kControl, step_, kRoundsTag,
                                                send, timeout_));
  int64_t most = mine;
  for (int r = 0; r < R; ++r) {
    if (r == me) continue;
    const net::Frame& f = in[r];
    if (f.header.dtype != net::FrameDType::kI32 || f.header.numel() != 1 || f.payload.size() != 4)
      return InvalidArgument("EP step " + std::to_string(step_) + ": malformed round count from rank " +
                             std::to_string(r) + " (" + comm_->name(r) + ")");
    int32_t theirs = 0;
    std::memcpy(&theirs, f.payload.data(), sizeof theirs);
    if (theirs < 0 || theirs > (1 << 20))
      return InvalidArgument("EP step " + std::to_string(step_) + ": rank " + std::to_string(r) +
                             " (" + comm_->name(r) + ") announces " + std::to_string(theirs) +
                             " rounds");
    most = std::max<int64_t>(most, theirs);
  }
  return most;
}

Status EpExpertExecutor::RunRouted(int64_t layer, const float* x, int64_t T,
                                   const int32_t* expert_ids, const float* weights,
                                   float* routed) {
  const int64_t k = cfg_.num_experts_per_tok, H = cfg_.hidden_size;
  std::vector<float> slots(static_cast<size_t>(T * k * H));
  FM_RETURN_IF_ERROR(RunSlots(layer, x, T, expert_ids, slots.data()));
  CombineRouted(slots.data(), weights, T, k, H, routed);
  return Status::Ok();
}

Status EpExpertExecutor::RunSlots(int64_t layer, const float* x, int64_t T,
                                  const int32_t* expert_ids, float* slots) {
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

  // Every member's requests (this member's own rows directly) as one batch of rows and pairs,
  // so the runner reads each expert's weights once for the whole layer.
  std::vector<float> rows;
  std::vector<int32_t> pairs;
  std::vector<int64_t> first_pair(R + 1, 0);
  for (int r = 0; r < R; ++r) {
    const int32_t row0 = static_cast<int32_t>(rows.size() / std::max<int64_t>(H, 1));
    const char* rp = reinterpret_cast<const char*>(out[r].pairs.data());  // [p, 2] int32
    int64_t n = static_cast<int64_t>(out[r].row_ids.size()), p = static_cast<int64_t>(out[r].slots.size());
    if (r == me) {
      rows.insert(rows.end(), out[r].rows.begin(), out[r].rows.end());
    } else {
      const net::Frame& fp = in_pairs[r];
      const net::Frame& fr = in_rows[r];
      if (fp.header.dtype != net::FrameDType::kI32 || fp.header.rank != 2 ||
          fp.header.dims[1] != 2 || fr.header.dtype != net::FrameDType::kF32 ||
          fr.header.rank != 2 || fr.header.dims[1] != static_cast<uint32_t>(H))
        return InvalidArgument(what + ": malformed dispatch from rank " + std::to_string(r) +
                               " (" + comm_->name(r) + ")");
      n = fr.header.dims[0];
      p = fp.header.dims[0];
      // A rank that routed nothing here sends empty frames: no memcpy from a null pointer.
      rows.resize(rows.size() + fr.header.numel());
      if (!fr.payload.empty())
        std::memcpy(rows.data() + row0 * H, fr.payload.data(), fr.payload.size());
      rp = reinterpret_cast<const char*>(fp.payload.data());
    }
    for (int64_t i = 0; i < p; ++i) {
      int32_t row = 0, e = 0;
      std::memcpy(&row, rp + 8 * i, sizeof row);
      std::memcpy(&e, rp + 8 * i + 4, sizeof e);
      if (row < 0 || row >= n || e < expert_begin_[me] || e >= expert_begin_[me + 1])
        return InvalidArgument(what + ": pair " + std::to_string(i) + " from rank " +
                               std::to_string(r) + " (" + comm_->name(r) + "): row " +
                               std::to_string(row) + ", expert " + std::to_string(e) +
                               " is not this member's (experts [" +
                               std::to_string(expert_begin_[me]) + ", " +
                               std::to_string(expert_begin_[me + 1]) + "), " +
                               std::to_string(n) + " rows)");
      pairs.push_back(row0 + row);
      pairs.push_back(e);
    }
    first_pair[r + 1] = first_pair[r] + p;
  }
  const int64_t total = first_pair[R];
  std::vector<float> results(static_cast<size_t>(total * H));
  FM_RETURN_IF_ERROR(runner_->RunPairs(layer, rows.data(),
                                       static_cast<int64_t>(rows.size() / std::max<int64_t>(H, 1)),
                                       pairs.data(), total, results.data())
                         .Wrap(what));
  std::vector<net::CommBuffer> send_out(R);
  for (int r = 0; r < R; ++r) {
    const int64_t p = first_pair[r + 1] - first_pair[r];
    send_out[r] = {net::FrameDType::kF32, {static_cast<uint32_t>(p), static_cast<uint32_t>(H)},
                   results.data() + first_pair[r] * H, static_cast<size_t>(p * H) * sizeof(float)};
    if (r != me) {
      std::lock_guard<std::mutex> lock(stats_mu_);
      stats_.combine_bytes += send_out[r].nbytes;
    }
  }
  FM_ASSIGN_OR_RETURN(auto in_out, comm_->AllToAllV(net::FrameKind::kEpCombine, step_,
                                                    Tag(layer, kOutPart), send_out, timeout_));

  // Each pair's output into its (row, j) slot.
  std::fill(slots, slots + T * k * H, 0.0f);
  for (int r = 0; r < R; ++r) {
    const Outgoing& o = out[r];
    const float* y = results.data() + first_pair[r] * H;
    if (r != me) {
      const net::Frame& f = in_out[r];
      if (f.header.dtype != net::FrameDType::kF32 || f.header.numel() != o.slots.size() * H)
        return InvalidArgument(what + ": combine from rank " + std::to_string(r) + " (" +
                               comm_->name(r) + ") has " + std::to_string(f.header.numel()) +
                               " values, expected " + std::to_string(o.slots.size() * H));
      y = reinterpret_cast<const float*>(f.payload.data());
    }
    for (size_t i = 0; i < o.slots.size(); ++i)
      std::memcpy(slots + o.slots[i] * H, y + i * H, H * sizeof(float));
  }
  return Status::Ok();
}

}  // namespace fm
