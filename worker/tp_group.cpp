#include "worker/tp_group.h"

#include <algorithm>
#include <cstring>
#include <string>

namespace fm {

CommTpGroup::CommTpGroup(net::Communicator* comm, std::vector<int64_t> expert_begin,
                         net::Millis timeout)
    : comm_(comm), expert_begin_(std::move(expert_begin)), timeout_(timeout) {}

int CommTpGroup::ExpertOwner(int32_t e) const {
  // expert_begin_ is ascending; the owner is the last member whose range starts at or below e.
  auto it = std::upper_bound(expert_begin_.begin(), expert_begin_.end(), e);
  return std::clamp(static_cast<int>(it - expert_begin_.begin()) - 1, 0, size() - 1);
}

Result<std::vector<std::vector<float>>> CommTpGroup::AllGather(std::span<const float> mine) {
  const int n = size(), me = rank();
  const uint32_t tag = next_tag_++;
  const net::CommBuffer buf{net::FrameDType::kF32, {static_cast<uint32_t>(mine.size())},
                            mine.data(), mine.size() * sizeof(float)};
  FM_ASSIGN_OR_RETURN(std::vector<net::Frame> in,
                      comm_->AllToAllV(net::FrameKind::kTpGather, step_, tag,
                                       std::vector<net::CommBuffer>(n, buf), Wait()));
  bytes_sent_ += static_cast<uint64_t>(n - 1) * buf.nbytes;
  std::vector<std::vector<float>> pieces(n);
  for (int r = 0; r < n; ++r) {
    if (r == me) {
      pieces[r].assign(mine.begin(), mine.end());
      continue;
    }
    const net::Frame& f = in[r];
    if (f.header.dtype != net::FrameDType::kF32 || f.header.rank != 1 ||
        f.payload.size() != f.header.numel() * sizeof(float))
      return InvalidArgument("tensor-parallel gather " + std::to_string(tag) + " of step " +
                             std::to_string(step_) + ": malformed piece from member " +
                             std::to_string(r) + " (" + comm_->name(r) + ")");
    pieces[r].resize(f.header.numel());
    if (!f.payload.empty()) std::memcpy(pieces[r].data(), f.payload.data(), f.payload.size());
  }
  return pieces;
}

Status CommTpGroup::AllGatherInPlace(float* all, const std::vector<int64_t>& counts) {
  const int n = size(), me = rank();
  const uint32_t tag = next_tag_++;
  if (static_cast<int>(counts.size()) != n)
    return InvalidArgument("tensor-parallel gather " + std::to_string(tag) + ": " +
                           std::to_string(counts.size()) + " counts for " + std::to_string(n) +
                           " members");
  std::vector<net::RecvTarget> into(n);
  int64_t at = 0;
  for (int r = 0; r < n; ++r) {
    into[r] = {all + at, static_cast<size_t>(counts[r]) * sizeof(float), /*device=*/true};
    at += counts[r];
  }
  const net::CommBuffer buf{net::FrameDType::kF32, {static_cast<uint32_t>(counts[me])},
                            into[me].data, into[me].capacity, /*device=*/true};
  const std::vector<net::CommBuffer> send(n, buf);
  FM_ASSIGN_OR_RETURN(std::vector<net::FrameHeader> in,
                      comm_->AllToAllVInto(net::FrameKind::kTpGather, step_, tag, send, into,
                                           Wait()));
  bytes_sent_ += static_cast<uint64_t>(n - 1) * buf.nbytes;
  for (int r = 0; r < n; ++r) {
    if (r == me) continue;
    if (in[r].dtype != net::FrameDType::kF32 || in[r].numel() != static_cast<uint64_t>(counts[r]))
      return InvalidArgument("tensor-parallel gather " + std::to_string(tag) + " of step " +
                             std::to_string(step_) + ": member " + std::to_string(r) + " (" +
                             comm_->name(r) + ") sent " + std::to_string(in[r].numel()) +
                             " values, expected " + std::to_string(counts[r]));
  }
  return Status::Ok();
}

}  // namespace fm
