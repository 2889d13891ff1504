// Hardware profile of a node: what the cost model (cost_model.h) needs to predict speed.
// Built-in profiles (nodes[].profile in the cluster YAML; values below are the defaults):
//
//   name  mem_bw_gbps  decode_eff  memory_gb  compute_tflops  link_gbps  link_latency_us
//   gb10      270         0.85        128          100           200           10
//   h200     4430         0.17        141          989           400            5
//   cpu     probed        0.6       probed     0.04 x cores      10           50
//
// Where each figure comes from:
// - gb10 (DGX Spark): 273 GB/s LPDDR5x and 128 GB are NVIDIA's specification (the
//   measured ~270 reported for it is what we take); 200 Gb/s is its ConnectX-7 RoCE port.
//   decode_eff 0.85 is an assumption (no GB10 was lent to this project): with it tp2 of the
//   real model predicts ~31 tok/s, the low end of the 30-45 tok/s vLLM reports on two Sparks.
//   compute 100 TFLOPS: 1/8 of the 1 PFLOP sparse-FP4 specification (dense BF16 class), an
//   estimate. The 10 us latency is an assumption for one small message over RoCE with NCCL.
// - h200: 4.8 TB/s HBM3e is the specification; 4430 GB/s is the project's device read probe
//   (`bench decode --device`, docs/performance.md "GPU decode"); decode_eff 0.17 is what the
//   project's CUDA decode reached at the real model's shapes on it (same section, 2026-12-04):
//   raise it with `bench decode`'s bw_efficiency as the kernels improve. 141 GB and 989 TFLOPS
//   (dense BF16) are the specification; 400 Gb/s / 5 us is one NDR InfiniBand port per GPU.
// - cpu: the memory bandwidth is probed at start (common/membw.h, all cores, 256 MiB),
//   memory is the host's physical memory. decode_eff 0.6 is `bench decode`'s bw_efficiency on
//   the project's CPU kernels (0.58-0.71, docs/performance.md). 40 GFLOP/s a core is an
//   estimate (AVX2 FMA peak ~100 at 3 GHz, the tiled kernels reach about half at best). The
//   link is loopback TCP plus a gRPC step: 10 Gb/s and 50 us are estimates.
// Any field may be overridden per node: `profile: { name: gb10, link_gbps: 100 }`.
#pragma once
#include <string>
#include <vector>

#include "common/status.h"

namespace fm {

struct HardwareProfile {
  std::string name;               // the built-in it starts from: gb10 | h200 | cpu
  double mem_bw_gbps = 0;         // device memory read bandwidth, GB/s (1e9 B/s); 0 = not probed
  double decode_efficiency = 1;   // share of mem_bw a decode step reaches, (0, 1]
  double memory_gb = 0;           // device memory, GB (1e9 B); shown (planning uses memory_gib)
  double compute_tflops = 0;      // matrix throughput for prefill, 1e12 FLOP/s
  double link_gbps = 0;           // network bandwidth, Gb/s (1e9 bit/s)
  double link_latency_us = 0;     // one message, one way
  bool probed = false;            // cpu: the figures above were measured on this host

  double effective_bytes_per_s() const { return mem_bw_gbps * 1e9 * decode_efficiency; }
  double link_bytes_per_s() const { return link_gbps * 1e9 / 8; }
};

// The names of the built-in profiles, in the order above.
const std::vector<std::string>& HardwareProfileNames();
// A built-in profile; NotFound naming the known ones for anything else. `cpu` comes back with
// mem_bw_gbps, memory_gb and compute_tflops 0: ProbeHostProfile fills them.
Result<HardwareProfile> BuiltinHardwareProfile(const std::string& name);
// The profile a node gets when the YAML names none: cpu for `device: cpu`, gb10 for cuda:N.
const char* DefaultProfileName(int cuda_device);

// Fills the host-measured fields of a `cpu` profile that the YAML left unset (memory read
// bandwidth with every core, physical memory, compute from the core count). The probe runs
// once per process (~0.3 s) and its result is reused.
void ProbeHostProfile(HardwareProfile* p);

}  // namespace fm
