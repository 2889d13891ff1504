#include "coordinator/request_stream.h"

namespace fm {

bool RequestStream::Pop(Event* ev, std::chrono::milliseconds timeout) {
  std::unique_lock<std::mutex> lock(mu_);
  if (!cv_.wait_for(lock, timeout, [&] { return !events_.empty(); })) return false;
  *ev = std::move(events_.front());
  events_.pop_front();
  return true;
}

void RequestStream::Push(Event ev) {
  std::shared_ptr<StreamWaker> waker;
  {
    std::lock_guard<std::mutex> lock(mu_);
    events_.push_back(std::move(ev));
    waker = waker_;
  }
  cv_.notify_all();
  if (waker) waker->Notify();
}

void RequestStream::SetWaker(std::shared_ptr<StreamWaker> waker) {
  std::lock_guard<std::mutex> lock(mu_);
  waker_ = std::move(waker);
}

uint64_t StreamWaker::count() const {
  std::lock_guard<std::mutex> lock(mu_);
  return count_;
}

void StreamWaker::Wait(uint64_t seen, std::chrono::milliseconds timeout) {
  std::unique_lock<std::mutex> lock(mu_);
  cv_.wait_for(lock, timeout, [&] { return count_ != seen; });
}

void StreamWaker::Notify() {
  {
    std::lock_guard<std::mutex> lock(mu_);
    ++count_;
  }
  cv_.notify_all();
}

void RequestStream::Cancel() {
  cancelled_ = true;
  std::function<void()> hook;
  {
    std::lock_guard<std::mutex> lock(mu_);
    hook = on_cancel_;
  }
  if (hook) hook();
}

}  // namespace fm
