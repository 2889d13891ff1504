// Bytes copied between host and device memory, per device of this process (docs/gpu.md
// "Host<->device traffic"): kernels/cuda counts every copy it makes (DeviceBuffer's copies,
// Upload) and the NCCL communicator its staging copies; `flashmesh status` (through the
// worker's Stats) and `flashmesh bench decode --device` read them. Plain C++ in fm_common, so
// every build reads the same counters: a build without CUDA counts nothing and reads zeros.
// Workers of one process on one device share that device's counters.
#pragma once
#include <cstddef>
#include <cstdint>

namespace fm {

enum class TransferDirection { kHostToDevice, kDeviceToHost };

// kLoad: a device buffer made with its contents once (cuda::Upload: weights, constants, the
// one-time set-up of a shard); kStep: every other copy, the traffic of the steps. "Bytes per
// token" divides the kStep bytes only.
enum class TransferPhase { kLoad, kStep };

struct TransferBytes {
  uint64_t host_to_device = 0, device_to_host = 0;
};

struct DeviceTransfers {
  TransferBytes load, step;
};

// Adds `bytes` to device `device`'s counter of `phase` and `direction`. Thread-safe.
void CountTransfer(int device, TransferPhase phase, TransferDirection direction, size_t bytes);

// Everything counted for `device` since the process started (zeros for a device never copied
// to or from).
DeviceTransfers TransfersOf(int device);

}  // namespace fm
