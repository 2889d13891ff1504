#include "coordinator/scheduler.h"

#include <grpcpp/grpcpp.h>

#include <algorithm>

#include "common/log.h"
#include "worker/grpc_status.h"

namespace fm {
namespace {

constexpr auto kStepTimeout = std::chrono::seconds(120);
constexpr auto kControlTimeout = std::chrono::seconds(2);
// After the first failed RPC of a micro-batch, how long to wait for the others so that the
// error names the node that died rather than a peer that could not reach it.
constexpr auto kFailureGrace = std::chrono::milliseconds(300);
constexpr auto kIdleWake = std::chrono::milliseconds(20);

bool IsChannelError(const grpc::Status& s, const std::string& node) {
  // Errors a worker returns itself start with "node <name>"; anything else came from the
  // channel (connection refused/reset, deadline): the node itself is unreachable.
  return s.error_message().rfind("node " + node, 0) != 0;
}

}  // namespace

bool RequestStream::Pop(Event* ev, std::chrono::milliseconds timeout) {
  std::unique_lock<std::mutex> lock(mu_);
  if (!cv_.wait_for(lock, timeout, [&] { return !events_.empty(); })) return false;
  *ev = std::move(events_.front());
  events_.pop_front();
  return true;
}

void RequestStream::Push(Event ev) {
  {
    std::lock_guard<std::mutex> lock(mu_);
    events_.push_back(std::move(ev));
  }
  cv_.notify_all();
}

struct Scheduler::StepCall {
  struct PerNode {
    grpc::ClientContext ctx;
    flashmesh::v1::StepBatchRequest req;   // the items of this node's EP member
    flashmesh::v1::StepBatchResponse resp;
    grpc::Status status;
    bool done = false;
  };
  uint64_t step_id = 0;
  std::vector<uint64_t> seq_ids;
  std::vector<std::unique_ptr<PerNode>> nodes;
  std::mutex mu;
  int remaining = 0;
  bool failed = false;
  std::chrono::steady_clock::time_point first_failure;
};

Scheduler::Scheduler(Cluster* cluster, const Tokenizer* tokenizer, SchedulerLimits limits)
    : cluster_(cluster), tokenizer_(tokenizer), limits_(limits), thread_([this] { Loop(); }) {}

Scheduler::~Scheduler() {
  {
    std::lock_guard<std::mutex> lock(mu_);
    stop_ = true;
  }
  cv_.notify_all();
  thread_.join();
  for (auto& [id, call] : in_flight_)
    for (auto& n : call->nodes) n->ctx.TryCancel();
  // Callbacks of cancelled RPCs still touch this object: wait for the last one.
  while (outstanding_rpcs_ > 0) std::this_thread::sleep_for(std::chrono::milliseconds(5));
}

Result<std::shared_ptr<RequestStream>> Scheduler::Submit(GenerateParams params) {
  FM_RETURN_IF_ERROR(cluster_->Ready());
  auto r = std::make_unique<Request>();
  r->params = std::move(params);
  r->stream = std::make_shared<RequestStream>();
  if (tokenizer_) r->decoder.emplace(*tokenizer_);
  r->next = r->params.prompt;
  auto stream = r->stream;
  {
    std::lock_guard<std::mutex> lock(mu_);
    if (static_cast<int64_t>(incoming_.size()) >= limits_.max_queue)
      return ResourceExhausted("the request queue is full (" + std::to_string(limits_.max_queue) +
                               " waiting; limits.max_queue)");
    incoming_.push_back(std::move(r));
    queued_count_ = static_cast<int>(incoming_.size());
  }
  cv_.notify_all();
  return stream;
}

void Scheduler::Loop() {
  while (true) {
    {
      std::unique_lock<std::mutex> lock(mu_);
      cv_.wait_for(lock, kIdleWake);
      if (stop_) return;
    }
    // Finished (or failed) micro-batches, in step order.
    std::vector<std::shared_ptr<StepCall>> finished;
    for (auto& [id, call] : in_flight_) {
      std::lock_guard<std::mutex> lock(call->mu);
      if (call->remaining == 0 ||
          (call->failed && std::chrono::steady_clock::now() - call->first_failure >= kFailureGrace))
        finished.push_back(call);
    }
    for (auto& call : finished) {
      if (!in_flight_.count(call->step_id)) continue;   // dropped by an earlier FailAll
      in_flight_.erase(call->step_id);
      Complete(call.get());
    }
    Status ready = cluster_->Ready();
    if (!ready.ok()) {
      // Also when idle: a node that comes back has forgotten the step order (prev_step_id),
      // so the survivors must forget it too or the next step waits for one it never saw.
      if (!live_.empty() || !in_flight_.empty() || last_step_id_ != 0) FailAll(ready);
      std::deque<std::unique_ptr<Request>> queued;
      {
        std::lock_guard<std::mutex> lock(mu_);
        queued.swap(incoming_);
        queued_count_ = 0;
      }
      for (auto& r : queued) r->stream->Push({RequestStream::Event::kError, {}, {}, ready});
      continue;
    }
    // Cancelled sequences that are between steps.
    std::vector<uint64_t> cancelled;
    for (auto& [id, r] : live_)
      if (r->stream->cancelled() && !r->in_flight) cancelled.push_back(id);
    for (auto id : cancelled) Finish(live_[id].get(), flashmesh::v1::FINISH_REASON_CANCELLED, "");
    Admit();
    Launch();
  }
}

void Scheduler::Admit() {
  while (static_cast<int64_t>(live_.size()) < limits_.max_batch) {
    std::unique_ptr<Request> r;
    {
      std::lock_guard<std::mutex> lock(mu_);
      if (incoming_.empty()) break;
      r = std::move(incoming_.front());
      incoming_.pop_front();
      queued_count_ = static_cast<int>(incoming_.size());
    }
    if (r->stream->cancelled()) continue;
    r->id = next_request_id_++;
    flashmesh::v1::StartSequenceRequest req;
    req.set_seq_id(r->id);
    req.set_max_context(static_cast<int32_t>(limits_.max_context));
    *req.mutable_sampling() = r->params.sampling;
    // Data-parallel attention: the sequence lives on one member of every stage's EP group,
    // the one with the fewest live sequences.
    std::vector<int> load(cluster_->expert_parallel(), 0);
    for (const auto& [id, q] : live_) ++load[q->member];
    r->member = static_cast<int>(std::min_element(load.begin(), load.end()) - load.begin());
    Status failed;
    std::vector<NodeHandle*> started;
    for (const auto& node : cluster_->nodes()) {
      if (node->plan().ep_rank != r->member) continue;
      flashmesh::v1::StartSequenceResponse resp;
      grpc::ClientContext ctx;
      ctx.set_deadline(std::chrono::system_clock::now() + kControlTimeout);
      grpc::Status s = node->stub()->StartSequence(&ctx, req, &resp);
      if (!s.ok()) {
        failed = FromGrpc(s, IsChannelError(s, node->name())
                                 ? "node " + node->name() + " (" + node->control() + ") is unavailable"
                                 : "starting the sequence");
        break;
      }
      started.push_back(node.get());
    }
    if (!failed.ok()) {
      FM_LOG(kWarn, "scheduler") << "request " << r->id << ": " << failed.ToString();
      for (NodeHandle* n : started) {
        flashmesh::v1::FreeSequenceRequest freq;
        freq.add_seq_ids(r->id);
        flashmesh::v1::FreeSequenceResponse fresp;
        grpc::ClientContext ctx;
        ctx.set_deadline(std::chrono::system_clock::now() + kControlTimeout);
        n->stub()->FreeSequence(&ctx, freq, &fresp);
      }
      r->stream->Push({RequestStream::Event::kError, {}, {}, failed});
      continue;
    }
    live_[r->id] = std::move(r);
  }
  active_count_ = static_cast<int>(live_.size());
}

void Scheduler::Launch() {
  const int stages = cluster_->num_stages();
  while (num_in_flight() < stages) {
    std::vector<Request*> ready;
    for (auto& [id, r] : live_)
      if (!r->in_flight && !r->stream->cancelled() && !r->next.empty()) ready.push_back(r.get());
    if (ready.empty()) return;
    // Spread the ready sequences over the free pipeline slots.
    const size_t slots = static_cast<size_t>(stages - num_in_flight());
    const size_t take = (ready.size() + slots - 1) / slots;
    auto call = std::make_shared<StepCall>();
    call->step_id = next_step_id_++;
    std::vector<flashmesh::v1::StepItem> items(take);
    for (size_t i = 0; i < take; ++i) {
      Request* r = ready[i];
      flashmesh::v1::StepItem* item = &items[i];
      item->set_seq_id(r->id);
      item->mutable_tokens()->Add(r->next.begin(), r->next.end());
      r->next.clear();
      r->in_flight = true;
      call->seq_ids.push_back(r->id);
    }
    in_flight_[call->step_id] = call;
    const auto& nodes = cluster_->nodes();
    call->remaining = static_cast<int>(nodes.size());
    // Every worker runs every step (an EP member without sequences still serves its experts),
    // each with its member's items, in the order given by prev_step_id.
    for (size_t i = 0; i < nodes.size(); ++i) {
      auto pn = std::make_unique<StepCall::PerNode>();
      pn->req.set_step_id(call->step_id);
      pn->req.set_prev_step_id(last_step_id_);
      for (const auto& item : items)
        if (live_[item.seq_id()]->member == nodes[i]->plan().ep_rank) *pn->req.add_items() = item;
      call->nodes.push_back(std::move(pn));
    }
    last_step_id_ = call->step_id;
    for (size_t i = 0; i < nodes.size(); ++i) {
      StepCall::PerNode* pn = call->nodes[i].get();
      ++outstanding_rpcs_;
      pn->ctx.set_deadline(std::chrono::system_clock::now() + kStepTimeout);
      const auto sent = std::chrono::steady_clock::now();
      NodeHandle* node = nodes[i].get();
      nodes[i]->stub()->async()->StepBatch(&pn->ctx, &pn->req, &pn->resp,
                                           [this, call, pn, sent, node](grpc::Status s) {
                                             if (step_observer_ && s.ok())
                                               step_observer_(node->name(), std::chrono::duration<double>(
                                                   std::chrono::steady_clock::now() - sent).count());
                                             {
                                               std::lock_guard<std::mutex> lock(call->mu);
                                               pn->status = std::move(s);
                                               pn->done = true;
                                               --call->remaining;
                                               if (!pn->status.ok() && !call->failed) {
                                                 call->failed = true;
                                                 call->first_failure = std::chrono::steady_clock::now();
                                               }
                                             }
                                             cv_.notify_all();
                                             --outstanding_rpcs_;
                                           });
    }
  }
}

Status Scheduler::Attribute(const StepCall& call) const {
  const auto& nodes = cluster_->nodes();
  for (size_t i = 0; i < nodes.size(); ++i) {
    const auto& pn = call.nodes[i];
    if (pn->done && !pn->status.ok() && IsChannelError(pn->status, nodes[i]->name())) {
      std::string why = pn->status.error_message();
      nodes[i]->MarkDown(why);
      return Unavailable("node " + nodes[i]->name() + " (" + nodes[i]->control() +
                         ") is unavailable: " + why);
    }
  }
  FM_RETURN_IF_ERROR(cluster_->Ready());
  for (size_t i = 0; i < nodes.size(); ++i) {
    const auto& pn = call.nodes[i];
    if (pn->done && !pn->status.ok()) return FromGrpc(pn->status, "step " + std::to_string(call.step_id));
  }
  return Unavailable("step " + std::to_string(call.step_id) + " did not finish");
}

void Scheduler::Complete(StepCall* call) {
  bool failed;
  {
    std::lock_guard<std::mutex> lock(call->mu);
    failed = call->failed;
  }
  if (failed) {
    Status why;
    {
      std::lock_guard<std::mutex> lock(call->mu);
      why = Attribute(*call);
    }
    for (auto& n : call->nodes) n->ctx.TryCancel();
    FM_LOG(kWarn, "scheduler") << "micro-batch " << call->step_id << " failed: " << why.ToString();
    FailAll(why);
    return;
  }
  // The last stage's members sampled their own sequences.
  std::vector<flashmesh::v1::SampledToken> sampled;
  const auto& nodes = cluster_->nodes();
  for (size_t i = 0; i < nodes.size(); ++i)
    if (nodes[i]->plan().head)
      for (const auto& t : call->nodes[i]->resp.tokens()) sampled.push_back(t);
  if (sampled.size() != call->seq_ids.size()) {
    FailAll(Internal("the last stage returned " + std::to_string(sampled.size()) +
                     " tokens for " + std::to_string(call->seq_ids.size()) + " sequences"));
    return;
  }
  for (const auto& t : sampled) {
    auto it = live_.find(t.seq_id());
    if (it == live_.end()) continue;
    Request* r = it->second.get();
    r->in_flight = false;
    if (r->stream->cancelled()) {
      Finish(r, flashmesh::v1::FINISH_REASON_CANCELLED, "");
      continue;
    }
    ApplyToken(r, t.id(), t.logprob());
  }
}

void Scheduler::ApplyToken(Request* r, int32_t id, float logprob) {
  ++r->generated;
  RequestStream::Event ev;
  ev.kind = RequestStream::Event::kToken;
  ev.token.set_id(id);
  ev.token.set_logprob(logprob);
  size_t scan_from = r->text.size();
  if (r->decoder) {
    auto piece = r->decoder->Push(id);
    if (piece.ok()) {
      ev.token.set_text(*piece);
      r->text += *piece;
    }
  }
  r->stream->Push(std::move(ev));
  if (tokenizer_ && id == tokenizer_->eos_id() && !r->params.ignore_eos)
    return Finish(r, flashmesh::v1::FINISH_REASON_STOP, "");
  for (const auto& s : r->params.stop) {
    size_t from = scan_from >= s.size() ? scan_from - s.size() + 1 : 0;
    if (r->text.find(s, from) != std::string::npos) return Finish(r, flashmesh::v1::FINISH_REASON_STOP, s);
  }
  const int64_t context = static_cast<int64_t>(r->params.prompt.size()) + r->generated;
  if (r->generated >= r->params.max_tokens || context >= limits_.max_context)
    return Finish(r, flashmesh::v1::FINISH_REASON_LENGTH, "");
  r->next = {id};
}

void Scheduler::Finish(Request* r, flashmesh::v1::FinishReason reason, const std::string& stop_string) {
  RequestStream::Event ev;
  ev.kind = RequestStream::Event::kFinish;
  ev.finish.set_reason(reason);
  ev.finish.mutable_usage()->set_prompt_tokens(static_cast<int32_t>(r->params.prompt.size()));
  ev.finish.mutable_usage()->set_completion_tokens(static_cast<int32_t>(r->generated));
  ev.finish.set_stop_string(stop_string);
  // Free before the final message: once a client sees its stream end, its KV is released on
  // every worker (status right after a finished stream shows the memory back).
  uint64_t id = r->id;
  FreeOnWorkers({id});
  r->stream->Push(std::move(ev));
  live_.erase(id);
  active_count_ = static_cast<int>(live_.size());
}

void Scheduler::FreeOnWorkers(const std::vector<uint64_t>& ids) {
  flashmesh::v1::FreeSequenceRequest req;
  for (auto id : ids) req.add_seq_ids(id);
  for (const auto& node : cluster_->nodes()) {
    if (node->state() == flashmesh::v1::NODE_STATE_DOWN) continue;
    flashmesh::v1::FreeSequenceResponse resp;
    grpc::ClientContext ctx;
    ctx.set_deadline(std::chrono::system_clock::now() + kControlTimeout);
    grpc::Status s = node->stub()->FreeSequence(&ctx, req, &resp);
    if (!s.ok()) {
      FM_LOG(kWarn, "scheduler") << "FreeSequence on " << node->name() << ": " << s.error_message();
    }
  }
}

void Scheduler::FailAll(const Status& why) {
  for (auto& [id, call] : in_flight_)
    for (auto& n : call->nodes) n->ctx.TryCancel();
  in_flight_.clear();
  last_step_id_ = 0;   // the workers' Reset forgets the step order too
  for (auto& [id, r] : live_) r->stream->Push({RequestStream::Event::kError, {}, {}, why});
  live_.clear();
  active_count_ = 0;
  // Every sequence lives on every stage: the survivors drop theirs and abort waiting steps.
  for (const auto& node : cluster_->nodes()) {
    if (node->state() == flashmesh::v1::NODE_STATE_DOWN) continue;
    flashmesh::v1::ResetRequest req;
    flashmesh::v1::ResetResponse resp;
    grpc::ClientContext ctx;
    ctx.set_deadline(std::chrono::system_clock::now() + kControlTimeout);
    node->stub()->Reset(&ctx, req, &resp);
  }
}

}  // namespace fm
