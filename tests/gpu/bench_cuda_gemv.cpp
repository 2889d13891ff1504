// GEMV bandwidth on the GPU for the model's decode shapes: bytes of weights + scales read per
// call / time per call. Each shape rotates over enough weight copies (>= 512 MiB) that L2
// (50 MiB on H100/H200) cannot hold them, so the number is DRAM bandwidth, as in decode.
// Usage: bench_cuda_gemv  (prints one line per shape; exit 1 on a CUDA error; 0 devices: skip).
#include <cuda_runtime.h>

#include <cstdio>
#include <random>
#include <vector>

#include "kernels/cuda/check.cuh"
#include "kernels/cuda/ops.h"

namespace fm {
namespace {

struct Shape {
  const char* name;
  WeightFormat format;
  int64_t rows, cols;
};

const Shape kShapes[] = {
    {"attn.wq_b      FP8", WeightFormat::kFP8Block, 32768, 1024},
    {"attn.wo_b      FP8", WeightFormat::kFP8Block, 4096, 8192},
    {"shared w1      FP8", WeightFormat::kFP8Block, 2048, 4096},
    {"expert w1      FP4", WeightFormat::kFP4Block32, 2048, 4096},
    {"expert w2      FP4", WeightFormat::kFP4Block32, 4096, 2048},
    {"head          BF16", WeightFormat::kBF16, 129280, 4096},
    {"hc_attn_fn     F32", WeightFormat::kF32, 24, 16384},
};

size_t ElemBytesTimes2(WeightFormat f) {
  switch (f) {
    case WeightFormat::kF32: return 8;
    case WeightFormat::kBF16: return 4;
    case WeightFormat::kFP8Block: return 2;
    case WeightFormat::kFP4Block32: return 1;
  }
  return 0;
}

Status BenchShape(const Shape& s) {
  QWeight host{s.format, s.rows, s.cols, nullptr, nullptr};
  const size_t n = static_cast<size_t>(s.rows * s.cols);
  std::vector<uint8_t> data(n * ElemBytesTimes2(s.format) / 2), scale;
  std::mt19937 rng(1);
  // Small codes only (no NaN/inf patterns): low 6 bits of each byte, scales near 1.
  for (auto& b : data) b = static_cast<uint8_t>(rng() & 0x37);
  if (s.format == WeightFormat::kFP8Block)
    scale.assign(static_cast<size_t>((s.rows + 127) / 128 * ((s.cols + 127) / 128)), 127);
  if (s.format == WeightFormat::kFP4Block32) scale.assign(n / 32, 127);
  host.data = data.data();
  host.scale = scale.empty() ? nullptr : scale.data();

  const size_t bytes = host.bytes();
  const int copies = static_cast<int>(std::max<size_t>(1, (512ull << 20) / bytes + 1));
  std::vector<cuda::DeviceWeight> weights;
  for (int i = 0; i < copies; ++i) {
    FM_ASSIGN_OR_RETURN(cuda::DeviceWeight w, cuda::UploadWeight(host));
    weights.push_back(std::move(w));
  }
  std::vector<float> xh(s.cols, 0.5f);
  FM_ASSIGN_OR_RETURN(cuda::DeviceBuffer x, cuda::Upload(xh.data(), xh.size() * 4));
  FM_ASSIGN_OR_RETURN(cuda::DeviceBuffer y, cuda::DeviceBuffer::Alloc(s.rows * 4));

  for (int i = 0; i < copies; ++i)  // warm-up: first-touch and launch setup
    FM_RETURN_IF_ERROR(cuda::Gemv(weights[i].view(), x.as<float>(), y.as<float>()));
  cudaEvent_t start, stop;
  FM_CUDA_RETURN_IF_ERROR(cudaEventCreate(&start));
  FM_CUDA_RETURN_IF_ERROR(cudaEventCreate(&stop));
  const int iters = std::max(20, 4 * copies);
  FM_CUDA_RETURN_IF_ERROR(cudaEventRecord(start));
  for (int i = 0; i < iters; ++i)
    FM_RETURN_IF_ERROR(cuda::Gemv(weights[i % copies].view(), x.as<float>(), y.as<float>()));
  FM_CUDA_RETURN_IF_ERROR(cudaEventRecord(stop));
  FM_RETURN_IF_ERROR(cuda::Synchronize());
  float ms = 0;
  FM_CUDA_RETURN_IF_ERROR(cudaEventElapsedTime(&ms, start, stop));
  cudaEventDestroy(start);
  cudaEventDestroy(stop);
  const double us = 1000.0 * ms / iters;
  std::printf("%s [%6lld, %5lld] %8.2f MiB  %8.2f us  %7.1f GB/s\n", s.name,
              static_cast<long long>(s.rows), static_cast<long long>(s.cols),
              bytes / double(1 << 20), us, bytes / (us * 1e3));
  return Status::Ok();
}

}  // namespace
}  // namespace fm

int main() {
  if (fm::cuda::DeviceCount() == 0) {
    std::printf("bench_cuda_gemv: no CUDA device, skipped\n");
    return 0;
  }
  std::printf("bench_cuda_gemv on %s\n", fm::cuda::DeviceDescription(0).c_str());
  for (const auto& s : fm::kShapes) {
    const fm::Status st = BenchShape(s);
    if (!st.ok()) {
      std::fprintf(stderr, "bench_cuda_gemv: %s: %s\n", s.name, st.ToString().c_str());
      return 1;
    }
  }
  return 0;
}
