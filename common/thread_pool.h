// A fixed pool of worker threads with one primitive: ParallelFor over [0, n) in static,
// contiguous chunks. Every output index is computed by exactly one thread with a loop that
// does not depend on the thread count, so results are bit-identical for any pool size.
#pragma once
#include <condition_variable>
#include <cstddef>
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
  // Chunks are at least `grain` long. Not reentrant: do not call from inside fn.
  void ParallelFor(size_t n, size_t grain, const std::function<void(size_t, size_t)>& fn);

 private:
  void WorkerLoop(int index);
  std::vector<std::thread> workers_;
  std::mutex mu_;
  std::condition_variable cv_work_, cv_done_;
  const std::function<void(size_t, size_t)>* job_ = nullptr;
  size_t job_n_ = 0, job_chunk_ = 0;
  int job_parts_ = 0;
  int pending_ = 0;
  unsigned long generation_ = 0;
  bool stop_ = false;
};

}  // namespace fm
