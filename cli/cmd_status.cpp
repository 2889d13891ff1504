// flashmesh status --server HOST:PORT [--json]: one row per node.
#include <cstdio>
#include <optional>
#include <string>

#include <nlohmann/json.hpp>

#include "cli/cluster_status.h"
#include "cli/commands.h"
#include "cli/flags.h"

namespace fm::cli {
namespace {

std::string Mib(uint64_t bytes) {
  char buf[32];
  std::snprintf(buf, sizeof buf, "%.1f", static_cast<double>(bytes) / 1048576.0);
  return buf;
}

nlohmann::json TopExperts(const flashmesh::v1::NodeStatus& n) {
  nlohmann::json a = nlohmann::json::array();
  for (const auto& e : n.top_experts()) a.push_back({{"expert", e.expert()}, {"tokens", e.tokens()}});
  return a;
}

// Host<->device bytes per token of each node whose steps ran on a device (none: no lines).
void PrintDeviceTraffic(const flashmesh::v1::ClusterStatusResponse& resp) {
  bool header = false;
  for (const auto& n : resp.nodes()) {
    if (n.device_tokens() == 0) continue;
    if (!header) std::printf("host<->device bytes per token (device steps since start):\n");
    header = true;
    const double tokens = static_cast<double>(n.device_tokens());
    std::printf("  %-14s h2d %.0f  d2h %.0f  (over %llu tokens)\n", n.name().c_str(),
                static_cast<double>(n.host_to_device_bytes()) / tokens,
                static_cast<double>(n.device_to_host_bytes()) / tokens,
                static_cast<unsigned long long>(n.device_tokens()));
  }
}

const CommandSpec kSpec{
    "status",
    "one row per node: state, stage, layers, experts, weight MiB, KV MiB, active\n"
    "sequences, tok/s, seconds since the last heartbeat, data-plane MiB sent; with expert\n"
    "parallelism, each node's 5 most-routed experts; for device (cuda) nodes, the host<->device\n"
    "bytes per token of their steps. Exit 0 when healthy, 1 when not (the reason is printed),\n"
    "2 when the coordinator does not answer, 3 when nothing was asked (a usage error,\n"
    "unusable credentials, a --server that is not a coordinator's API port)",
    {{"server", "HOST:PORT", "the coordinator's API", true},
     {"json", nullptr, "the status as JSON"},
     {"token-file", "FILE", "bearer token file (security.token_file)"},
     {"tls-ca", "FILE", "CA of the coordinator's certificate (security.tls)"}}};

}  // namespace

int CmdStatus(int argc, char** argv) {
  int rc = 0;
  const std::optional<Flags> flags = StartCommand(kSpec, argc, argv, &rc);
  if (!flags) return rc == 0 ? 0 : kExitCannotAsk;   // --help, or a usage error
  const auto status = FetchClusterStatus("status", *flags, stderr, &rc);
  if (!status) {
    // A JSON reader gets JSON whatever happened: the coordinator is down (exit 2); the reason
    // went to stderr. Nothing was asked (exit 3: bad flags or credentials) prints nothing.
    if (flags->Has("json") && rc == 2) std::printf("%s\n", nlohmann::json{{"reachable", false}}.dump().c_str());
    return rc;
  }
  const flashmesh::v1::ClusterStatusResponse& resp = *status;
  if (flags->Has("json")) {
    nlohmann::json j;
    j["reachable"] = true;
    j["healthy"] = resp.healthy();
    j["reason"] = resp.reason();
    j["model"] = resp.model();
    j["pipeline_stages"] = resp.pipeline_stages();
    j["expert_parallel"] = resp.expert_parallel();
    j["tensor_parallel"] = resp.tensor_parallel();
    j["active_requests"] = resp.active_requests();
    j["queued_requests"] = resp.queued_requests();
    j["nodes"] = nlohmann::json::array();
    for (const auto& n : resp.nodes()) {
      j["nodes"].push_back({{"name", n.name()},
                            {"state", StateName(n.state())},
                            {"stage", n.stage()},
                            {"layer_begin", n.layer_begin()},
                            {"layer_end", n.layer_end()},
                            {"expert_begin", n.expert_begin()},
                            {"expert_end", n.expert_end()},
                            {"embed", n.embed()},
                            {"head", n.head()},
                            {"weight_bytes", n.weight_bytes()},
                            {"kv_bytes", n.kv_bytes()},
                            {"active_sequences", n.active_sequences()},
                            {"tokens_per_second", n.tokens_per_second()},
                            {"heartbeat_age_s", n.heartbeat_age_s()},
                            {"data_bytes_sent", n.data_bytes_sent()},
                            {"data_bytes_received", n.data_bytes_received()},
                            {"data_frames_rejected", n.data_frames_rejected()},
                            {"ep_bytes_sent", n.ep_bytes_sent()},
                            {"host_to_device_bytes", n.host_to_device_bytes()},
                            {"device_to_host_bytes", n.device_to_host_bytes()},
                            {"device_tokens", n.device_tokens()},
                            {"top_experts", TopExperts(n)},
                            {"control", n.control()},
                            {"data", n.data()},
                            {"error", n.error()}});
    }
    std::printf("%s\n", j.dump(2).c_str());
    return resp.healthy() ? 0 : 1;
  }
  const std::string group = resp.tensor_parallel() > 1
                                ? " x " + std::to_string(resp.tensor_parallel()) + "-way tensor parallel"
                                : "";
  std::printf("cluster: %s, %d stage(s)%s, %d active / %d queued requests\n",
              resp.healthy() ? "healthy" : ("NOT READY (" + resp.reason() + ")").c_str(),
              resp.pipeline_stages(), group.c_str(), resp.active_requests(), resp.queued_requests());
  std::printf("%-14s %-8s %5s %-9s %-9s %10s %9s %6s %8s %7s %10s\n", "NODE", "STATE", "STAGE",
              "LAYERS", "EXPERTS", "WEIGHT_MiB", "KV_MiB", "SEQS", "TOK/S", "HB_AGE", "DATA_MiB");
  for (const auto& n : resp.nodes()) {
    // Half-open as plan prints them (without its space, to fit the column): [0,3) is layers
    // 0, 1 and 2.
    const std::string layers =
        "[" + std::to_string(n.layer_begin()) + "," + std::to_string(n.layer_end()) + ")";
    const std::string experts =
        "[" + std::to_string(n.expert_begin()) + "," + std::to_string(n.expert_end()) + ")";
    char age[16];
    if (n.heartbeat_age_s() < 0) std::snprintf(age, sizeof age, "never");
    else std::snprintf(age, sizeof age, "%.1fs", n.heartbeat_age_s());
    std::printf("%-14s %-8s %5d %-9s %-9s %10s %9s %6d %8.1f %7s %10s\n", n.name().c_str(),
                StateName(n.state()), n.stage(), layers.c_str(), experts.c_str(),
                Mib(n.weight_bytes()).c_str(), Mib(n.kv_bytes()).c_str(), n.active_sequences(),
                n.tokens_per_second(), age, Mib(n.data_bytes_sent()).c_str());
    if (!n.error().empty() && n.state() != flashmesh::v1::NODE_STATE_UP)
      std::printf("  %s: %s\n", n.name().c_str(), n.error().c_str());
  }
  if (resp.expert_parallel() > 1) {
    std::printf("expert load (rows routed per expert, top 5):\n");
    for (const auto& n : resp.nodes()) {
      std::printf("  %-14s", n.name().c_str());
      for (const auto& e : n.top_experts())
        std::printf(" %d:%llu", e.expert(), static_cast<unsigned long long>(e.tokens()));
      std::printf("   (EP sent %s MiB)\n", Mib(n.ep_bytes_sent()).c_str());
    }
  }
  PrintDeviceTraffic(resp);
  return resp.healthy() ? 0 : 1;
}

}  // namespace fm::cli
