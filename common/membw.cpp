#include "common/membw.h"

#include <algorithm>
#include <chrono>
#include <cstdint>
#include <cstring>
#include <memory>
#include <vector>

namespace fm {
namespace {

typedef float f32x16 __attribute__((vector_size(64)));

constexpr size_t kPage = 4096;
constexpr int kPasses = 5;

// Sum of n floats (n a multiple of 128) with 8 independent vector accumulators, so the loads,
// not the add latency, set the pace.
float SumStream(const float* p, size_t n) {
  f32x16 acc[8] = {};
  for (size_t i = 0; i < n; i += 128) {
    for (int k = 0; k < 8; ++k) {
      f32x16 v;
      std::memcpy(&v, p + i + 16 * k, sizeof(v));
      acc[k] += v;
    }
  }
  for (int k = 1; k < 8; ++k) acc[0] += acc[k];
  float s = 0.0f;
  for (int l = 0; l < 16; ++l) s += acc[0][l];
  return s;
}

}  // namespace

ReadBandwidthProbe::ReadBandwidthProbe(ThreadPool* pool, size_t bytes)
    : pool_(pool), pages_(bytes / kPage) {
  const size_t floats_per_page = kPage / sizeof(float);
  buf_.reset(new float[pages_ * floats_per_page]);
  // First touch by the thread that later reads the page (placement on NUMA machines).
  auto fill = [&](size_t b, size_t e) {
    for (size_t i = b * floats_per_page; i < e * floats_per_page; ++i)
      buf_[i] = static_cast<float>(i & 1023) * (1.0f / 1024.0f);
  };
  if (pool_) pool_->ParallelFor(pages_, 1, fill);
  else fill(0, pages_);
}

double ReadBandwidthProbe::Measure(int passes) {
  if (pages_ == 0) return 0.0;
  const size_t floats_per_page = kPage / sizeof(float);
  const int parts = pool_ ? pool_->size() : 1;
  const size_t chunk = (pages_ + parts - 1) / parts;  // ThreadPool's chunking for grain 1
  std::vector<float> sink(static_cast<size_t>(parts) * 16, 0.0f);  // keeps the sums alive
  auto sum = [&](size_t b, size_t e) {
    const float s = SumStream(buf_.get() + b * floats_per_page, (e - b) * floats_per_page);
    sink[std::min(b / chunk, static_cast<size_t>(parts) - 1) * 16] += s;  // slot per chunk
  };
  double best_s = 1e30;
  for (int pass = 0; pass < passes; ++pass) {
    const auto t0 = std::chrono::steady_clock::now();
    if (pool_) pool_->ParallelFor(pages_, 1, sum);
    else sum(0, pages_);
    const auto t1 = std::chrono::steady_clock::now();
    best_s = std::min(best_s, std::chrono::duration<double>(t1 - t0).count());
  }
  volatile float keep = sink[0];
  (void)keep;
  return static_cast<double>(pages_ * kPage) / best_s / 1e9;
}

double MeasureReadBandwidthGBps(ThreadPool* pool, size_t bytes) {
  ReadBandwidthProbe probe(pool, bytes);
  return probe.Measure(kPasses);
}

}  // namespace fm
