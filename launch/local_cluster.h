// The processes of a cluster YAML on this machine, for `up` and `bench cluster`: a
// `flashmesh worker` for every node whose control host is local, then the coordinator.
#pragma once
#include <memory>
#include <string>
#include <vector>

#include "common/status.h"
#include "config/cluster_config.h"
#include "launch/child_process.h"

namespace fm {

struct LocalClusterArgs {
  std::string config_path;                    // the YAML, passed on as --config
  std::vector<std::string> worker_args;       // after `worker --config FILE --node NAME`
  std::vector<std::string> coordinator_args;  // after `coordinator --config FILE`
  ChildOutput output;
};

// A loopback address (IsLoopback: 127.0.0.0/8, localhost, ::1) or 0.0.0.0.
bool IsLocalHost(const std::string& host);

// Starts this binary (SelfBinary) as the worker of every node of `cfg` whose control host is
// local (a remote one is logged: start it there with `flashmesh worker`), then as the
// coordinator; children named "worker NAME" and "coordinator" (the last one).
Result<std::vector<std::unique_ptr<ChildProcess>>> StartLocalCluster(const ClusterConfig& cfg,
                                                                     const LocalClusterArgs& args);

}  // namespace fm
