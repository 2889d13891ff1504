// Metrics: the coordinator's Prometheus metrics (prometheus-cpp registry + text serializer),
// served as GET /metrics. Request-side metrics are counted as requests run (both APIs, label
// api="http" | "grpc"); cluster-side ones (queue, sequences, per-node up / bytes / KV) are read
// at scrape time from the scheduler, the cluster and each worker's Stats. Names and labels are
// listed in docs/api.md ("Metrics").
#pragma once
#include <chrono>
#include <memory>
#include <string>

#include "common/status.h"
#include "flashmesh/v1/api.pb.h"

namespace prometheus {
class Registry;
class Counter;
class Histogram;
template <typename T>
class Family;
}  // namespace prometheus

namespace fm {

class Cluster;
class Scheduler;

class Metrics {
 public:
  Metrics();
  ~Metrics();
  // A request that finished (stop / length / cancelled), with its token counts.
  void Finished(const std::string& api, const flashmesh::v1::Finish& finish);
  // A request that ended with an error (validation, auth, queue full, worker failure): counted
  // by the HTTP status the error maps to (openai_request.h), for both APIs.
  void Failed(const std::string& api, const Status& error);
  void FirstToken(double seconds);
  void InterToken(double seconds);
  // One micro-batch's StepBatch round trip to `node`.
  void StepLatency(const std::string& node, double seconds);
  // The whole exposition (text format 0.0.4).
  std::string Render(Cluster* cluster, const Scheduler* scheduler);

 private:
  std::shared_ptr<prometheus::Registry> registry_;
  prometheus::Family<prometheus::Counter>* requests_;
  prometheus::Family<prometheus::Counter>* errors_;
  prometheus::Counter* prompt_tokens_;
  prometheus::Counter* generation_tokens_;
  prometheus::Histogram* ttft_;
  prometheus::Histogram* itl_;
  prometheus::Family<prometheus::Histogram>* step_latency_;
};

// One request's timing: TTFT at its first token, inter-token latency after that.
class RequestMeter {
 public:
  RequestMeter(Metrics* metrics, std::string api)
      : metrics_(metrics), api_(std::move(api)), last_(std::chrono::steady_clock::now()) {}
  // The request's prompt length, once it is submitted (a cancelled request's usage).
  void Submitted(int64_t prompt_tokens) { prompt_ = prompt_tokens; }
  void Token();
  void Finished(const flashmesh::v1::Finish& finish) { metrics_->Finished(api_, finish); }
  // The client went away: finish_reason cancelled, with the tokens used until then.
  void Cancelled();
  void Failed(const Status& error) { metrics_->Failed(api_, error); }

 private:
  Metrics* metrics_;
  std::string api_;
  std::chrono::steady_clock::time_point last_;
  bool first_ = true;
  int64_t prompt_ = 0, generated_ = 0;
};

}  // namespace fm
