// flashmesh worker --config FILE --node NAME [--model DIR] [--threads N]
#include <grpcpp/grpcpp.h>

#include <cstdio>
#include <thread>

#include "cli/commands.h"
#include "cli/daemon_flags.h"
#include "common/log.h"
#include "coordinator/cluster_config.h"
#include "worker/grpc_status.h"
#include "net/tcp_transport.h"
#include "worker/worker_service.h"

namespace fm::cli {

int CmdWorker(int argc, char** argv) {
  const char* usage =
      "usage: flashmesh worker --config FILE --node NAME [--model DIR] [--threads N]\n"
      "                        [--log-level LEVEL]\n"
      "  serves the Worker control API of node NAME (nodes[].control of the cluster YAML) and\n"
      "  waits for the coordinator to tell it which shard to load. --model overrides the\n"
      "  checkpoint directory on this machine. Stops on SIGINT/SIGTERM.\n";
  auto flags = Flags::Parse(argc, argv, {"config", "node", "model", "threads", "log-level"}, {"help"});
  if (!flags.ok()) {
    std::fprintf(stderr, "worker: %s\n%s", flags.status().message().c_str(), usage);
    return 2;
  }
  if (flags->Has("help")) {
    std::fputs(usage, stdout);
    return 0;
  }
  if (!flags->Has("config") || !flags->Has("node")) {
    std::fputs(usage, stderr);
    return 2;
  }
  if (Status s = ApplyLogLevel(*flags); !s.ok()) {
    std::fprintf(stderr, "worker: %s\n", s.message().c_str());
    return 2;
  }
  auto threads = flags->GetInt("threads", std::thread::hardware_concurrency());
  if (!threads.ok() || *threads < 1) {
    std::fprintf(stderr, "worker: --threads must be a positive integer\n");
    return 2;
  }
  BlockShutdownSignals();
  auto cfg = LoadClusterConfig(flags->Get("config"));
  if (!cfg.ok()) {
    std::fprintf(stderr, "worker: %s\n", cfg.status().message().c_str());
    return 1;
  }
  const std::string node = flags->Get("node");
  const NodeConfig* nc = cfg->FindNode(node);
  if (!nc) {
    std::fprintf(stderr, "worker: %s: no node named '%s' in nodes[]\n", cfg->path.c_str(), node.c_str());
    return 1;
  }
  auto secret = ReadClusterSecret(*cfg);
  if (!secret.ok()) {
    std::fprintf(stderr, "worker: %s\n", secret.status().message().c_str());
    return 1;
  }
  auto data_plane = net::MakeTcpTransport(
      {.self_name = node, .secret = *secret, .encrypt = cfg->security.encrypt_data_plane});
  Status listening = data_plane.ok() ? (*data_plane)->Listen(nc->data.ToString()) : data_plane.status();
  if (!listening.ok()) {
    std::fprintf(stderr, "worker %s: data plane (nodes[].data %s): %s\n", node.c_str(),
                 nc->data.ToString().c_str(), listening.message().c_str());
    return 1;
  }
  if (cfg->security.insecure && secret->empty())
    FM_LOG(kWarn, "worker") << "security.insecure: this worker obeys any caller and takes data "
                               "from any peer that claims a node's name";
  WorkerSecurity security{.cluster_secret = *secret};
  std::vector<net::AllowedPeer> peers;   // until LoadShard names this worker's: any node's
  for (const NodeConfig& n : cfg->nodes) {
    security.node_data[n.name] = n.data.ToString();
    if (n.name != node) peers.push_back({n.name, n.data.host});
  }
  if (Status s = (*data_plane)->SetAllowedPeers(peers); !s.ok()) {
    std::fprintf(stderr, "worker %s: data plane: %s\n", node.c_str(), s.message().c_str());
    return 1;
  }
  WorkerService service(node, flags->Get("model"), static_cast<int>(*threads), data_plane->get(),
                        std::move(security));
  int port = 0;
  // security.tls: mutual TLS, only a client with a certificate of the cluster's CA gets through.
  auto credentials = ServerCredentialsFor({cfg->security.tls.cert, cfg->security.tls.key,
                                           cfg->security.tls.ca}, true);
  if (!credentials.ok()) {
    std::fprintf(stderr, "worker %s: %s\n", node.c_str(), credentials.status().message().c_str());
    return 1;
  }
  auto server = StartGrpcServer(nc->control.ToString(), &service, &port, kWorkerMaxRequestBytes,
                                *credentials);
  if (!server.ok()) {
    std::fprintf(stderr, "worker %s: %s\n", node.c_str(), server.status().message().c_str());
    return 1;
  }
  FM_LOG(kInfo, "worker") << "node " << node << " listening on " << nc->control.host << ":" << port
                          << " (control), " << (*data_plane)->listen_address() << " (data)";
  int sig = WaitForShutdownSignal();
  FM_LOG(kInfo, "worker") << "node " << node << " stopping (signal " << sig << ")";
  service.Stop();
  (*server)->Shutdown(std::chrono::system_clock::now() + std::chrono::seconds(2));
  return 0;
}

}  // namespace fm::cli
