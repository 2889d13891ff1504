#include "coordinator/scheduler.h"

#include <algorithm>
#include <bit>
#include <cctype>
#include <set>

#include "common/log.h"
#include "rpc/grpc_status.h"

namespace fm {
namespace {

// After the first failed RPC of a micro-batch, how long to wait for the others so that the
// error names the node that failed rather than a peer that could not reach it. A peer that gave
// up waiting for its input answers at 9/10 of the step's deadline (worker_service.cpp), the
// stage that froze only at the deadline: that failure waits for the deadline itself, plus
// kDeadlineSlack for the frozen one's RPC to end.
constexpr auto kFailureGrace = std::chrono::milliseconds(300);
constexpr auto kDeadlineSlack = std::chrono::milliseconds(200);
constexpr size_t kRecentSteps = 32;   // steps whose times size the next deadlines
// Prompt rows one step may score (prompt_logprobs): a scored row with 20 alternatives is ~240
// bytes of the last stage's reply, so 16384 of them stay far below the reply cap the
// coordinator takes from a worker (kWorkerMaxReplyBytes, 16 MiB), whatever max_step_tokens is.
constexpr size_t kMaxScoredRowsPerStep = 16384;
static_assert(kMaxScoredRowsPerStep * 240 < kWorkerMaxReplyBytes / 2);
// The longest the scheduling thread sleeps with nothing due (every event also wakes it).
constexpr auto kMaxSleep = std::chrono::seconds(1);

}  // namespace

Scheduler::Scheduler(WorkerSet* workers, const Tokenizer* tokenizer, SchedulerLimits limits)
    : workers_(workers),
      tokenizer_(tokenizer),
      limits_(limits),
      signal_(std::make_shared<Signal>()),
      needs_reset_(workers->workers().size(), 0),
      resetting_(workers->workers().size(), 0),
      unowned_(workers->workers().size()),
      freeing_(workers->workers().size()),
      stray_(workers->workers().size()) {
  next_step_id_ = (workers_->term() << 20) + 1;   // above every earlier coordinator's (worker_set.h)
  // The closures posted run on the scheduling thread only, so `this` in them is alive.
  workers_->OnChange([weak = std::weak_ptr<Signal>(signal_)] {
    if (auto s = weak.lock()) s->Post(nullptr);
  });
  workers_->OnHeld([weak = std::weak_ptr<Signal>(signal_), this](int w, std::vector<uint64_t> ids,
                                                                 Clock::time_point asked) {
    if (auto s = weak.lock()) s->Post([this, w, ids = std::move(ids), asked] { Reconcile(w, ids, asked); });
  });
  thread_ = std::thread([this] { Loop(); });
}

Scheduler::~Scheduler() {
  {
    std::lock_guard<std::mutex> lock(signal_->mu);
    signal_->stop = true;
  }
  signal_->cv.notify_all();
  thread_.join();
  const Status stopping = Unavailable("the coordinator is stopping");
  for (auto& [id, call] : in_flight_) call->Cancel();
  for (auto& [id, r] : live_) r->stream->Push({RequestStream::Event::kError, {}, {}, stopping});
  for (auto& r : incoming_) r->stream->Push({RequestStream::Event::kError, {}, {}, stopping});
  // Callbacks still touch this object: cancel the calls on their way and wait for the last.
  std::map<uint64_t, std::function<void()>> cancels;
  {
    std::lock_guard<std::mutex> lock(rpc_mu_);
    cancels = cancels_;
  }
  for (auto& [id, cancel] : cancels) cancel();
  std::unique_lock<std::mutex> lock(rpc_mu_);
  rpc_cv_.wait(lock, [&] { return outstanding_rpcs_.empty(); });
}

Result<std::shared_ptr<RequestStream>> Scheduler::Submit(GenerateParams params) {
  std::vector<GenerateParams> one;
  one.push_back(std::move(params));
  FM_ASSIGN_OR_RETURN(auto streams, SubmitAll(std::move(one)));
  return streams[0];
}

Result<std::vector<std::shared_ptr<RequestStream>>> Scheduler::SubmitAll(std::vector<GenerateParams> params) {
  FM_RETURN_IF_ERROR(workers_->Ready());
  std::vector<std::unique_ptr<Request>> requests;
  std::vector<std::shared_ptr<RequestStream>> streams;
  for (auto& p : params) {
    auto r = std::make_unique<Request>();
    r->params = std::move(p);
    r->stream = std::make_shared<RequestStream>();
    r->stream->on_cancel_ = [weak = std::weak_ptr<Signal>(signal_)] {
      if (auto s = weak.lock()) s->Post(nullptr);
    };
    if (tokenizer_) r->decoder.emplace(*tokenizer_);
    r->next = r->params.prompt;
    if (r->ScoresPrompt() && !r->params.prompt.empty()) {
      r->prompt_scores.resize(r->params.prompt.size() - 1);
    }
    streams.push_back(r->stream);
    requests.push_back(std::move(r));
  }
  SharePrompt(requests);
  {
    std::lock_guard<std::mutex> lock(signal_->mu);
    DropDeadQueuedLocked(Clock::now());
    if (static_cast<int64_t>(incoming_.size() + requests.size()) > limits_.max_queue)
      return ResourceExhausted("the request queue is full (" + std::to_string(incoming_.size()) + " of " +
                               std::to_string(limits_.max_queue) + " waiting, " +
                               std::to_string(requests.size()) + " more asked; limits.max_queue)");
    for (auto& r : requests) incoming_.push_back(std::move(r));
    queued_count_ = static_cast<int>(incoming_.size());
    signal_->wake = true;
  }
  signal_->cv.notify_all();
  return streams;
}

Status Scheduler::Health() const {
  std::lock_guard<std::mutex> lock(health_mu_);
  const auto now = Clock::now();
  for (const auto& [id, t] : step_times_)
    if (now > t.second)
      return Unavailable("step " + std::to_string(id) + " is overdue (running for " +
                         std::to_string(std::chrono::duration_cast<std::chrono::milliseconds>(
                                            now - t.first).count()) + " ms)");
  if (resetting_any_) return Unavailable("resetting the workers after a failed step");
  for (const auto& why : stray_)
    if (!why.empty()) return Unavailable(why);
  return Status::Ok();
}

void Scheduler::Signal::Post(std::function<void()> fn) {
  std::lock_guard<std::mutex> lock(mu);
  if (fn) posted.push_back(std::move(fn));
  wake = true;
  cv.notify_all();
}

void Scheduler::Post(std::function<void()> fn) { signal_->Post(std::move(fn)); }

uint64_t Scheduler::Track() {
  std::lock_guard<std::mutex> lock(rpc_mu_);
  outstanding_rpcs_.insert(++last_rpc_);
  return last_rpc_;
}

void Scheduler::Untrack(uint64_t call) {
  std::lock_guard<std::mutex> lock(rpc_mu_);
  outstanding_rpcs_.erase(call);
  cancels_.erase(call);
  rpc_cv_.notify_all();
}

void Scheduler::Keep(uint64_t call, std::function<void()> cancel) {
  std::lock_guard<std::mutex> lock(rpc_mu_);
  if (outstanding_rpcs_.count(call)) cancels_[call] = std::move(cancel);   // else: answered already
}

void Scheduler::Loop() {
  while (true) {
    std::vector<std::function<void()>> posted;
    {
      const auto wake_at = NextWake();
      std::unique_lock<std::mutex> lock(signal_->mu);
      signal_->cv.wait_until(lock, wake_at, [&] { return signal_->stop || signal_->wake; });
      if (signal_->stop) return;
      signal_->wake = false;
      posted.swap(signal_->posted);
    }
    for (auto& fn : posted) fn();
    Tick();
  }
}

Scheduler::Clock::time_point Scheduler::NextWake() {
  auto at = Clock::now() + kMaxSleep;
  for (const auto& [id, call] : in_flight_)
    if (call->failed) at = std::min(at, call->settle_by);
  std::lock_guard<std::mutex> lock(signal_->mu);
  for (const auto& r : incoming_) at = std::min(at, r->params.deadline);
  return at;
}

void Scheduler::Tick() {
  const auto now = Clock::now();
  // A failed micro-batch whose other RPCs had their grace.
  for (auto it = in_flight_.begin(); it != in_flight_.end(); ++it) {
    if (it->second->failed && now >= it->second->settle_by) {
      std::shared_ptr<StepCall> call = it->second;
      in_flight_.erase(it);
      Complete(call.get());
      break;   // Complete failed everything in flight
    }
  }
  Status running = workers_->Running();
  if (!running.ok()) {
    if (!live_.empty() || !in_flight_.empty()) FailAll(running);
    FailQueued(running);
    return;
  }
  std::vector<Request*> cancelled;
  for (auto& [id, r] : live_)
    if (r->stream->cancelled() && r->in_flight == 0 && r->starting == 0) cancelled.push_back(r.get());
  for (Request* r : cancelled) Finish(r, flashmesh::v1::FINISH_REASON_CANCELLED);
  {
    std::lock_guard<std::mutex> lock(signal_->mu);
    DropDeadQueuedLocked(now);
  }
  FreeIdlePrefixes();   // after the queue's dead: they may have been a prefix's last sharers
  SendResets();
  if (std::any_of(needs_reset_.begin(), needs_reset_.end(), [](char c) { return c; }) ||
      std::any_of(resetting_.begin(), resetting_.end(), [](char c) { return c; }))
    return;   // nothing new until every worker forgot the failed schedule
  // DRAINING: the live sequences finish, nothing new starts.
  Status ready = workers_->Ready();
  if (ready.ok()) {
    Admit();
  } else {
    FailQueued(ready);
  }
  Launch();
}

void Scheduler::DropDeadQueuedLocked(Clock::time_point now) {
  for (auto it = incoming_.begin(); it != incoming_.end();) {
    RequestStream* s = (*it)->stream.get();
    if (s->cancelled()) {
      s->Push({RequestStream::Event::kError, {}, {}, Cancelled("cancelled while queued")});
    } else if (now >= (*it)->params.deadline) {
      s->Push({RequestStream::Event::kError, {}, {},
               DeadlineExceeded("the request's deadline passed while it was queued")});
    } else {
      ++it;
      continue;
    }
    it = incoming_.erase(it);
  }
  queued_count_ = static_cast<int>(incoming_.size());
}

void Scheduler::Admit() {
  while (static_cast<int64_t>(live_.size()) < limits_.max_batch) {
    std::unique_ptr<Request> owned;
    {
      std::lock_guard<std::mutex> lock(signal_->mu);
      DropDeadQueuedLocked(Clock::now());
      if (incoming_.empty()) break;
      owned = std::move(incoming_.front());
      incoming_.pop_front();
      queued_count_ = static_cast<int>(incoming_.size());
    }
    owned->queued_mark.reset();
    // Data-parallel attention: the sequence lives on one member of every stage's EP group,
    // the one with the fewest live sequences (prefix sequences included: each member's KV is
    // planned for its share of max_batch).
    std::vector<int> load(workers_->expert_parallel(), 0);
    for (const auto& [id, q] : live_) ++load[q->member];
    const int member = static_cast<int>(std::min_element(load.begin(), load.end()) - load.begin());
    Request* prefix = owned->shared ? PrefixFor(*owned, member, load) : nullptr;
    Request* r = StartRequest(std::move(owned), member);
    if (prefix) prefix->waiting.insert(r->id);
  }
  CountActive();
}

Scheduler::Request* Scheduler::StartRequest(std::unique_ptr<Request> owned, int member) {
  const auto& workers = workers_->workers();
  Request* r = owned.get();
  r->id = next_request_id_++;
  r->member = member;
  live_[r->id] = std::move(owned);
  flashmesh::v1::StartSequenceRequest req;
  req.set_seq_id(r->id);
  // The request's own reach (prompt + max_tokens, one spare), not the cluster's max_context:
  // a worker sizes and charges a sequence's KV by it (its budget, a device's caches), so short
  // requests leave room for more, as vLLM's block tables do.
  const int64_t reach = static_cast<int64_t>(r->params.prompt.size()) + r->params.max_tokens;
  req.set_max_context(static_cast<int32_t>(std::min(limits_.max_context, reach)));
  *req.mutable_sampling() = r->params.sampling;
  std::vector<int> targets;
  for (size_t i = 0; i < workers.size(); ++i)
    if (workers[i].ep_rank == r->member) targets.push_back(static_cast<int>(i));
  r->starting = static_cast<int>(targets.size());
  starts_outstanding_ += r->starting;
  const auto deadline = Clock::now() + limits_.control_timeout;
  for (int w : targets) {
    const uint64_t rpc = Track();
    Keep(rpc, workers_->StartSequence(
                  w, req, deadline,
                  [this, id = r->id, w, rpc](RpcResult res, flashmesh::v1::StartSequenceResponse) {
                    Post([this, id, w, res] { OnStarted(id, w, res); });
                    Untrack(rpc);
                  }));
  }
  return r;
}

void Scheduler::OnStarted(uint64_t id, int worker, const RpcResult& res) {
  --starts_outstanding_;
  auto it = live_.find(id);
  if (it == live_.end()) return;   // failed meanwhile: the resets drop it on every worker
  Request* r = it->second.get();
  --r->starting;
  if (res.ok()) {
    r->started.push_back(worker);
  } else if (r->start_error.ok()) {
    if (res.fault == RpcFault::kUnreachable) {
      workers_->MarkDown(worker, res.status.message());
      r->start_error = res.status;
    } else if (NoAnswerInTime(res.fault)) {
      // Paused (a swap storm, SIGSTOP) or dead: the heartbeat tells which within
      // heartbeat.timeout_ms. Marking it down here would fail every live request over a pause
      // shorter than that; this request alone fails, and a late start is freed as unowned.
      r->start_error = res.status;
    } else if (res.fault == RpcFault::kSuperseded) {
      // This coordinator stepped down (cluster_rpc.cpp): that is what the client hears.
      const Status running = workers_->Running();
      r->start_error = running.ok() ? Unavailable(res.status.message()) : running;
    } else {
      r->start_error = res.status.Wrap("starting the sequence");
    }
    FM_LOG(kWarn, "scheduler") << "request " << id << ": " << r->start_error.ToString();
  }
  if (r->starting == 0) r->started_at = Clock::now();
  if (r->starting > 0 || r->start_error.ok()) return;
  FreeOnWorkers(r->started, {id});
  End(r, r->start_error);
}

Scheduler::Clock::time_point Scheduler::StepDeadline(Clock::time_point now, size_t rows) const {
  if (recent_steps_.empty()) return now + limits_.first_step * static_cast<int64_t>(rows / 1024 + 1);
  // A measured step of r rows in t seconds bounds a step of `rows`: by t when rows <= r, by
  // t x rows / r beyond (a step costs a fixed part plus a part per row). The largest bound from
  // the steps of a similar size (a quarter to 4x); without one, the slowest time per row x
  // rows (which a 1-row decode step, mostly fixed cost, makes 10-100x too long for a prefill).
  const double want = static_cast<double>(std::max<size_t>(rows, 1));
  double bound = -1, slowest_per_row = 0;
  auto consider = [&](const StepTime& s) {
    const double r = static_cast<double>(std::max<size_t>(s.rows, 1));
    slowest_per_row = std::max(slowest_per_row, s.seconds / r);
    if (4 * r >= want && r <= 4 * want) bound = std::max(bound, s.seconds * std::max(1.0, want / r));
  };
  for (const StepTime& s : recent_steps_) consider(s);
  for (const auto& [size_class, s] : latest_by_size_) consider(s);
  const double estimate = bound < 0 ? slowest_per_row * want : bound;
  return now + limits_.step_floor +
         std::chrono::duration_cast<Clock::duration>(
             std::chrono::duration<double>(limits_.step_multiple * estimate));
}

void Scheduler::Launch() {
  const int stages = workers_->num_stages();
  const auto& workers = workers_->workers();
  while (num_in_flight() < stages) {
    // Decode rows first, so that a long prompt never holds back the streams already going.
    // A prompt's next chunk does not wait for the one before it (no token comes between them):
    // the stages run steps in order, so a pipeline prefills one prompt on all its stages at once.
    // It comes after the prompts with no step in flight, though: a short prompt behind a long
    // one takes the next free slot instead of waiting for the long one's last chunk.
    std::vector<Request*> decode, prefill;
    for (auto& [id, r] : live_) {
      // A fork runs the prompt's last token, one row: in a step after the prefix sequence's last
      // chunk, which every stage has then run first. (The prefix lives while a fork waits; were
      // it gone, ForkSource says null and the request prefills alone.)
      if (const Request* h = ForkSource(*r)) {
        if (h->starting == 0 && h->next.empty() && r->starting == 0 && !r->stream->cancelled())
          decode.push_back(r.get());
        continue;
      }
      if (r->prefix && r->sharers.expired()) continue;   // nobody left to fork from it
      const bool prompt_left = r->generated == 0;   // next holds the rest of the prompt
      if (r->starting == 0 && (r->in_flight == 0 || prompt_left) && !r->stream->cancelled() &&
          !r->next.empty())
        (r->next.size() == 1 ? decode : prefill).push_back(r.get());
    }
    std::stable_partition(prefill.begin(), prefill.end(),
                          [](const Request* r) { return r->in_flight == 0; });
    if (decode.empty() && prefill.empty()) return;
    // Spread the ready decode rows over the free pipeline slots.
    const size_t slots = static_cast<size_t>(stages - num_in_flight());
    const size_t take = (decode.size() + slots - 1) / slots;
    auto call = std::make_shared<StepCall>();
    call->step_id = next_step_id_++;
    std::vector<std::pair<int, flashmesh::v1::StepItem>> items;   // (member, item)
    auto add = [&](Request* r, size_t n) {
      flashmesh::v1::StepItem item;
      item.set_seq_id(r->id);
      if (Request* h = ForkSource(*r)) {
        item.set_fork_from(h->id);
        r->next.erase(r->next.begin(), r->next.end() - 1);   // the prefix sequence ran these
        h->waiting.erase(r->id);
        ++h->forks_in_flight;
        call->fork_sources.push_back(h->id);
      }
      const int64_t position = static_cast<int64_t>(r->params.prompt.size() - r->next.size());
      item.mutable_tokens()->Add(r->next.begin(), r->next.begin() + static_cast<std::ptrdiff_t>(n));
      r->next.erase(r->next.begin(), r->next.begin() + static_cast<std::ptrdiff_t>(n));
      // A prefix sequence samples nothing, not even after its last chunk.
      if (!r->next.empty() || r->prefix) {
        item.set_prefill_continues(true);
        call->chunk_ids.push_back(r->id);
      }
      // A prompt chunk scores the token after each of its rows: the chunk's own, then the next
      // chunk's first.
      if (r->ScoresPrompt() && r->generated == 0) {
        if (!r->next.empty()) item.set_next_token(r->next.front());
        const int64_t count = static_cast<int64_t>(n) - (r->next.empty() ? 1 : 0);
        if (count > 0) call->scores_due[r->id] = {position + 1, count};
      }
      items.emplace_back(r->member, std::move(item));
      call->rows += n;
      ++r->in_flight;
      call->seq_ids.push_back(r->id);
    };
    for (size_t i = 0; i < take; ++i) add(decode[i], 1);
    // Then prompt chunks, in that order and oldest prompt first, while the step has room
    // (always one). So different prompts fill a pipeline's stages when there are enough of them,
    // and one prompt fills them alone otherwise. A chunk ends at a multiple of max_step_tokens
    // from the prompt's start, whatever else the step holds, so the bits of a request never
    // depend on its neighbours.
    const size_t budget = static_cast<size_t>(std::max<int64_t>(limits_.max_step_tokens, 1));
    const size_t take_prefill = (prefill.size() + slots - 1) / slots;
    size_t scored_rows = 0;
    for (size_t i = 0; i < take_prefill; ++i) {
      Request* r = prefill[i];
      // A prompt that is scored goes in chunks of at most kMaxScoredRowsPerStep (still a
      // function of the prompt alone), and a step takes no more such rows than that.
      const size_t own = r->ScoresPrompt() ? std::min(budget, kMaxScoredRowsPerStep) : budget;
      const size_t sent = r->params.prompt.size() - r->next.size();
      const size_t n = std::min(r->next.size(), own - sent % own);
      const size_t scored = r->ScoresPrompt() ? n : 0;
      if (i > 0 && (call->rows + n > budget || scored_rows + scored > kMaxScoredRowsPerStep)) break;
      scored_rows += scored;
      add(r, n);
    }
    // With nothing in flight every worker has run every step sent: no order to keep (and a
    // worker reset out of band meanwhile is not left waiting for a step it forgot).
    const uint64_t prev = in_flight_.empty() ? 0 : last_step_id_;
    last_step_id_ = call->step_id;
    in_flight_[call->step_id] = call;
    call->launched = Clock::now();
    // A stage runs steps in order: this one waits for the rows in flight before it too.
    for (const auto& [id, c] : in_flight_) call->rows_to_run += c->rows;
    const auto deadline = StepDeadline(call->launched, call->rows_to_run);
    call->deadline = deadline;
    {
      std::lock_guard<std::mutex> lock(health_mu_);
      step_times_[call->step_id] = {call->launched, call->launched + (deadline - call->launched) / 2};
    }
    const size_t n = workers.size();
    call->results.resize(n);
    call->responses.resize(n);
    call->done.assign(n, 0);
    call->remaining = static_cast<int>(n);
    // Every worker runs every step (an EP member without sequences still serves its experts),
    // each with its member's items, in the order given by prev_step_id.
    for (size_t i = 0; i < n; ++i) {
      flashmesh::v1::StepBatchRequest req;
      req.set_step_id(call->step_id);
      req.set_prev_step_id(prev);
      for (const auto& [member, item] : items)
        if (member == workers[i].ep_rank) *req.add_items() = item;
      const uint64_t rpc = Track();
      const int w = static_cast<int>(i);
      call->cancels.push_back(workers_->StepBatch(
          w, req, deadline,
          [this, call, w, rpc](RpcResult r, flashmesh::v1::StepBatchResponse resp) {
            const double seconds =
                std::chrono::duration<double>(Clock::now() - call->launched).count();
            Post([this, call, w, r, resp = std::move(resp), seconds]() mutable {
              OnStepDone(call, w, std::move(r), std::move(resp), seconds);
            });
            Untrack(rpc);
          }));
    }
  }
}

void Scheduler::OnStepDone(const std::shared_ptr<StepCall>& call, int worker, RpcResult r,
                           flashmesh::v1::StepBatchResponse resp, double seconds) {
  if (!in_flight_.count(call->step_id)) return;   // ended by a failure
  if (r.ok() && step_observer_) step_observer_(workers_->workers()[worker].name, seconds);
  if (!r.ok() && !call->failed) {
    call->failed = true;
    const bool gave_up_waiting =
        r.fault == RpcFault::kWorker && r.status.code() == Code::kDeadlineExceeded;
    call->settle_by = gave_up_waiting ? std::max(Clock::now() + kFailureGrace, call->deadline + kDeadlineSlack)
                                      : Clock::now() + kFailureGrace;
  }
  call->results[worker] = std::move(r);
  call->responses[worker] = std::move(resp);
  call->done[worker] = 1;
  if (--call->remaining > 0) return;
  in_flight_.erase(call->step_id);
  Complete(call.get());
}

Status Scheduler::Attribute(const StepCall& call) {
  const size_t n = call.results.size();
  const std::string step = "step " + std::to_string(call.step_id);
  // A worker that did not answer is the cause; its peers' errors (waiting for its manifold,
  // an EP exchange it never joined) are consequences. Unless this coordinator was not running
  // when the answers were due: then no node is to blame (nor marked down).
  auto first = [&](RpcFault fault) -> const RpcResult* {
    for (size_t i = 0; i < n; ++i)
      if (call.done[i] && call.results[i].fault == fault) return &call.results[i];
    return nullptr;
  };
  for (RpcFault fault : {RpcFault::kUnreachable, RpcFault::kCoordinatorStalled, RpcFault::kTimedOut}) {
    const RpcResult* r = first(fault);
    if (!r) continue;
    if (fault != RpcFault::kCoordinatorStalled)
      workers_->MarkDown(static_cast<int>(r - call.results.data()), r->status.message());
    return Unavailable(r->status.message());
  }
  for (size_t i = 0; i < n; ++i)
    if (call.done[i] && call.results[i].fault == RpcFault::kLostSequences)
      return Unavailable(call.results[i].status.message());
  FM_RETURN_IF_ERROR(workers_->Running());
  for (size_t i = 0; i < n; ++i) {
    if (!call.done[i] || call.results[i].ok()) continue;
    const Status& why = call.results[i].status;
    // A worker's own message names the step already ("node w1: step N aborted: ..."): once.
    const std::string& m = why.message();
    bool named = false;
    for (size_t at = m.find(step); at != std::string::npos && !named; at = m.find(step, at + 1))
      named = at + step.size() == m.size() || !std::isdigit(static_cast<unsigned char>(m[at + step.size()]));
    return named ? why : why.Wrap(step);
  }
  return Internal(step + " failed without an error");
}

void Scheduler::Complete(StepCall* call) {
  {
    std::lock_guard<std::mutex> lock(health_mu_);
    step_times_.erase(call->step_id);
  }
  if (call->failed) {
    const Status why = Attribute(*call);
    call->Cancel();   // FailAll below cancels only what is still in flight
    FM_LOG(kWarn, "scheduler") << "micro-batch " << call->step_id << " failed: " << why.ToString();
    FailAll(why, call->deadline);
    return;
  }
  call->cancels.clear();
  // The last stage's members sampled their own sequences.
  std::vector<flashmesh::v1::SampledToken> sampled;
  const auto& workers = workers_->workers();
  // Exactly one token for each sequence of the step: a token for another id, or a second one,
  // would leave a sequence of the step in flight for good (its slot and KV held, its client
  // waiting), so it fails the step like any worker error.
  std::set<uint64_t> unanswered(call->seq_ids.begin(), call->seq_ids.end());
  for (uint64_t id : call->chunk_ids) unanswered.erase(id);
  const size_t want = unanswered.size();
  for (size_t i = 0; i < workers.size(); ++i) {
    if (!workers[i].head) continue;
    for (const auto& t : call->responses[i].tokens()) {
      if (unanswered.erase(t.seq_id()) == 0) {
        FailAll(Internal("node " + workers[i].name + " (" + workers[i].control +
                         ") returned a token for sequence " + std::to_string(t.seq_id()) +
                         ", which is not an unanswered sequence of step " +
                         std::to_string(call->step_id)));
        return;
      }
      sampled.push_back(t);
      if (!t.error().empty()) sampled.back().set_error("node " + workers[i].name + ": " + t.error());
    }
  }
  if (!unanswered.empty()) {
    FailAll(Internal("the last stage returned " + std::to_string(sampled.size()) +
                     " tokens for " + std::to_string(want) + " sequences"));
    return;
  }
  if (!TakePromptScores(call)) return;
  for (uint64_t id : call->fork_sources)
    if (auto it = live_.find(id); it != live_.end()) --it->second->forks_in_flight;
  const double seconds = std::chrono::duration<double>(Clock::now() - call->launched).count();
  // Its time covers the steps it waited behind too: measured against all those rows (against
  // its own alone, a pipeline's deadlines counted the wait twice and grew with stages^2).
  const StepTime measured{call->rows_to_run, seconds};
  recent_steps_.push_back(measured);
  if (recent_steps_.size() > kRecentSteps) recent_steps_.pop_front();
  // Kept past the recent window: the prefills of a mostly decoding cluster.
  latest_by_size_[std::bit_width(std::max<size_t>(measured.rows, 1)) - 1] = measured;
  for (const auto& t : sampled) {
    auto it = live_.find(t.seq_id());
    if (it == live_.end()) continue;
    Request* r = it->second.get();
    --r->in_flight;
    if (EndIfScoringFailed(r)) continue;
    if (r->stream->cancelled()) {
      // Else a chunk's step before it is still on its way: Tick finishes it after that one.
      if (r->in_flight == 0) Finish(r, flashmesh::v1::FINISH_REASON_CANCELLED);
      continue;
    }
    if (!t.error().empty()) {
      // The model's logits for this sequence alone (a NaN or +inf): its request ends, and the
      // step's other sequences, whose rows never mix with its, keep their tokens.
      const Status why = Internal("the next token of sequence " + std::to_string(r->id) +
                                  " could not be sampled: " + t.error());
      FM_LOG(kWarn, "scheduler") << why.ToString();
      FreeOnWorkers(r->started, {r->id});
      End(r, why);
      continue;
    }
    if (r->ScoresPrompt() && !r->prompt_sent) {
      r->held = t;
      ReleaseFirstToken(r);
      continue;
    }
    ApplyToken(r, t);
  }
  // A prompt chunk's sequence is ready for its next chunk.
  for (uint64_t id : call->chunk_ids) {
    auto it = live_.find(id);
    if (it == live_.end()) continue;
    Request* r = it->second.get();
    --r->in_flight;
    if (EndIfScoringFailed(r)) continue;
    if (r->in_flight == 0 && r->stream->cancelled()) Finish(r, flashmesh::v1::FINISH_REASON_CANCELLED);
  }
}

void Scheduler::ApplyToken(Request* r, const flashmesh::v1::SampledToken& t) {
  const int32_t id = t.id();
  ++r->generated;
  // Stops of every kind wait for min_tokens (vLLM's rule; the last stage held the stop tokens
  // back until then).
  const bool may_stop = r->generated >= r->params.min_tokens;
  const auto& stop_ids = r->params.stop_token_ids;
  const bool stop_token = may_stop && std::find(stop_ids.begin(), stop_ids.end(), id) != stop_ids.end();
  const bool stopped =
      stop_token || (may_stop && tokenizer_ && id == tokenizer_->eos_id() && !r->params.ignore_eos);
  const int64_t context = static_cast<int64_t>(r->params.prompt.size()) + r->generated;
  const bool length = r->generated >= r->params.max_tokens || context >= limits_.max_context;
  RequestStream::Event ev;
  ev.kind = RequestStream::Event::kToken;
  ev.token.set_id(id);
  ev.token.set_logprob(t.logprob());
  AddAlternatives(t, r->params.sampling.top_logprobs(), ev.token.mutable_top_logprobs());
  size_t scan_from = r->text.size();
  if (r->decoder) {
    // A stop token's own text is not part of the output (vLLM's), as end-of-sentence has none.
    auto piece = stop_token ? Result<std::string>(std::string()) : r->decoder->Push(id);
    std::string text = piece.ok() ? *piece : std::string();
    // The last token: an unfinished UTF-8 character still held comes out as U+FFFD.
    if (stopped || length) text += r->decoder->Flush();
    ev.token.set_text(text);
    r->text += text;
  }
  r->stream->Push(std::move(ev));
  if (stopped) return Finish(r, flashmesh::v1::FINISH_REASON_STOP);
  for (const auto& s : r->params.stop) {
    // Only an occurrence that ends in this token's text: the earlier text had its turn.
    const size_t from = scan_from >= s.size() ? scan_from - s.size() + 1 : 0;
    const size_t at = may_stop ? r->text.find(s, from) : std::string::npos;
    if (at != std::string::npos) return Finish(r, flashmesh::v1::FINISH_REASON_STOP, s, static_cast<int64_t>(at));
  }
  if (length) return Finish(r, flashmesh::v1::FINISH_REASON_LENGTH);
  r->next = {id};
}

void Scheduler::AddAlternatives(const flashmesh::v1::SampledToken& t, int asked,
                                google::protobuf::RepeatedPtrField<flashmesh::v1::TopLogprob>* out) const {
  // No more than the request asked for, whatever a worker sent.
  const int alts = std::min(t.top_size(), std::max(asked, 0));
  for (int i = 0; i < alts; ++i) {
    const auto& alt = t.top(i);
    auto* a = out->Add();
    a->set_id(alt.id());
    a->set_logprob(alt.logprob());
    if (tokenizer_) {
      auto bytes = tokenizer_->TokenBytes(alt.id());
      if (bytes.ok()) a->set_token(*bytes);
    }
  }
}

void Scheduler::Finish(Request* r, flashmesh::v1::FinishReason reason, const std::string& stop_string,
                       int64_t stop_offset) {
  RequestStream::Event ev;
  ev.kind = RequestStream::Event::kFinish;
  ev.finish.set_reason(reason);
  ev.finish.mutable_usage()->set_prompt_tokens(static_cast<int32_t>(r->params.prompt.size()));
  ev.finish.mutable_usage()->set_completion_tokens(static_cast<int32_t>(r->generated));
  ev.finish.set_stop_string(stop_string);
  ev.finish.set_stop_offset(stop_offset);
  // Freed and no longer counted before the client sees its stream end.
  FreeOnWorkers(r->started, {r->id});
  std::shared_ptr<RequestStream> stream = r->stream;
  Leave(r);
  live_.erase(r->id);
  CountActive();
  stream->Push(std::move(ev));
}

void Scheduler::End(Request* r, Status why) {
  std::shared_ptr<RequestStream> stream = r->stream;
  Leave(r);
  live_.erase(r->id);
  CountActive();
  stream->Push({RequestStream::Event::kError, {}, {}, why});
}

}  // namespace fm
