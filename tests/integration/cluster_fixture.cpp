#include "tests/integration/cluster_fixture.h"
#include "tests/integration/http_client.h"

#include "rpc/grpc_status.h"

#if FM_TEST_CUDA
#include "kernels/cuda/device.h"
#endif

#include <gtest/gtest.h>
#include <signal.h>
#include <unistd.h>

#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <sstream>
#include <thread>

namespace fm::it {

TempDir::TempDir() {
  char tmpl[] = "/tmp/fm_it_XXXXXX";
  path_ = mkdtemp(tmpl);
}

TempDir::~TempDir() {
  std::error_code ec;
  std::filesystem::remove_all(path_, ec);
}

// A flashmesh next to this test binary (a copy packed by tests/gpu/pack.sh, run on another
// machine), else the one this build made.
std::string FlashmeshBinary() {
  std::error_code ec;
  const auto beside = std::filesystem::read_symlink("/proc/self/exe", ec).parent_path() / "flashmesh";
  return !ec && std::filesystem::exists(beside) ? beside.string() : FM_FLASHMESH_BINARY;
}

Process::Process(std::vector<std::string> args, std::string log_path) {
  ChildOutput output;
  output.log_path = std::move(log_path);
  auto child = ChildProcess::Start("flashmesh " + args.at(0), FlashmeshBinary(), args, output);
  if (!child.ok()) {
    ADD_FAILURE() << child.status().ToString();
    return;
  }
  child_ = std::move(child).value();
}

pid_t Process::pid() const { return child_ ? child_->pid() : -1; }

void Process::Signal(int sig) {
  if (child_) child_->Signal(sig);
}

bool Process::Running() { return child_ && child_->Running(); }

int Process::Wait(std::chrono::milliseconds timeout) {
  return child_ ? child_->Wait(timeout) : -1;
}

std::string Process::Log() const {
  if (!child_) return "";
  std::ifstream f(child_->log_path());
  std::stringstream ss;
  ss << f.rdbuf();
  return ss.str();
}

int RunFlashmesh(const std::vector<std::string>& args, std::string* out, std::chrono::milliseconds timeout) {
  TempDir dir;
  Process p(args, dir.path() + "/out.log");
  int rc = p.Wait(timeout);
  if (out) *out = p.Log();
  return rc;
}

int FreePort() {
  auto port = FreeLoopbackPort();
  if (!port.ok()) ADD_FAILURE() << port.status().ToString();
  return port.ok() ? *port : 0;
}

const std::string& SmallModel() {
  static TempDir dir;   // removed when the test binary exits
  static std::string path = [] {
    std::string p = dir.path() + "/small";
    std::string out;
    int rc = RunFlashmesh({"mkmodel", "--preset", "small", p}, &out, std::chrono::seconds(120));
    if (rc != 0) {
      std::fprintf(stderr, "mkmodel failed (%d): %s\n", rc, out.c_str());
      std::abort();
    }
    return p;
  }();
  return path;
}

Cluster::Cluster(const ClusterSpec& spec) : spec_(spec) {
  api_port_ = FreePort();
  std::ostringstream y;
  if (spec.http) http_port_ = FreePort();
  y << "model: " << SmallModel() << "\n"
    << "coordinator: { listen: 127.0.0.1:" << api_port_;
  if (spec.http) y << ", http: 127.0.0.1:" << http_port_;
  y << " }\n"
    << "parallel: { pipeline_stages: " << spec.stages
    << ", expert_parallel: " << spec.expert_parallel;
  if (spec.tensor_parallel > 1) y << ", tensor_parallel: " << spec.tensor_parallel;
  y << " }\n"
    << "transport: " << spec.transport << "\n"
    << "nodes:\n";
  const int workers = spec.stages * spec.expert_parallel * spec.tensor_parallel;
  for (int i = 0; i < workers; ++i) {
    control_.push_back("127.0.0.1:" + std::to_string(FreePort()));
    data_.push_back("127.0.0.1:" + std::to_string(FreePort()));
    y << "  - { name: " << node(i) << ", control: " << control_[i] << ", data: " << data_[i]
      << ", device: "
      << (spec.transport == "nccl" ? "cuda:" + std::to_string(i % std::max(1, spec.gpus))
                                   : spec.device)
      << ", memory_gib: 4 }\n";
  }
  y << "limits: { max_batch: " << spec.max_batch << ", max_context: " << spec.max_context
    << ", max_queue: " << spec.max_queue << ", max_tokens: " << spec.max_tokens
    << ", max_streams_per_client: " << spec.max_streams_per_client
    << ", max_step_tokens: " << spec.max_step_tokens << " }\n"
    << "heartbeat: { interval_ms: 250, timeout_ms: 2000 }\n"
    << "activation_dtype: " << spec.activation_dtype << "\n";
  std::vector<std::string> security;
  if (!spec.cluster_secret.empty()) {
    std::ofstream(secret_file()) << spec.cluster_secret << "\n";
    security.push_back("cluster_secret_file: cluster.secret");
  }
  if (!spec.tls_dir.empty())
    security.push_back("tls: { cert: " + spec.tls_dir + "/node.pem, key: " + spec.tls_dir +
                       "/node.key, ca: " + spec.tls_dir + "/ca.pem }");
  if (!security.empty()) {
    y << "security: { " << security[0];
    for (size_t i = 1; i < security.size(); ++i) y << ", " << security[i];
    y << " }\n";
  }
  yaml_ = dir_.path() + "/cluster.yaml";
  std::ofstream(yaml_) << y.str();
  workers_.resize(workers);
}

std::unique_ptr<Process> Cluster::StartNextCoordinator(std::string* api) const {
  const int port = FreePort();
  *api = "127.0.0.1:" + std::to_string(port);
  // A copy of the YAML whose coordinator listens on that port.
  std::ifstream in(yaml_);
  std::stringstream ss;
  ss << in.rdbuf();
  std::string text = ss.str();
  const std::string from = "listen: 127.0.0.1:" + std::to_string(api_port_);
  text.replace(text.find(from), from.size(), "listen: " + *api);
  const size_t http = text.find(", http: ");   // a second coordinator serves gRPC only
  if (http != std::string::npos) text.erase(http, text.find(" }", http) - http);
  const std::string yaml = dir_.path() + "/cluster-" + std::to_string(port) + ".yaml";
  std::ofstream(yaml) << text;
  return std::make_unique<Process>(std::vector<std::string>{"coordinator", "--config", yaml},
                                   dir_.path() + "/coordinator-" + std::to_string(port) + ".log");
}

void Cluster::StartWorker(int i, const std::vector<std::string>& extra) {
  std::vector<std::string> args = {"worker", "--config", yaml_, "--node", node(i), "--threads", "1"};
  args.insert(args.end(), extra.begin(), extra.end());
  workers_[i] = std::make_unique<Process>(args, dir_.path() + "/" + node(i) + ".log");
}

void Cluster::StartCoordinator(const std::vector<std::string>& extra) {
  std::vector<std::string> args = {"coordinator", "--config", yaml_};
  args.insert(args.end(), extra.begin(), extra.end());
  coordinator_ = std::make_unique<Process>(args, dir_.path() + "/coordinator.log");
}

void Cluster::StartAll() {
  for (int i = 0; i < workers(); ++i) StartWorker(i);
  StartCoordinator();
}

void Cluster::KillWorker(int i, int sig) {
  workers_[i]->Signal(sig);
  workers_[i]->Wait(std::chrono::seconds(10));
}

std::string Cluster::Logs() const {
  std::string all;
  if (coordinator_) all += "--- coordinator\n" + coordinator_->Log();
  for (size_t i = 0; i < workers_.size(); ++i)
    if (workers_[i]) all += "--- " + node(static_cast<int>(i)) + "\n" + workers_[i]->Log();
  return all;
}

Server::Server(std::vector<std::string> extra_args) {
  port_ = FreePort();
  std::vector<std::string> args = {"serve", "--model", SmallModel(), "--listen",
                                   "127.0.0.1:" + std::to_string(port_), "--threads", "1"};
  args.insert(args.end(), extra_args.begin(), extra_args.end());
  proc_ = std::make_unique<Process>(args, dir_.path() + "/serve.log");
}

std::unique_ptr<flashmesh::v1::Inference::Stub> Connect(const std::string& api) {
  // Tests poll a server that is still starting: with gRPC's default reconnect every cluster
  // looked 5 s slow to start.
  return flashmesh::v1::Inference::NewStub(
      grpc::CreateCustomChannel(api, grpc::InsecureChannelCredentials(), ReconnectingChannelArgs()));
}

flashmesh::v1::ClusterStatusResponse Status(flashmesh::v1::Inference::Stub* stub) {
  // The coordinator fills a node's counters from a Stats call with a short deadline and leaves
  // them 0 when it does not answer in time (a loaded or sanitized worker): asked again, for up
  // to 2 s, until every UP node's counters came (an UP node holds weights).
  const auto until = std::chrono::steady_clock::now() + std::chrono::seconds(2);
  while (true) {
    grpc::ClientContext ctx;
    ctx.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(5));
    flashmesh::v1::ClusterStatusRequest req;
    flashmesh::v1::ClusterStatusResponse resp;
    stub->ClusterStatus(&ctx, req, &resp);
    bool complete = true;
    for (const auto& n : resp.nodes())
      complete = complete && (n.state() != flashmesh::v1::NODE_STATE_UP || n.weight_bytes() > 0);
    if (complete || std::chrono::steady_clock::now() >= until) return resp;
    std::this_thread::sleep_for(std::chrono::milliseconds(50));
  }
}

