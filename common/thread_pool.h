// A fixed pool of worker threads with one primitive: ParallelFor over [0, n) in static,
// contiguous chunks. Every output index is computed by exactly one thread with a loop that
// does not depend on the thread count, so results are bit-identical for any pool size.
//
// A decode step makes hundreds of short ParallelFor calls; waking a sleeping thread costs tens
// of microseconds on a VM, so after each job the workers (and the caller, waiting for them)
// spin for a short while before they block (kSpin in thread_pool.cpp).
#pragma once
#include <atomic>
#include <cstddef>
#include <cstdint>
#include <exception>
#include <functional>
#include <mutex>
#include <thread>
#include <vector>

namespace fm {

class ThreadPool {
 public:
  // threads <= 0 means std::thread::hardware_concurrency().
  explicit ThreadPool(int threads);
  ~ThreadPool();
  ThreadPool(const ThreadPool&) = delete;
  ThreadPool& operator=(const ThreadPool&) = delete;

  int size() const { return static_cast<int>(workers_.size()) + 1; }
  // Calls fn(begin, end) on disjoint chunks covering [0, n); the caller thread takes part.
  // Chunks are at least `grain` long. Not reentrant: do not call from inside fn. A chunk that
  // throws (bad_alloc) does not end the process or leave the pool mid-job: every chunk is
  // waited for, then the first exception is rethrown here.
  void ParallelFor(size_t n, size_t grain, const std::function<void(size_t, size_t)>& fn);

 private:
  void WorkerLoop(int index);
  uint32_t AwaitChange(std::atomic<uint32_t>& a, uint32_t old);
  void Publish(std::atomic<uint32_t>& a, uint32_t v);
  std::vector<std::thread> workers_;
  // The job of the current generation. Written by the caller before it bumps generation_, read
  // by the workers after they see the bump; every worker acknowledges every generation (pending_)
  // before the caller returns, so no worker reads a job that is being rewritten.
  const std::function<void(size_t, size_t)>* job_ = nullptr;
  size_t job_n_ = 0, job_chunk_ = 0;
  int job_parts_ = 0;
  bool stop_ = false;
  std::atomic<uint32_t> generation_{0};
  std::atomic<uint32_t> pending_{0};
  std::atomic<int> sleepers_{0};  // threads inside SleepWhile on either word
  std::mutex error_mu_;
  std::exception_ptr error_;   // a worker's chunk threw (the first); under error_mu_
};

}  // namespace fm
