#include "common/thread_pool.h"

#include <algorithm>
#include <chrono>
#include <climits>

#if defined(__linux__)
#include <linux/futex.h>
#include <sys/syscall.h>
#include <unistd.h>
#endif

namespace fm {
namespace {

// How long a thread polls before it blocks: longer than the gaps between the kernels of one
// decode step (attention and the router run on one thread; measured gaps exceed 100 us, and
// a 100 us spin halved decode speed on 2 cores), short enough that an idle pool gives its
// cores back soon. After kSpinHot the poll yields each time, so other processes on the same
// cores (pipeline stages of a local cluster) still run.
constexpr auto kSpinHot = std::chrono::microseconds(50);
constexpr auto kSpin = std::chrono::microseconds(2000);

inline void CpuRelax() {
#if defined(__x86_64__) || defined(__i386__)
  __builtin_ia32_pause();
#endif
}

// Blocks while *a == old (or returns at once if it is not). std::atomic::wait in libstdc++ 12
// goes through a shared condition variable and a broadcast per notify; a private futex wakes
// just this address, and only when a sleeper is counted.
void SleepWhile(std::atomic<uint32_t>& a, uint32_t old) {
#if defined(__linux__)
  syscall(SYS_futex, reinterpret_cast<uint32_t*>(&a), FUTEX_WAIT_PRIVATE, old, nullptr, nullptr, 0);
#else
  a.wait(old, std::memory_order_acquire);
#endif
}
void WakeAll(std::atomic<uint32_t>& a) {
#if defined(__linux__)
  syscall(SYS_futex, reinterpret_cast<uint32_t*>(&a), FUTEX_WAKE_PRIVATE, INT_MAX, nullptr, nullptr, 0);
#else
  a.notify_all();
#endif
}

}  // namespace

// Waits until a != old: polls for kSpin, then sleeps. The sleeper count and the value are
// both seq_cst, so either the waker sees the sleeper or the sleeper sees the new value.
uint32_t ThreadPool::AwaitChange(std::atomic<uint32_t>& a, uint32_t old) {
  const auto start = std::chrono::steady_clock::now();
  bool hot = true;
  for (int i = 0;; ++i) {
    const uint32_t v = a.load(std::memory_order_acquire);
    if (v != old) return v;
    if (hot) {
      CpuRelax();
      if ((i & 63) == 63) hot = std::chrono::steady_clock::now() - start < kSpinHot;
    } else {
      std::this_thread::yield();
      if (std::chrono::steady_clock::now() - start > kSpin) break;
    }
  }
  for (;;) {
    sleepers_.fetch_add(1);
    if (a.load() == old) SleepWhile(a, old);
    sleepers_.fetch_sub(1);
    const uint32_t v = a.load(std::memory_order_acquire);
    if (v != old) return v;
  }
}

void ThreadPool::Publish(std::atomic<uint32_t>& a, uint32_t v) {
  a.store(v);
  if (sleepers_.load() > 0) WakeAll(a);
}


ThreadPool::ThreadPool(int threads) {
  if (threads <= 0) threads = static_cast<int>(std::max(1u, std::thread::hardware_concurrency()));
  for (int i = 1; i < threads; ++i) workers_.emplace_back([this, i] { WorkerLoop(i); });
}

ThreadPool::~ThreadPool() {
  stop_ = true;
  pending_.store(static_cast<uint32_t>(workers_.size()), std::memory_order_relaxed);
  Publish(generation_, generation_.load() + 1);
  for (auto& t : workers_) t.join();
}

void ThreadPool::ParallelFor(size_t n, size_t grain,
                             const std::function<void(size_t, size_t)>& fn) {
  if (n == 0) return;
  grain = std::max<size_t>(grain, 1);
  const size_t max_parts = (n + grain - 1) / grain;
  const int parts = static_cast<int>(std::min<size_t>(max_parts, size()));
  if (parts <= 1) {
    fn(0, n);
    return;
  }
  const size_t chunk = (n + parts - 1) / parts;
  job_ = &fn;
  job_n_ = n;
  job_chunk_ = chunk;
  job_parts_ = parts;
  pending_.store(static_cast<uint32_t>(workers_.size()), std::memory_order_relaxed);
  Publish(generation_, generation_.load() + 1);  // only this thread writes generation_
  std::exception_ptr error;
  try {
    fn(0, std::min(chunk, n));  // part 0 on the caller
  } catch (...) {
    error = std::current_exception();
  }
  for (uint32_t left = pending_.load(std::memory_order_acquire); left != 0;)
    left = AwaitChange(pending_, left);
  job_ = nullptr;
  {
    std::lock_guard<std::mutex> lock(error_mu_);
    if (!error) error = error_;
    error_ = nullptr;
  }
  if (error) std::rethrow_exception(error);
}

void ThreadPool::WorkerLoop(int index) {
  uint32_t seen = 0;
  for (;;) {
    seen = AwaitChange(generation_, seen);
    if (stop_) return;
    if (index < job_parts_) {
      const size_t begin = job_chunk_ * static_cast<size_t>(index);
      const size_t end = std::min(job_n_, begin + job_chunk_);
      if (begin < end) {
        try {
          (*job_)(begin, end);
        } catch (...) {
          std::lock_guard<std::mutex> lock(error_mu_);
          if (!error_) error_ = std::current_exception();
        }
      }
    }
    if (pending_.fetch_sub(1) == 1 && sleepers_.load() > 0) WakeAll(pending_);
  }
}

}  // namespace fm
