// The scheduler's shared prompts (docs/architecture.md "Shared prompts"): the requests of one
// SubmitAll with one prompt share its prefill through a prefix sequence that each forks from.
// On the scheduling thread, like the rest of scheduler.cpp.
#include <algorithm>

#include "coordinator/scheduler.h"

namespace fm {

void Scheduler::SharePrompt(const std::vector<std::unique_ptr<Request>>& requests) {
  if (requests.size() < 2) return;
  const GenerateParams& first = requests[0]->params;
  // The sampler of a fork takes the prompt the prefix sequence's saw, which it keeps only under
  // a repetition penalty (Sampler::AdoptPrompt): the same penalty for all. A request that scores
  // its prompt (prompt_logprobs) runs all of it itself.
  const bool share = first.prompt.size() >= 2 &&
                     std::all_of(requests.begin(), requests.end(), [&](const auto& r) {
                       return r->params.prompt == first.prompt && !r->ScoresPrompt() &&
                              r->params.sampling.repetition_penalty() == first.sampling.repetition_penalty();
                     });
  if (!share) return;
  auto shared = std::make_shared<SharedPrompt>();
  shared->prefix.prompt.assign(first.prompt.begin(), first.prompt.end() - 1);
  shared->prefix.sampling = first.sampling;
  shared->prefix.deadline = first.deadline;
  auto queued = std::make_shared<const int>(0);
  shared->queued = queued;
  for (auto& r : requests) {
    r->shared = shared;
    r->queued_mark = queued;
  }
}

Scheduler::Request* Scheduler::PrefixFor(const Request& r, int member, std::vector<int> load) {
  SharedPrompt& shared = *r.shared;
  // Worth a slot when two requests at least fork from it: one of those still queued (r's own
  // mark is gone) must land here too, in this pass (under data-parallel attention a prefix does
  // not wait for a later one: FreeIdlePrefixes). Each member that takes requests of the prompt
  // gets its own prefix, and the queued ones spread over the members as any sequences do
  // (Admit): placed in turn on the loads with r and this prefix here, as many as the batch
  // has room for, does one come to `member`? (3 on 2 idle members: no, the next two go to
  // the other; 4: yes.)
  const int64_t room = limits_.max_batch - static_cast<int64_t>(live_.size()) - 2;
  auto forks_here = [&] {
    load[member] += 2;
    for (int64_t q = std::min<int64_t>(shared.queued.use_count(), room); q > 0; --q) {
      const auto least = std::min_element(load.begin(), load.end());
      if (least - load.begin() == member) return true;
      ++*least;
    }
    return false;
  };
  // The member's KV is planned for its share of the batch (ceil(max_batch / k) sequences), which
  // placement keeps to as long as the prefix and r fit it.
  const int64_t k = static_cast<int64_t>(load.size());
  const int64_t share = (limits_.max_batch + k - 1) / k;
  if (shared.tried.insert(member).second && room >= 1 && load[member] + 2 <= share && forks_here()) {
    auto h = std::make_unique<Request>();
    h->params = shared.prefix;
    h->stream = std::make_shared<RequestStream>();   // nobody reads it
    h->next = h->params.prompt;
    h->prefix = true;
    h->sharers = r.shared;
    shared.seq_by_member[member] = StartRequest(std::move(h), member)->id;
  }
  return LivePrefix(shared, member);
}

void Scheduler::CountActive() {
  active_count_ = static_cast<int>(std::count_if(live_.begin(), live_.end(),
                                                 [](const auto& q) { return !q.second->prefix; }));
}

Scheduler::Request* Scheduler::LivePrefix(const SharedPrompt& shared, int member) {
  auto it = shared.seq_by_member.find(member);
  if (it == shared.seq_by_member.end()) return nullptr;
  auto live = live_.find(it->second);
  return live == live_.end() ? nullptr : live->second.get();
}

Scheduler::Request* Scheduler::ForkSource(const Request& r) {
  Request* h = r.shared ? LivePrefix(*r.shared, r.member) : nullptr;
  return h && h->waiting.count(r.id) ? h : nullptr;
}

void Scheduler::FreeIdlePrefixes() {
  std::vector<Request*> idle;
  for (auto& [id, r] : live_) {
    if (!r->prefix || r->starting != 0 || r->in_flight != 0 || r->forks_in_flight != 0 || !r->waiting.empty())
      continue;
    // A request still queued forks from it once a slot frees (n above the batch's room), so it
    // keeps its slot until then: that slot for a while, against a whole prefill each. Not under
    // data-parallel attention: k members' prefixes would hold k slots, and a queued request may
    // land on another member anyway.
    const std::shared_ptr<SharedPrompt> shared = r->sharers.lock();
    const bool keep = shared && workers_->expert_parallel() == 1 && !shared->queued.expired();
    if (!shared || (r->next.empty() && !keep)) idle.push_back(r.get());
  }
  for (Request* r : idle) Finish(r, flashmesh::v1::FINISH_REASON_STOP);   // freed on every worker
}

void Scheduler::Leave(Request* r) {
  if (Request* h = ForkSource(*r)) h->waiting.erase(r->id);
  if (!r->prefix) return;
  if (auto shared = r->sharers.lock()) shared->seq_by_member.erase(r->member);
}

}  // namespace fm