int Gpus() {
#if FM_TEST_CUDA
  return cuda::DeviceCount();
#else
  return 0;
#endif
}

bool WaitHealthy(const std::string& api, std::chrono::milliseconds timeout) {
  auto stub = Connect(api);
  auto deadline = std::chrono::steady_clock::now() + timeout;
  while (std::chrono::steady_clock::now() < deadline) {
    if (Status(stub.get()).healthy()) return true;
    std::this_thread::sleep_for(std::chrono::milliseconds(100));
  }
  return false;
}

std::string FirstNodeError(const std::string& api, std::chrono::milliseconds timeout) {
  auto stub = Connect(api);
  const auto deadline = std::chrono::steady_clock::now() + timeout;
  while (std::chrono::steady_clock::now() < deadline) {
    std::this_thread::sleep_for(std::chrono::milliseconds(200));
    const auto status = Status(stub.get());   // kept: the loop reads its nodes
    for (const auto& n : status.nodes())
      if (n.state() == flashmesh::v1::NODE_STATE_DOWN && !n.error().empty()) return n.error();
  }
  return "";
}

std::string NodeErrorContaining(const std::string& api, const std::string& needle,
                                std::chrono::milliseconds timeout) {
  const auto deadline = std::chrono::steady_clock::now() + timeout;
  std::string err;
  while (err.find(needle) == std::string::npos && std::chrono::steady_clock::now() < deadline)
    err = FirstNodeError(api, std::chrono::seconds(5));
  return err;
}

