// CreateCudaShardModel of a build without CUDA (FLASHMESH_CUDA OFF or no nvcc at configure).
#include "model/cuda/shard_model.h"

#include <string>

namespace fm {

Result<std::unique_ptr<ShardModel>> CreateCudaShardModel(const Checkpoint&, int device,
                                                         CudaStepMode) {
  return Unavailable("device cuda:" + std::to_string(device) +
                     ": this flashmesh was built without CUDA (no nvcc at configure time)");
}

Status SetCudaWeightCore(CudaWeightCore) {
  return Unavailable("the tensor-core choice: this flashmesh was built without CUDA (no nvcc at "
                     "configure time)");
}

Status SetCudaLaunchOverlap(bool) {
  return Unavailable("launch overlap: this flashmesh was built without CUDA (no nvcc at "
                     "configure time)");
}

Status CudaDeviceHealth(int) { return Status::Ok(); }

Result<double> CudaReadBandwidthGbps(int device) {
  return Unavailable("device cuda:" + std::to_string(device) +
                     ": this flashmesh was built without CUDA (no nvcc at configure time)");
}

}  // namespace fm
