// NCCL smoke test: the library links and matches its header; a 1-rank communicator all-reduces
// on one GPU (the identity). The all-reduce skips without a CUDA device.
#include <gtest/gtest.h>
#include <nccl.h>

#include <vector>

#include "kernels/cuda/device.h"

namespace fm {
namespace {

TEST(NcclSmoke, LibraryVersionMatchesHeader) {
  int version = 0;
  ASSERT_EQ(ncclGetVersion(&version), ncclSuccess);
  // NCCL_VERSION_CODE = major*10000 + minor*100 + patch; the patch level may differ.
  EXPECT_EQ(version / 100, NCCL_VERSION_CODE / 100) << "libnccl " << version << " vs nccl.h "
                                                   << NCCL_VERSION_CODE;
}

TEST(NcclSmoke, OneRankAllReduceIsIdentity) {
  if (cuda::DeviceCount() == 0) GTEST_SKIP() << "no CUDA device";
  ASSERT_EQ(cudaSetDevice(0), cudaSuccess);
  ncclUniqueId id;
  ASSERT_EQ(ncclGetUniqueId(&id), ncclSuccess);
  ncclComm_t comm = nullptr;
  const ncclResult_t init = ncclCommInitRank(&comm, 1, id, 0);
  ASSERT_EQ(init, ncclSuccess) << ncclGetErrorString(init);

  const size_t n = 4099;
  std::vector<float> in(n);
  for (size_t i = 0; i < n; ++i) in[i] = 0.25f * static_cast<float>(i) - 100.0f;
  auto send = cuda::Upload(in.data(), n * sizeof(float));
  auto recv = cuda::DeviceBuffer::Alloc(n * sizeof(float));
  ASSERT_TRUE(send.ok()) << send.status().ToString();
  ASSERT_TRUE(recv.ok()) << recv.status().ToString();
  const ncclResult_t r = ncclAllReduce(send->data(), recv->data(), n, ncclFloat, ncclSum, comm,
                                       /*stream=*/nullptr);
  EXPECT_EQ(r, ncclSuccess) << ncclGetErrorString(r);
  const Status sync = cuda::Synchronize();
  EXPECT_TRUE(sync.ok()) << sync.ToString();
  std::vector<float> out(n, 0.0f);
  ASSERT_TRUE(recv->CopyToHost(out.data(), n * sizeof(float)).ok());
  EXPECT_EQ(out, in);
  EXPECT_EQ(ncclCommDestroy(comm), ncclSuccess);
}

}  // namespace
}  // namespace fm
