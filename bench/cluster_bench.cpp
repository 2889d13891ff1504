// flashmesh bench cluster --config FILE: the pipeline's cost against the single process, in
// one run. Starts every worker of the YAML and its coordinator as child processes, plus a
// `flashmesh serve` of the same checkpoint with the same kernel threads (on the device of the
// YAML's first node), then alternates
// identical greedy requests between the two (batch 1, then --streams concurrent ones) and
// reports decode tok/s of both, their ratio, the time to the first token (a long --prompt goes
// in chunks of the YAML's limits.max_step_tokens on both sides), the data-plane bytes per
// generated token (and the device workers' host<->device copy bytes), and whether both produced
// the same tokens. Both sides run through the same API, scheduler and worker code, so the ratio
// isolates the pipeline: hops, frames and per-stage RPCs. Next to
// each measured figure it prints the cost model's prediction (coordinator/cost_model.h) for
// the same run, with the nodes' profiles (cpu: probed before anything starts).
#include "bench/cluster_bench.h"

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstring>
#include <nlohmann/json.hpp>
#include <optional>
#include <string>
#include <thread>
#include <vector>

#include "common/device_transfers.h"
#include "common/log.h"
#include "coordinator/api_client.h"
#include "coordinator/coordinator.h"
#include "coordinator/cost_model.h"
#include "launch/local_cluster.h"
#include "rpc/grpc_status.h"

