#include "coordinator/reasoning.h"

#include <algorithm>

namespace fm {

void FindThinkEnd(std::string_view text, size_t* end, size_t* searched) {
  if (*end != std::string_view::npos) return;
  // A tag may straddle what was searched and what is new.
  const size_t from = *searched >= kThinkEnd.size() ? *searched - kThinkEnd.size() + 1 : 0;
  *end = text.find(kThinkEnd, from);
  *searched = text.size();
}

size_t ReleasableReasoning(std::string_view text) {
  for (size_t n = std::min(text.size(), kThinkEnd.size() - 1); n > 0; --n)
    if (text.substr(text.size() - n) == kThinkEnd.substr(0, n)) return text.size() - n;
  return text.size();
}

ReasoningParts SplitReasoning(std::string_view text, size_t end, size_t from, size_t upto) {
  upto = std::min(upto, text.size());
  from = std::min(from, upto);
  if (end == std::string_view::npos) return {text.substr(from, upto - from), {}};
  const size_t content = std::min(end + kThinkEnd.size(), text.size());
  ReasoningParts p;
  if (from < end) p.reasoning = text.substr(from, std::min(upto, end) - from);
  const size_t c = std::max(from, content);
  if (c < upto) p.content = text.substr(c, upto - c);
  return p;
}

}  // namespace fm
