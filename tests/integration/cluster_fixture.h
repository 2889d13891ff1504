// Helpers of the integration tests: real `flashmesh` processes on 127.0.0.1 with fresh ports,
// a shared small test checkpoint, cluster YAMLs, and a gRPC client of the Inference API.
// Every process is killed (SIGKILL) and reaped when its handle goes away.
#pragma once
#include <grpcpp/grpcpp.h>
#include <sys/types.h>

#include <chrono>
#include <cstdint>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include <nlohmann/json.hpp>

#include "flashmesh/v1/api.grpc.pb.h"
#include "launch/child_process.h"

namespace fm::it {

// A directory under /tmp removed (recursively) on destruction.
class TempDir {
 public:
  TempDir();
  ~TempDir();
  const std::string& path() const { return path_; }

 private:
  std::string path_;
};

// A child process running the built flashmesh binary (launch/child_process.h); stdout+stderr
// go to `log_path`.
class Process {
 public:
  Process(std::vector<std::string> args, std::string log_path);
  pid_t pid() const;
  void Signal(int sig);
  // Waits up to `timeout` for the exit; the exit status (or 128+signal), -1 on timeout.
  int Wait(std::chrono::milliseconds timeout);
  bool Running();
  std::string Log() const;   // the whole log so far

 private:
  std::unique_ptr<ChildProcess> child_;   // null when it could not start (a test failure)
};

// Runs flashmesh to completion (bounded); returns the exit code, output into *out.
int RunFlashmesh(const std::vector<std::string>& args, std::string* out,
                 std::chrono::milliseconds timeout = std::chrono::seconds(60));

std::string FlashmeshBinary();
// A TCP port on 127.0.0.1 nobody listens on right now (never the same twice per process).
int FreePort();
// The small preset checkpoint, written once per test binary.
const std::string& SmallModel();

struct ClusterSpec {
  int stages = 3;
  int expert_parallel = 1;   // workers = stages * expert_parallel, named w0.. stage-major
  int tensor_parallel = 1;   // > 1 (with expert_parallel 1): workers = stages * tensor_parallel
  int max_batch = 16;
  int max_context = 512;
  int max_tokens = 256;
  int max_queue = 64;
  int max_streams_per_client = 64;
  int max_step_tokens = 2048;   // limits.max_step_tokens: prompts longer go in chunks
  std::string activation_dtype = "f32";          // stage-to-stage frames
  std::string cluster_secret = "it-cluster-secret";  // data-plane auth; "" = none
  std::string transport = "tcp";                     // "nccl": node i on cuda:(i % gpus)
  std::string device = "cpu";                        // every node's device with transport tcp
  int gpus = 1;
  bool http = false;                                 // coordinator.http on a fresh port
  // security.tls from DIR/node.pem, node.key, ca.pem (every node and the coordinator share
  // the certificate); "" = no TLS.
  std::string tls_dir;
};

// A cluster: YAML, one worker process per plan slot (stage-major), and the coordinator.
class Cluster {
 public:
  explicit Cluster(const ClusterSpec& spec);
  const std::string& yaml() const { return yaml_; }
  // security.cluster_secret_file (rewrite it before StartWorker to give a worker another secret).
  std::string secret_file() const { return dir_.path() + "/cluster.secret"; }
  std::string api() const { return "127.0.0.1:" + std::to_string(api_port_); }
  int http_port() const { return http_port_; }   // 0 without spec.http
  std::string node(int i) const { return std::string("w").append(std::to_string(i)); }
  const std::string& control(int i) const { return control_[i]; }   // host:port of node i
  const std::string& data(int i) const { return data_[i]; }
  // A second coordinator of this cluster's YAML on a fresh API port, gRPC only (a failover, or
  // the newer term a stale coordinator meets), logging into the cluster's directory; *api: its
  // address.
  std::unique_ptr<Process> StartNextCoordinator(std::string* api) const;
  // `extra` arguments after the usual ones (e.g. --model DIR).
  void StartWorker(int i, const std::vector<std::string>& extra = {});
  void StartCoordinator(const std::vector<std::string>& extra = {});
  void StartAll();
  int workers() const { return static_cast<int>(workers_.size()); }
  Process* worker(int i) { return workers_[i].get(); }
  Process* coordinator() { return coordinator_.get(); }
  void KillWorker(int i, int sig);
  std::string Logs() const;

 private:
  TempDir dir_;
  ClusterSpec spec_;
  std::string yaml_;
  int api_port_ = 0;
  int http_port_ = 0;
  std::vector<std::string> control_, data_;
  std::vector<std::unique_ptr<Process>> workers_;
  std::unique_ptr<Process> coordinator_;
};

// `flashmesh serve` on a fresh port.
class Server {
 public:
  explicit Server(std::vector<std::string> extra_args = {});
  std::string api() const { return "127.0.0.1:" + std::to_string(port_); }
  Process* process() { return proc_.get(); }

