#include "common/device_transfers.h"

#include <map>
#include <mutex>

namespace fm {
namespace {

// A copy between host and device takes microseconds at least: a mutex costs nothing beside it,
// and a map needs no bound on the device index.
std::mutex transfers_mu;
std::map<int, DeviceTransfers>& Counters() {
  static std::map<int, DeviceTransfers> counters;
  return counters;
}

}  // namespace

void CountTransfer(int device, TransferPhase phase, TransferDirection direction, size_t bytes) {
  std::lock_guard<std::mutex> lock(transfers_mu);
  DeviceTransfers& d = Counters()[device];
  TransferBytes& b = phase == TransferPhase::kLoad ? d.load : d.step;
  (direction == TransferDirection::kHostToDevice ? b.host_to_device : b.device_to_host) += bytes;
}

DeviceTransfers TransfersOf(int device) {
  std::lock_guard<std::mutex> lock(transfers_mu);
  const auto it = Counters().find(device);
  return it == Counters().end() ? DeviceTransfers{} : it->second;
}

}  // namespace fm
