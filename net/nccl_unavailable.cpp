// net/nccl_communicator.h in a build without NCCL (no CUDA toolkit, or the sanitizer and fuzz
// builds): the backend is absent and says so; the worker turns this into a LoadShard error.
#include "net/nccl_communicator.h"

namespace fm::net {
namespace {
Status NotBuilt() {
  return Unavailable("this flashmesh was built without NCCL (CUDA toolkit with nccl.h and "
                     "libnccl not found at configure time); use transport: tcp");
}
}  // namespace

bool NcclBuilt() { return false; }

Result<std::string> NcclNewUniqueId() { return NotBuilt(); }

Result<std::unique_ptr<NcclCommunicator>> MakeNcclCommunicator(std::vector<CommMember>, int, int,
                                                               const std::string&,
                                                               const std::string&) {
  return NotBuilt();
}

}  // namespace fm::net
