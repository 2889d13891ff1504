#include "worker/stage_executor.h"

#include <new>
#include <optional>

#include "common/log.h"

namespace fm {
namespace {

constexpr auto kRateWindow = std::chrono::seconds(10);
}  // namespace

Status CopyPayloadIn(const net::Frame& f, Activations* x) {
  // Checked again here, against x: the frame was checked against the shard it arrived for.
  const net::FrameHeader& h = f.header;
  if (h.rank != 2 || static_cast<int64_t>(h.dims[0]) != x->rows() ||
      static_cast<int64_t>(h.dims[1]) != x->row_floats() ||
      f.payload.size() != h.numel() * net::FrameDTypeSize(h.dtype))
    return InvalidArgument("activation of step " + std::to_string(h.step_id) + ": shape [" +
                           std::to_string(h.dims[0]) + ", " + std::to_string(h.dims[1]) +
                           "], the step wants [" + std::to_string(x->rows()) + ", " +
                           std::to_string(x->row_floats()) + "]");
  if (f.header.dtype == net::FrameDType::kF32)
    return x->CopyFromHost(0, x->rows(), reinterpret_cast<const float*>(f.payload.data()));
  FM_ASSIGN_OR_RETURN(const std::vector<float> rows, net::FramePayloadAsF32(f));
  return x->CopyFromHost(0, x->rows(), rows.data());
}

StageExecutor::StageExecutor(ShardRuntime* runtime)
    : runtime_(runtime), thread_([this] { Loop(); }) {}

StageExecutor::~StageExecutor() {
  {
    std::lock_guard<std::mutex> lock(mu_);
    stop_ = true;
  }
  cv_.notify_all();
  thread_.join();
}

void StageExecutor::SetNext(std::unique_ptr<ActivationSink> next) {
  std::lock_guard<std::mutex> exec(exec_mu_);
  std::lock_guard<std::mutex> lock(mu_);
  next_ = std::move(next);
}

void StageExecutor::SetPrev(std::unique_ptr<ActivationSource> prev) {
  std::lock_guard<std::mutex> exec(exec_mu_);
  std::lock_guard<std::mutex> lock(mu_);
  prev_ = std::move(prev);
  cv_.notify_all();
}

Status StageExecutor::RunStep(uint64_t step_id, uint64_t prev_step_id,
                              std::vector<StepSlice> slices, Clock::time_point deadline,
                              std::vector<SampledId>* sampled, std::vector<PromptScores>* prompt) {
  Step step;
  step.id = step_id;
  step.prev = prev_step_id;
  step.deadline = deadline;
  step.slices = std::move(slices);
  std::unique_lock<std::mutex> lock(mu_);
  if (stopped_) return Unavailable("step " + std::to_string(step_id) + ": the worker is stopping");
  if (waiting_.count(step_id)) return InvalidArgument("step " + std::to_string(step_id) + " is already queued");
  // Step ids only rise: one at or below the last run is a repeat, which would advance its
  // sequences' KV over the same tokens again.
  if (last_run_ != 0 && step_id <= last_run_)
    return InvalidArgument("step " + std::to_string(step_id) + " is not after the last step run (" +
                           std::to_string(last_run_) + ")");
  if (auto r = refused_.find(step_id); r != refused_.end()) {
    const Status why = r->second;
    refused_.erase(r);
    return why;
  }
  waiting_[step_id] = &step;
  cv_.notify_all();
  if (!cv_.wait_until(lock, deadline, [&] { return step.done; })) {
    if (!step.running) {
      waiting_.erase(step_id);
      return DeadlineExceeded("step " + std::to_string(step_id) + " waited too long for its input");
    }
    cv_.wait(lock, [&] { return step.done; });   // a running step cannot be abandoned
  }
  if (sampled) *sampled = std::move(step.sampled);
  if (prompt) *prompt = std::move(step.prompt);
  return step.status;
}

Status StageExecutor::Receive(net::Frame activation) {
  const net::FrameHeader& h = activation.header;
  const uint64_t step_id = h.step_id;
  if (!runtime_->loaded()) return Unavailable("no shard loaded");
  if (h.dtype != net::FrameDType::kF32 && h.dtype != net::FrameDType::kBF16)
    return InvalidArgument("activation of step " + std::to_string(step_id) + ": dtype " +
                           net::FrameDTypeName(h.dtype) + " (want f32 or bf16)");
  if (h.rank != 2 || h.dims[1] != runtime_->row_floats() ||
      activation.payload.size() != h.numel() * net::FrameDTypeSize(h.dtype))
    return InvalidArgument("activation of step " + std::to_string(step_id) + ": shape [" +
                           std::to_string(h.dims[0]) + ", " + std::to_string(h.dims[1]) +
                           "] does not match this stage (hc*H = " +
                           std::to_string(runtime_->row_floats()) + ")");
  // The transport's own bound on a peer's unread frames (max_waiting_steps of the largest
  // step's frames) holds here too: the receiver moves frames into the inbox as they come.
  const ShardPlacement& p = runtime_->placement();
  const uint64_t max_bytes = p.max_waiting_bytes(
      static_cast<uint64_t>(std::max<int64_t>(p.max_step_rows, 1)) *
      static_cast<uint64_t>(runtime_->row_floats()) * sizeof(float));
  std::lock_guard<std::mutex> lock(mu_);
  uint64_t bytes = activation.payload.size();
  for (const auto& [id, f] : inbox_)
    if (id != step_id) bytes += f.payload.size();
  if ((inbox_.size() >= kMaxInboxSteps && !inbox_.count(step_id)) || bytes > max_bytes)
    return ResourceExhausted("activation of step " + std::to_string(step_id) + ": " +
                             std::to_string(inbox_.size()) + " steps (" + std::to_string(bytes) +
                             " bytes with it, at most " + std::to_string(max_bytes) +
                             ") already wait in the inbox (the previous stage runs too far "
                             "ahead or floods)");
  inbox_[step_id] = std::move(activation);
  cv_.notify_all();
  return Status::Ok();
}

void StageExecutor::FailWaitingStep(uint64_t step_id, const Status& why) {
  std::lock_guard<std::mutex> lock(mu_);
  auto it = waiting_.find(step_id);
  if (it == waiting_.end()) {
    // Its StepBatch is still on its way: RunStep fails it when it comes. A step that ran or
    // runs (its input came another way) is not refused.
    if (step_id > last_run_) {
      refused_[step_id] = why;
      if (refused_.size() > kMaxInboxSteps) refused_.erase(refused_.begin());
    }
    return;
  }
  it->second->status = why;
  it->second->done = true;
  waiting_.erase(it);
  cv_.notify_all();
}

void StageExecutor::Free(const std::vector<uint64_t>& seq_ids) {
  // Not by taking exec_mu_ here: the loop takes it again within microseconds of a step's end
  // whenever the next step is ready, and a mutex is not fair, so under load a free waited for
  // seconds (past the coordinator's timeout, which then failed the whole cluster).
  runtime_->Uncharge(seq_ids);
  std::unique_lock<std::mutex> lock(mu_);
  pending_frees_.insert(pending_frees_.end(), seq_ids.begin(), seq_ids.end());
  const uint64_t ticket = ++frees_asked_;
  cv_.notify_all();
  cv_.wait(lock, [&] { return frees_done_ >= ticket || stop_; });
}

void StageExecutor::ApplyFreesLocked(std::unique_lock<std::mutex>& lock) {
  std::vector<uint64_t> ids = std::move(pending_frees_);
  pending_frees_.clear();
  const uint64_t upto = frees_asked_;
  lock.unlock();
  {
    std::lock_guard<std::mutex> exec(exec_mu_);
    for (auto id : ids) runtime_->FreeSequence(id);
  }
  lock.lock();
  frees_done_ = upto;
  cv_.notify_all();
}

Status StageExecutor::Exclusive(const std::function<Status()>& swap) {
  std::lock_guard<std::mutex> exec(exec_mu_);
  Status st = swap();
  // Frames that arrived during the swap were checked against the shard before it.
  std::lock_guard<std::mutex> lock(mu_);
  inbox_.clear();
  refused_.clear();
  return st;
}

void StageExecutor::Reset() {
  uint64_t running = 0;
  {
    std::lock_guard<std::mutex> lock(mu_);
    FailWaitingLocked();
    running = last_run_;
    // A rendezvous link waits on the neighbour stage: end that wait too.
    if (next_) next_->AbortStep(running);
    if (prev_) prev_->AbortStep(running);
  }
  // The running step may be blocked on an EP member that died: end it now rather than at
  // its deadline, so that the reset is done before the coordinator starts new sequences
  // (which this reset must not free).
  runtime_->AbortStep(running);
  std::lock_guard<std::mutex> exec(exec_mu_);
  runtime_->AbortStep(0);
  std::lock_guard<std::mutex> lock(mu_);
  if (next_) next_->AbortStep(0);   // clears the aborted step for the steps after the reset
  if (prev_) prev_->AbortStep(0);
  FailWaitingLocked();   // steps that arrived meanwhile belong to the aborted schedule too
  inbox_.clear();
  refused_.clear();
  last_run_ = 0;
  runtime_->FreeAll();
}

void StageExecutor::Stop() {
  {
    std::lock_guard<std::mutex> lock(mu_);
    stopped_ = true;
  }
  Reset();
}

void StageExecutor::FailWaitingLocked() {
  for (auto& [id, step] : waiting_) {
    step->status = Unavailable("step " + std::to_string(id) + " aborted: the cluster was reset");
    step->done = true;
  }
  waiting_.clear();
  cv_.notify_all();
}

StageExecutor::Step* StageExecutor::NextReadyLocked() {
  const bool first = runtime_->first_stage();
  for (auto& [id, step] : waiting_)
    // prev 0: the first step since the coordinator reset the cluster.
    if ((step->prev == last_run_ || step->prev == 0) && (first || prev_ || inbox_.count(id)))
      return step;
  return nullptr;
}

void StageExecutor::Loop() {
  std::unique_lock<std::mutex> lock(mu_);
  while (true) {
    Step* step = nullptr;
    cv_.wait(lock, [&] {
      return stop_ || frees_done_ < frees_asked_ || (step = NextReadyLocked()) != nullptr;
    });
    if (stop_) break;
    if (frees_done_ < frees_asked_) {  // before the next step: a busy stage delays them by one
      ApplyFreesLocked(lock);
      continue;
    }
    waiting_.erase(step->id);
    step->running = true;
    last_run_ = step->id;
    // Step ids only rise (across resets and coordinators, coordinator/worker_set.h term()):
    // activations of earlier steps belong to aborted ones and would only fill the inbox.
    inbox_.erase(inbox_.begin(), inbox_.lower_bound(step->id));
    std::optional<net::Frame> received;
    if (auto it = inbox_.find(step->id); it != inbox_.end()) {
      received = std::move(it->second);
      inbox_.erase(it);
    }
    lock.unlock();
    Status st;
    {
      std::lock_guard<std::mutex> exec(exec_mu_);
      // A throw here would end the daemon (this thread has no caller): a step too large for
      // this host's memory fails that step, as a device out of memory does.
      try {
        st = Execute(step, received ? &*received : nullptr);
      } catch (const std::bad_alloc&) {
        st = ResourceExhausted("step " + std::to_string(step->id) + ": out of host memory");
      } catch (const std::exception& e) {
        st = Internal("step " + std::to_string(step->id) + ": " + e.what());
      }
      if (!st.ok()) runtime_->MarkIfDeviceLost();
    }
    lock.lock();
    if (!st.ok()) {
      FM_LOG(kWarn, "worker") << "step " << step->id << ": " << st.ToString();
    }
    step->status = st;
    step->done = true;
    cv_.notify_all();
  }
}

Status StageExecutor::Execute(Step* step, const net::Frame* received) {
  if (!runtime_->loaded())
    return Unavailable("step " + std::to_string(step->id) + ": no shard loaded");
  const ShardPlacement p = runtime_->placement();
  // X stays in the shard's memory (the device for a device shard) from here to the send or
  // the head; only a received frame's payload is copied in, once.
  Activations& x = runtime_->activations();
  FM_RETURN_IF_ERROR(runtime_->CheckSlices(step->slices));   // before X is sized by them
  FM_RETURN_IF_ERROR(runtime_->Fork(step->slices));
  int64_t rows = 0;
  for (const auto& s : step->slices) rows += static_cast<int64_t>(s.tokens.size());
  if (p.stage == 0) {
    FM_RETURN_IF_ERROR(runtime_->Embed(step->slices, &x));
  } else if (prev_) {
    FM_RETURN_IF_ERROR(prev_->Receive(step->id, rows, step->deadline, &x));
  } else {
    const int64_t got = received ? received->header.dims[0] : 0;
    if (got != rows)
      return InvalidArgument("step " + std::to_string(step->id) + ": the activation has " +
                             std::to_string(got) + " rows, the batch " + std::to_string(rows));
    FM_RETURN_IF_ERROR(x.Resize(rows));
    if (rows > 0) FM_RETURN_IF_ERROR(CopyPayloadIn(*received, &x));
  }
  FM_RETURN_IF_ERROR(runtime_->Forward(step->id, step->deadline, step->slices, x.data()));
  if (p.samples()) {
    FM_ASSIGN_OR_RETURN(step->prompt, runtime_->ScorePrompts(step->slices, x));
    FM_ASSIGN_OR_RETURN(step->sampled, runtime_->Sample(step->slices, x));
  } else if (!p.head) {
    if (!next_) return Internal("stage " + std::to_string(p.stage) + " has no next stage");
    FM_RETURN_IF_ERROR(next_->Send(step->id, step->deadline, x));
  }
  std::lock_guard<std::mutex> lock(mu_);
  auto now = Clock::now();
  recent_rows_.emplace_back(now, rows);
  rows_total_ += rows;
  while (!recent_rows_.empty() && now - recent_rows_.front().first > kRateWindow)
    recent_rows_.pop_front();
  return Status::Ok();
}

double StageExecutor::tokens_per_second() const {
  std::lock_guard<std::mutex> lock(mu_);
  auto now = Clock::now();
  int64_t rows = 0;
  for (const auto& [t, n] : recent_rows_)
    if (now - t <= kRateWindow) rows += n;
  return static_cast<double>(rows) / std::chrono::duration<double>(kRateWindow).count();
}

uint64_t StageExecutor::rows_processed() const {
  std::lock_guard<std::mutex> lock(mu_);
  return rows_total_;
}

}  // namespace fm
