// RequestStream: one request's events (tokens, then a finish or an error), filled by the
// scheduler and drained by the API handler; StreamWaker lets one reader wait on several.
#pragma once
#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <deque>
#include <functional>
#include <memory>
#include <mutex>

#include "common/status.h"
#include "flashmesh/v1/api.pb.h"

namespace fm {

// Wakes the reader of several streams (an HTTP request of n choices) when any of them gets an
// event: it notes count(), looks at every stream, and waits for another event if none had one.
class StreamWaker {
 public:
  uint64_t count() const;
  // Until count() differs from `seen`, or `timeout`.
  void Wait(uint64_t seen, std::chrono::milliseconds timeout);
  void Notify();

 private:
  mutable std::mutex mu_;
  std::condition_variable cv_;
  uint64_t count_ = 0;
};

// One request's stream of events, filled by the scheduler, drained by the API handler.
class RequestStream {
 public:
  struct Event {
    enum Kind { kToken, kFinish, kError, kPrompt } kind = kToken;
    flashmesh::v1::TokenEvent token;
    flashmesh::v1::Finish finish;
    Status error;
    flashmesh::v1::PromptLogprobs prompt = {};   // kPrompt: once, before the first token
  };
  // Waits up to `timeout` for the next event.
  bool Pop(Event* ev, std::chrono::milliseconds timeout);
  void Push(Event ev);
  // Ends the request (the client left): it leaves the queue, or its sequence is freed.
  void Cancel();
  bool cancelled() const { return cancelled_; }
  // Every later Push also notifies `waker`.
  void SetWaker(std::shared_ptr<StreamWaker> waker);

 private:
  friend class Scheduler;   // sets on_cancel_ at Submit
  std::mutex mu_;
  std::condition_variable cv_;
  std::deque<Event> events_;
  std::atomic<bool> cancelled_{false};
  std::function<void()> on_cancel_;   // wakes the scheduler (if it still exists); set by Submit
  std::shared_ptr<StreamWaker> waker_;
};

}  // namespace fm
