// The JSON bodies of the OpenAI-compatible HTTP API (docs/api.md, "HTTP API"): decoding of
// /v1/chat/completions and /v1/completions requests into OpenAiRequest (and of vLLM's /tokenize
// and /detokenize), and OpenAI's error object. Plain JSON in, plain structs out (no gRPC, no tokenizer): the fuzz target decodes
// untrusted bodies with exactly this code. As OpenAI does, unknown fields are ignored; a known
// field with the wrong type or an out-of-range value is InvalidArgument whose message starts
// with the field's name ("temperature: ...", "messages[1].role: ...").
#pragma once
#include <cstdint>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

#include "common/status.h"
#include "model/tokenizer.h"

namespace fm {

// Stop strings a request may give (both APIs). OpenAI allows 4; vLLM any number, and
// lm-evaluation-harness sends a task's `until` strings plus the end-of-sentence text, often 5
// or more. Each costs a search of each token's text and holds back up to its length - 1 bytes.
inline constexpr int kMaxStopStrings = 16;

struct OpenAiRequest {
  bool chat = true;                      // /v1/chat/completions; false: /v1/completions
  std::string model;                     // informative: one model is served
  std::vector<ChatMessage> messages;     // chat
  // Completions: the prompts, one or OpenAI's batch of several; each is a text or token ids
  // (ids non-empty when used) and gets n choices (choice index = prompt * n + choice).
  struct Prompt {
    std::string text;
    std::vector<int32_t> ids;
  };
  std::vector<Prompt> prompts;
  bool add_special_tokens = true;        // completions: BOS before a text prompt (vLLM's)
  int64_t max_tokens = 0;                // 0 = unset: as many as the limits allow
  std::string max_tokens_field = "max_tokens";   // the field that set it (errors name it)
  double temperature = 1.0;              // OpenAI's default; 0 = greedy
  double top_p = 1.0;
  int64_t top_k = 0;                     // extension (vLLM's); 0 = off
  double min_p = 0.0;                    // extension (vLLM's, llama.cpp's); 0 = off
  double frequency_penalty = 0.0;        // [-2, 2]
  double presence_penalty = 0.0;         // [-2, 2]
  double repetition_penalty = 1.0;       // extension (vLLM's); 1 = off
  std::vector<std::pair<int32_t, float>> logit_bias;   // (token id, bias in [-100, 100])
  std::vector<int32_t> stop_token_ids;   // extension (vLLM's)
  int64_t min_tokens = 0;                // extension (vLLM's)
  std::optional<uint64_t> seed;
  std::vector<std::string> stop;
  bool stream = false;
  bool include_usage = false;            // stream_options.include_usage
  bool logprobs = false;                 // chat: logprobs: true; completions: logprobs: N >= 0
  int64_t top_logprobs = 0;
  // Completions: the prompt comes back before the generated text; with logprobs, its tokens
  // with theirs too (the first one's null), as OpenAI's legacy API and vLLM do.
  bool echo = false;
  // Completions' max_tokens 0 with echo: the prompt (and its logprobs) alone. The generation
  // still runs one token (max_tokens is 1), which the answer leaves out.
  bool prompt_only = false;
  // vLLM's: each prompt token's logprob, rank and this many alternatives, in vLLM's
  // prompt_logprobs list (a completions choice's, a chat response's); not with stream.
  std::optional<int64_t> prompt_logprobs;
  bool ignore_eos = false;               // extension (vLLM's)
  bool thinking = false;                 // chat: chat_template_kwargs.thinking (vLLM's)
  int64_t n = 1;                         // choices: n generations of the prompt
};

// Decodes a request body. InvalidArgument names the field (see above), or the body when it is
// not JSON, nests arrays/objects deeper than kMaxJsonNesting or holds more values than below:
// far above what a request needs (a prompt of token ids is numbers: as many as the longest
// context, 2^20 positions), they bound what one body costs decoded to ~55 MB (measured; a
// 4 MiB body of "{}," would cost ~160 MB).
inline constexpr size_t kMaxJsonNesting = 64;
inline constexpr size_t kMaxJsonNodes = 65536;       // objects, arrays and strings
inline constexpr size_t kMaxJsonScalars = 1 << 20;   // numbers, true, false and null
Result<OpenAiRequest> DecodeOpenAiRequest(std::string_view body, bool chat);

// /tokenize (vLLM's): a completions body ({"prompt", "add_special_tokens"}) or, when it has
// "messages", a chat body (the template and its chat_template_kwargs), decoded as above;
// return_token_strs also asks for each token's text.
struct TokenizeRequest {
  OpenAiRequest input;
  bool return_token_strs = false;
};
Result<TokenizeRequest> DecodeTokenizeRequest(std::string_view body);

// /detokenize (vLLM's): {"tokens": [id, ...]}, ids in [0, 2^31) (the tokenizer bounds them by
// its vocabulary); errors name "tokens" or "tokens[i]".
Result<std::vector<int32_t>> DecodeDetokenizeRequest(std::string_view body);

// OpenAI's error object: {"error": {"message", "type", "param", "code"}}.
struct OpenAiError {
  int http_status = 500;
  std::string message;
  std::string type;    // invalid_request_error, authentication_error, ...
  std::string param;   // the field, "" = null
  std::string code;    // "" = null
  std::string ToJson() const;
};

// The HTTP status and error object of a flashmesh Status: InvalidArgument and OutOfRange 400
// (param = the field the message starts with), Unauthenticated 401, ResourceExhausted 429,
// Unavailable 503, NotFound 404, DeadlineExceeded 504, anything else 500.
OpenAiError ErrorFromStatus(const Status& s);

}  // namespace fm
