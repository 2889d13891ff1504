// Tensor parallelism on the device shard (model/tp.h; docs/gpu.md "Tensor parallel on the
// device"): on a group that takes device memory (NCCL) the pieces a member exchanges go GPU to
// GPU (TpGroup::AllGatherInPlace into a scratch, then CopyRowPieces joins them); otherwise
// through the host (a copy of its piece out, TpGroup::AllGather, a copy of the joined rows in).
// The exchanges are driven by the host, so a tensor-parallel step runs eagerly.
// Every output element is still computed on one member by the same kernel as in a shard of its
// own (GemvTask::plan_rows, experts rows), so the result has the single device shard's bits.
#pragma once
#include <cstdint>

#include "common/status.h"
#include "kernels/cuda/device.h"
#include "model/config.h"
#include "model/cuda/device_weights.h"
#include "model/tp.h"

namespace fm {

// full [T, t * width] (device, from byte 0) <- every member's [T, width] piece side by side,
// this member's read from device `mine` (from byte 0). full may be mine. all: scratch of at
// least t * T * width floats (the device path's gathered pieces).
Status GatherColumnsOnDevice(TpGroup* tp, const cuda::DeviceBuffer& mine, int64_t T,
                             int64_t width, cuda::DeviceBuffer* full, cuda::DeviceBuffer* all);

// A layer's MoE on a member (MoeForwardTp's device twin): out [T, H] from the normed input y
// [T, H] and the routing ids / weights [T, k] every member computed alike. This member runs its
// rows of the shared expert and the (row, k) pairs of its experts; the rest is gathered.
// Scratch: h (>= T (k + 1) rows of hs floats), contrib (>= T (k + 1) rows of H floats); for the
// device path all (>= T (k + 1) H and T Is floats: the gathered pieces) and rows (>= T k int32);
// the device path checks each before it writes.
struct MoeTpBuffers {
  const float* y = nullptr;
  cuda::DeviceBuffer* ids = nullptr;  // overwritten: other members' experts masked to -1
  const float* rw = nullptr;
  cuda::DeviceBuffer* h = nullptr;
  int64_t hs = 0;
  cuda::DeviceBuffer* contrib = nullptr;
  float* out = nullptr;
  cuda::DeviceBuffer* all = nullptr;
  cuda::DeviceBuffer* rows = nullptr;
};
Status MoeTpOnDevice(const ModelConfig& cfg, const DevLayer& l, TpGroup* tp, int64_t T,
                     const MoeTpBuffers& b);

}  // namespace fm
