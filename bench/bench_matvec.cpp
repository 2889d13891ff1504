// Matmul throughput at decode and prefill shapes: bytes/s counts the weight bytes read
// (QWeight::bytes(), scales included) per call, so T=1 shows how close decode gets to the
// memory bandwidth, reported alongside as the `mem_bw` counter of the BM_ReadBandwidth probe.
//   bench_matvec --benchmark_counters_tabular=true
#include <benchmark/benchmark.h>

#include <cstring>
#include <memory>
#include <random>
#include <vector>

#include "common/membw.h"
#include "common/thread_pool.h"
#include "kernels/cpu/matvec.h"

namespace fm {
namespace {

constexpr int kFormatF32 = 0, kFormatBF16 = 1, kFormatFP8 = 2, kFormatFP4 = 3;

// Random bytes are valid weights in every format (FP8 NaN codes only change values, not
// speed); scales are kept near 2^-8 so nothing overflows.
struct BenchWeight {
  QWeight w;
  std::vector<uint8_t> data, scale;
  BenchWeight(int format, int64_t rows, int64_t cols) {
    static const WeightFormat kF[] = {WeightFormat::kF32, WeightFormat::kBF16,
                                      WeightFormat::kFP8Block, WeightFormat::kFP4Block32};
    w.format = kF[format];
    w.rows = rows;
    w.cols = cols;
    const size_t n = static_cast<size_t>(rows * cols);
    const size_t nbytes = format == kFormatF32 ? 4 * n : format == kFormatBF16 ? 2 * n
                          : format == kFormatFP8 ? n : n / 2;
    data.resize(nbytes);
    std::mt19937 rng(1);
    for (size_t i = 0; i < nbytes; ++i) data[i] = static_cast<uint8_t>(rng() & 0x3F);  // finite
    if (format == kFormatFP8) scale.assign(static_cast<size_t>((rows + 127) / 128 * ((cols + 127) / 128)), 119);
    if (format == kFormatFP4) scale.assign(static_cast<size_t>(rows * (cols / 32)), 119);
    w.data = data.data();
    w.scale = scale.empty() ? nullptr : scale.data();
  }
};

ThreadPool* Pool(int threads) {
  static std::unique_ptr<ThreadPool> pools[9];
  if (!pools[threads]) pools[threads] = std::make_unique<ThreadPool>(threads);
  return pools[threads].get();
}

// Args: format, rows, cols, T, threads[, hot]. Several copies of the weight are cycled so the
// working set is well beyond the caches, as in a decode step; hot = 1 keeps one small copy in
// L2 instead, which shows the decode's compute bound (cold/hot near 1: compute-bound).
void BM_Matmul(benchmark::State& state) {
  const int format = static_cast<int>(state.range(0));
  const int64_t rows = state.range(1), cols = state.range(2), T = state.range(3);
  ThreadPool* pool = Pool(static_cast<int>(state.range(4)));
  const size_t one = BenchWeight(format, 1, cols).w.bytes() * static_cast<size_t>(rows);
  const bool hot = state.range(5) != 0;
  const int copies = hot ? 1 : static_cast<int>(std::max<size_t>(1, (256u << 20) / one));
  std::vector<std::unique_ptr<BenchWeight>> ws;
  for (int i = 0; i < copies; ++i) ws.push_back(std::make_unique<BenchWeight>(format, rows, cols));
  std::vector<float> x(static_cast<size_t>(T * cols), 0.5f), y(static_cast<size_t>(T * rows));
  int k = 0;
  for (auto _ : state) {
    Matmul(ws[k]->w, x.data(), T, y.data(), pool);
    benchmark::DoNotOptimize(y.data());
    k = (k + 1) % copies;
  }
  const double bytes = static_cast<double>(ws[0]->w.bytes());
  state.SetBytesProcessed(static_cast<int64_t>(bytes) * state.iterations());
  state.counters["weight_GBps"] =
      benchmark::Counter(bytes * 1e-9, benchmark::Counter::kIsIterationInvariantRate);
  state.counters["GMACps"] = benchmark::Counter(
      static_cast<double>(rows * cols * T) * 1e-9, benchmark::Counter::kIsIterationInvariantRate);
}

void DecodeShapes(benchmark::internal::Benchmark* b) {
  b->ArgNames({"fmt", "rows", "cols", "T", "thr", "hot"});
  for (int thr : {1, 2})
    for (int64_t T : {1, 4, 16}) {
      b->Args({kFormatFP8, 4096, 4096, T, thr, 0});
      b->Args({kFormatFP4, 2048, 4096, T, thr, 0});
      b->Args({kFormatFP4, 4096, 2048, T, thr, 0});
      b->Args({kFormatBF16, 4096, 4096, T, thr, 0});
      b->Args({kFormatBF16, 16384, 2048, T, thr, 0});   // the head: 4 KiB rows
      b->Args({kFormatF32, 2048, 4096, T, thr, 0});
    }
  b->Args({kFormatFP8, 4096, 4096, 256, 2, 0});
  b->Args({kFormatFP4, 2048, 4096, 256, 2, 0});
  // In L2 (512 KiB of weights), one thread.
  b->Args({kFormatFP8, 256, 2048, 1, 1, 1});
  b->Args({kFormatFP4, 512, 2048, 1, 1, 1});
  b->Args({kFormatBF16, 128, 2048, 1, 1, 1});
  b->UseRealTime();
}
BENCHMARK(BM_Matmul)->Apply(DecodeShapes);

void BM_ReadBandwidth(benchmark::State& state) {
  ThreadPool* pool = Pool(static_cast<int>(state.range(0)));
  double gbps = 0.0;
  for (auto _ : state) gbps = MeasureReadBandwidthGBps(pool, 512u << 20);
  state.counters["mem_bw_GBps"] = gbps;
}
BENCHMARK(BM_ReadBandwidth)->ArgName("thr")->Arg(1)->Arg(2)->Iterations(1)->UseRealTime();

}  // namespace
}  // namespace fm

BENCHMARK_MAIN();