Generation Generate(flashmesh::v1::Inference::Stub* stub, const flashmesh::v1::GenerateRequest& req,
                    const std::string& token) {
  Generation g;
  grpc::ClientContext ctx;
  ctx.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(120));
  if (!token.empty()) ctx.AddMetadata("authorization", "Bearer " + token);
  auto reader = stub->Generate(&ctx, req);
  flashmesh::v1::GenerateResponse resp;
  while (reader->Read(&resp)) {
    if (resp.has_token()) {
      g.ids.push_back(resp.token().id());
      g.logprobs.push_back(resp.token().logprob());
      g.top.emplace_back();
      for (const auto& alt : resp.token().top_logprobs()) g.top.back().emplace_back(alt.id(), alt.logprob());
      g.text += resp.token().text();
      g.pieces.push_back(resp.token().text());
    } else if (resp.has_finish()) {
      g.finish = resp.finish();
      g.finished = true;
    } else if (resp.has_prompt_logprobs()) {
      ++g.prompt_events;
      g.prompt.insert(g.prompt.end(), resp.prompt_logprobs().tokens().begin(), resp.prompt_logprobs().tokens().end());
    }
  }
  g.status = reader->Finish();
  return g;
}

flashmesh::v1::GenerateRequest TokensRequest(const std::vector<int32_t>& prompt, int max_tokens) {
  flashmesh::v1::GenerateRequest req;
  for (int32_t id : prompt) req.mutable_tokens()->add_ids(id);
  req.set_max_tokens(max_tokens);
  req.set_ignore_eos(true);
  req.mutable_sampling()->set_greedy(true);
  return req;
}

