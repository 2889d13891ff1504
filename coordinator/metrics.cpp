#include "coordinator/metrics.h"

#include <algorithm>

#include <grpcpp/grpcpp.h>
#include <prometheus/counter.h>
#include <prometheus/histogram.h>
#include <prometheus/registry.h>
#include <prometheus/text_serializer.h>

#include "coordinator/api_service.h"
#include "coordinator/cluster.h"
#include "coordinator/openai_request.h"
#include "coordinator/scheduler.h"

namespace fm {
namespace {

constexpr auto kStatsTimeout = std::chrono::milliseconds(800);

const char* ReasonLabel(flashmesh::v1::FinishReason r) {
  switch (r) {
    case flashmesh::v1::FINISH_REASON_STOP: return "stop";
    case flashmesh::v1::FINISH_REASON_LENGTH: return "length";
    case flashmesh::v1::FINISH_REASON_CANCELLED: return "cancelled";
    default: return "unspecified";
  }
}

// Latency buckets from 1 ms to ~2 min (decode steps on CPU are tens of ms, prefill seconds).
prometheus::Histogram::BucketBoundaries LatencyBuckets() {
  return {0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 120};
}

// A family read at scrape time: one sample per node.
struct NodeFamily {
  prometheus::MetricFamily f;
  NodeFamily(const char* name, const char* help, prometheus::MetricType type) {
    f.name = name;
    f.help = help;
    f.type = type;
  }
  void Add(const std::string& node, double v, const char* extra_name = nullptr, const char* extra_value = nullptr) {
    prometheus::ClientMetric m;
    m.label.push_back({"node", node});
    if (extra_name) m.label.push_back({extra_name, extra_value});
    std::sort(m.label.begin(), m.label.end());   // as the registry prints its own labels
    if (f.type == prometheus::MetricType::Counter) m.counter.value = v;
    else m.gauge.value = v;
    f.metric.push_back(std::move(m));
  }
};

prometheus::MetricFamily Scalar(const char* name, const char* help, double v) {
  prometheus::MetricFamily f;
  f.name = name;
  f.help = help;
  f.type = prometheus::MetricType::Gauge;
  f.metric.emplace_back();
  f.metric.back().gauge.value = v;
  return f;
}

}  // namespace

Metrics::Metrics() : registry_(std::make_shared<prometheus::Registry>()) {
  requests_ = &prometheus::BuildCounter()
                   .Name("flashmesh_requests_total")
                   .Help("Requests that finished, by API and finish reason")
                   .Register(*registry_);
  errors_ = &prometheus::BuildCounter()
                 .Name("flashmesh_request_errors_total")
                 .Help("Requests that ended with an error, by API and HTTP status code")
                 .Register(*registry_);
  prompt_tokens_ = &prometheus::BuildCounter()
                        .Name("flashmesh_prompt_tokens_total")
                        .Help("Prompt tokens of finished requests")
                        .Register(*registry_)
                        .Add({});
  generation_tokens_ = &prometheus::BuildCounter()
                            .Name("flashmesh_generation_tokens_total")
                            .Help("Generated tokens of finished requests")
                            .Register(*registry_)
                            .Add({});
  ttft_ = &prometheus::BuildHistogram()
               .Name("flashmesh_time_to_first_token_seconds")
               .Help("From a request's arrival to its first generated token")
               .Register(*registry_)
               .Add({}, LatencyBuckets());
  itl_ = &prometheus::BuildHistogram()
              .Name("flashmesh_inter_token_latency_seconds")
              .Help("Between consecutive generated tokens of one request")
              .Register(*registry_)
              .Add({}, LatencyBuckets());
  step_latency_ = &prometheus::BuildHistogram()
                       .Name("flashmesh_node_step_latency_seconds")
                       .Help("StepBatch round trip of one micro-batch to a node")
                       .Register(*registry_);
  // The usual series exist from the start, at 0, so that rate() and absence alerts see an idle
  // server as idle rather than as missing data.
  for (const char* api : {"grpc", "http"}) {
    for (const char* reason : {"stop", "length", "cancelled"})
      requests_->Add({{"api", api}, {"finish_reason", reason}});
    for (const char* code : {"400", "429", "500", "503", "504"}) errors_->Add({{"api", api}, {"code", code}});
  }
}

Metrics::~Metrics() = default;

void Metrics::Finished(const std::string& api, const flashmesh::v1::Finish& finish) {
  requests_->Add({{"api", api}, {"finish_reason", ReasonLabel(finish.reason())}}).Increment();
  prompt_tokens_->Increment(finish.usage().prompt_tokens());
  generation_tokens_->Increment(finish.usage().completion_tokens());
}

void Metrics::Failed(const std::string& api, const Status& error) {
  errors_->Add({{"api", api}, {"code", std::to_string(ErrorFromStatus(error).http_status)}}).Increment();
}

void Metrics::FirstToken(double seconds) { ttft_->Observe(seconds); }
void Metrics::InterToken(double seconds) { itl_->Observe(seconds); }

void Metrics::StepLatency(const std::string& node, double seconds) {
  step_latency_->Add({{"node", node}}, LatencyBuckets()).Observe(seconds);
}

std::string Metrics::Render(Cluster* cluster, const Scheduler* scheduler) {
  std::vector<prometheus::MetricFamily> families = registry_->Collect();
  families.push_back(Scalar("flashmesh_queue_depth", "Requests waiting for a batch slot", scheduler->queued()));
  families.push_back(Scalar("flashmesh_active_sequences", "Sequences being generated", scheduler->active()));
  // The stats first (up to kStatsTimeout with a frozen node), then the health and the node
  // states together: a scrape never says ready beside a node that is down.
  const auto stats = cluster->StatsOfAll(kStatsTimeout);
  const bool ready = ClusterHealth(*cluster, *scheduler).ok();   // /health's rule
  families.push_back(Scalar("flashmesh_cluster_ready", "1 while the cluster can generate (/health is 200)",
                            ready ? 1 : 0));
  using prometheus::MetricType;
  NodeFamily up("flashmesh_node_up",
                "1 when the node is up (shard loaded, heartbeats fresh, not draining)",
                MetricType::Gauge);
  NodeFamily kv("flashmesh_node_kv_cache_bytes", "KV cache bytes held by the node's live sequences", MetricType::Gauge);
  NodeFamily seqs("flashmesh_node_active_sequences", "Sequences live on the node", MetricType::Gauge);
  NodeFamily data("flashmesh_node_data_plane_bytes_total", "Data-plane bytes (frame headers + payloads)", MetricType::Counter);
  NodeFamily ep("flashmesh_node_ep_bytes_sent_total",
                "Group exchange payload bytes sent: expert-parallel dispatch + combine, or "
                "tensor-parallel all-gathers", MetricType::Counter);
  NodeFamily device("flashmesh_node_device_copy_bytes_total",
                    "Host<->device copy bytes of the node's steps (0 on a CPU node)", MetricType::Counter);
  NodeFamily device_tokens("flashmesh_node_device_tokens_total",
                           "Rows the node's device steps ran (what its device copy bytes cover)",
                           MetricType::Counter);
  for (size_t i = 0; i < cluster->nodes().size(); ++i) {
    const NodeHandle* node = cluster->nodes()[i].get();
    up.Add(node->name(), node->state() == flashmesh::v1::NODE_STATE_UP ? 1 : 0);
    if (!stats[i]) continue;
    const flashmesh::v1::StatsResponse& resp = *stats[i];
    kv.Add(node->name(), static_cast<double>(resp.kv_bytes()));
    seqs.Add(node->name(), resp.active_sequences());
    data.Add(node->name(), static_cast<double>(resp.data_bytes_sent()), "direction", "sent");
    data.Add(node->name(), static_cast<double>(resp.data_bytes_received()), "direction", "received");
    ep.Add(node->name(), static_cast<double>(resp.ep_bytes_sent()));
    device.Add(node->name(), static_cast<double>(resp.host_to_device_bytes()), "direction",
               "host_to_device");
    device.Add(node->name(), static_cast<double>(resp.device_to_host_bytes()), "direction",
               "device_to_host");
    device_tokens.Add(node->name(), static_cast<double>(resp.device_tokens()));
  }
  for (auto* f : {&up, &kv, &seqs, &data, &ep, &device, &device_tokens})
    families.push_back(std::move(f->f));
  return prometheus::TextSerializer().Serialize(families);
}

void RequestMeter::Token() {
  auto now = std::chrono::steady_clock::now();
  double s = std::chrono::duration<double>(now - last_).count();
  if (first_) metrics_->FirstToken(s);
  else metrics_->InterToken(s);
  first_ = false;
  last_ = now;
  ++generated_;
}

void RequestMeter::Cancelled() {
  flashmesh::v1::Finish f;
  f.set_reason(flashmesh::v1::FINISH_REASON_CANCELLED);
  f.mutable_usage()->set_prompt_tokens(static_cast<int32_t>(prompt_));
  f.mutable_usage()->set_completion_tokens(static_cast<int32_t>(generated_));
  Finished(f);
}

}  // namespace fm
