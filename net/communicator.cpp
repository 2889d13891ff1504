#include "net/communicator.h"

#include <chrono>
#include <mutex>
#include <optional>
#include <thread>

namespace fm::net {

namespace {

using Clock = std::chrono::steady_clock;

Millis Remaining(Clock::time_point deadline) {
  const auto left = std::chrono::duration_cast<Millis>(deadline - Clock::now());
  return left.count() > 0 ? left : Millis(0);
}

class TcpCommunicator final : public Communicator {
 public:
  TcpCommunicator(Transport* t, std::vector<CommMember> members, int rank)
      : t_(t), members_(std::move(members)), rank_(rank), held_(members_.size()) {}

  int rank() const override { return rank_; }
  int size() const override { return static_cast<int>(members_.size()); }
  const std::string& name(int rank) const override { return members_[rank].name; }

  // Connections are made on demand, so a member that restarted rejoins without the others
  // reloading: the lower rank of a pair dials (retrying until the deadline, the peer may still
  // be starting), the higher one waits to be dialed.
  Status EnsureConnected(int peer, uint64_t step, Clock::time_point deadline) {
    Status st;
    while (!t_->IsConnected(name(peer))) {
      FM_RETURN_IF_ERROR(sends_.Check(step));
      if (Clock::now() >= deadline)
        return st.ok() ? DeadlineExceeded("peer '" + name(peer) + "' did not connect in time") : st;
      if (peer < rank_) {
        st = t_->WaitForPeer(name(peer), std::min(Remaining(deadline), kAbortPoll));
        if (!st.ok() && st.code() != Code::kDeadlineExceeded) return st;
        st = Status::Ok();   // a slice ran out, not the call
        continue;
      }
      st = t_->Connect(name(peer), members_[peer].address, std::min(Remaining(deadline), Millis(2000)));
      if (st.ok() || st.code() == Code::kUnauthenticated) return st;
      std::this_thread::sleep_for(Millis(50));
    }
    return Status::Ok();
  }

  Result<std::vector<Frame>> AllToAllV(FrameKind kind, uint64_t step, uint32_t tag,
                                       const std::vector<CommBuffer>& send,
                                       Millis timeout) override {
    FM_RETURN_IF_ERROR(CheckBufferCount(send.size()));
    const auto deadline = Clock::now() + timeout;
    // Sends never wait for the peer to read (the transport drains every connection into its
    // queue), so "send to all, then receive from all" cannot deadlock.
    for (int r = 0; r < size(); ++r)
      if (r != rank_) FM_RETURN_IF_ERROR(Send(r, kind, step, tag, send[r], Remaining(deadline)));
    std::vector<Frame> recv(size());
    for (int r = 0; r < size(); ++r)
      if (r != rank_) {
        FM_ASSIGN_OR_RETURN(recv[r], Recv(r, kind, step, tag, Remaining(deadline)));
      }
    return recv;
  }

  Status Send(int peer, FrameKind kind, uint64_t step, uint32_t tag, const CommBuffer& buf,
              Millis timeout) override {
    FM_RETURN_IF_ERROR(CheckPeer(peer));
    if (buf.device)
      return InvalidArgument("send to rank " + std::to_string(peer) +
                             ": a device buffer, but the TCP communicator sends host memory");
    const auto deadline = Clock::now() + timeout;
    FM_RETURN_IF_ERROR(EnsureConnected(peer, step, deadline)
                           .Wrap("EP rank " + std::to_string(peer) + " (" + name(peer) + ")"));
    FM_ASSIGN_OR_RETURN(FrameHeader h, HeaderFor(peer, kind, step, tag, buf));
    const std::string who = "EP rank " + std::to_string(peer) + " (" + name(peer) + ")";
    return sends_
        .Send(step, name(peer),
              [&] { return t_->Send(name(peer), h, buf.data, buf.nbytes, Remaining(deadline)); })
        .Wrap(who);
  }

