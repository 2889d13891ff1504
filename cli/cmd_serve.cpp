// flashmesh serve --model DIR [--listen ADDR] [--http ADDR]: single process, coordinator + one
// in-process worker holding the whole model; the reference every distributed run is compared with.
#include <cstdio>
#include <optional>
#include <thread>

#include "cli/commands.h"
#include "cli/flags.h"
#include "common/log.h"
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
     {"max-tokens", "N", "new tokens per request (default 4096)"},
     {"max-queue", "N", "waiting requests before new ones are refused (default 64)"},
     {"max-streams-per-client", "N", "concurrent generations of one client (default 64)"},
     {"threads", "N", "kernel threads (default: all cores)"},
     {"token-file", "FILE", "API bearer tokens (security.token_file)"}}};

}  // namespace

int CmdServe(int argc, char** argv) {
  int rc = 0;
  const std::optional<Flags> flags = StartCommand(kSpec, argc, argv, &rc);
  if (!flags) return rc;
  CoordinatorSetup setup;
  setup.listen = flags->Get("listen", "127.0.0.1:7070");
  setup.http = flags->Get("http");
  setup.model_dir = flags->Get("model");
  auto model = LoadModelConfig(setup.model_dir + "/config.json");
  if (!model.ok()) {
    std::fprintf(stderr, "serve: %s\n", model.status().message().c_str());
    return 1;
  }
  setup.model = *model;
  struct IntFlag { const char* name; int64_t fallback; int64_t* out; };
  int64_t max_batch, max_context, max_tokens, max_queue, max_streams, threads;
  const IntFlag ints[] = {{"max-batch", 16, &max_batch},   {"max-context", 8192, &max_context},
                          {"max-tokens", 4096, &max_tokens}, {"max-queue", 64, &max_queue},
                          {"max-streams-per-client", 64, &max_streams},
                          {"threads", std::thread::hardware_concurrency(), &threads}};
  for (const auto& f : ints) {
    auto v = flags->GetInt(f.name, f.fallback, 1);
    if (!v.ok()) return UsageError(kSpec, v.status().message());
    *f.out = *v;
  }
  if (flags->Has("token-file")) {
    auto tokens = ReadApiTokens(flags->Get("token-file"));
    if (!tokens.ok()) {
      std::fprintf(stderr, "serve: %s\n", tokens.status().message().c_str());
      return 1;
    }
    setup.api.api_tokens = *tokens;
  }
  BlockShutdownSignals();
  // One stage: the data plane is never dialed, it only has to exist.
  auto data_plane = net::MakeTcpTransport({.self_name = "local"});
  if (!data_plane.ok()) {
    std::fprintf(stderr, "serve: %s\n", data_plane.status().message().c_str());
    return 1;
  }
  WorkerService worker("local", "", static_cast<int>(threads), data_plane->get());
  int worker_port = 0;
  auto worker_server = StartGrpcServer("127.0.0.1:0", &worker, &worker_port, kWorkerMaxRequestBytes);
  if (!worker_server.ok()) {
    std::fprintf(stderr, "serve: %s\n", worker_server.status().message().c_str());
    return 1;
  }
  WorkerPlan w;
  w.node = "local";
  w.layer_begin = 0;
  w.layer_end = model->num_hidden_layers;
  w.expert_begin = 0;
  w.expert_end = model->n_routed_experts;
  w.embed = w.head = true;
  setup.plan.pipeline_stages = 1;
  setup.plan.expert_parallel = 1;
  setup.plan.workers = {w};
  const std::string control = "127.0.0.1:" + std::to_string(worker_port);
  setup.addresses = {{control, ""}};
  setup.cluster.model_dir = setup.model_dir;
  setup.cluster.max_context = max_context;
  setup.limits = {max_batch, max_queue, max_context};
  setup.api.max_tokens = max_tokens;
  setup.api.max_context = max_context;
  setup.api.max_streams_per_client = max_streams;
  setup.api.model_name = setup.model_dir;
  auto coord = Coordinator::Start(std::move(setup));
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
