#include "coordinator/openai_request.h"

#include <algorithm>
#include <cctype>
#include <cmath>
#include <limits>

#include <nlohmann/json.hpp>

namespace fm {
namespace {

using Json = nlohmann::json;

constexpr int64_t kMaxTopLogprobs = 20;  // OpenAI's limit
constexpr size_t kMaxTokenLists = 1024;   // logit_bias entries, stop_token_ids (api_service.h)
constexpr int64_t kMaxChoices = 128;      // OpenAI's limit on n

const char* TypeName(const Json& v) {
  switch (v.type()) {
    case Json::value_t::null: return "null";
    case Json::value_t::boolean: return "a boolean";
    case Json::value_t::string: return "a string";
    case Json::value_t::array: return "an array";
    case Json::value_t::object: return "an object";
    case Json::value_t::number_float: return "a number";
    default: return "an integer";
  }
}

Status WrongType(const std::string& field, const char* expected, const Json& v) {
  return InvalidArgument(field + ": expected " + expected + ", got " + TypeName(v));
}

// The value of `key` when present and not null (OpenAI treats null as absent).
const Json* Field(const Json& obj, const char* key) {
  auto it = obj.find(key);
  return it == obj.end() || it->is_null() ? nullptr : &*it;
}

Result<double> Number(const Json& v, const std::string& field) {
  if (!v.is_number()) return WrongType(field, "a number", v);
  double d = v.get<double>();
  if (!std::isfinite(d)) return InvalidArgument(field + ": not a finite number");
  return d;
}

Result<int64_t> Integer(const Json& v, const std::string& field) {
  if (v.is_number_integer()) {
    if (v.is_number_unsigned() && v.get<uint64_t>() > static_cast<uint64_t>(std::numeric_limits<int64_t>::max()))
      return InvalidArgument(field + ": " + v.dump() + " is too large");
    return v.get<int64_t>();
  }
  // 3.0 is an integer for JSON clients that only have doubles (JavaScript).
  if (v.is_number_float()) {
    double d = v.get<double>();
    if (std::isfinite(d) && d == std::floor(d)) {
      if (std::fabs(d) < 9.0e15) return static_cast<int64_t>(d);
      // A whole number written as a float, or too long for int64/uint64: past what a double
      // holds exactly.
      return InvalidArgument(field + ": " + v.dump() + " is out of range (an integer must fit "
                             "int64; written with an exponent or a fraction, it must be under 9e15 "
                             "in magnitude)");
    }
  }
  return WrongType(field, "an integer", v);
}

Result<bool> Boolean(const Json& v, const std::string& field) {
  if (!v.is_boolean()) return WrongType(field, "a boolean", v);
  return v.get<bool>();
}

Result<std::string> String(const Json& v, const std::string& field) {
  if (!v.is_string()) return WrongType(field, "a string", v);
  return v.get<std::string>();
}

// Message content: a string, or an array of {type: "text", text} parts (concatenated).
Result<std::string> Content(const Json& v, const std::string& field) {
  if (v.is_string()) return v.get<std::string>();
  if (!v.is_array()) return WrongType(field, "a string or an array of text parts", v);
  std::string text;
  for (size_t i = 0; i < v.size(); ++i) {
    const std::string part = field + "[" + std::to_string(i) + "]";
    if (!v[i].is_object()) return WrongType(part, "an object", v[i]);
    const Json* type = Field(v[i], "type");
    if (!type) return InvalidArgument(part + ".type: missing");
    FM_ASSIGN_OR_RETURN(std::string t, String(*type, part + ".type"));
    if (t != "text") return InvalidArgument(part + ".type: \"" + t + "\" is not supported (only \"text\")");
    const Json* body = Field(v[i], "text");
    if (!body) return InvalidArgument(part + ".text: missing");
    FM_ASSIGN_OR_RETURN(std::string s, String(*body, part + ".text"));
    text += s;
  }
  return text;
}

Status DecodeMessages(const Json& v, OpenAiRequest* r) {
  if (!v.is_array()) return WrongType("messages", "an array", v);
  if (v.empty()) return InvalidArgument("messages: empty");
  for (size_t i = 0; i < v.size(); ++i) {
    const std::string field = "messages[" + std::to_string(i) + "]";
    if (!v[i].is_object()) return WrongType(field, "an object", v[i]);
    const Json* role = Field(v[i], "role");
    if (!role) return InvalidArgument(field + ".role: missing");
    ChatMessage m;
    FM_ASSIGN_OR_RETURN(m.role, String(*role, field + ".role"));
    if (m.role != "system" && m.role != "user" && m.role != "assistant")
      return InvalidArgument(field + ".role: \"" + m.role + "\" is not supported (system, user, assistant)");
    // null: no content, as OpenAI allows (an assistant message this API returned in thinking
    // mode has null content when the reasoning took every token; clients send it back).
    if (const Json* c = Field(v[i], "content"); c && !c->is_null()) {
      FM_ASSIGN_OR_RETURN(m.content, Content(*c, field + ".content"));
    }
    r->messages.push_back(std::move(m));
  }
  return Status::Ok();
}

// One prompt named `field`: a string, or an array of token ids. allow_empty: "" is a prompt
// (/tokenize counts it, as vLLM's does); a generation refuses it.
Status DecodeOnePrompt(const Json& p, const std::string& field, bool allow_empty, OpenAiRequest::Prompt* out) {
  if (p.is_string()) {
    out->text = p.get<std::string>();
    if (out->text.empty() && !allow_empty) return InvalidArgument(field + ": empty");
    return Status::Ok();
  }
  if (!p.is_array()) return WrongType(field, "a string or an array of token ids", p);
  if (p.empty()) return InvalidArgument(field + ": empty");
  for (size_t i = 0; i < p.size(); ++i) {
    const std::string at = field + "[" + std::to_string(i) + "]";
    FM_ASSIGN_OR_RETURN(int64_t id, Integer(p[i], at));
    if (id < 0 || id > std::numeric_limits<int32_t>::max()) return InvalidArgument(at + ": " + std::to_string(id) + " is not a token id");
    out->ids.push_back(static_cast<int32_t>(id));
  }
  return Status::Ok();
}

// A prompt, or OpenAI's batch: an array of prompts (strings or arrays of ids), each named
// prompt[i] (a batch of one keeps the name "prompt").
Status DecodePrompt(const Json& v, OpenAiRequest* r, bool allow_empty) {
  if (!(v.is_array() && !v.empty() && (v[0].is_string() || v[0].is_array()))) {
    r->prompts.resize(1);
    return DecodeOnePrompt(v, "prompt", allow_empty, &r->prompts[0]);
  }
  if (static_cast<int64_t>(v.size()) > kMaxChoices)
    return InvalidArgument("prompt: a batch of " + std::to_string(v.size()) + " prompts, more than " +
                           std::to_string(kMaxChoices));
  r->prompts.resize(v.size());
  for (size_t i = 0; i < v.size(); ++i) {
    const std::string field = v.size() == 1 ? "prompt" : "prompt[" + std::to_string(i) + "]";
    FM_RETURN_IF_ERROR(DecodeOnePrompt(v[i], field, allow_empty, &r->prompts[i]));
  }
  return Status::Ok();
}

Status DecodeStop(const Json& v, OpenAiRequest* r) {
  if (v.is_string()) {
    if (v.get<std::string>().empty()) return InvalidArgument("stop: empty string");
    r->stop.push_back(v.get<std::string>());
    return Status::Ok();
  }
  if (!v.is_array()) return WrongType("stop", "a string or an array of strings", v);
  if (static_cast<int64_t>(v.size()) > kMaxStopStrings)
    return InvalidArgument("stop: " + std::to_string(v.size()) + " strings (at most " + std::to_string(kMaxStopStrings) + ")");
  for (size_t i = 0; i < v.size(); ++i) {
    const std::string field = "stop[" + std::to_string(i) + "]";
    FM_ASSIGN_OR_RETURN(std::string s, String(v[i], field));
    if (s.empty()) return InvalidArgument(field + ": empty string");
    r->stop.push_back(std::move(s));
  }
  return Status::Ok();
}

Status DecodeSampling(const Json& j, OpenAiRequest* r) {
  if (const Json* v = Field(j, "temperature")) {
    FM_ASSIGN_OR_RETURN(r->temperature, Number(*v, "temperature"));
    if (r->temperature < 0 || r->temperature > 2) return InvalidArgument("temperature: " + v->dump() + " outside [0, 2]");
  }
  if (const Json* v = Field(j, "top_p")) {
    FM_ASSIGN_OR_RETURN(r->top_p, Number(*v, "top_p"));
    if (!(r->top_p > 0 && r->top_p <= 1)) return InvalidArgument("top_p: " + v->dump() + " outside (0, 1]");
  }
  if (const Json* v = Field(j, "top_k")) {
    FM_ASSIGN_OR_RETURN(r->top_k, Integer(*v, "top_k"));
    if (r->top_k == -1) r->top_k = 0;   // vLLM's "off"
    if (r->top_k < 0 || r->top_k > std::numeric_limits<int32_t>::max())
      return InvalidArgument("top_k: " + v->dump() + " (0 or -1 = off, else a positive count)");
  }
  if (const Json* v = Field(j, "min_p")) {
    FM_ASSIGN_OR_RETURN(r->min_p, Number(*v, "min_p"));
    if (!(r->min_p >= 0 && r->min_p <= 1)) return InvalidArgument("min_p: " + v->dump() + " outside [0, 1]");
  }
  for (auto [field, value] : {std::pair{"frequency_penalty", &r->frequency_penalty},
                              std::pair{"presence_penalty", &r->presence_penalty}}) {
    if (const Json* v = Field(j, field)) {
      FM_ASSIGN_OR_RETURN(*value, Number(*v, field));
      if (!(*value >= -2 && *value <= 2)) return InvalidArgument(std::string(field) + ": " + v->dump() + " outside [-2, 2]");
    }
  }
  if (const Json* v = Field(j, "repetition_penalty")) {
    FM_ASSIGN_OR_RETURN(r->repetition_penalty, Number(*v, "repetition_penalty"));
    // Past float's range the worker's value would be inf: as out of range as 0.
    if (!(r->repetition_penalty > 0 && r->repetition_penalty <= 1e6))
      return InvalidArgument("repetition_penalty: " + v->dump() + " outside (0, 1e6]");
  }
  if (const Json* v = Field(j, "logit_bias")) {
    if (!v->is_object()) return WrongType("logit_bias", "an object of token id: bias", *v);
    if (v->size() > kMaxTokenLists)
      return InvalidArgument("logit_bias: " + std::to_string(v->size()) + " entries (at most " +
                             std::to_string(kMaxTokenLists) + ")");
    for (const auto& [key, bias] : v->items()) {
      // OpenAI's keys are token ids written as strings ("50256"); spaces or tabs around, one
      // leading "+" and leading zeros are taken too (as vLLM's int() takes them).
      const size_t b0 = key.find_first_not_of(" \t"), b1 = key.find_last_not_of(" \t");
      std::string digits = b0 == std::string::npos ? "" : key.substr(b0, b1 - b0 + 1);
      if (!digits.empty() && digits[0] == '+') digits.erase(0, 1);
      while (digits.size() > 1 && digits[0] == '0') digits.erase(0, 1);
      if (digits.empty() || digits.size() > 10 || digits.find_first_not_of("0123456789") != std::string::npos ||
          std::stoll(digits) > std::numeric_limits<int32_t>::max())
        return InvalidArgument("logit_bias: the key \"" + key.substr(0, 16) + "\" is not a token id");
      const auto id = static_cast<int32_t>(std::stoll(digits));
      const std::string field = "logit_bias." + std::to_string(id);
      FM_ASSIGN_OR_RETURN(double b, Number(bias, field));
      if (!(b >= -100 && b <= 100)) return InvalidArgument(field + ": " + bias.dump() + " outside [-100, 100]");
      for (const auto& [seen, unused] : r->logit_bias)
        if (seen == id) return InvalidArgument(field + ": token " + std::to_string(id) + " is given twice");
      r->logit_bias.emplace_back(id, static_cast<float>(b));
    }
  }
  if (const Json* v = Field(j, "stop_token_ids")) {
    if (!v->is_array()) return WrongType("stop_token_ids", "an array of token ids", *v);
    if (v->size() > kMaxTokenLists)
      return InvalidArgument("stop_token_ids: " + std::to_string(v->size()) + " ids (at most " +
                             std::to_string(kMaxTokenLists) + ")");
    for (size_t i = 0; i < v->size(); ++i) {
      const std::string field = "stop_token_ids[" + std::to_string(i) + "]";
      FM_ASSIGN_OR_RETURN(int64_t id, Integer((*v)[i], field));
      if (id < 0 || id > std::numeric_limits<int32_t>::max()) return InvalidArgument(field + ": " + std::to_string(id) + " is not a token id");
      r->stop_token_ids.push_back(static_cast<int32_t>(id));
    }
  }
  if (const Json* v = Field(j, "min_tokens")) {
    FM_ASSIGN_OR_RETURN(r->min_tokens, Integer(*v, "min_tokens"));
    if (r->min_tokens < 0 || r->min_tokens > std::numeric_limits<int32_t>::max())
      return InvalidArgument("min_tokens: " + std::to_string(r->min_tokens) + " (a count >= 0)");
  }
  if (const Json* v = Field(j, "seed")) {
    FM_ASSIGN_OR_RETURN(int64_t seed, Integer(*v, "seed"));
    r->seed = static_cast<uint64_t>(seed);
  }
  return Status::Ok();
}

// The values of RefuseUnsupported's fields that change nothing.
bool IsNumber1(const Json& v) { return v.is_number() && v.get<double>() == 1; }
bool IsFalse(const Json& v) { return v.is_boolean() && !v.get<bool>(); }
bool IsTrue(const Json& v) { return v.is_boolean() && v.get<bool>(); }
bool IsEmptyArray(const Json& v) { return v.is_array() && v.empty(); }
bool NoValue(const Json&) { return false; }   // only null (absent) changes nothing

// Fields of OpenAI's (or vLLM's) API that change what is generated and that this server does
// not do: a 400 naming the field, unless the value is the one that changes nothing. Ignoring
// them, as unknown fields are, would answer other text than was asked for.
Status RefuseUnsupported(const Json& j, bool chat) {
  struct Unsupported {
    const char* field;
    bool (*neutral)(const Json&);
    const char* neutral_text;
    bool chat_only = false;   // a field of the chat template or its messages
  };
  static const Unsupported kFields[] = {
      {"best_of", IsNumber1, "1"},
      {"echo", IsFalse, "false", true},
      {"suffix", [](const Json& v) { return v.is_string() && v.get<std::string>().empty(); }, "\"\""},
      {"tools", IsEmptyArray, "[]"},
      {"functions", IsEmptyArray, "[]"},
      {"tool_choice", [](const Json& v) { return v == "none" || v == "auto"; }, "\"none\" or \"auto\""},
      {"response_format",
       [](const Json& v) { return v.is_object() && v.size() == 1 && v.contains("type") && v["type"] == "text"; },
       "{\"type\": \"text\"}"},
      // vLLM's structured outputs and beam search.
      {"guided_json", NoValue, "null"},
      {"guided_regex", NoValue, "null"},
      {"guided_choice", NoValue, "null"},
      {"guided_grammar", NoValue, "null"},
      {"structured_outputs", NoValue, "null"},
      {"use_beam_search", IsFalse, "false"},
      {"length_penalty", IsNumber1, "1"},
      // vLLM's sampling and output extensions.
      {"allowed_token_ids", NoValue, "null"},
      {"bad_words", IsEmptyArray, "[]"},
      {"include_stop_str_in_output", IsFalse, "false"},
      {"skip_special_tokens", IsTrue, "true"},
      {"truncate_prompt_tokens", NoValue, "null"},
      {"logits_processors", NoValue, "null"},
      {"return_tokens_as_token_ids", IsFalse, "false"},
      // Chat: the template (thinking: chat_template_kwargs), other modalities, tools of OpenAI's.
      {"add_generation_prompt", IsTrue, "true", true},
      // The template writes the BOS; vLLM's chat default adds none before it.
      {"add_special_tokens", IsFalse, "false", true},
      {"continue_final_message", IsFalse, "false", true},
      {"chat_template", NoValue, "null", true},
      {"documents", NoValue, "null", true},
      {"reasoning_effort", NoValue, "null (thinking is chat_template_kwargs.thinking)", true},
      {"modalities", [](const Json& v) { return v == Json::array({"text"}); }, "[\"text\"]", true},
      {"audio", NoValue, "null", true},
      {"web_search_options", NoValue, "null", true},
  };
  for (const Unsupported& u : kFields) {
    if (u.chat_only && !chat) continue;
    const Json* v = Field(j, u.field);
    if (v && !u.neutral(*v))
      return InvalidArgument(std::string(u.field) + ": " + v->dump(-1, ' ', false, Json::error_handler_t::replace)
                                 .substr(0, 64) + " is not supported by this server (only " + u.neutral_text + ")");
  }
  return Status::Ok();
}

// tokenize: a /tokenize body, whose text prompt may be empty.
Status DecodeObject(const Json& j, bool chat, OpenAiRequest* r, bool tokenize = false) {
  r->chat = chat;
  if (const Json* v = Field(j, "model")) {
    FM_ASSIGN_OR_RETURN(r->model, String(*v, "model"));
  }
  if (chat) {
    const Json* m = Field(j, "messages");
    if (!m) return InvalidArgument("messages: missing");
    FM_RETURN_IF_ERROR(DecodeMessages(*m, r));
  } else {
    const Json* p = Field(j, "prompt");
    if (!p) return InvalidArgument("prompt: missing");
    FM_RETURN_IF_ERROR(DecodePrompt(*p, r, tokenize));
    if (const Json* v = Field(j, "add_special_tokens")) {
      FM_ASSIGN_OR_RETURN(r->add_special_tokens, Boolean(*v, "add_special_tokens"));
    }
  }
  if (const Json* v = Field(j, "n")) {
    FM_ASSIGN_OR_RETURN(r->n, Integer(*v, "n"));
    if (r->n < 1 || r->n > kMaxChoices)
      return InvalidArgument("n: " + std::to_string(r->n) + " outside [1, " + std::to_string(kMaxChoices) + "]");
    if (r->n * static_cast<int64_t>(r->prompts.size()) > kMaxChoices)
      return InvalidArgument("n: " + std::to_string(r->n) + " choices of " + std::to_string(r->prompts.size()) +
                             " prompts, more than " + std::to_string(kMaxChoices) + " in all");
  }
  // max_completion_tokens is the newer name; when both are given it wins, as in OpenAI's API.
  for (const char* key : {"max_tokens", "max_completion_tokens"}) {
    if (const Json* v = Field(j, key)) {
      FM_ASSIGN_OR_RETURN(r->max_tokens, Integer(*v, key));
      r->max_tokens_field = key;
      // 0: the prompt alone (with echo, checked below), OpenAI's legacy way to score a text.
      r->prompt_only = r->max_tokens == 0 && !chat;
      if (r->prompt_only) r->max_tokens = 1;
      if (r->max_tokens < 1) return InvalidArgument(std::string(key) + ": " + std::to_string(r->max_tokens) + " (must be >= 1)");
    }
  }
  FM_RETURN_IF_ERROR(DecodeSampling(j, r));
  FM_RETURN_IF_ERROR(RefuseUnsupported(j, chat));
  // vLLM's way to turn on a DeepSeek model's thinking; the template takes no other argument, and
  // ignores the others a client sends (as a Jinja template does).
  if (const Json* v = Field(j, "chat_template_kwargs"); v && chat) {
    if (!v->is_object()) return WrongType("chat_template_kwargs", "an object", *v);
    if (const Json* t = Field(*v, "thinking")) {
      FM_ASSIGN_OR_RETURN(r->thinking, Boolean(*t, "chat_template_kwargs.thinking"));
    }
  }
  if (const Json* v = Field(j, "stop")) FM_RETURN_IF_ERROR(DecodeStop(*v, r));
  if (const Json* v = Field(j, "stream")) {
    FM_ASSIGN_OR_RETURN(r->stream, Boolean(*v, "stream"));
  }
  if (const Json* v = Field(j, "stream_options")) {
    if (!v->is_object()) return WrongType("stream_options", "an object", *v);
    if (const Json* u = Field(*v, "include_usage")) {
      FM_ASSIGN_OR_RETURN(r->include_usage, Boolean(*u, "stream_options.include_usage"));
    }
  }
  if (const Json* v = Field(j, "logprobs")) {
    if (chat) {
      FM_ASSIGN_OR_RETURN(r->logprobs, Boolean(*v, "logprobs"));
    } else {   // completions: logprobs is the number of alternatives
      FM_ASSIGN_OR_RETURN(int64_t n, Integer(*v, "logprobs"));
      if (n < 0 || n > kMaxTopLogprobs) return InvalidArgument("logprobs: " + std::to_string(n) + " outside [0, 20]");
      r->logprobs = true;
      r->top_logprobs = n;
    }
  }
  if (const Json* v = Field(j, "top_logprobs"); v && chat) {
    FM_ASSIGN_OR_RETURN(r->top_logprobs, Integer(*v, "top_logprobs"));
    if (r->top_logprobs < 0 || r->top_logprobs > kMaxTopLogprobs)
      return InvalidArgument("top_logprobs: " + std::to_string(r->top_logprobs) + " outside [0, 20]");
    if (!r->logprobs) return InvalidArgument("top_logprobs: needs logprobs: true");
  }
  if (const Json* v = Field(j, "ignore_eos")) {
    FM_ASSIGN_OR_RETURN(r->ignore_eos, Boolean(*v, "ignore_eos"));
  }
  if (const Json* v = Field(j, "echo"); v && !chat) {
    FM_ASSIGN_OR_RETURN(r->echo, Boolean(*v, "echo"));
  }
  if (r->prompt_only && !r->echo)
    return InvalidArgument(r->max_tokens_field + ": 0 (must be >= 1; 0 only with echo: true, the prompt alone)");
  if (const Json* v = Field(j, "prompt_logprobs")) {   // vLLM's
    FM_ASSIGN_OR_RETURN(int64_t n, Integer(*v, "prompt_logprobs"));
    if (n < 0 || n > kMaxTopLogprobs)
      return InvalidArgument("prompt_logprobs: " + std::to_string(n) + " outside [0, 20]");
    // vLLM streams no prompt logprobs: it refuses N > 0 with stream and ignores 0.
    if (r->stream && n > 0) return InvalidArgument("prompt_logprobs: not available with stream: true (as vLLM)");
    if (!r->stream) r->prompt_logprobs = n;
  }
  return Status::Ok();
}

// What parsing `body` would build (brackets and quotes inside strings skipped), counted before
// it is: the parser keeps any depth, but dumping a value (an error message quoting it) recurses
// once a level, and 100,000 levels fit a 200 kB body; and a parsed object, array or string costs
// ~100 bytes for its 2-3 bytes of JSON ("{}," 4 MiB of them: ~160 MB), a number or literal 16.
struct JsonShape {
  size_t deepest = 0;
  size_t nodes = 0;     // objects, arrays and strings (keys too)
  size_t scalars = 0;   // numbers, true, false, null
};

JsonShape ScanJson(std::string_view body) {
  JsonShape shape;
  size_t depth = 0;
  bool in_string = false, escaped = false, in_scalar = false;
  for (char c : body) {
    if (in_string) {
      if (escaped) escaped = false;
      else if (c == '\\') escaped = true;
      else if (c == '"') in_string = false;
      continue;
    }
    const bool scalar_char = std::isalnum(static_cast<unsigned char>(c)) || c == '-' || c == '+' || c == '.';
    if (scalar_char && !in_scalar) ++shape.scalars;
    in_scalar = scalar_char;
    if (c == '"') {
      in_string = true;
      ++shape.nodes;
    } else if (c == '[' || c == '{') {
      shape.deepest = std::max(shape.deepest, ++depth);
      ++shape.nodes;
    } else if ((c == ']' || c == '}') && depth > 0) {
      --depth;
    }
  }
  return shape;
}

// The body as a JSON object, within the bounds in openai_request.h.
Result<Json> ParseBody(std::string_view body) {
  const JsonShape shape = ScanJson(body);
  if (shape.deepest > kMaxJsonNesting)
    return InvalidArgument("body: JSON nested deeper than " + std::to_string(kMaxJsonNesting) +
                           " levels");
  if (shape.nodes > kMaxJsonNodes)
    return InvalidArgument("body: more than " + std::to_string(kMaxJsonNodes) +
                           " JSON objects, arrays and strings");
  if (shape.scalars > kMaxJsonScalars)
    return InvalidArgument("body: more than " + std::to_string(kMaxJsonScalars) +
                           " JSON numbers, true, false and null");
  Json j;
  try {
    j = Json::parse(body.begin(), body.end());
  } catch (const Json::exception& e) {
    // Where and why ("... at line 1, column 17: syntax error ...", "number overflow parsing
    // '1e400'"), without the library's "[json.exception.parse_error.101] " tag.
    std::string why = e.what();
    if (size_t tag = why.find("] "); why.rfind("[json.exception.", 0) == 0 && tag != std::string::npos)
      why.erase(0, tag + 2);
    // Its "last read: '...'" echoes the bad token, which can be most of a 4 MiB body.
    if (why.size() > 200) {
      why.resize(200);
      why.append("...");
    }
    return InvalidArgument("body: not valid JSON (" + why + ")");
  }
  if (!j.is_object()) return WrongType("body", "a JSON object", j);
  return j;
}

}  // namespace

Result<OpenAiRequest> DecodeOpenAiRequest(std::string_view body, bool chat) {
  FM_ASSIGN_OR_RETURN(Json j, ParseBody(body));
  OpenAiRequest r;
  FM_RETURN_IF_ERROR(DecodeObject(j, chat, &r));
  return r;
}

Result<TokenizeRequest> DecodeTokenizeRequest(std::string_view body) {
  FM_ASSIGN_OR_RETURN(Json j, ParseBody(body));
  TokenizeRequest r;
  FM_RETURN_IF_ERROR(DecodeObject(j, Field(j, "messages") != nullptr, &r.input, /*tokenize=*/true));
  if (r.input.prompts.size() > 1) return InvalidArgument("prompt: /tokenize takes one prompt, not a batch");
  if (const Json* v = Field(j, "return_token_strs")) {
    FM_ASSIGN_OR_RETURN(r.return_token_strs, Boolean(*v, "return_token_strs"));
  }
  return r;
}

Result<std::vector<int32_t>> DecodeDetokenizeRequest(std::string_view body) {
  FM_ASSIGN_OR_RETURN(Json j, ParseBody(body));
  const Json* v = Field(j, "tokens");
  if (!v) return InvalidArgument("tokens: missing");
  if (!v->is_array()) return WrongType("tokens", "an array of token ids", *v);
  std::vector<int32_t> ids;
  for (size_t i = 0; i < v->size(); ++i) {
    const std::string field = "tokens[" + std::to_string(i) + "]";
    FM_ASSIGN_OR_RETURN(int64_t id, Integer((*v)[i], field));
    if (id < 0 || id > std::numeric_limits<int32_t>::max())
      return InvalidArgument(field + ": " + std::to_string(id) + " is not a token id");
    ids.push_back(static_cast<int32_t>(id));
  }
  return ids;
}

std::string OpenAiError::ToJson() const {
  // OpenAI's key order: ordered_json keeps the order written (Json sorts).
  nlohmann::ordered_json e = {{"message", message}, {"type", type}, {"param", nullptr}, {"code", nullptr}};
  if (!param.empty()) e["param"] = param;
  if (!code.empty()) e["code"] = code;
  return nlohmann::ordered_json{{"error", e}}.dump(-1, ' ', false, Json::error_handler_t::replace);
}

OpenAiError ErrorFromStatus(const Status& s) {
  OpenAiError e;
  e.message = s.message();
  switch (s.code()) {
    case Code::kInvalidArgument:
    case Code::kOutOfRange: {
      e.http_status = 400;
      e.type = "invalid_request_error";
      size_t colon = s.message().find(": ");
      if (colon != std::string::npos && s.message().find(' ') >= colon) e.param = s.message().substr(0, colon);
      break;
    }
    case Code::kUnauthenticated:
      e.http_status = 401;
      e.type = "authentication_error";
      e.code = "invalid_api_key";
      break;
    case Code::kResourceExhausted:   // the queue, or a worker's KV budget (ShardRuntime)
      e.http_status = 429;
      e.type = "rate_limit_error";
      e.code = s.message().find("KV cache budget") != std::string::npos ? "kv_cache_full" : "queue_full";
      break;
    case Code::kNotFound:
      e.http_status = 404;
      e.type = "not_found_error";
      break;
    case Code::kUnavailable:
      e.http_status = 503;
      e.type = "service_unavailable";
      break;
    case Code::kDeadlineExceeded:
      e.http_status = 504;
      e.type = "timeout";
      break;
    default:
      e.http_status = 500;
      e.type = "server_error";
  }
  return e;
}

}  // namespace fm
