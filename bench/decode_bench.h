// `flashmesh bench decode`: single-process decode speed against the machine's memory
// bandwidth (the CLI parses the flags, cli/cmd_bench.cpp). Prefills `context` tokens, then
// decodes `tokens` tokens one at a time (greedy), and reports
//     tok_per_s               decode steps per second (embed + layers + head of one token)
//     weight_bytes_per_token  bytes of weights one step reads: every dense tensor of the layers
//                             (attention, compressor, indexer, hc, router, shared expert, norms),
//                             the routed experts the step actually selected, head and final
//                             norm, one embedding row: InspectReport's bytes per token
//                             (model/inspect.h) with the routed experts counted as run
//     mem_bw_gbps             streaming read bandwidth, measured here with the same threads
//                             after each of 8 decode rounds (median)
//     bw_efficiency           weight traffic / bandwidth of each round, the median round
//   With --streams B > 1, B sequences decode together (one step = B rows, as a serving batch):
//     tok_per_s               every stream's tokens per second together; weight bytes are
//                             those of a step (dense once, the distinct experts of its rows)
//     streams_speedup         (device) that aggregate over the single stream's, same run
//   On a device (--device cuda:N) also
//     h2d_bytes_per_token     host->device copy bytes of the single stream's decode steps per
//     d2h_bytes_per_token     token, and device->host (common/device_transfers.h; the weight
//                             upload is not in them)
//   and extrapolates to the full model (FullModelConfig: all 43 layers of DeepSeek-V4-Flash for
//   a `mkmodel --preset flash --layers N` checkpoint, else the checkpoint itself):
//     head_ms                 embed + Logits of one token, timed alone (median of 8)
//     head_rich_ms            the same with a sampling pick with 20 top logprobs, penalties and
//                             min-p (not in the prediction; what such a request adds)
//     layer_ms                (time per token - head_ms) / the checkpoint's layers
//     full_model_ms_per_token layer_ms * the full model's layers + head_ms
//     full_model_floor_ms     the full model's weight bytes per token / the measured bandwidth
#pragma once
#include <cstdint>
#include <string>

#include "common/status.h"

namespace fm::bench {

struct DecodeOptions {
  std::string model;
  int64_t context = 64, tokens = 32, streams = 1;
  int threads = 0;
  int cuda_device = -1;  // --device cuda:N; -1 = CPU
  bool eager = false;    // --eager: no CUDA graph
  bool tensor_cores = false;  // --weight-core tc: FP8/FP4 weights through the tensor cores
  bool launch_overlap = false;  // --launch-overlap: programmatic dependent launch + L2 prefetch
  bool json = false;
};

// Runs the benchmark on the CPU shard (cuda_device < 0) or the device one, and prints its
// report on stdout (one JSON object with json).
Status RunDecodeBench(const DecodeOptions& o);

}  // namespace fm::bench
