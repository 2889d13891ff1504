#include "launch/local_cluster.h"

#include "common/log.h"

namespace fm {

bool IsLocalHost(const std::string& host) { return IsLoopback(host) || host == "0.0.0.0"; }

Result<std::vector<std::unique_ptr<ChildProcess>>> StartLocalCluster(const ClusterConfig& cfg,
                                                                     const LocalClusterArgs& args) {
  const std::string binary = SelfBinary();
  std::vector<std::unique_ptr<ChildProcess>> children;
  auto start = [&](const std::string& name, std::vector<std::string> argv,
                   const std::vector<std::string>& extra) -> Status {
    argv.insert(argv.end(), extra.begin(), extra.end());
    FM_ASSIGN_OR_RETURN(auto child, ChildProcess::Start(name, binary, argv, args.output));
    FM_LOG(kInfo, "launch") << "started " << name << " (pid " << child->pid() << ")";
    children.push_back(std::move(child));
    return Status::Ok();
  };
  for (const auto& n : cfg.nodes) {
    if (!IsLocalHost(n.control.host)) {
      FM_LOG(kInfo, "launch") << "node " << n.name << " is remote (" << n.control.ToString()
                              << "): start it there with `flashmesh worker`";
      continue;
    }
    FM_RETURN_IF_ERROR(start("worker " + n.name,
                             {"worker", "--config", args.config_path, "--node", n.name},
                             args.worker_args));
  }
  FM_RETURN_IF_ERROR(
      start("coordinator", {"coordinator", "--config", args.config_path}, args.coordinator_args));
  return children;
}

}  // namespace fm
