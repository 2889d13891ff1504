// Built-in hardware profiles and the host probe (hardware_profile.h has the figures' sources).
#include "config/hardware_profile.h"

#include <unistd.h>

#include <algorithm>
#include <mutex>
#include <thread>

#include "common/membw.h"
#include "common/thread_pool.h"

namespace fm {
namespace {

constexpr double kCpuGflopsPerCore = 40;
constexpr size_t kProbeBytes = size_t{256} << 20;   // far beyond the caches

struct HostFigures {
  double mem_bw_gbps = 0, memory_gb = 0, compute_tflops = 0;
};

HostFigures MeasureHost() {
  const int cores = static_cast<int>(std::max(1u, std::thread::hardware_concurrency()));
  ThreadPool pool(cores);
  HostFigures h;
  h.mem_bw_gbps = MeasureReadBandwidthGBps(&pool, kProbeBytes);
  const long pages = sysconf(_SC_PHYS_PAGES), page = sysconf(_SC_PAGESIZE);
  h.memory_gb = pages > 0 && page > 0 ? static_cast<double>(pages) * page / 1e9 : 0;
  h.compute_tflops = cores * kCpuGflopsPerCore / 1e3;
  return h;
}

}  // namespace

const std::vector<std::string>& HardwareProfileNames() {
  static const std::vector<std::string> names = {"gb10", "h200", "cpu"};
  return names;
}

Result<HardwareProfile> BuiltinHardwareProfile(const std::string& name) {
  HardwareProfile p;
  p.name = name;
  if (name == "gb10") {
    p.mem_bw_gbps = 270;
    p.decode_efficiency = 0.85;
    p.memory_gb = 128;
    p.compute_tflops = 100;
    p.link_gbps = 200;
    p.link_latency_us = 10;
  } else if (name == "h200") {
    p.mem_bw_gbps = 4430;
    p.decode_efficiency = 0.17;
    p.memory_gb = 141;
    p.compute_tflops = 989;
    p.link_gbps = 400;
    p.link_latency_us = 5;
  } else if (name == "cpu") {
    p.decode_efficiency = 0.6;
    p.link_gbps = 10;
    p.link_latency_us = 50;
  } else {
    std::string known;
    for (const auto& n : HardwareProfileNames()) known += (known.empty() ? "" : ", ") + n;
    return NotFound("hardware profile '" + name + "': unknown (built-in: " + known + ")");
  }
  return p;
}

const char* DefaultProfileName(int cuda_device) { return cuda_device >= 0 ? "gb10" : "cpu"; }

void ProbeHostProfile(HardwareProfile* p) {
  if (p->name != "cpu" || (p->mem_bw_gbps > 0 && p->memory_gb > 0 && p->compute_tflops > 0))
    return;
  static std::once_flag once;
  static HostFigures host;
  std::call_once(once, [] { host = MeasureHost(); });
  if (p->mem_bw_gbps <= 0) p->mem_bw_gbps = host.mem_bw_gbps;
  if (p->memory_gb <= 0) p->memory_gb = host.memory_gb;
  if (p->compute_tflops <= 0) p->compute_tflops = host.compute_tflops;
  p->probed = true;
}

}  // namespace fm
