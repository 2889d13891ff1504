#include "coordinator/stall_watch.h"

#include <algorithm>

#include "common/log.h"

namespace fm {

StallWatch::StallWatch() : last_tick_(Clock::now()), thread_([this] { Run(); }) {}

StallWatch::~StallWatch() {
  {
    std::lock_guard<std::mutex> lock(mu_);
    stop_ = true;
  }
  cv_.notify_all();
  thread_.join();
}

void StallWatch::Run() {
  std::unique_lock<std::mutex> lock(mu_);
  while (!stop_) {
    cv_.wait_for(lock, kTick, [&] { return stop_; });
    const auto now = Clock::now();
    if (now - last_tick_ > kStall) {
      stalls_.emplace_back(last_tick_, now);
      if (stalls_.size() > 16) stalls_.pop_front();
      FM_LOG(kWarn, "coordinator") << "this process did not run for "
                                   << std::chrono::duration_cast<std::chrono::milliseconds>(now - last_tick_).count()
                                   << " ms (paused, or starved of CPU)";
    }
    last_tick_ = now;
  }
}

std::chrono::milliseconds StallWatch::StalledAround(Clock::time_point deadline) const {
  using std::chrono::duration_cast;
  using std::chrono::milliseconds;
  std::lock_guard<std::mutex> lock(mu_);
  milliseconds longest{0};
  for (const auto& [from, to] : stalls_)
    if (to >= deadline - kMargin) longest = std::max(longest, duration_cast<milliseconds>(to - from));
  const auto now = Clock::now();
  if (now - last_tick_ > kStall) longest = std::max(longest, duration_cast<milliseconds>(now - last_tick_));
  return longest;
}

}  // namespace fm
