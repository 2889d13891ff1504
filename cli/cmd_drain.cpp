// flashmesh drain --config FILE --node NAME [--wait S | --resume]: takes a worker out of
// service without failing a live request: it refuses new sequences, so the coordinator admits
// no request (each needs every stage; new and queued ones get UNAVAILABLE naming the node),
// while the live ones finish. --wait returns once no node of the cluster holds a sequence (an
// expert-parallel member serves the experts of its group's sequences, wherever they live), so
// the worker can be stopped or restarted (a restarted worker serves again); --resume takes
// new sequences again. Nothing else ends a drain: it holds across the worker's reloads.
// Speaks to the workers' control ports as the coordinator does: the YAML's cluster secret
// signs each call, its TLS files are the client's.
#include <algorithm>
#include <chrono>
#include <cstdio>
#include <memory>
#include <optional>
#include <string>
#include <thread>
#include <vector>

#include "cli/commands.h"
#include "cli/flags.h"
#include "config/cluster_config.h"
#include "flashmesh/v1/worker.grpc.pb.h"
#include "rpc/control_auth.h"
#include "rpc/grpc_status.h"

namespace fm::cli {
namespace {

const CommandSpec kSpec{
    "drain",
    "a worker takes no new sequence while the live ones finish, so that it can be stopped\n"
    "or restarted without failing a live request; the cluster admits no request meanwhile.\n"
    "Exit 0 done, 1 the worker refused or did not answer, 2 a usage error.",
    {{"config", "FILE", "the cluster YAML (the node's control address, secret and TLS files)", true},
     {"node", "NAME", "the worker (nodes[].name)", true},
     {"wait", "S", "then wait up to S seconds until no node holds a sequence (exit 1 past that)"},
     {"resume", nullptr, "take new sequences again instead"}}};

constexpr auto kCallDeadline = std::chrono::seconds(5);

int Fail(const std::string& what) {
  std::fprintf(stderr, "drain: %s\n", what.c_str());
  return 1;
}

}  // namespace

int CmdDrain(int argc, char** argv) {
  int rc = 0;
  const std::optional<Flags> flags = StartCommand(kSpec, argc, argv, &rc);
  if (!flags) return rc;
  if (flags->Has("wait") && flags->Has("resume"))
    return UsageError(kSpec, "--wait and --resume exclude each other");
  auto wait_s = flags->GetInt("wait", 0, 0, 86400);
  if (!wait_s.ok()) return UsageError(kSpec, wait_s.status().message());
  auto cfg = LoadClusterConfig(flags->Get("config"));
  if (!cfg.ok()) return Fail(cfg.status().message());
  const std::string node = flags->Get("node");
  const NodeConfig* nc = cfg->FindNode(node);
  if (!nc) {   // a usage error: the flag names nothing in the YAML
    std::fprintf(stderr, "drain: %s: no node named '%s' in nodes[]\n", cfg->path.c_str(),
                 node.c_str());
    return 2;
  }
  auto secret = ReadClusterSecret(*cfg);
  if (!secret.ok()) return Fail(secret.status().message());
  const TlsConfig& t = cfg->security.tls;
  auto credentials = ChannelCredentialsFor({t.cert, t.key, t.ca});
  if (!credentials.ok()) return Fail(credentials.status().message());
  const std::string target = nc->control.ToString();
  auto call = [&](grpc::ClientContext* ctx) {
    ctx->set_deadline(std::chrono::system_clock::now() + kCallDeadline);
  };

  // The worker refuses a state change older than the coordinator term it follows: ask which
  // one first (Health is not fenced), then sign the Drain with it.
  flashmesh::v1::HealthResponse health;
  {
    auto stub = flashmesh::v1::Worker::NewStub(
        NewWorkerChannel(target, node, WorkerChannelArgs(), *secret, 0, *credentials));
    grpc::ClientContext ctx;
    call(&ctx);
    const grpc::Status s = stub->Health(&ctx, flashmesh::v1::HealthRequest(), &health);
    if (!s.ok()) return Fail("node " + node + " (" + target + "): " + s.error_message());
  }
  auto stub = flashmesh::v1::Worker::NewStub(
      NewWorkerChannel(target, node, WorkerChannelArgs(), *secret, health.term(), *credentials));
  flashmesh::v1::DrainRequest req;
  req.set_resume(flags->Has("resume"));
  flashmesh::v1::DrainResponse resp;
  {
    grpc::ClientContext ctx;
    call(&ctx);
    const grpc::Status s = stub->Drain(&ctx, req, &resp);
    if (!s.ok()) return Fail("node " + node + " (" + target + "): " + s.error_message());
  }
  if (req.resume()) {
    std::printf("node %s takes new sequences again\n", node.c_str());
    return 0;
  }
  std::printf("node %s draining: %d live sequence(s) on it\n", node.c_str(),
              resp.active_sequences());
  if (!flags->Has("wait")) return 0;
  // Every node's live sequences. A request the coordinator admitted before its next heartbeat
  // saw the drain may still start on the other nodes, so zero counts only after two
  // heartbeat periods.
  std::vector<std::unique_ptr<flashmesh::v1::Worker::Stub>> all;
  for (const NodeConfig& n : cfg->nodes)
    all.push_back(flashmesh::v1::Worker::NewStub(NewWorkerChannel(
        n.control.ToString(), n.name, WorkerChannelArgs(), *secret, health.term(), *credentials)));
  const auto beat = cfg->heartbeat.period();
  const auto start = std::chrono::steady_clock::now();
  const auto settled = start + 2 * beat;
  const auto until = start + std::chrono::seconds(*wait_s);
  // A node that cannot be reached (down for maintenance, say: UNAVAILABLE) runs no step: the
  // coordinator fails what it held. It counts as holding nothing, said once. Any other error,
  // and any error of the drained node itself, fails the wait as before.
  std::vector<char> silent(all.size(), 0);
  while (true) {
    int64_t live = 0;
    std::string holders;   // "w0: 1, w1: 1": a pipeline's request holds a sequence on every stage
    for (size_t i = 0; i < all.size(); ++i) {
      grpc::ClientContext ctx;
      call(&ctx);
      flashmesh::v1::StatsResponse stats;
      const grpc::Status s = all[i]->Stats(&ctx, flashmesh::v1::StatsRequest(), &stats);
      if (!s.ok() && (s.error_code() != grpc::StatusCode::UNAVAILABLE || cfg->nodes[i].name == node))
        return Fail("node " + cfg->nodes[i].name + " (" + cfg->nodes[i].control.ToString() +
                    "): " + s.error_message());
      if (!s.ok()) {
        if (!silent[i])
          std::fprintf(stderr, "drain: node %s (%s) does not answer (%s): counted as holding nothing\n",
                       cfg->nodes[i].name.c_str(), cfg->nodes[i].control.ToString().c_str(),
                       s.error_message().c_str());
        silent[i] = 1;
        continue;
      }
      live += stats.active_sequences();
      if (stats.active_sequences() > 0)
        holders += (holders.empty() ? "" : ", ") + cfg->nodes[i].name + ": " +
                   std::to_string(stats.active_sequences());
    }
    const auto now = std::chrono::steady_clock::now();
    if (live == 0 && now >= settled) break;
    if (now >= until && live > 0)
      return Fail("live sequences after " + std::to_string(*wait_s) + " s, per node: " + holders +
                  " (a request holds one on each of its stages and group members; node " + node +
                  " stays draining)");
    if (now >= until) {
      const auto settle_s = std::chrono::duration_cast<std::chrono::seconds>(2 * beat).count() + 1;
      return Fail("no live sequence yet, but a request admitted before the drain was seen may "
                  "start until two heartbeat periods after it: --wait at least " +
                  std::to_string(settle_s) + " s (node " + node + " stays draining)");
    }
    std::this_thread::sleep_for(std::chrono::milliseconds(200));
  }
  std::printf("node %s drained: no live sequence in the cluster\n", node.c_str());
  return 0;
}

}  // namespace fm::cli