LiveStream::LiveStream(flashmesh::v1::Inference::Stub* stub, const flashmesh::v1::GenerateRequest& req) {
  ctx_.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(60));
  reader_ = stub->Generate(&ctx_, req);
  started_ = Next();
}

bool LiveStream::Next() {
  if (!reader_->Read(&resp_)) return false;
  tokens_ += resp_.has_token() ? 1 : 0;
  return true;
}

grpc::Status LiveStream::Finish() {
  while (Next()) {
  }
  return reader_->Finish();
}

void RunBenchCluster(const Cluster& cluster, nlohmann::json* report) {
  std::string out;
  ASSERT_EQ(RunFlashmesh({"bench", "cluster", "--config", cluster.yaml(), "--tokens", "4", "--prompt",
                          "3", "--streams", "2", "--threads", "1", "--json"},
                         &out, std::chrono::seconds(180)),
            0)
      << out;
  const size_t begin = out.find("{\n"), end = out.rfind("}");
  ASSERT_NE(begin, std::string::npos) << out;
  *report = nlohmann::json::parse(out.substr(begin, end - begin + 1));
}

void ExpectEqualsOneCudaWorker(Cluster& cluster) {
  using namespace std::chrono_literals;
  ClusterSpec one;
  one.stages = 1;
  one.device = "cuda:0";
  Cluster single(one);
  single.StartAll();
  ASSERT_TRUE(WaitHealthy(single.api(), 120s)) << single.Logs();
  ASSERT_TRUE(WaitHealthy(cluster.api(), 120s)) << cluster.Logs();
  auto ref = Connect(single.api());
  auto stub = Connect(cluster.api());
  for (int i = 0; i < 3; ++i) {
    std::vector<int32_t> prompt = {5 + i, 6, 7, 8 + i};
    for (int j = 0; j < 20 * i; ++j) prompt.push_back((j * 7 + i) % 500);
    const auto req = TokensRequest(prompt, 8);
    Generation want = Generate(ref.get(), req), got = Generate(stub.get(), req);
    ASSERT_TRUE(want.status.ok() && got.status.ok())
        << want.status.error_message() << " / " << got.status.error_message() << cluster.Logs();
    EXPECT_EQ(got.ids, want.ids) << "request " << i;
    EXPECT_EQ(got.logprobs, want.logprobs) << "request " << i;
  }
}

void ExpectClusterEqualsSingle(const ClusterSpec& spec,
                               const std::vector<flashmesh::v1::GenerateRequest>& requests,
                               size_t tokens, flashmesh::v1::ClusterStatusResponse* status) {
  using namespace std::chrono_literals;
  Server single;
  Cluster cluster(spec);
  cluster.StartAll();
  ASSERT_TRUE(WaitHealthy(single.api(), 60s)) << single.process()->Log();
  ASSERT_TRUE(WaitHealthy(cluster.api(), 60s)) << cluster.Logs();
  auto ref = Connect(single.api());
  const size_t n = requests.size();
  std::vector<Generation> want(n), got(n);
  for (size_t i = 0; i < n; ++i) want[i] = Generate(ref.get(), requests[i]);
  // Concurrent, so that the group's members hold sequences of one micro-batch.
  std::vector<std::thread> threads;
  for (size_t i = 0; i < n; ++i)
    threads.emplace_back([&, i] {
      auto stub = Connect(cluster.api());
      got[i] = Generate(stub.get(), requests[i]);
    });
  for (auto& t : threads) t.join();
  for (size_t i = 0; i < n; ++i) {
    ASSERT_TRUE(want[i].status.ok()) << want[i].status.error_message();
    ASSERT_TRUE(got[i].status.ok()) << got[i].status.error_message() << cluster.Logs();
    EXPECT_EQ(got[i].ids, want[i].ids) << "request " << i;
    EXPECT_EQ(got[i].logprobs, want[i].logprobs) << "request " << i;
    EXPECT_EQ(got[i].top, want[i].top) << "request " << i;
    EXPECT_EQ(got[i].ids.size(), tokens);
  }
  if (spec.http) ExpectChoicesEqualSeededRequests(cluster.http_port(), ref.get(), requests);
  auto stub = Connect(cluster.api());
  *status = StatusAfterFrees(stub.get());
}

