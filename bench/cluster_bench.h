// `flashmesh bench cluster`: a cluster YAML's pipeline against the single process, in one run
// (the CLI parses the flags, cli/cmd_bench.cpp; what is measured: bench/cluster_bench.cpp).
#pragma once
#include <cstdint>
#include <string>

#include "common/status.h"

namespace fm::bench {

struct ClusterBenchOptions {
  std::string config, model;
  int64_t tokens = 64, prompt = 16, streams = 8, threads = 0;   // threads > 0 when run
  bool json = false;
};

// Loads the YAML, probes the cpu profiles, starts the cluster and a `serve` of the same model
// as children of this binary, measures both, prints the report on stdout, and stops them.
Status RunClusterBench(const ClusterBenchOptions& o);

}  // namespace fm::bench
