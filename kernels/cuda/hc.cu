// Hyper-connection ops and the MoE combine on CUDA (ops.h): twins of kernels/cpu/hc.h and
// MoeCombine_kH. One block per token for hc_head, which reduces over the row; its weights run on
// thread 0 in the CPU's order. (hc_post + the next hc_pre: fused.cu HcPostPre.)
#include <cuda_runtime.h>

#include <string>

#include "kernels/cuda/check.cuh"
#include "kernels/cuda/launch.cuh"
#include "kernels/cuda/moe_combine.cuh"
#include "kernels/cuda/ops.h"

namespace fm::cuda {
namespace {

constexpr int kHcThreads = 256;
constexpr int kHcMaxStreams = 16;
constexpr int kElemThreads = 256;

__device__ float SigmoidF(float v) { return 1.0f / (1.0f + expf(-v)); }

// Sum over the block in a fixed order (a tree over the thread partials); all threads get it.
__device__ float HcBlockSum(float v) {
  __shared__ float part[kHcThreads];
  part[threadIdx.x] = v;
  __syncthreads();
  for (int half = kHcThreads / 2; half > 0; half /= 2) {
    if (threadIdx.x < half) part[threadIdx.x] += part[threadIdx.x + half];
    __syncthreads();
  }
  const float total = part[0];
  __syncthreads();
  return total;
}

// 1 / sqrt(mean(x[0..len)^2) + eps) over the block.
__device__ float BlockRmsInv(const float* x, int64_t len, float eps) {
  float ss = 0.0f;
  for (int64_t i = threadIdx.x; i < len; i += kHcThreads) ss += x[i] * x[i];
  const float mean = HcBlockSum(ss) / static_cast<float>(len);
  return 1.0f / sqrtf(mean + eps);
}

// One block per token: rinv of X[n*H], the hc_head weights (thread 0), y = sum_i pre_i X[i].
__global__ void HcHeadKernel(const float* x, const float* mix, const float* base, float scale,
                             int n, int64_t H, float hc_eps, float rms_eps, float* y) {
  KernelPrologue();
  __shared__ float pre[kHcMaxStreams];
  const int64_t t = blockIdx.x;
  const float* xt = x + t * n * H;
  const float rinv = BlockRmsInv(xt, n * H, rms_eps);
  if (threadIdx.x == 0)
    for (int i = 0; i < n; ++i) pre[i] = SigmoidF(mix[t * n + i] * rinv * scale + base[i]) + hc_eps;
  __syncthreads();
  for (int64_t h = threadIdx.x; h < H; h += kHcThreads) {
    float acc = 0.0f;
    for (int i = 0; i < n; ++i) acc += pre[i] * xt[i * H + h];
    y[t * H + h] = acc;
  }
}

// One thread per (t, k, h): X'[k][h] = post[k] * out[h] + sum_j comb[j*n+k] * X[j][h].
__global__ void HcPostKernel(const float* x, const HcPostInput out, const float* post,
                             const float* comb, int64_t T, int n, int64_t H, float* x_new) {
  KernelPrologue();
  const int64_t i = static_cast<int64_t>(blockIdx.x) * kElemThreads + threadIdx.x;
  if (i >= T * n * H) return;
  const int64_t h = i % H, k = (i / H) % n, t = i / (H * n);
  const float* xt = x + t * n * H;
  const float* ct = comb + t * n * n;
  float acc = post[t * n + k] * HcPostInputAt(out, t, H, h);
  for (int j = 0; j < n; ++j) acc += ct[j * n + k] * xt[j * H + h];
  x_new[i] = acc;
}

// One thread per (t, h): y[h] = sum_j w[j] * contrib[j][h], j ascending.
// contrib rows per token: k, or k + 1 with the shared expert's row last (added with weight 1).
__global__ void MoeCombineKernel(const float* contrib, const float* w, int64_t T, int k,
                                 bool add_shared, int64_t H, float* y) {
  KernelPrologue();
  const int64_t i = static_cast<int64_t>(blockIdx.x) * kElemThreads + threadIdx.x;
  if (i >= T * H) return;
  y[i] = MoeCombineAt(contrib, w, i / H, k, add_shared, H, i % H);
}

Status CheckStreams(const char* op, int64_t T, int64_t n, int64_t H) {
  if (T < 0) return InvalidArgument(std::string(op) + ": tokens " + std::to_string(T) + " < 0");
  if (n < 1 || n > kHcMaxStreams)
    return InvalidArgument(std::string(op) + ": hc streams " + std::to_string(n) + " outside [1, " +
                           std::to_string(kHcMaxStreams) + "]");
  if (H < 1) return InvalidArgument(std::string(op) + ": hidden " + std::to_string(H) + " < 1");
  return Status::Ok();
}

}  // namespace

Status HcHead(const float* x, const float* mix, const float* base, float scale, int64_t T,
              int64_t n, int64_t H, float hc_eps, float rms_eps, float* y) {
  FM_RETURN_IF_ERROR(CheckStreams("HcHead", T, n, H));
  if (T == 0) return Status::Ok();
  if (!x || !mix || !base || !y) return InvalidArgument("HcHead: null device pointer");
  return Launch("HcHeadKernel", HcHeadKernel, static_cast<unsigned>(T), kHcThreads, 0, x, mix, base,
                scale, static_cast<int>(n), H, hc_eps, rms_eps, y);
}

Status CheckHcPostInput(const char* op, const HcPostInput& in) {
  if (in.contrib && (in.out || !in.w || in.k < 1 || in.k > 1024))
    return InvalidArgument(std::string(op) + ": expert slots need their weights and top_k in [1, 1024] " +
                           "and no dense output beside them (top_k " + std::to_string(in.k) + ")");
  return Status::Ok();
}

Status HcPost(const float* x, const HcPostInput& out, const float* post, const float* comb,
              int64_t T, int64_t n, int64_t H, float* x_new) {
  FM_RETURN_IF_ERROR(CheckStreams("HcPost", T, n, H));
  FM_RETURN_IF_ERROR(CheckHcPostInput("HcPost", out));
  if (T == 0) return Status::Ok();
  if (!x || !out.present() || !post || !comb || !x_new)
    return InvalidArgument("HcPost: null device pointer");
  if (x == x_new) return InvalidArgument("HcPost: x_new must not alias x");
  return Launch("HcPostKernel", HcPostKernel, BlocksFor(T * n * H, kElemThreads), kElemThreads, 0,
                x, out, post, comb, T, static_cast<int>(n), H, x_new);
}

Status MoeCombine(const float* contrib, const float* w, int64_t T, int64_t k, int64_t H, float* y,
                  bool add_shared) {
  if (T < 0 || k < 1 || H < 1)
    return InvalidArgument("MoeCombine: tokens " + std::to_string(T) + ", top_k " + std::to_string(k) +
                           ", hidden " + std::to_string(H) + " (want tokens >= 0, top_k >= 1, hidden >= 1)");
  if (T == 0) return Status::Ok();
  if (!contrib || !w || !y) return InvalidArgument("MoeCombine: null device pointer");
  return Launch("MoeCombineKernel", MoeCombineKernel, BlocksFor(T * H, kElemThreads), kElemThreads,
                0, contrib, w, T, static_cast<int>(k), add_shared, H, y);
}

}  // namespace fm::cuda
