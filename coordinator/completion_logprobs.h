// The logprobs object of /v1/completions (OpenAI's legacy shape: parallel tokens,
// token_logprobs, top_logprobs and text_offset arrays) and its echo: the prompt sent back before
// the generated text, with its tokens' scores (GenerateRequest.prompt_logprobs) when logprobs
// are asked for, as OpenAI's legacy API and vLLM return it (lm-evaluation-harness scores
// loglikelihood tasks this way).
#pragma once
#include <cstddef>
#include <cstdint>
#include <span>
#include <string>

#include <nlohmann/json.hpp>

#include "flashmesh/v1/api.pb.h"
#include "model/tokenizer.h"

namespace fm {

// Keys stay in the order written, as OpenAI sends them: a top_logprobs object lists the most
// likely token first, and every body starts with id, object, created, model.
using Json = nlohmann::ordered_json;

// A token as completions' logprobs name it (in `tokens` and as a `top_logprobs` key): its text
// when that is whole UTF-8, else OpenAI's "bytes:\xNN..." spelling, and vLLM's "token_id:N"
// without a tokenizer (empty `token`). So two tokens never share a key.
std::string CompletionToken(int32_t id, const std::string& token);

// One token's entry {token, logprob, top}: `top` is OpenAI's {token: logprob} of the first
// `alts` alternatives and the token itself ("up to logprobs + 1"; the token's own value last,
// so it wins). `token` is the token's own bytes.
Json CompletionEntry(int32_t id, const std::string& token, float logprob,
                     const google::protobuf::RepeatedPtrField<flashmesh::v1::TopLogprob>& top, int64_t alts);

// Completions' logprobs of the tokens `entries` (CompletionEntry's), each starting at its
// offset in the choice's text, in characters (a token may add none: a special token, or part
// of a character).
Json CompletionLogprobs(const Json& entries, const Json& offsets);

// A completion's echo of its prompt `ids`: `text` is the prompt's own text when it was sent as
// text (`sent`), else the ids decoded as generated text is (special tokens skipped); offsets
// count the decoded pieces before each token. With logprobs, `entries` gets each prompt
// token's entry once AddScores has them (the first token's logprob and top are null: nothing
// comes before it).
struct CompletionEcho {
  std::string text;
  size_t chars = 0;               // code points in text: the generated tokens' offsets start here
  Json entries = Json::array();
  Json offsets = Json::array();   // one per prompt token
  int32_t first_id = -1;
  bool sent = false;              // streamed already
};
CompletionEcho MakeCompletionEcho(const Tokenizer* tokenizer, std::span<const int32_t> ids,
                                  const std::string* sent);
// The prompt's scores (the PromptLogprobs events, in order) -> entries: null for the first
// token, then one per scored token with at most `top` alternatives. `first_bytes`: the first
// token's own bytes ("" unknown).
void AddPromptScores(CompletionEcho* echo, const std::string& first_bytes,
                     const flashmesh::v1::PromptLogprobs& scores, int64_t top);

// vLLM's prompt_logprobs list of a prompt's scores: null for the first token, then per token
// {"id": {"logprob", "rank", "decoded_token"}}, the token itself first, then its `top` most
// likely alternatives (ranks 1..top; the token's own entry stays first when it is among them).
Json VllmPromptLogprobs(const flashmesh::v1::PromptLogprobs& scores, int64_t top);

}  // namespace fm
