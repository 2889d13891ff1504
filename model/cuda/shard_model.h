// ShardModel on a CUDA device (docs/gpu.md "Device shard"): the shard's weights resident in
// device memory (uploaded once, in their checkpoint formats), each sequence's decode state on the
// device (window ring, compressed entries, indexer keys, compressor pending rows), and the
// T = 1 step of every layer queued on one stream from kernels/cuda with no host round trip
// inside it. What depends on the position (rows, counts, the token) and which sequences' caches a
// step's rows use are written by the host into small device buffers before each step, so a
// decode step of B sequences is captured once per batch-size bucket as a CUDA graph and replayed
// for any sequences at any positions. A prefill of T tokens runs in batched steps (decode ==
// prefill, as on CPU). Same interface and results as the CPU ShardModel within float rounding
// (tests/gpu: logits within 1e-3).
#pragma once
#include <memory>

#include "common/status.h"
#include "model/checkpoint.h"
#include "model/forward.h"

namespace fm {

// kGraph: a decode step of B sequences (one token each) replays the CUDA graph of its bucket
// (docs/gpu.md: 1, 2, 4, ... 32 rows, padded), captured on the bucket's first step (the
// default); kEager: every step launches its kernels (vLLM's enforce-eager: for comparing and
// debugging). With an expert executor (EP) the step is eager: it waits for the host mid-layer.
enum class CudaStepMode { kGraph, kEager };

// Binds ckpt's selection and uploads it to CUDA device `device`. Without CUDA in the build, or
// without such a device: an error that says so. No MTP block on the device yet (has_mtp false).
Result<std::unique_ptr<ShardModel>> CreateCudaShardModel(const Checkpoint& ckpt, int device,
                                                         CudaStepMode mode = CudaStepMode::kGraph);

// The core device kernels stream FP8/FP4 weights with (kernels/cuda/ops.h SetWeightPath) for the
// whole process: f32 FMAs (the default, measured on the H200) or the tensor cores (mma.sync,
// gemv_tc.cuh; not yet measured). Set it before a shard's first step and leave it: a shard captures
// a CUDA graph at each batch bucket's first step, and a graph keeps the core it was captured
// with. Without CUDA in the build: an error that says so.
enum class CudaWeightCore { kFma, kTensorCore };
Status SetCudaWeightCore(CudaWeightCore core);

// Launch overlap (kernels/cuda/ops.h SetLaunchOverlap: programmatic dependent launch, and the
// weight kernels' L2 prefetch before they wait) for the whole process; bit-identical results,
// off by default until a GPU run measures it. Set it before a shard's first step, as above.
Status SetCudaLaunchOverlap(bool on);

// After a failed step on device `device`: OK when it still works, else the error that ended
// this process's context on it (kernels/cuda DeviceHealth: no later call can succeed). OK
// without CUDA in the build (no device shard runs there).
Status CudaDeviceHealth(int device);

// Read bandwidth of CUDA device `device` in GB/s (kernels/cuda MeasureReadBandwidth over 1 GiB),
// what `flashmesh bench decode --device cuda:N` divides its weight traffic by.
Result<double> CudaReadBandwidthGbps(int device);

}  // namespace fm
