// flashmesh serve --model DIR [--listen ADDR] [--http ADDR]: single process, coordinator + one
// in-process worker holding the whole model; the reference every distributed run is compared with.
// The coordinator is set up from a one-node ClusterConfig through SetupFromConfig, the same
// path as `flashmesh coordinator`.
#include <algorithm>
#include <cstdio>
#include <limits>
#include <optional>
#include <random>
#include <thread>

#include "cli/commands.h"
#include "cli/flags.h"
#include "common/log.h"
#include "config/cluster_config.h"
#include "coordinator/coordinator.h"
#include "net/tcp_transport.h"
#include "rpc/grpc_status.h"
#include "worker/worker_service.h"

namespace fm::cli {

namespace {

const CommandSpec kSpec{
    "serve",
    "one process: the coordinator plus one worker holding every layer; the reference every\n"
    "distributed run is compared with.",
    {{"model", "DIR", "checkpoint directory", true},
     {"listen", "HOST:PORT", "the Inference API (default 127.0.0.1:7070); port 0 picks a free\n"
                             "port, printed as 'listening on HOST:PORT'"},
     {"http", "HOST:PORT", "also the OpenAI-compatible HTTP API, /health and /metrics\n"
                           "(printed as 'http listening on HOST:PORT')"},
     {"max-batch", "N", "sequences decoded together (default 16)"},
     {"max-context", "N", "tokens per sequence (default 8192)"},
     {"max-tokens", "N", "new tokens per request (default 4096, or --max-context if smaller)"},
     {"max-queue", "N", "waiting requests before new ones are refused (default 64)"},
     {"max-step-tokens", "N", "rows of one step; longer prompts go in chunks of N (default 2048)"},
     {"max-streams-per-client", "N", "concurrent generations of one client (default 64)"},
     {"write-stall-timeout", "S", "a gRPC stream whose client reads nothing for S seconds ends\n"
                                  "(default 60)"},
     {"threads", "N", "kernel threads (default: all cores)"},
     {"device", "cpu|cuda:N", "where the shard runs (default cpu)"},
     {"token-file", "FILE", "API bearer tokens (security.token_file)"}}};

}  // namespace

int CmdServe(int argc, char** argv) {
  int rc = 0;
  const std::optional<Flags> flags = StartCommand(kSpec, argc, argv, &rc);
  if (!flags) return rc;
  struct IntFlag { const char* name; int64_t fallback; int64_t* out; int64_t max; };
  int64_t max_batch, max_context, max_tokens, max_queue, max_step_tokens, max_streams, write_stall,
      threads;
  constexpr int64_t kAny = std::numeric_limits<int64_t>::max();
  const IntFlag ints[] = {{"max-batch", 16, &max_batch, kMaxBatchLimit},
                          {"max-context", 8192, &max_context, kMaxContextLimit},
                          {"max-tokens", 4096, &max_tokens, kAny}, {"max-queue", 64, &max_queue, kAny},
                          {"max-step-tokens", 2048, &max_step_tokens, kMaxContextLimit},
                          {"max-streams-per-client", 64, &max_streams, kAny},
                          {"write-stall-timeout", 60, &write_stall, 86400},
                          {"threads", std::thread::hardware_concurrency(), &threads, kMaxThreads}};
  for (const auto& f : ints) {
    auto v = flags->GetInt(f.name, f.fallback, 1, f.max);
    if (!v.ok()) return UsageError(kSpec, v.status().message());
    *f.out = *v;
  }
  // As the YAML's limits: max_tokens defaults to at most max_context and may not exceed it.
  if (!flags->Has("max-tokens")) max_tokens = std::min(max_tokens, max_context);
  if (max_tokens > max_context)
    return UsageError(kSpec, "--max-tokens: " + std::to_string(max_tokens) + " exceeds --max-context " +
                                 std::to_string(max_context));
  // serve is a one-node cluster set up as a YAML's coordinator is (SetupFromConfig); its node
  // is the worker below, in this process on an ephemeral loopback port.
  ClusterConfig cluster;
  cluster.path = "serve";
  auto listen = ParseHostPort(flags->Get("listen", "127.0.0.1:7070"), /*allow_zero=*/true);
  if (!listen.ok()) return UsageError(kSpec, listen.status().Wrap("--listen").message());
  cluster.coordinator.listen = *listen;
  if (flags->Has("http")) {
    auto http = ParseHostPort(flags->Get("http"), /*allow_zero=*/true);
    if (!http.ok()) return UsageError(kSpec, http.status().Wrap("--http").message());
    cluster.coordinator.http = *http;
  }
  cluster.parallel.automatic = false;
  cluster.parallel.pipeline_stages = 1;
  cluster.parallel.expert_parallel = 1;
  cluster.limits.max_batch = max_batch;
  cluster.limits.max_context = max_context;
  cluster.limits.max_tokens = max_tokens;
  cluster.limits.max_queue = max_queue;
  cluster.limits.max_step_tokens = max_step_tokens;
  cluster.limits.max_streams_per_client = max_streams;
  cluster.limits.write_stall_timeout_s = static_cast<double>(write_stall);
  cluster.security.token_file = flags->Get("token-file");
  // serve's own heartbeat (a worker in the same process answers at once).
  cluster.heartbeat.interval_ms = 500;
  cluster.heartbeat.timeout_ms = 2500;
  BlockShutdownSignals();
  // One stage: the data plane is never dialed, it only has to exist.
  net::TransportOptions dp;
  dp.self_name = "local";
  auto data_plane = net::MakeTcpTransport(dp);
  if (!data_plane.ok()) {
    std::fprintf(stderr, "serve: %s\n", data_plane.status().message().c_str());
    return 1;
  }
  // The in-process worker listens on a loopback TCP port that any local user can reach (and
  // that ClusterStatus shows): its control calls carry a credential from a secret made for
  // this process alone, as a cluster's do from its secret file.
  std::random_device urandom;
  std::string secret;
  for (int i = 0; i < 8; ++i) secret += std::to_string(urandom()) + ".";
  WorkerSecurity security;
  security.cluster_secret = secret;
  WorkerService worker("local", "", static_cast<int>(threads), data_plane->get(), security);
  int worker_port = 0;
  auto worker_server = StartGrpcServer("127.0.0.1:0", &worker, &worker_port, kWorkerMaxRequestBytes);
  if (!worker_server.ok()) {
    std::fprintf(stderr, "serve: %s\n", worker_server.status().message().c_str());
    return 1;
  }
  NodeConfig node;
  node.name = "local";
  node.control = {"127.0.0.1", static_cast<uint16_t>(worker_port)};
  node.data = {"127.0.0.1", 0};   // one stage: its data plane is never dialed
  node.device = flags->Get("device", "cpu");
  const Result<int> cuda = ParseDevice(node.device);
  if (!cuda.ok()) return UsageError(kSpec, cuda.status().Wrap("--device").message());
  node.cuda_device = *cuda;
  // Not planned against a memory budget: the machine holds what it holds.
  node.memory_gib = std::numeric_limits<double>::infinity();
  cluster.nodes = {node};
  auto setup = SetupFromConfig(cluster, flags->Get("model"));
  if (!setup.ok()) {
    std::fprintf(stderr, "serve: %s\n", setup.status().message().c_str());
    return 1;
  }
  setup->cluster.cluster_secret = secret;
  auto coord = Coordinator::Start(std::move(setup).value());
  if (!coord.ok()) {
    std::fprintf(stderr, "serve: %s\n", coord.status().message().c_str());
    return 1;
  }
  std::string host = flags->Get("listen", "127.0.0.1:7070");
  host = host.substr(0, host.rfind(':'));
  std::printf("listening on %s:%d\n", host.c_str(), (*coord)->port());
  if (!flags->Get("http").empty()) {
    std::string http_host = flags->Get("http");
    http_host = http_host.substr(0, http_host.rfind(':'));
    std::printf("http listening on %s:%d\n", http_host.c_str(), (*coord)->http_port());
  }
  std::fflush(stdout);
  int sig = WaitForShutdownSignal();
  FM_LOG(kInfo, "serve") << "stopping (signal " << sig << ")";
  (*coord)->Shutdown();
  worker.Stop();
  (*worker_server)->Shutdown(std::chrono::system_clock::now() + std::chrono::seconds(2));
  return 0;
}

}  // namespace fm::cli
