// flashmesh plan --config FILE [--model DIR] [--prompt N] [--json]
#include <cstdio>
#include <filesystem>
#include <nlohmann/json.hpp>
#include <optional>
#include <string>

#include "cli/commands.h"
#include "cli/flags.h"
#include "config/cluster_config.h"
#include "coordinator/cost_model.h"
#include "coordinator/planner.h"
#include "model/config.h"

namespace fm::cli {
namespace {

nlohmann::json PredictionJson(const Prediction& p) {
  return {{"decode_tok_s", p.tok_s},           {"decode_tok_s_batch", p.tok_s_batch},
          {"ttft_s", p.ttft_s},                {"step_ms", p.step_s * 1e3},
          {"read_ms", p.read_s * 1e3},         {"wire_ms", p.wire_s * 1e3},
          {"hop_bytes_per_token", p.hop_bytes}, {"ep_bytes_per_token", p.ep_bytes},
          {"tp_bytes_per_token", p.tp_bytes},   {"exchanges_per_token", p.exchanges},
          {"busiest_read_bytes_per_token", p.busiest_read_bytes}};
}

// The candidates' table: layout, fits, batch-1 and batch-B tok/s, TTFT, bytes, wire.
std::string FormatCandidates(const std::vector<PlanCandidate>& all, const Plan& chosen,
                             const CostQuery& q) {
  char line[256];
  std::string out;
  std::snprintf(line, sizeof line,
                "\ncost model (docs/performance.md): decode at context %lld, batch %lld; TTFT of "
                "a %lld-token prompt in chunks of %lld\n",
                static_cast<long long>(q.context), static_cast<long long>(q.batch),
                static_cast<long long>(q.prompt), static_cast<long long>(q.step_tokens));
  out += line;
  const std::string batch = "tok/s b" + std::to_string(q.batch);
  std::snprintf(line, sizeof line, "%-13s %-4s %9s %9s %8s %9s %9s %9s\n", "layout", "fits",
                "tok/s b1", batch.c_str(), "TTFT s", "read GB", "wire KB", "wire ms");
  out += line;
  for (const PlanCandidate& c : all) {
    const std::string name = LayoutName(c.pipeline_stages, c.expert_parallel, c.tensor_parallel);
    const bool is_chosen = c.pipeline_stages == chosen.pipeline_stages &&
                           c.expert_parallel == chosen.expert_parallel &&
                           c.tensor_parallel == chosen.tensor_parallel;
    const std::string note = is_chosen ? "<- chosen" : "";
    if (!c.plan.ok() || !c.prediction.ok()) {
      std::snprintf(line, sizeof line, "%-13s %-4s %s\n", name.c_str(), "no",
                    (c.plan.ok() ? c.prediction.status() : c.plan.status()).message().c_str());
      out += line;
      continue;
    }
    const Prediction& p = *c.prediction;
    std::snprintf(line, sizeof line, "%-13s %-4s %9.2f %9.2f %8.3f %9.2f %9.1f %9.3f",
                  name.c_str(), "yes", p.tok_s, p.tok_s_batch, p.ttft_s,
                  p.busiest_read_bytes / 1e9, p.wire_bytes() / 1e3, p.wire_s * 1e3);
    out += line + (note.empty() ? "" : "  " + note) + "\n";
  }
  out += "  read GB: weight + KV bytes the busiest worker reads a token (batch 1); wire: bytes\n"
         "  all workers send a token (hops + EP + TP) and the wire part of a token's time\n";
  return out;
}

const CommandSpec kSpec{
    "plan",
    "validates a cluster YAML and prints the placement plan (node, stage, layers, experts,\n"
    "weight / KV / free GiB) from the model's config.json alone; no weights are read.\n"
    "Then the cost model's prediction (decode tok/s at batch 1 and max_batch, time to first\n"
    "token, bytes read and sent per token) for every layout of the nodes (pp x ep, pp x tp);\n"
    "`parallel: auto` takes the fastest that fits. cpu profiles are probed (~0.3 s).",
    {{"config", "FILE", "the cluster YAML", true},
     {"model", "DIR", "checkpoint directory instead of the YAML's `model`"},
     {"prompt", "N", "the prompt of the TTFT column (default min(1024, limits.max_context); at\n"
                     "most limits.max_context), in chunks of limits.max_step_tokens"},
     {"json", nullptr, "the plan as JSON"}}};

}  // namespace

int CmdPlan(int argc, char** argv) {
  int rc = 0;
  const std::optional<Flags> flags = StartCommand(kSpec, argc, argv, &rc);
  if (!flags) return rc;
  const std::string config = flags->Get("config"), model = flags->Get("model");
  const bool json = flags->Has("json");
  auto cluster = LoadClusterConfig(config);
  if (!cluster.ok()) {
    std::fprintf(stderr, "plan: %s\n", cluster.status().ToString().c_str());
    return 1;
  }
  const std::string dir = model.empty() ? cluster->model : model;
  const std::string config_json = (std::filesystem::path(dir) / "config.json").string();
  auto mc = LoadModelConfig(config_json);
  if (!mc.ok()) {
    std::fprintf(stderr, "plan: %s\n", mc.status().ToString().c_str());
    return 1;
  }
  const ClusterConfig probed = WithProbedProfiles(*cluster);
  auto plan = PlanShards(*mc, probed);
  if (!plan.ok()) {
    std::fprintf(stderr, "plan: %s: %s\n", config.c_str(), plan.status().ToString().c_str());
    return 1;
  }
  CostQuery q = QueryFor(probed);
  auto prompt = flags->GetInt("prompt", q.prompt, 1, probed.limits.max_context);
  if (!prompt.ok()) {
    std::fprintf(stderr, "plan: %s\n", prompt.status().ToString().c_str());
    return 2;
  }
  q.prompt = *prompt;
  const std::vector<PlanCandidate> all = PlanCandidates(*mc, probed, q);
  if (json) {
    nlohmann::json j = nlohmann::json::parse(PlanToJson(*plan));
    j["query"] = {{"batch", q.batch}, {"prompt", q.prompt}, {"context", q.context},
                  {"step_tokens", q.step_tokens}};
    j["candidates"] = nlohmann::json::array();
    for (const PlanCandidate& c : all) {
      nlohmann::json cj = {{"pipeline_stages", c.pipeline_stages},
                           {"expert_parallel", c.expert_parallel},
                           {"tensor_parallel", c.tensor_parallel},
                           {"fits", c.plan.ok()}};
      if (!c.plan.ok()) cj["error"] = c.plan.status().message();
      else if (c.prediction.ok()) cj["prediction"] = PredictionJson(*c.prediction);
      if (c.plan.ok() && c.pipeline_stages == plan->pipeline_stages &&
          c.expert_parallel == plan->expert_parallel && c.tensor_parallel == plan->tensor_parallel)
        j["prediction"] = cj["prediction"];
      j["candidates"].push_back(cj);
    }
    std::printf("%s\n", j.dump(2).c_str());
  } else {
    std::printf("model: %s\n", dir.c_str());
    std::fputs(FormatPlanTable(*plan).c_str(), stdout);
    std::printf("profiles:");
    for (const NodeConfig& n : probed.nodes) {
      const HardwareProfile& p = n.profile;
      std::printf(" %s %s (%.0f GB/s x %.2f%s, %.0f Gb/s, %.0f us)%s", n.name.c_str(),
                  p.name.c_str(), p.mem_bw_gbps, p.decode_efficiency, p.probed ? " probed" : "",
                  p.link_gbps, p.link_latency_us, &n == &probed.nodes.back() ? "\n" : ";");
    }
    std::fputs(FormatCandidates(all, *plan, q).c_str(), stdout);
  }
  return 0;
}

}  // namespace fm::cli
