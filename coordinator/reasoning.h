// DeepSeek's thinking mode (chat_template_kwargs.thinking): the prompt ends with "<think>", so
// the generation starts inside the reasoning, and the first "</think>" ends it. The chat API
// returns the text before the tag as the message's `reasoning_content` and the text after it as
// its `content`, the tag in neither: DeepSeek's own API and vLLM's / SGLang's DeepSeek reasoning
// parsers do the same (docs/api.md "Thinking").
#pragma once

#include <cstddef>
#include <string_view>

namespace fm {

inline constexpr std::string_view kThinkStart = "<think>", kThinkEnd = "</think>";

// Where the reasoning of `text` ends (the first kThinkEnd), searching only what `text` gained
// since the last call: `*end` is npos until found, `*searched` how far the search got.
void FindThinkEnd(std::string_view text, size_t* end, size_t* searched);

// The tag found at `found` (npos: none) if the first `size` bytes of the text hold all of it,
// else npos: a reasoning that a stop string cut inside or before its tag did not end.
inline size_t ReasoningEnd(size_t found, size_t size) {
  return found != std::string_view::npos && found + kThinkEnd.size() <= size ? found : std::string_view::npos;
}

// While no tag was found: how much of `text` may be streamed as reasoning, i.e. all but a
// suffix that could be the first bytes of kThinkEnd.
size_t ReleasableReasoning(std::string_view text);

// text[from, upto) as its reasoning part and its content part (the tag at `end` left out;
// end npos: no tag, all reasoning).
struct ReasoningParts {
  std::string_view reasoning, content;
};
ReasoningParts SplitReasoning(std::string_view text, size_t end, size_t from, size_t upto);

}  // namespace fm
