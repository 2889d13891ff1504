// Streaming read-bandwidth probe: what the decode benchmark divides its achieved weight
// traffic by (bw_efficiency), measured with the same threads the kernels use.
#pragma once
#include <cstddef>
#include <memory>

#include "common/thread_pool.h"

namespace fm {

// Sums a freshly allocated buffer of `bytes` (rounded down to whole 4 KiB pages; use one much
// larger than the caches) with every thread of `pool` (null: this thread only), each thread
// over its own contiguous part; returns the best of a few passes in GB/s (1e9 bytes/s).
double MeasureReadBandwidthGBps(ThreadPool* pool, size_t bytes);

// The same probe, allocated and first-touched once, measured as often as wanted: bench decode
// interleaves it with the decode rounds, so each ratio compares like with like on a machine
// whose bandwidth drifts.
class ReadBandwidthProbe {
 public:
  ReadBandwidthProbe(ThreadPool* pool, size_t bytes);
  // Best of `passes` passes, GB/s.
  double Measure(int passes);

 private:
  ThreadPool* pool_;
  size_t pages_;
  std::unique_ptr<float[]> buf_;
};

}  // namespace fm
