// libFuzzer target: the coordinator's HTTP request parsing (Beast, with the server's limits)
// and the OpenAI request decoding of whatever body it yields (as a generation, a /tokenize and
// a /detokenize body). Neither may crash, the bytes the
// parser holds stay within the header limit; a decoded
// request must satisfy what the decoder promises, and every error must render as valid JSON
// naming a field that is in its message.
#include <cmath>
#include <cstdint>
#include <cstdlib>
#include <string>

#include <nlohmann/json.hpp>

#include "coordinator/http_request.h"
#include "coordinator/openai_request.h"

namespace {

// A refused body: a 400 whose param (if any) starts its message, rendered as valid JSON.
void CheckRefusal(const fm::Status& s) {
  fm::OpenAiError e = fm::ErrorFromStatus(s);
  if (e.http_status != 400) std::abort();
  if (!e.param.empty() && s.message().rfind(e.param + ": ", 0) != 0) std::abort();
  if (nlohmann::json::parse(e.ToJson(), nullptr, false).is_discarded()) std::abort();
}

void CheckDecoded(const std::string& body, bool chat) {
  auto r = fm::DecodeOpenAiRequest(body, chat);
  if (!r.ok()) return CheckRefusal(r.status());
  if (chat && r->messages.empty()) std::abort();
  if (!chat && (r->prompts.empty() || r->n * static_cast<int64_t>(r->prompts.size()) > 128)) std::abort();
  for (const auto& p : r->prompts)
    if (!chat && p.text.empty() && p.ids.empty()) std::abort();
  if (r->max_tokens < 0 || r->top_k < 0 || !(r->top_p > 0 && r->top_p <= 1)) std::abort();
  if (!(r->temperature >= 0 && r->temperature <= 2) || r->top_logprobs < 0 || r->top_logprobs > 20) std::abort();
  if (!(r->min_p >= 0 && r->min_p <= 1) || !(r->repetition_penalty > 0 && r->repetition_penalty <= 1e6)) std::abort();
  if (!(std::fabs(r->frequency_penalty) <= 2) || !(std::fabs(r->presence_penalty) <= 2)) std::abort();
  if (r->n < 1 || r->n > 128 || r->min_tokens < 0 || r->logit_bias.size() > 1024 || r->stop_token_ids.size() > 1024)
    std::abort();
  for (const auto& [id, bias] : r->logit_bias)
    if (id < 0 || !(std::fabs(bias) <= 100)) std::abort();
  for (const auto& s : r->stop)
    if (s.empty()) std::abort();
  if (chat && r->echo) std::abort();   // chat has no echo: refused, never decoded
  if (r->prompt_only && (!r->echo || r->max_tokens != 1)) std::abort();
  if (r->prompt_logprobs && (*r->prompt_logprobs < 0 || *r->prompt_logprobs > 20 || r->stream)) std::abort();
}

void CheckTokenizeBodies(const std::string& body) {
  auto t = fm::DecodeTokenizeRequest(body);
  if (!t.ok()) CheckRefusal(t.status());
  else if (t->input.chat ? t->input.messages.empty() : t->input.prompts.size() != 1)
    std::abort();
  auto d = fm::DecodeDetokenizeRequest(body);
  if (!d.ok()) return CheckRefusal(d.status());
  for (int32_t id : *d)
    if (id < 0) std::abort();
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  if (size < 2) return 0;
  // Byte 0: which endpoint decodes the body; byte 1: the size of the pieces the socket delivers.
  const bool chat = data[0] & 1;
  const size_t piece = 1 + data[1] % 64;
  data += 2;
  size -= 2;
  fm::HttpRequestParser parser(/*max_header_bytes=*/1024, /*max_body_bytes=*/8192);
  std::string buffer;
  size_t off = 0;
  while (true) {
    auto state = parser.Feed(&buffer);
    if (state == fm::HttpRequestParser::State::kError) {
      const int s = parser.error_status();
      if (s != 400 && s != 413 && s != 431 && s != 501) std::abort();
      return 0;
    }
    if (state == fm::HttpRequestParser::State::kDone) break;
    // What the parser leaves unconsumed is bounded like the header (a chunk line, a trailer;
    // after a chunk, its CRLF too).
    if (buffer.size() > 1024 + 1) std::abort();
    parser.TakeContinue();
    if (off == size) return 0;   // the client stopped mid-request
    const size_t n = std::min(piece, size - off);
    buffer.append(reinterpret_cast<const char*>(data) + off, n);
    off += n;
  }
  const fm::HttpRequest& req = parser.request();
  if (req.body.size() > 8192) std::abort();
  CheckDecoded(req.body, chat);
  CheckTokenizeBodies(req.body);
  // The raw bytes as a body too: the JSON decoder sees arbitrary text, not only what HTTP framed.
  CheckDecoded(std::string(reinterpret_cast<const char*>(data), size), chat);
  CheckTokenizeBodies(std::string(reinterpret_cast<const char*>(data), size));
  return 0;
}
