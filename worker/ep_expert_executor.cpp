#include "worker/ep_expert_executor.h"

#include <algorithm>
#include <cstring>

namespace fm {
namespace {

// Tags of one layer's three exchanges (step id in the frame header separates steps).
uint32_t Tag(int64_t layer, uint32_t part) { return static_cast<uint32_t>(layer) * 4 + part; }
constexpr uint32_t kPairsPart = 0, kRowsPart = 1, kOutPart = 2;
constexpr uint32_t kRoundsTag = 0xFFFFFFFEu;   // a step's round count (the barrier's is ~0)

}  // namespace

EpExpertExecutor::EpExpertExecutor(const ModelConfig& cfg, ExpertRunner* runner,
                                   net::Communicator* comm, std::vector<int64_t> expert_begin,
                                   net::Millis timeout, int64_t max_rows)
    : cfg_(cfg),
      runner_(runner),
      comm_(comm),
      expert_begin_(std::move(expert_begin)),
      timeout_(timeout),
      max_pairs_(std::max<int64_t>(max_rows, 1) * cfg.num_experts_per_tok) {
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
                                                send, Wait()));
  int64_t most = mine;
  for (int r = 0; r < R; ++r) {
    if (r == me) continue;
    const net::Frame& f = in[r];
    if (f.header.dtype != net::FrameDType::kI32 || f.header.numel() != 1 || f.payload.size() != 4)
      return InvalidArgument("EP step " + std::to_string(step_) + ": malformed round count from " +
                             Who(r));
    int32_t theirs = 0;
    std::memcpy(&theirs, f.payload.data(), sizeof theirs);
    if (theirs < 0 || theirs > (1 << 20))
      return InvalidArgument("EP step " + std::to_string(step_) + ": " + Who(r) + " announces " +
                             std::to_string(theirs) + " rounds");
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

Result<std::vector<EpExpertExecutor::Outgoing>> EpExpertExecutor::Route(
    int64_t layer, int64_t T, const int32_t* expert_ids) {
  const int64_t E = cfg_.n_routed_experts, k = cfg_.num_experts_per_tok;
  std::vector<Outgoing> out(comm_->size());
  std::vector<int32_t> last_row(comm_->size(), -1);
  std::lock_guard<std::mutex> lock(stats_mu_);
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
      }
      o.pairs.push_back(static_cast<int32_t>(o.row_ids.size() - 1));
      o.pairs.push_back(e);
      o.slots.push_back(row * k + j);
    }
  return out;
}

Result<std::vector<net::Frame>> EpExpertExecutor::SendPairs(int64_t layer,
                                                            const std::vector<Outgoing>& out) {
  const int R = comm_->size();
  std::vector<net::CommBuffer> send(R);
  uint64_t bytes = 0;
  for (int r = 0; r < R; ++r) {
    send[r] = {net::FrameDType::kI32, {static_cast<uint32_t>(out[r].slots.size()), 2},
               out[r].pairs.data(), out[r].pairs.size() * sizeof(int32_t)};
    if (r != comm_->rank()) bytes += send[r].nbytes;
  }
  CountBytes(bytes, 0);
  FM_ASSIGN_OR_RETURN(auto in, comm_->AllToAllV(net::FrameKind::kEpDispatch, step_,
                                                Tag(layer, kPairsPart), send, Wait()));
  for (int r = 0; r < R; ++r) {
    if (r == comm_->rank()) continue;
    const net::Frame& f = in[r];
    if (f.header.dtype != net::FrameDType::kI32 || f.header.rank != 2 || f.header.dims[1] != 2)
      return InvalidArgument(What(layer) + ": malformed dispatch pairs from " + Who(r));
    if (static_cast<int64_t>(f.header.dims[0]) > max_pairs_)
      return InvalidArgument(What(layer) + ": " + Who(r) + " sends " +
                             std::to_string(f.header.dims[0]) + " pairs, more than a step's rows x k (" +
                             std::to_string(max_pairs_) + ")");
  }
  return in;
}

Status EpExpertExecutor::CheckRows(int64_t layer, int r, const net::FrameHeader& h,
                                   int64_t pairs) const {
  if (h.dtype != net::FrameDType::kF32 || h.rank != 2 ||
      h.dims[1] != static_cast<uint32_t>(cfg_.hidden_size))
    return InvalidArgument(What(layer) + ": malformed dispatch rows from " + Who(r));
  if (static_cast<int64_t>(h.dims[0]) > pairs)   // every row sent has a pair here
    return InvalidArgument(What(layer) + ": " + Who(r) + " sends " + std::to_string(h.dims[0]) +
                           " rows for " + std::to_string(pairs) + " pairs");
  return Status::Ok();
}

