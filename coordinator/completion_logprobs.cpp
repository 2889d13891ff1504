#include "coordinator/completion_logprobs.h"

#include <algorithm>
#include <cstdio>
#include <optional>

#include "common/utf8.h"

namespace fm {

std::string CompletionToken(int32_t id, const std::string& token) {
  if (token.empty()) return "token_id:" + std::to_string(id);
  if (FirstInvalidUtf8(token) == std::string_view::npos) return token;
  std::string out = "bytes:";
  char hex[8];
  for (unsigned char c : token) {
    std::snprintf(hex, sizeof hex, "\\x%02x", c);
    out += hex;
  }
  return out;
}

Json CompletionEntry(int32_t id, const std::string& token, float logprob,
                     const google::protobuf::RepeatedPtrField<flashmesh::v1::TopLogprob>& top, int64_t alts) {
  const std::string chosen = CompletionToken(id, token);
  Json entries = Json::object();
  for (int k = 0; k < std::min<int64_t>(alts, top.size()); ++k)
    entries[CompletionToken(top[k].id(), top[k].token())] = top[k].logprob();
  entries[chosen] = logprob;
  return {{"token", chosen}, {"logprob", logprob}, {"top", std::move(entries)}};
}

Json CompletionLogprobs(const Json& entries, const Json& offsets) {
  Json tokens = Json::array(), lps = Json::array(), tops = Json::array();
  for (const auto& e : entries) {
    tokens.push_back(e["token"]);
    lps.push_back(e["logprob"]);
    tops.push_back(e["top"]);
  }
  return {{"tokens", tokens}, {"token_logprobs", lps}, {"top_logprobs", tops}, {"text_offset", offsets}};
}

namespace {
size_t CodePoints(const std::string& s) {
  size_t n = 0;
  for (unsigned char b : s) n += (b & 0xC0) != 0x80;
  return n;
}
}  // namespace

CompletionEcho MakeCompletionEcho(const Tokenizer* tokenizer, std::span<const int32_t> ids,
                                  const std::string* sent) {
  CompletionEcho e;
  if (!ids.empty()) e.first_id = ids.front();
  std::string decoded;
  size_t chars = 0;
  std::optional<StreamDecoder> decoder;
  if (tokenizer) decoder.emplace(*tokenizer);
  for (int32_t id : ids) {
    e.offsets.push_back(chars);
    if (!decoder) continue;
    Result<std::string> piece = decoder->Push(id);
    if (!piece.ok()) continue;   // an id past the tokenizer's own table: no text, as generated
    chars += CodePoints(*piece);
    decoded += *piece;
  }
  if (decoder) decoded += decoder->Flush();
  e.text = sent ? *sent : decoded;
  e.chars = CodePoints(e.text);
  return e;
}

void AddPromptScores(CompletionEcho* echo, const std::string& first_bytes,
                     const flashmesh::v1::PromptLogprobs& scores, int64_t top) {
  if (echo->entries.empty() && echo->first_id >= 0)
    echo->entries.push_back({{"token", CompletionToken(echo->first_id, first_bytes)},
                             {"logprob", nullptr}, {"top", nullptr}});
  for (const auto& t : scores.tokens())
    echo->entries.push_back(CompletionEntry(t.id(), t.token(), t.logprob(), t.top_logprobs(), top));
}

Json VllmPromptLogprobs(const flashmesh::v1::PromptLogprobs& scores, int64_t top) {
  Json out = Json::array({nullptr});
  for (const auto& t : scores.tokens()) {
    Json position = Json::object();
    position[std::to_string(t.id())] = {{"logprob", t.logprob()}, {"rank", t.rank()}, {"decoded_token", t.token()}};
    // An alternative's rank is its place in the list; the token itself among them takes its
    // place's rank too (vLLM's dict overwrites it so; they differ only among equal logits).
    for (int k = 0; k < std::min<int64_t>(top, t.top_logprobs_size()); ++k) {
      const auto& alt = t.top_logprobs(k);
      position[std::to_string(alt.id())] = {{"logprob", alt.logprob()}, {"rank", k + 1}, {"decoded_token", alt.token()}};
    }
    out.push_back(std::move(position));
  }
  return out;
}

}  // namespace fm
