// The scheduler's recovery paths: failing what runs, resetting workers, freeing sequences on
// them and reconciling what a worker holds with what the requests own. They run on the
// scheduling thread, like the rest of scheduler.cpp.
#include <algorithm>

#include "coordinator/scheduler.h"

namespace fm {

void Scheduler::FailQueued(const Status& why) {
  std::deque<std::unique_ptr<Request>> queued;
  {
    std::lock_guard<std::mutex> lock(signal_->mu);
    queued.swap(incoming_);
    queued_count_ = 0;
  }
  for (auto& r : queued) r->stream->Push({RequestStream::Event::kError, {}, {}, why});
}

void Scheduler::SendResets() {
  // Health is degraded from before the first Reset goes out until every worker acknowledged one
  // (the loop below moves workers from needs_reset_ to resetting_, which leaves `any` as is).
  const bool any = std::any_of(needs_reset_.begin(), needs_reset_.end(), [](char c) { return c; }) ||
                   std::any_of(resetting_.begin(), resetting_.end(), [](char c) { return c; });
  {
    std::lock_guard<std::mutex> lock(health_mu_);
    resetting_any_ = any;
  }
  if (!any) busy_until_ = {};   // every worker has forgotten the failure
  // A StartSequence still on its way could land after the Reset and leave its sequence behind.
  if (starts_outstanding_ > 0) return;
  const auto deadline = std::max(Clock::now(), busy_until_) + limits_.control_timeout;
  for (size_t i = 0; i < needs_reset_.size(); ++i) {
    const int w = static_cast<int>(i);
    // Not serving (down, loading): once it is.
    if (!needs_reset_[i] || resetting_[i] || !workers_->serving(w)) continue;
    needs_reset_[i] = 0;
    resetting_[i] = 1;
    const uint64_t rpc = Track();
    Keep(rpc, workers_->Reset(w, deadline, [this, w, rpc](RpcResult r, flashmesh::v1::ResetResponse) {
      Post([this, w, r] {
        resetting_[w] = 0;
        if (r.ok()) return;
        needs_reset_[w] = 1;
        // This coordinator was paused: the next turn sends it again (the node is not at fault).
        if (r.fault == RpcFault::kCoordinatorStalled) return;
        // It may still hold sequences: DOWN (which fails what runs) until it answers again.
        workers_->MarkDown(w, "Reset failed: " + r.status.message());
      });
      Untrack(rpc);
    }));
  }
}

void Scheduler::FreeOnWorkers(const std::vector<int>& workers, const std::vector<uint64_t>& ids) {
  flashmesh::v1::FreeSequenceRequest req;
  for (uint64_t id : ids) req.add_seq_ids(id);
  // A worker frees between steps: behind the steps in flight (a prefill may run for seconds),
  // so the free has until their deadlines, plus its own time. A busy worker is not a dead one.
  auto deadline = Clock::now() + limits_.control_timeout;
  for (const auto& [id, call] : in_flight_)
    deadline = std::max(deadline, call->deadline + limits_.control_timeout);
  for (int w : workers) {
    for (uint64_t id : ids) ++freeing_[w][id];
    const uint64_t rpc = Track();
    Keep(rpc, workers_->FreeSequence(w, req, deadline,
                                     [this, w, ids, rpc](RpcResult r, flashmesh::v1::FreeSequenceResponse) {
      Post([this, w, ids, r] {
        for (uint64_t id : ids)
          if (--freeing_[w][id] == 0) freeing_[w].erase(id);
        // Its KV stays behind: DOWN fails what runs and resets it once it answers again. One
        // that did not answer in time may only be paused: the heartbeat decides, and a sequence
        // it still holds then is freed as unowned (Reconcile).
        if (!r.ok() && !NoAnswerInTime(r.fault))
          workers_->MarkDown(w, "FreeSequence failed: " + r.status.message());
      });
      Untrack(rpc);
    }));
  }
}

void Scheduler::Reconcile(int worker, std::vector<uint64_t> held, Clock::time_point asked) {
  if (needs_reset_[worker] || resetting_[worker]) return;   // the reset drops everything
  // Sorted for the searches below: the worker's order is its own (a std::map today).
  std::sort(held.begin(), held.end());
  held.erase(std::unique(held.begin(), held.end()), held.end());
  const std::string node = workers_->workers()[worker].name;
  std::vector<uint64_t> unowned, stray;
  for (uint64_t id : held) {
    if (live_.count(id) || freeing_[worker].count(id)) continue;
    unowned.push_back(id);
    // Unowned at the last beat too: not a free still on its way.
    if (std::binary_search(unowned_[worker].begin(), unowned_[worker].end(), id)) stray.push_back(id);
  }
  if (!unowned.empty()) FreeOnWorkers({worker}, unowned);
  unowned_[worker] = unowned;
  {
    std::lock_guard<std::mutex> lock(health_mu_);
    stray_[worker] = stray.empty() ? "" : "node " + node + " holds " + std::to_string(stray.size()) +
                                             " sequence(s) no request owns (freeing them)";
  }
  // Sequences it held before this beat was asked and does not hold now: lost (an out-of-band
  // Reset, or a restart). One in flight fails with its step.
  std::vector<Request*> lost;
  for (auto& [id, r] : live_)
    if (r->starting == 0 && r->in_flight == 0 && r->started_at < asked &&
        std::count(r->started.begin(), r->started.end(), worker) &&
        !std::binary_search(held.begin(), held.end(), id))
      lost.push_back(r.get());
  for (Request* r : lost) {
    FreeOnWorkers(r->started, {r->id});
    End(r, Unavailable("node " + node + " lost sequence " + std::to_string(r->id) +
                       " (the worker was reset or restarted)"));
  }
}

void Scheduler::FailAll(const Status& why, Clock::time_point failed_step_deadline) {
  // This failure's Resets wait behind the steps it cancels (and the one that failed).
  busy_until_ = failed_step_deadline;
  for (auto& [id, call] : in_flight_) {
    call->Cancel();
    busy_until_ = std::max(busy_until_, call->deadline);
  }
  in_flight_.clear();
  {
    std::lock_guard<std::mutex> lock(health_mu_);
    step_times_.clear();
  }
  std::map<uint64_t, std::unique_ptr<Request>> failed;
  failed.swap(live_);
  active_count_ = 0;
  for (auto& [id, r] : failed) r->stream->Push({RequestStream::Event::kError, {}, {}, why});
  // Every worker drops what it holds and aborts its waiting steps before anything new starts.
  std::fill(needs_reset_.begin(), needs_reset_.end(), 1);
  SendResets();
}

}  // namespace fm