Status EpExpertExecutor::AppendPairs(int64_t layer, int r, const int32_t* in, int64_t p,
                                     int64_t n, int64_t row0, std::vector<int32_t>* pairs) const {
  const int me = comm_->rank();
  const char* rp = reinterpret_cast<const char*>(in);   // [p, 2] int32, maybe unaligned
  for (int64_t i = 0; i < p; ++i) {
    int32_t row = 0, e = 0;
    std::memcpy(&row, rp + 8 * i, sizeof row);
    std::memcpy(&e, rp + 8 * i + 4, sizeof e);
    if (row < 0 || row >= n || e < expert_begin_[me] || e >= expert_begin_[me + 1])
      return InvalidArgument(What(layer) + ": pair " + std::to_string(i) + " from " + Who(r) +
                             ": row " + std::to_string(row) + ", expert " + std::to_string(e) +
                             " is not this member's (experts [" +
                             std::to_string(expert_begin_[me]) + ", " +
                             std::to_string(expert_begin_[me + 1]) + "), " + std::to_string(n) +
                             " rows)");
    pairs->push_back(static_cast<int32_t>(row0 + row));
    pairs->push_back(e);
  }
  return Status::Ok();
}

Status EpExpertExecutor::CheckCombine(int64_t layer, int r, const net::FrameHeader& h,
                                      size_t pairs) const {
  const uint64_t want = pairs * static_cast<uint64_t>(cfg_.hidden_size);
  if (h.dtype != net::FrameDType::kF32 || h.numel() != want)
    return InvalidArgument(What(layer) + ": combine from " + Who(r) + " has " +
                           std::to_string(h.numel()) + " values, expected " + std::to_string(want));
  return Status::Ok();
}

Status EpExpertExecutor::RunSlots(int64_t layer, const float* x, int64_t T,
                                  const int32_t* expert_ids, float* slots) {
  // A round without rows of a member whose experts are on a GPU serves the others there.
  if (T == 0 && runner_->device_rows()) return RunSlotsOnDevice(layer, x, T, expert_ids, slots);
  const int64_t k = cfg_.num_experts_per_tok, H = cfg_.hidden_size;
  const int R = comm_->size(), me = comm_->rank();
  FM_ASSIGN_OR_RETURN(std::vector<Outgoing> out, Route(layer, T, expert_ids));
  FM_ASSIGN_OR_RETURN(auto in_pairs, SendPairs(layer, out));
  // The rows each owner needs, in the order of its row ids.
  std::vector<std::vector<float>> rows_for(R);
  std::vector<net::CommBuffer> send_rows(R);
  uint64_t bytes = 0;
  for (int r = 0; r < R; ++r) {
    for (int32_t row : out[r].row_ids) rows_for[r].insert(rows_for[r].end(), x + row * H, x + (row + 1) * H);
    send_rows[r] = {net::FrameDType::kF32, {static_cast<uint32_t>(out[r].row_ids.size()),
                                            static_cast<uint32_t>(H)},
                    rows_for[r].data(), rows_for[r].size() * sizeof(float)};
    if (r != me) bytes += send_rows[r].nbytes;
  }
  CountBytes(bytes, 0);
  FM_ASSIGN_OR_RETURN(auto in_rows, comm_->AllToAllV(net::FrameKind::kEpDispatch, step_,
                                                     Tag(layer, kRowsPart), send_rows, Wait()));

  // Every member's requests (this member's own rows directly) as one batch of rows and pairs,
  // so the runner reads each expert's weights once for the whole layer.
  std::vector<float> rows;
  std::vector<int32_t> pairs;
  std::vector<int64_t> first_pair(R + 1, 0);
  for (int r = 0; r < R; ++r) {
    const int64_t row0 = static_cast<int64_t>(rows.size()) / H;
    const int32_t* rp = out[r].pairs.data();
    int64_t n = static_cast<int64_t>(out[r].row_ids.size()), p = static_cast<int64_t>(out[r].slots.size());
    if (r == me) {
      rows.insert(rows.end(), rows_for[r].begin(), rows_for[r].end());
    } else {
      const net::Frame& fr = in_rows[r];
      p = in_pairs[r].header.dims[0];
      FM_RETURN_IF_ERROR(CheckRows(layer, r, fr.header, p));
      n = fr.header.dims[0];
      // A rank that routed nothing here sends empty frames: no memcpy from a null pointer.
      rows.resize(rows.size() + fr.header.numel());
      if (!fr.payload.empty())
        std::memcpy(rows.data() + row0 * H, fr.payload.data(), fr.payload.size());
      rp = reinterpret_cast<const int32_t*>(in_pairs[r].payload.data());
    }
    FM_RETURN_IF_ERROR(AppendPairs(layer, r, rp, p, n, row0, &pairs));
    first_pair[r + 1] = first_pair[r] + p;
  }
  const int64_t total = first_pair[R];
  std::vector<float> results(static_cast<size_t>(total * H));
  FM_RETURN_IF_ERROR(runner_->RunPairs(layer, rows.data(), static_cast<int64_t>(rows.size()) / H,
                                       pairs.data(), total, results.data())
                         .Wrap(What(layer)));
  std::vector<net::CommBuffer> send_out(R);
  bytes = 0;
  for (int r = 0; r < R; ++r) {
    const int64_t p = first_pair[r + 1] - first_pair[r];
    send_out[r] = {net::FrameDType::kF32, {static_cast<uint32_t>(p), static_cast<uint32_t>(H)},
                   results.data() + first_pair[r] * H, static_cast<size_t>(p * H) * sizeof(float)};
    if (r != me) bytes += send_out[r].nbytes;
  }
  CountBytes(0, bytes);
  FM_ASSIGN_OR_RETURN(auto in_out, comm_->AllToAllV(net::FrameKind::kEpCombine, step_,
                                                    Tag(layer, kOutPart), send_out, Wait()));

  // Each pair's output into its (row, j) slot.
  std::fill(slots, slots + T * k * H, 0.0f);
  for (int r = 0; r < R; ++r) {
    const Outgoing& o = out[r];
    const float* y = results.data() + first_pair[r] * H;
    if (r != me) {
      FM_RETURN_IF_ERROR(CheckCombine(layer, r, in_out[r].header, o.slots.size()));
      y = reinterpret_cast<const float*>(in_out[r].payload.data());
    }
    for (size_t i = 0; i < o.slots.size(); ++i)
      std::memcpy(slots + o.slots[i] * H, y + i * H, H * sizeof(float));
  }
  return Status::Ok();
}

