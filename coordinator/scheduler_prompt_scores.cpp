// The scheduler's prompt logprobs (docs/architecture.md "Prompt logprobs"): the last stage's
// scores of each step checked against what it was due and kept by position, then sent before
// the first token. On the scheduling thread, like the rest of scheduler.cpp.
#include <algorithm>

#include "common/log.h"
#include "coordinator/scheduler.h"

namespace fm {

bool Scheduler::TakePromptScores(StepCall* call) {
  if (call->scores_due.empty()) return true;
  const auto& workers = workers_->workers();
  auto due = call->scores_due;   // what is still to come
  const std::string step = " of step " + std::to_string(call->step_id);
  for (size_t i = 0; i < workers.size(); ++i) {
    if (!workers[i].head) continue;
    const std::string node = "node " + workers[i].name + " (" + workers[i].control + ")";
    for (const auto& p : call->responses[i].prompt_scores()) {
      const std::string seq = "sequence " + std::to_string(p.seq_id());
      auto d = due.find(p.seq_id());
      if (d == due.end()) {
        FailAll(Internal(node + " returned prompt logprobs for " + seq + step + ", which were not due"));
        return false;
      }
      const auto [first, count] = d->second;
      due.erase(d);
      auto it = live_.find(p.seq_id());
      Request* r = it == live_.end() ? nullptr : it->second.get();
      if (!p.error().empty()) {
        // The model's logits for this prompt (a NaN or +inf): its request ends, the others stand.
        if (r && r->score_error.ok()) {
          r->score_error = Internal("the prompt of sequence " + std::to_string(r->id) +
                                    " could not be scored: node " + workers[i].name + ": " + p.error());
          FM_LOG(kWarn, "scheduler") << r->score_error.ToString();
          r->next.clear();   // no more of its chunks
          r->held.reset();
        }
        continue;
      }
      if (p.first() != first || p.tokens_size() != count) {
        FailAll(Internal(node + " returned the scores of prompt positions [" + std::to_string(p.first()) +
                         ", " + std::to_string(p.first() + p.tokens_size()) + ") of " + seq + step +
                         ", due [" + std::to_string(first) + ", " + std::to_string(first + count) + ")"));
        return false;
      }
      if (!r || !r->score_error.ok()) continue;   // ended meanwhile
      for (int k = 0; k < count; ++k) {
        const auto& t = p.tokens(k);
        const size_t pos = static_cast<size_t>(first + k);
        if (t.id() != r->params.prompt[pos]) {
          FailAll(Internal(node + " scored token " + std::to_string(t.id()) + " at prompt position " +
                           std::to_string(pos) + " of " + seq + step + ", which holds " +
                           std::to_string(r->params.prompt[pos])));
          return false;
        }
        flashmesh::v1::PromptToken& out = r->prompt_scores[pos - 1];
        out.set_id(t.id());
        out.set_logprob(t.logprob());
        out.set_rank(t.rank());
        if (tokenizer_)
          if (auto bytes = tokenizer_->TokenBytes(t.id()); bytes.ok()) out.set_token(*bytes);
        AddAlternatives(t, r->params.sampling.prompt_logprobs(), out.mutable_top_logprobs());
      }
      r->scored += static_cast<size_t>(count);
      ReleaseFirstToken(r);   // its last chunk may have come back before this one
    }
  }
  if (!due.empty()) {
    FailAll(Internal("the last stage returned no prompt logprobs for sequence " +
                     std::to_string(due.begin()->first) + step));
    return false;
  }
  return true;
}

void Scheduler::ReleaseFirstToken(Request* r) {
  if (!r->held || r->scored < r->prompt_scores.size()) return;
  RequestStream::Event ev;
  ev.kind = RequestStream::Event::kPrompt;
  for (auto& t : r->prompt_scores) *ev.prompt.add_tokens() = std::move(t);
  r->prompt_scores.clear();
  r->prompt_sent = true;
  r->stream->Push(std::move(ev));
  const flashmesh::v1::SampledToken first = std::move(*r->held);
  r->held.reset();
  ApplyToken(r, first);
}

bool Scheduler::EndIfScoringFailed(Request* r) {
  if (r->score_error.ok()) return false;
  if (r->in_flight == 0) {
    FreeOnWorkers(r->started, {r->id});
    End(r, r->score_error);
  }
  return true;
}

}  // namespace fm
