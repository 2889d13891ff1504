#include "coordinator/write_watchdog.h"

#include <algorithm>

#include "common/log.h"

namespace fm {

WriteWatchdog::WriteWatchdog(std::chrono::milliseconds limit)
    : limit_(limit), thread_([this] { Run(); }) {}

WriteWatchdog::~WriteWatchdog() {
  {
    std::lock_guard<std::mutex> lock(mu_);
    stop_ = true;
  }
  cv_.notify_all();
  thread_.join();
}

WriteWatchdog::Write::Write(WriteWatchdog* dog, grpc::ServerContext* ctx) : dog_(dog) {
  std::lock_guard<std::mutex> lock(dog_->mu_);
  id_ = dog_->next_id_++;
  dog_->writes_[id_] = {ctx, Clock::now()};
}

// Once this returns the watchdog no longer holds ctx: the handler may end and free it.
WriteWatchdog::Write::~Write() {
  std::lock_guard<std::mutex> lock(dog_->mu_);
  dog_->writes_.erase(id_);
}

void WriteWatchdog::Run() {
  // Checked at a tenth of the limit (at least every 10 ms, at most every second): a stalled
  // write ends between 1 and 1.1 limits after it began.
  const auto tick = std::clamp<std::chrono::milliseconds>(limit_ / 10, std::chrono::milliseconds(10),
                                                          std::chrono::milliseconds(1000));
  std::unique_lock<std::mutex> lock(mu_);
  while (!stop_) {
    cv_.wait_for(lock, tick);
    const Clock::time_point now = Clock::now();
    for (auto it = writes_.begin(); it != writes_.end();) {
      if (now - it->second.since < limit_) {
        ++it;
        continue;
      }
      FM_LOG(kWarn, "api") << "cancelling a Generate call whose client read nothing for "
                           << limit_.count() << " ms (" << it->second.ctx->peer() << ")";
      it->second.ctx->TryCancel();
      it = writes_.erase(it);
    }
  }
}

}  // namespace fm