Result<std::vector<net::FrameHeader>> EpExpertExecutor::ExchangeOnDevice(
    DeviceRows* dev, net::FrameKind kind, int64_t layer, uint32_t part,
    const std::vector<net::CommBuffer>& send, const std::vector<net::RecvTarget>& into) {
  const uint32_t tag = Tag(layer, part);
  if (comm_->device_buffers()) return comm_->AllToAllVInto(kind, step_, tag, send, into, Wait());
  // TCP: each payload crosses the host once each way.
  const int R = comm_->size(), me = comm_->rank();
  std::vector<std::vector<uint8_t>> staged(R);
  std::vector<net::CommBuffer> host = send;
  for (int r = 0; r < R; ++r) {
    if (r == me) continue;
    staged[r].resize(send[r].nbytes);
    FM_RETURN_IF_ERROR(dev->ToHost(send[r].data, staged[r].data(), send[r].nbytes));
    host[r].data = staged[r].data();
    host[r].device = false;
  }
  FM_ASSIGN_OR_RETURN(auto in, comm_->AllToAllV(kind, step_, tag, host, Wait()));
  std::vector<net::FrameHeader> headers(R);
  for (int r = 0; r < R; ++r) {
    if (r == me) continue;
    FM_RETURN_IF_ERROR(net::Communicator::CheckFits(r, in[r].payload.size(), into[r].capacity)
                           .Wrap(What(layer)));
    FM_RETURN_IF_ERROR(dev->FromHost(in[r].payload.data(), into[r].data, in[r].payload.size()));
    headers[r] = in[r].header;
  }
  return headers;
}

