// `flashmesh bench cluster`: the cluster of a YAML against the single process, in one run
// (cli/bench_cluster.cpp has the method).
#pragma once

namespace fm::cli {

// argv[0] = "bench", argv[1] = "cluster"; returns the exit code.
int BenchCluster(int argc, char** argv);

}  // namespace fm::cli
