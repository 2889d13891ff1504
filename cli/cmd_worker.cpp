// flashmesh worker --config FILE --node NAME [--model DIR] [--threads N]
#include <grpcpp/grpcpp.h>

#include <cstdio>
#include <optional>
#include <thread>

#include "cli/commands.h"
#include "cli/flags.h"
#include "common/log.h"
#include "config/cluster_config.h"
#include "net/tcp_transport.h"
#include "rpc/grpc_status.h"
#include "worker/worker_service.h"

namespace fm::cli {

namespace {

const CommandSpec kSpec{
    "worker",
    "serves the Worker control API of node NAME (nodes[].control of the cluster YAML) and\n"
    "waits for the coordinator to tell it which shard to load. Stops on SIGINT/SIGTERM.",
    {{"config", "FILE", "the cluster YAML", true},
     {"node", "NAME", "this worker's node in nodes[]", true},
     {"model", "DIR", "the checkpoint directory on this machine instead of the YAML's `model`"},
     {"threads", "N", "kernel threads (default: all cores)"}}};

}  // namespace

int CmdWorker(int argc, char** argv) {
  int rc = 0;
  const std::optional<Flags> flags = StartCommand(kSpec, argc, argv, &rc);
  if (!flags) return rc;
  auto threads = flags->GetInt("threads", std::thread::hardware_concurrency(), 1, kMaxThreads);
  if (!threads.ok()) return UsageError(kSpec, threads.status().message());
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
  if (cfg->security.insecure && secret->empty()) {
    FM_LOG(kWarn, "worker") << "security.insecure: this worker obeys any caller and takes data "
                               "from any peer that claims a node's name";
  }
  WorkerSecurity security;
  security.cluster_secret = *secret;
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
                          << " (control), " << (*data_plane)->listen_address() << " (data), "
                          << *threads << " kernel threads";
  int sig = WaitForShutdownSignal();
  FM_LOG(kInfo, "worker") << "node " << node << " stopping (signal " << sig << ")";
  service.Stop();
  (*server)->Shutdown(std::chrono::system_clock::now() + std::chrono::seconds(2));
  return 0;
}

}  // namespace fm::cli
