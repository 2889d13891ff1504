// The manifold buffer of a device shard (model/activations.h): X in device memory of one CUDA
// device, grown rarely. Its host copies and row copies run on a stream of its own and return
// when done, so whoever touches X next (the shard's stream, an NCCL link's stream, the host)
// finds it complete without an event to wait on.
#pragma once
#include <memory>

#include "model/activations.h"

namespace fm {

// Activations of row_floats floats a row on CUDA device `device` (no memory until Resize).
Result<std::unique_ptr<Activations>> NewDeviceActivations(int device, int64_t row_floats);

}  // namespace fm