 private:
  TempDir dir_;
  int port_ = 0;
  std::unique_ptr<Process> proc_;
};

struct Generation {
  grpc::Status status;
  std::vector<int32_t> ids;
  std::vector<float> logprobs;
  std::vector<std::vector<std::pair<int32_t, float>>> top;   // each token's top_logprobs (id, logprob)
  std::string text;
  std::vector<std::string> pieces;   // text of each token (whole UTF-8 characters)
  flashmesh::v1::Finish finish;
  bool finished = false;
  // GenerateRequest.prompt_logprobs: the scores of every PromptLogprobs event, in order.
  std::vector<flashmesh::v1::PromptToken> prompt;
  int prompt_events = 0;
};

std::unique_ptr<flashmesh::v1::Inference::Stub> Connect(const std::string& api);
// CUDA devices of this host (0 in a build without CUDA).
int Gpus();
// Polls ClusterStatus until healthy; false after `timeout`.
bool WaitHealthy(const std::string& api, std::chrono::milliseconds timeout);
// Asks pred every 100 ms until it holds (true) or `timeout` passed (pred's last answer).
template <typename Pred>
bool Eventually(Pred pred, std::chrono::milliseconds timeout) {
  const auto deadline = std::chrono::steady_clock::now() + timeout;
  while (std::chrono::steady_clock::now() < deadline) {
    if (pred()) return true;
    std::this_thread::sleep_for(std::chrono::milliseconds(100));
  }
  return pred();
}
// The error of the first node the coordinator at `api` reports down with one; "" if none does
// within `timeout`.
std::string FirstNodeError(const std::string& api, std::chrono::milliseconds timeout);
// The first such error that contains `needle`, polling until `timeout` (a node may be down for
// another reason first, e.g. refusing connections before it listens); the last one otherwise.
std::string NodeErrorContaining(const std::string& api, const std::string& needle,
                                std::chrono::milliseconds timeout);
Generation Generate(flashmesh::v1::Inference::Stub* stub, const flashmesh::v1::GenerateRequest& req,
                    const std::string& token = "");
flashmesh::v1::GenerateRequest TokensRequest(const std::vector<int32_t>& prompt, int max_tokens);

// A generation that runs while a test acts on the cluster (kill, drain, cancel): started with a
// 60 s deadline, its first event already read.
class LiveStream {
 public:
  LiveStream(flashmesh::v1::Inference::Stub* stub, const flashmesh::v1::GenerateRequest& req);
  bool started() const { return started_; }   // the first event came
  bool Next();                                 // reads one more event; false at the end
  void Cancel() { ctx_.TryCancel(); }
  grpc::Status Finish();                       // reads to the end: the stream's status
  int tokens() const { return tokens_; }       // token events read so far
  const flashmesh::v1::GenerateResponse& last() const { return resp_; }

 private:
  grpc::ClientContext ctx_;
  std::unique_ptr<grpc::ClientReader<flashmesh::v1::GenerateResponse>> reader_;
  flashmesh::v1::GenerateResponse resp_;
  int tokens_ = 0;
  bool started_ = false;
};

// `flashmesh bench cluster --json` on the YAML of `cluster` (which starts the processes itself;
// 4 new tokens after a 3-token prompt, 2 streams, one kernel thread a process): its report.
void RunBenchCluster(const Cluster& cluster, nlohmann::json* report);

// Runs every request on a single process, then all of them at once on a cluster of `spec`:
// each must give `tokens` tokens, with the single process's ids and logprobs. With spec.http,
// also the longest seeded request as the n = 3 choices of one HTTP completion (which share one
// prefill where the cluster allows): choice i must be the single process's request with
// seed + i. *status is the
// cluster's status once every worker has freed the finished sequences (frees are asynchronous
// and status shows the last heartbeat: up to 5 s), or the last one seen.
void ExpectClusterEqualsSingle(const ClusterSpec& spec,
                               const std::vector<flashmesh::v1::GenerateRequest>& requests,
                               size_t tokens, flashmesh::v1::ClusterStatusResponse* status);
// An HTTP completion of the longest seeded request with n = 3:
// choice i equals `reference`'s answer to that request with seed + i, logprobs and text.
void ExpectChoicesEqualSeededRequests(int http_port, flashmesh::v1::Inference::Stub* reference,
                                      const std::vector<flashmesh::v1::GenerateRequest>& requests);

// `cluster` (started, on GPUs) gives one cuda:0 worker's tokens and logprobs exactly (every
// output element is computed by the same kernels on one member), for prompts of 4, 24 and 44
// tokens (past 32 rows a device shard runs a prompt in several steps: AgreeRounds under EP).
void ExpectEqualsOneCudaWorker(Cluster& cluster);

// Starts a cluster of `spec`, kills worker `w` (a member of a stage's group) with SIGKILL while a
// stream runs: the stream must end UNAVAILABLE naming it within 5 s and `health --node` report it
// down; after its restart `after` must generate `after_tokens` tokens (no coordinator restart).
void ExpectKilledMemberFailsFastAndRestartRecovers(const ClusterSpec& spec, int w,
                                                  const flashmesh::v1::GenerateRequest& after,
                                                  size_t after_tokens);
flashmesh::v1::ClusterStatusResponse Status(flashmesh::v1::Inference::Stub* stub);
// The status once every worker has freed the finished sequences (0 KV bytes; frees are
// asynchronous and status shows the last heartbeat), polled for up to 5 s; the last one seen.
flashmesh::v1::ClusterStatusResponse StatusAfterFrees(flashmesh::v1::Inference::Stub* stub);

}  // namespace fm::it
