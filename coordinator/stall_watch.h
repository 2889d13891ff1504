// StallWatch: notices when this process did not run (SIGSTOP, a VM pause, CPU starvation) from
// a thread that wakes every kTick: a gap of more than kStall between two of its wakes is a
// stall. A worker call that ran out of time while the coordinator was stalled, or just after,
// may have been answered in time: the coordinator blames itself for it, not the node
// (cluster_rpc.cpp Classify, Cluster::Heartbeat), so a pause of the coordinator marks no
// healthy worker down.
#pragma once
#include <chrono>
#include <condition_variable>
#include <deque>
#include <mutex>
#include <thread>
#include <utility>

namespace fm {

class StallWatch {
 public:
  using Clock = std::chrono::steady_clock;
  static constexpr std::chrono::milliseconds kTick{50};
  static constexpr std::chrono::milliseconds kStall{300};
  // A stall that ended less than this before a deadline still counts: the answer may have been
  // waiting, unread, when the deadline passed.
  static constexpr std::chrono::milliseconds kMargin{500};

  StallWatch();
  ~StallWatch();
  StallWatch(const StallWatch&) = delete;
  StallWatch& operator=(const StallWatch&) = delete;

  // How long this process did not run around `deadline`: the longest stall that ended after
  // deadline - kMargin, including one that is ending now (seen before this thread woke to
  // record it); 0 when none.
  std::chrono::milliseconds StalledAround(Clock::time_point deadline) const;

 private:
  void Run();

  mutable std::mutex mu_;
  std::condition_variable cv_;
  bool stop_ = false;
  Clock::time_point last_tick_;
  std::deque<std::pair<Clock::time_point, Clock::time_point>> stalls_;   // [from, to], last 16
  std::thread thread_;
};

}  // namespace fm