Status EpExpertExecutor::RunSlotsOnDevice(int64_t layer, const float* x, int64_t T,
                                          const int32_t* expert_ids, float* slots) {
  DeviceRows* dev = runner_->device_rows();
  if (!dev)
    return InvalidArgument(What(layer) + ": rows in device memory, but this member's experts "
                           "are not on a device");
  const int64_t k = cfg_.num_experts_per_tok, H = cfg_.hidden_size;
  const size_t row_bytes = static_cast<size_t>(H) * sizeof(float);
  const int R = comm_->size(), me = comm_->rank();
  FM_ASSIGN_OR_RETURN(std::vector<Outgoing> out, Route(layer, T, expert_ids));
  FM_ASSIGN_OR_RETURN(auto in_pairs, SendPairs(layer, out));

  // Buffer 0, in rows of H: this member's rows for every owner in rank order (one gather from
  // x), then a region per other rank for the rows it sends here (at most one a pair).
  std::vector<int64_t> send_at(R + 1, 0), recv_at(R + 1, 0), pairs_in(R, 0);
  std::vector<int32_t> gather;
  for (int r = 0; r < R; ++r) {
    send_at[r + 1] = send_at[r] + static_cast<int64_t>(out[r].row_ids.size());
    gather.insert(gather.end(), out[r].row_ids.begin(), out[r].row_ids.end());
    pairs_in[r] = r == me ? static_cast<int64_t>(out[r].slots.size()) : in_pairs[r].header.dims[0];
  }
  recv_at[0] = send_at[R];
  for (int r = 0; r < R; ++r) recv_at[r + 1] = recv_at[r] + (r == me ? 0 : pairs_in[r]);
  FM_ASSIGN_OR_RETURN(float* rows, dev->Buffer(0, recv_at[R] * H));
  FM_RETURN_IF_ERROR(dev->GatherRows(x, T, gather.data(), send_at[R], rows));
  FM_RETURN_IF_ERROR(dev->Wait());
  std::vector<net::CommBuffer> send(R);
  std::vector<net::RecvTarget> into(R);
  uint64_t bytes = 0;
  for (int r = 0; r < R; ++r) {
    const int64_t n = send_at[r + 1] - send_at[r];
    send[r] = {net::FrameDType::kF32, {static_cast<uint32_t>(n), static_cast<uint32_t>(H)},
               rows + send_at[r] * H, static_cast<size_t>(n) * row_bytes, /*device=*/true};
    into[r] = {rows + recv_at[r] * H, static_cast<size_t>(pairs_in[r]) * row_bytes, true};
    if (r != me) bytes += send[r].nbytes;
  }
  CountBytes(bytes, 0);
  FM_ASSIGN_OR_RETURN(auto got, ExchangeOnDevice(dev, net::FrameKind::kEpDispatch, layer,
                                                 kRowsPart, send, into));

  // Every member's pairs over buffer 0's rows, in rank order.
  std::vector<int32_t> pairs;
  std::vector<int64_t> first_pair(R + 1, 0);
  for (int r = 0; r < R; ++r) {
    if (r == me) {
      FM_RETURN_IF_ERROR(AppendPairs(layer, r, out[r].pairs.data(), pairs_in[r],
                                     send_at[r + 1] - send_at[r], send_at[r], &pairs));
    } else {
      FM_RETURN_IF_ERROR(CheckRows(layer, r, got[r], pairs_in[r]));
      FM_RETURN_IF_ERROR(AppendPairs(layer, r,
                                     reinterpret_cast<const int32_t*>(in_pairs[r].payload.data()),
                                     pairs_in[r], got[r].dims[0], recv_at[r], &pairs));
    }
    first_pair[r + 1] = first_pair[r] + pairs_in[r];
  }

  // Buffer 1: the outputs of every pair run here (by requester), then a region per other rank
  // for the outputs of this member's pairs it ran.
  const int64_t total = first_pair[R];
  std::vector<int64_t> back_at(R + 1, total);
  for (int r = 0; r < R; ++r)
    back_at[r + 1] = back_at[r] + (r == me ? 0 : static_cast<int64_t>(out[r].slots.size()));
  FM_ASSIGN_OR_RETURN(float* res, dev->Buffer(1, back_at[R] * H));
  FM_RETURN_IF_ERROR(dev->RunPairsOnDevice(layer, rows, recv_at[R], pairs.data(), total, res)
                         .Wrap(What(layer)));
  FM_RETURN_IF_ERROR(dev->Wait());
  bytes = 0;
  for (int r = 0; r < R; ++r) {
    const int64_t p = first_pair[r + 1] - first_pair[r];
    const int64_t back = back_at[r + 1] - back_at[r];
    send[r] = {net::FrameDType::kF32, {static_cast<uint32_t>(p), static_cast<uint32_t>(H)},
               res + first_pair[r] * H, static_cast<size_t>(p) * row_bytes, true};
    into[r] = {res + back_at[r] * H, static_cast<size_t>(back) * row_bytes, true};
    if (r != me) bytes += send[r].nbytes;
  }
  CountBytes(0, bytes);
  FM_ASSIGN_OR_RETURN(got, ExchangeOnDevice(dev, net::FrameKind::kEpCombine, layer, kOutPart,
                                            send, into));

  // Slot (row, j) = the output of its pair: one gather from buffer 1.
  std::vector<int32_t> from(static_cast<size_t>(T * k), 0);
  for (int r = 0; r < R; ++r) {
    if (r != me) FM_RETURN_IF_ERROR(CheckCombine(layer, r, got[r], out[r].slots.size()));
    const int64_t base = r == me ? first_pair[me] : back_at[r];
    for (size_t i = 0; i < out[r].slots.size(); ++i)
      from[out[r].slots[i]] = static_cast<int32_t>(base + static_cast<int64_t>(i));
  }
  FM_RETURN_IF_ERROR(dev->GatherRows(res, back_at[R], from.data(), T * k, slots));
  return dev->Wait();
}

}  // namespace fm