  Result<Frame> Recv(int peer, FrameKind kind, uint64_t step, uint32_t tag,
                     Millis timeout) override {
    FM_RETURN_IF_ERROR(CheckPeer(peer));
    const auto deadline = Clock::now() + timeout;
    const std::string who = "EP rank " + std::to_string(peer) + " (" + name(peer) + ")";
    if (peer > rank_) FM_RETURN_IF_ERROR(EnsureConnected(peer, step, deadline).Wrap(who));  // we dial
    while (true) {
      FM_RETURN_IF_ERROR(sends_.Check(step).Wrap(who));
      Frame f;
      if (std::optional<Frame> held = TakeHeld(peer)) {
        f = std::move(*held);
      } else {
        // Waits in short slices so that AbortStep is seen promptly.
        Result<Frame> got = t_->Recv(name(peer), std::min(Remaining(deadline), kAbortPoll));
        if (!got.ok()) {
          if (got.status().code() != Code::kDeadlineExceeded) return got.status().Wrap(who);
          if (Clock::now() < deadline) continue;
          return DeadlineExceeded(who + ": no " + FrameKindName(kind) + " of step " + std::to_string(step) +
                                  " tag " + std::to_string(tag) + " within " +
                                  std::to_string(timeout.count()) + " ms");
        }
        f = std::move(got).value();
      }
      const FrameHeader& h = f.header;
      if (h.kind == kind && h.step_id == step && h.tag == tag) return f;
      // Step ids only grow: frames of an older step belong to a step that was aborted (a
      // member failed mid-step) and are skipped.
      if (h.step_id < step) continue;
      if (h.step_id > step) {
        // The peer sends all of a step's frames before the next step's, so it gave this step
        // up; the frame belongs to the step it is running now.
        const std::string later = std::to_string(h.step_id);
        Hold(peer, std::move(f));
        return Unavailable(who + " gave up step " + std::to_string(step) + " (it is on step " + later + ")");
      }
      // Out of step: the group cannot continue on this connection.
      t_->Disconnect(name(peer));
      return Internal(who + " sent " + FrameKindName(h.kind) + " step " + std::to_string(h.step_id) +
                      " tag " + std::to_string(h.tag) + ", expected " + FrameKindName(kind) +
                      " step " + std::to_string(step) + " tag " + std::to_string(tag));
    }
  }

  void AbortStep(uint64_t step) override { sends_.Abort(step, t_); }

 private:
  static constexpr Millis kAbortPoll{20};   // longest a wait goes without looking at AbortStep

  std::optional<Frame> TakeHeld(int peer) {
    std::lock_guard<std::mutex> lock(held_mu_);
    std::optional<Frame> f = std::move(held_[peer]);
    held_[peer].reset();
    return f;
  }

  void Hold(int peer, Frame f) {
    std::lock_guard<std::mutex> lock(held_mu_);
    held_[peer] = std::move(f);
  }

  Transport* t_;
  std::vector<CommMember> members_;
  int rank_;
  AbortableSends sends_;   // the step a reset aborted, and the sends it cuts short
  std::mutex held_mu_;
  std::vector<std::optional<Frame>> held_;   // per rank: a frame read ahead of its step
};

}  // namespace

Status AbortableSends::Send(uint64_t step, const std::string& peer,
                            const std::function<Status()>& send) {
  {
    std::lock_guard<std::mutex> lock(mu_);
    if (step != 0 && step == aborted_)
      return Unavailable("step " + std::to_string(step) + " aborted by a reset");
    in_flight_.emplace(peer, step);
  }
  const Status st = send();
  {
    std::lock_guard<std::mutex> lock(mu_);
    if (auto it = in_flight_.find(peer); it != in_flight_.end()) in_flight_.erase(it);
  }
  if (!st.ok()) FM_RETURN_IF_ERROR(Check(step));
  return st;
}

void AbortableSends::Abort(uint64_t step, Transport* t) {
  std::lock_guard<std::mutex> lock(mu_);
  aborted_ = step;
  if (step == 0) return;
  for (const auto& [peer, s] : in_flight_)
    if (s == step) t->Disconnect(peer);
}

Status AbortableSends::Check(uint64_t step) const {
  std::lock_guard<std::mutex> lock(mu_);
  if (step != 0 && step == aborted_)
    return Unavailable("step " + std::to_string(step) + " aborted by a reset");
  return Status::Ok();
}

Result<std::unique_ptr<Communicator>> MakeTcpCommunicator(Transport* transport,
                                                          std::vector<CommMember> members,
                                                          int rank) {
  if (members.empty()) return InvalidArgument("EP group: no members");
  if (rank < 0 || rank >= static_cast<int>(members.size()))
    return InvalidArgument("EP group: rank " + std::to_string(rank) + " outside [0, " +
                           std::to_string(members.size()) + ")");
  for (size_t i = 0; i < members.size(); ++i)
    for (size_t j = 0; j < i; ++j)
      if (members[i].name == members[j].name)
        return InvalidArgument("EP group: member '" + members[i].name + "' listed twice");
  return std::unique_ptr<Communicator>(
      std::make_unique<TcpCommunicator>(transport, std::move(members), rank));
}

}  // namespace fm::net