namespace fm::bench {
namespace {

using Clock = std::chrono::steady_clock;
using Options = ClusterBenchOptions;
constexpr auto kStartTimeout = std::chrono::seconds(180);
constexpr auto kStopGrace = std::chrono::seconds(5);
constexpr int kRepeats = 5;   // batch-1 runs per side, alternating; the best of each is kept

struct Run {
  Status status;
  std::vector<int32_t> ids;
  double first_s = 0;    // request -> first token
  double decode_s = 0;   // first token -> last token
  double total_s = 0;    // request -> last token
};

// Until `api` answers healthy; a child that exits meanwhile (a port in use, a bad --model)
// ends the wait at once, named.
Status WaitHealthy(const ApiClient& api, const std::string& what,
                   const std::vector<std::unique_ptr<ChildProcess>>& children) {
  const auto deadline = Clock::now() + kStartTimeout;
  std::string last = "no answer";
  while (Clock::now() < deadline) {
    for (const auto& child : children)
      if (!child->Running())
        return Unavailable(child->name() + " exited (" + child->exit_text() +
                           ") while waiting for " + what + " to become healthy");
    flashmesh::v1::ClusterStatusResponse resp;
    auto ctx = api.Context(2);
    grpc::Status s = api.stub->ClusterStatus(ctx.get(), {}, &resp);
    if (s.ok() && resp.healthy()) return Status::Ok();
    last = s.ok() ? "not every node is up" : s.error_message();
    std::this_thread::sleep_for(std::chrono::milliseconds(200));
  }
  return Unavailable(what + " did not become healthy within " +
                     std::to_string(std::chrono::duration_cast<std::chrono::seconds>(kStartTimeout).count()) +
                     " s: " + last);
}

Result<flashmesh::v1::ClusterStatusResponse> GetStatus(const ApiClient& api) {
  flashmesh::v1::ClusterStatusResponse resp;
  auto ctx = api.Context(10);
  grpc::Status s = api.stub->ClusterStatus(ctx.get(), {}, &resp);
  if (!s.ok()) return FromGrpc(s, "ClusterStatus");
  return resp;
}

// Data-plane bytes all workers sent: stage-to-stage frames, and EP dispatch + combine payloads.
uint64_t WireBytes(const flashmesh::v1::ClusterStatusResponse& s) {
  uint64_t sum = 0;
  for (const auto& n : s.nodes()) sum += n.data_bytes_sent();
  return sum;
}
uint64_t EpBytes(const flashmesh::v1::ClusterStatusResponse& s) {
  uint64_t sum = 0;
  for (const auto& n : s.nodes()) sum += n.ep_bytes_sent();
  return sum;
}

// Host<->device copy bytes of every device worker's steps (0 on CPU workers).
TransferBytes DeviceBytes(const flashmesh::v1::ClusterStatusResponse& s) {
  TransferBytes sum;
  for (const auto& n : s.nodes()) {
    sum.host_to_device += n.host_to_device_bytes();
    sum.device_to_host += n.device_to_host_bytes();
  }
  return sum;
}

// One greedy request of `o.tokens` new tokens past EOS; `salt` varies the prompt per stream.
Run Generate(const ApiClient& api, const Options& o, int salt) {
  flashmesh::v1::GenerateRequest req;
  for (int64_t i = 0; i < o.prompt; ++i) req.mutable_tokens()->add_ids(static_cast<int32_t>(3 + (i * 31 + salt * 17) % 200));
  req.set_max_tokens(static_cast<int32_t>(o.tokens));
  req.set_ignore_eos(true);
  req.mutable_sampling()->set_greedy(true);
  Run r;
  auto ctx = api.Context(600);
  const auto t0 = Clock::now();
  Clock::time_point first, last;
  auto reader = api.stub->Generate(ctx.get(), req);
  flashmesh::v1::GenerateResponse resp;
  while (reader->Read(&resp)) {
    if (!resp.has_token()) continue;
    last = Clock::now();
    if (r.ids.empty()) first = last;
    r.ids.push_back(resp.token().id());
  }
  grpc::Status s = reader->Finish();
  if (!s.ok()) r.status = FromGrpc(s, "Generate");
  else if (static_cast<int64_t>(r.ids.size()) != o.tokens)
    r.status = Internal("Generate returned " + std::to_string(r.ids.size()) + " tokens, asked " +
                        std::to_string(o.tokens));
  r.first_s = std::chrono::duration<double>(first - t0).count();
  r.decode_s = std::chrono::duration<double>(last - first).count();
  r.total_s = std::chrono::duration<double>(last - t0).count();
  return r;
}

// `streams` concurrent requests; aggregate generated tokens per second of wall time.
Result<double> Concurrent(const ApiClient& api, const Options& o) {
  std::vector<Run> runs(o.streams);
  std::vector<std::thread> threads;
  const auto t0 = Clock::now();
  for (int64_t i = 0; i < o.streams; ++i)
    threads.emplace_back([&, i] { runs[i] = Generate(api, o, static_cast<int>(i) + 1); });
  for (auto& t : threads) t.join();
  const double wall = std::chrono::duration<double>(Clock::now() - t0).count();
  for (const auto& r : runs) FM_RETURN_IF_ERROR(r.status);
  return static_cast<double>(o.streams * o.tokens) / wall;
}

struct Side {
  double decode_tok_s = 0, streams_tok_s = 0;
  double first_token_s = 0;   // the best of the batch-1 runs
  std::vector<int32_t> ids;
};

// The cost model's figures for this run: both sides, and the cluster's wire bytes per
// generated token of one request (prefill included, as measured).
struct Predicted {
  Prediction single, cluster;
  double wire_per_token = 0, ep_per_token = 0;
};

Result<Predicted> PredictRun(const Options& o, const ClusterConfig& cfg,
                             const CoordinatorSetup& setup) {
  const ModelConfig& m = setup.model;
  const ModelShape shape = ComputeModelShape(m);
  CostQuery q;
  q.batch = o.streams;
  q.prompt = o.prompt;
  q.step_tokens = cfg.limits.max_step_tokens;
  q.context = o.prompt + o.tokens / 2;
  Predicted p;
  FM_ASSIGN_OR_RETURN(p.cluster, PredictPlan(m, shape, setup.plan, cfg, q));
  // The single process: every layer on the first node, steps in process (no RPC, no memory
  // check: `serve` is not planned).
  Plan one;
  WorkerPlan w;
  w.layer_end = m.num_hidden_layers;
  w.expert_end = m.n_routed_experts;
  w.embed = w.head = true;
  one.workers = {w};
  ClusterConfig alone = cfg;
  alone.nodes.resize(1);
  q.control_rpc = false;
  FM_ASSIGN_OR_RETURN(p.single, PredictPlan(m, shape, one, alone, q));
  // One request moves prompt + tokens - 1 rows through every layer.
  const double rows = static_cast<double>(o.prompt + o.tokens - 1);
  const int act = cfg.activation_dtype == "bf16" ? 2 : 4;
  // Workers report EP dispatch + combine and TP all-gather payloads as one figure.
  p.ep_per_token = (p.cluster.ep_bytes + p.cluster.tp_bytes) * rows / o.tokens;
  const bool tagged = !cfg.security.cluster_secret_file.empty();
  const int64_t chunk = cfg.limits.max_step_tokens;
  p.wire_per_token = (RequestHopBytes(m, setup.plan, o.prompt, o.tokens, chunk, act, tagged) +
                      RequestTpFrameBytes(m, setup.plan, o.prompt, o.tokens, chunk, tagged)) /
                         o.tokens +
                     p.ep_per_token;
  return p;
}

Status Measure(const Options& o, const ClusterConfig& cfg, const CoordinatorSetup& setup) {
  FM_ASSIGN_OR_RETURN(const Predicted pred, PredictRun(o, cfg, setup));
  const std::string threads = std::to_string(o.threads);
  const std::vector<std::string> quiet = {"--log-level", "warn"};
  // Every child's stdout goes to stderr: this process's stdout carries the report.
  LocalClusterArgs cluster;
  cluster.config_path = o.config;
  cluster.output.stdout_to_stderr = true;
  if (!o.model.empty()) cluster.coordinator_args = {"--model", o.model};
  cluster.worker_args = {"--threads", threads};
  cluster.worker_args.insert(cluster.worker_args.end(), cluster.coordinator_args.begin(),
                             cluster.coordinator_args.end());
  for (auto* args : {&cluster.worker_args, &cluster.coordinator_args})
    args->insert(args->end(), quiet.begin(), quiet.end());
  std::vector<std::unique_ptr<ChildProcess>> children;
  auto run = [&]() -> Status {
    FM_ASSIGN_OR_RETURN(children, StartLocalCluster(cfg, cluster));
    // The single process runs where the cluster's first worker runs (a cluster of cuda workers
    // against one cuda worker). Its port is picked free, but another process on the machine (a
    // parallel test) can take it before serve binds it: a serve that exits before it is healthy
    // is started again on another port, up to 3 times in all.
    std::optional<ApiClient> single_client;
    for (int attempt = 1;; ++attempt) {
      FM_ASSIGN_OR_RETURN(int port, FreeLoopbackPort());
      const std::string single_addr = "127.0.0.1:" + std::to_string(port);
      std::vector<std::string> serve = {"serve", "--model", setup.model_dir, "--listen", single_addr,
                                        "--device", cfg.nodes.front().device,
                                        "--threads", threads, "--max-batch",
                                        std::to_string(cfg.limits.max_batch), "--max-context",
                                        std::to_string(cfg.limits.max_context), "--max-tokens",
                                        std::to_string(cfg.limits.max_tokens), "--max-queue",
                                        std::to_string(cfg.limits.max_queue),
                                        "--max-streams-per-client",
                                        std::to_string(cfg.limits.max_streams_per_client),
                                        "--max-step-tokens",
                                        std::to_string(cfg.limits.max_step_tokens)};
      serve.insert(serve.end(), quiet.begin(), quiet.end());
      FM_ASSIGN_OR_RETURN(auto single_process,
                          ChildProcess::Start("serve", SelfBinary(), serve, cluster.output));
      children.push_back(std::move(single_process));
      FM_ASSIGN_OR_RETURN(ApiClient single, ConnectApi(single_addr, ""));
      const Status up = WaitHealthy(single, "serve", children);
      if (up.ok()) {
        single_client = std::move(single);
        break;
      }
      // Only a serve that exited is started again; a cluster process that exited ends the bench.
      if (children.back()->Running() || attempt == 3) return up;
      children.pop_back();   // it exited: the next wait must not see it again
      FM_LOG(kWarn, "bench") << up.ToString() << "; starting it again on another port";
    }
    ApiClient& single = *single_client;
    FM_ASSIGN_OR_RETURN(ApiClient pipe, ConnectApi(setup.listen, cfg.security.token_file, cfg.security.tls.ca));
    FM_RETURN_IF_ERROR(WaitHealthy(pipe, "the cluster of " + o.config, children));
    FM_LOG(kInfo, "bench") << "both up; measuring";
    Options warm = o;
    warm.tokens = 2;
    FM_RETURN_IF_ERROR(Generate(single, warm, 0).status);
    FM_RETURN_IF_ERROR(Generate(pipe, warm, 0).status);

    Side s, c;
    uint64_t wire = 0, ep_bytes = 0;
    TransferBytes device_bytes;
    for (int rep = 0; rep < kRepeats; ++rep) {
      Run a = Generate(single, o, 0);
      FM_RETURN_IF_ERROR(a.status.Wrap("serve"));
      FM_ASSIGN_OR_RETURN(auto before, GetStatus(pipe));
      Run b = Generate(pipe, o, 0);
      FM_RETURN_IF_ERROR(b.status.Wrap("cluster"));
      FM_ASSIGN_OR_RETURN(auto after, GetStatus(pipe));
      wire = WireBytes(after) - WireBytes(before);
      ep_bytes = EpBytes(after) - EpBytes(before);
      const TransferBytes d0 = DeviceBytes(before), d1 = DeviceBytes(after);
      device_bytes = {d1.host_to_device - d0.host_to_device, d1.device_to_host - d0.device_to_host};
      s.decode_tok_s = std::max(s.decode_tok_s, (o.tokens - 1) / a.decode_s);
      c.decode_tok_s = std::max(c.decode_tok_s, (o.tokens - 1) / b.decode_s);
      s.first_token_s = rep == 0 ? a.first_s : std::min(s.first_token_s, a.first_s);
      c.first_token_s = rep == 0 ? b.first_s : std::min(c.first_token_s, b.first_s);
      s.ids = a.ids;
      c.ids = b.ids;
    }
    FM_ASSIGN_OR_RETURN(s.streams_tok_s, Concurrent(single, o));
    FM_ASSIGN_OR_RETURN(c.streams_tok_s, Concurrent(pipe, o));

    const double ratio = c.decode_tok_s / s.decode_tok_s;
    const double streams_ratio = c.streams_tok_s / s.streams_tok_s;
    // As the other ratios: above 1, the cluster is faster.
    const double first_token_speedup = s.first_token_s / c.first_token_s;
    const double wire_per_token = static_cast<double>(wire) / static_cast<double>(o.tokens);
    const double ep_per_token = static_cast<double>(ep_bytes) / static_cast<double>(o.tokens);
    const double h2d_per_token =
        static_cast<double>(device_bytes.host_to_device) / static_cast<double>(o.tokens);
    const double d2h_per_token =
        static_cast<double>(device_bytes.device_to_host) / static_cast<double>(o.tokens);
    const bool same = s.ids == c.ids;
    if (o.json) {
      nlohmann::json j = {
          {"config", o.config},
          {"model", setup.model_dir},
          {"pipeline_stages", setup.plan.pipeline_stages},
          {"workers", setup.plan.workers.size()},
          {"expert_parallel", setup.plan.expert_parallel},
          {"tensor_parallel", setup.plan.tensor_parallel},
          {"threads_per_process", o.threads},
          {"prompt_tokens", o.prompt},
          {"max_step_tokens", cfg.limits.max_step_tokens},
          {"new_tokens", o.tokens},
          {"streams", o.streams},
          {"single", {{"decode_tok_s", s.decode_tok_s}, {"streams_tok_s", s.streams_tok_s},
                      {"first_token_s", s.first_token_s}}},
          {"cluster",
           {{"decode_tok_s", c.decode_tok_s},
            {"first_token_s", c.first_token_s},
            {"streams_tok_s", c.streams_tok_s},
            {"wire_bytes_per_token", wire_per_token},   // all traffic, prefill included
            {"ep_bytes_per_token", ep_per_token},       // EP dispatch + combine, TP gathers
            // device workers' host<->device copies, all workers, prefill included
            {"h2d_bytes_per_token", h2d_per_token},
            {"d2h_bytes_per_token", d2h_per_token}}},
          {"decode_ratio", ratio},
          {"streams_ratio", streams_ratio},
          {"first_token_speedup", first_token_speedup},   // single's time / cluster's
          {"tokens_match", same},
          {"predicted",
           {{"single", {{"decode_tok_s", pred.single.tok_s},
                        {"streams_tok_s", pred.single.tok_s_batch},
                        {"first_token_s", pred.single.ttft_s}}},
            {"cluster", {{"decode_tok_s", pred.cluster.tok_s},
                         {"streams_tok_s", pred.cluster.tok_s_batch},
                         {"first_token_s", pred.cluster.ttft_s},
                         {"wire_bytes_per_token", pred.wire_per_token},
                         {"ep_bytes_per_token", pred.ep_per_token}}},
            {"decode_ratio", pred.cluster.tok_s / pred.single.tok_s},
            {"streams_ratio", pred.cluster.tok_s_batch / pred.single.tok_s_batch},
            {"first_token_speedup", pred.single.ttft_s / pred.cluster.ttft_s},
            // measured / predicted cluster decode tok/s at batch 1
            {"cluster_decode_measured_over_predicted", c.decode_tok_s / pred.cluster.tok_s}}}};
      std::printf("%s\n", j.dump(2).c_str());
    } else {
      std::printf("cluster %s: %d stage(s) x %d %s, %zu worker(s); %s; %lld threads per process\n",
                  o.config.c_str(), setup.plan.pipeline_stages, setup.plan.group(),
                  setup.plan.tensor_parallel > 1 ? "TP" : "EP",
                  setup.plan.workers.size(),
                  setup.model_dir.c_str(), static_cast<long long>(o.threads));
      std::printf("                       single    cluster   ratio"
                  "   predicted: single   cluster   ratio\n");
      std::printf("decode tok/s (batch 1) %9.2f %9.2f %7.3f %19.2f %9.2f %7.3f\n", s.decode_tok_s,
                  c.decode_tok_s, ratio, pred.single.tok_s, pred.cluster.tok_s,
                  pred.cluster.tok_s / pred.single.tok_s);
      std::printf("tok/s, %2lld streams     %9.2f %9.2f %7.3f %19.2f %9.2f %7.3f\n",
                  static_cast<long long>(o.streams), s.streams_tok_s, c.streams_tok_s,
                  streams_ratio, pred.single.tok_s_batch, pred.cluster.tok_s_batch,
                  pred.cluster.tok_s_batch / pred.single.tok_s_batch);
      std::printf("first token ms (1 req) %9.1f %9.1f %7.3f %19.1f %9.1f %7.3f (%lld-token prompt, "
                  "chunks of %lld; ratio: single / cluster)\n",
                  s.first_token_s * 1e3, c.first_token_s * 1e3, first_token_speedup,
                  pred.single.ttft_s * 1e3, pred.cluster.ttft_s * 1e3,
                  pred.single.ttft_s / pred.cluster.ttft_s, static_cast<long long>(o.prompt),
                  static_cast<long long>(cfg.limits.max_step_tokens));
      std::printf("wire bytes per token   %19.0f %27.0f (data plane, all traffic, prefill "
                  "included)\n", wire_per_token, pred.wire_per_token);
      std::printf("EP/TP bytes per token  %19.0f %27.0f (EP dispatch + combine, TP all-gather "
                  "payloads)\n",
                  ep_per_token, pred.ep_per_token);
      std::printf("host<->device per token %18.0f h2d, %.0f d2h (device workers' copies, prefill "
                  "included)\n", h2d_per_token, d2h_per_token);
      std::printf("tokens match           %19s\n", same ? "yes" : "NO");
    }
    if (!same) return Internal("the cluster's tokens differ from the single process's");
    return Status::Ok();
  };
  Status st = run();
  StopAll(children, kStopGrace);
  return st;
}

}  // namespace

Status RunClusterBench(const ClusterBenchOptions& o) {
  FM_ASSIGN_OR_RETURN(const ClusterConfig cfg, LoadClusterConfig(o.config));
  // Every stream comes from this one client: the YAML's limits must admit them all.
  const LimitsConfig& lim = cfg.limits;
  if (o.streams > lim.max_streams_per_client || o.streams > lim.max_batch + lim.max_queue)
    return InvalidArgument("--streams " + std::to_string(o.streams) + ": " + o.config +
                           " admits " + std::to_string(lim.max_streams_per_client) +
                           " streams of one client (limits.max_streams_per_client) and " +
                           std::to_string(lim.max_batch + lim.max_queue) +
                           " requests at once (limits.max_batch + limits.max_queue)");
  // Probe the cpu profiles now, before the children compete for the memory bandwidth.
  const ClusterConfig probed = WithProbedProfiles(cfg);
  FM_ASSIGN_OR_RETURN(const CoordinatorSetup setup, SetupFromConfig(probed, o.model));
  return Measure(o, probed, setup);
}

}  // namespace fm::bench