void ExpectChoicesEqualSeededRequests(int http_port, flashmesh::v1::Inference::Stub* reference,
                                      const std::vector<flashmesh::v1::GenerateRequest>& requests) {
  const flashmesh::v1::GenerateRequest* base = nullptr;
  for (const auto& r : requests)
    if (!r.sampling().greedy() && r.sampling().has_seed() &&
        (!base || r.tokens().ids_size() > base->tokens().ids_size()))
      base = &r;
  ASSERT_NE(base, nullptr) << "no seeded request to take choices of";
  constexpr int kChoices = 3;
  const auto& s = base->sampling();
  nlohmann::json body = {{"prompt", std::vector<int32_t>(base->tokens().ids().begin(),
                                                         base->tokens().ids().end())},
                         {"max_tokens", base->max_tokens()}, {"temperature", s.temperature()},
                         {"top_p", s.top_p()}, {"seed", s.seed()}, {"n", kChoices},
                         {"logprobs", 0}, {"ignore_eos", true}};
  HttpResult r = HttpCall(http_port, "POST", "/v1/completions", body.dump());
  ASSERT_EQ(r.status, 200) << r.raw;
  const nlohmann::json j = nlohmann::json::parse(r.body);
  ASSERT_EQ(j["choices"].size(), static_cast<size_t>(kChoices)) << j;
  for (int i = 0; i < kChoices; ++i) {
    auto alone = *base;
    alone.mutable_sampling()->set_seed(s.seed() + i);
    alone.set_ignore_eos(true);
    const Generation want = Generate(reference, alone);
    ASSERT_TRUE(want.status.ok()) << want.status.error_message();
    const nlohmann::json& got = j["choices"][i]["logprobs"]["token_logprobs"];
    ASSERT_EQ(got.size(), want.logprobs.size()) << "choice " << i;
    for (size_t t = 0; t < want.logprobs.size(); ++t)
      EXPECT_EQ(static_cast<float>(got[t].get<double>()), want.logprobs[t]) << "choice " << i << " token " << t;
    EXPECT_EQ(j["choices"][i]["text"], want.text) << "choice " << i;
  }
}

flashmesh::v1::ClusterStatusResponse StatusAfterFrees(flashmesh::v1::Inference::Stub* stub) {
  auto status = Status(stub);
  auto all_freed = [&] {
    for (const auto& node : status.nodes())
      if (node.kv_bytes() != 0) return false;
    return true;
  };
  const auto freed_by = std::chrono::steady_clock::now() + std::chrono::seconds(5);
  while (!all_freed() && std::chrono::steady_clock::now() < freed_by) {
    std::this_thread::sleep_for(std::chrono::milliseconds(100));
    status = Status(stub);
  }
  return status;
}

void ExpectKilledMemberFailsFastAndRestartRecovers(const ClusterSpec& spec, int w,
                                                  const flashmesh::v1::GenerateRequest& after,
                                                  size_t after_tokens) {
  using namespace std::chrono_literals;
  Cluster cluster(spec);
  cluster.StartAll();
  ASSERT_TRUE(WaitHealthy(cluster.api(), 60s)) << cluster.Logs();
  auto stub = Connect(cluster.api());
  LiveStream live(stub.get(), TokensRequest({5, 6, 7}, 250));
  ASSERT_TRUE(live.started()) << cluster.Logs();
  cluster.KillWorker(w, SIGKILL);
  const auto killed_at = std::chrono::steady_clock::now();
  const grpc::Status st = live.Finish();
  EXPECT_LT(std::chrono::steady_clock::now() - killed_at, 5s);
  EXPECT_EQ(st.error_code(), grpc::StatusCode::UNAVAILABLE) << st.error_message();
  const std::string name = cluster.node(w);
  EXPECT_NE(st.error_message().find(name), std::string::npos) << st.error_message();
  std::string out;
  EXPECT_EQ(RunFlashmesh({"health", "--server", cluster.api(), "--node", name}, &out, 5s), 2) << out;

  cluster.StartWorker(w);
  ASSERT_TRUE(WaitHealthy(cluster.api(), 60s)) << cluster.Logs();
  Generation g = Generate(stub.get(), after);
  ASSERT_TRUE(g.status.ok()) << g.status.error_message() << cluster.Logs();
  EXPECT_EQ(g.ids.size(), after_tokens);
}

}  // namespace fm::it
