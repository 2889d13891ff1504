// The HTTP API's request parsing without a server: HttpRequestParser (Beast, with limits) and
// DecodeOpenAiRequest / ErrorFromStatus (coordinator/openai_request.h).
#include <gtest/gtest.h>

#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include "coordinator/http_request.h"
#include "coordinator/openai_request.h"
#include "coordinator/reasoning.h"

namespace fm {
namespace {

using State = HttpRequestParser::State;

TEST(HttpRequestParser, ParsesAcrossArbitrarySplitsAndKeepsPipelinedBytes) {
  const std::string one = "POST /v1/chat/completions?x=1 HTTP/1.1\r\nHost: a\r\nAuthorization: Bearer t\r\n"
                          "Content-Length: 4\r\n\r\n{\"a\"";
  const std::string next = "GET /health HTTP/1.1\r\n";
  for (size_t split = 1; split < one.size(); ++split) {
    HttpRequestParser p(1024, 1024);
    std::string buffer = one.substr(0, split);
    EXPECT_EQ(p.Feed(&buffer), State::kNeedMore) << split;
    buffer += one.substr(split) + next;
    ASSERT_EQ(p.Feed(&buffer), State::kDone) << split;
    EXPECT_EQ(buffer, next) << "bytes of the next request stay";
    EXPECT_EQ(p.request().method, "POST");
    EXPECT_EQ(p.request().path, "/v1/chat/completions");
    EXPECT_EQ(p.request().Header("authorization"), "Bearer t");
    EXPECT_EQ(p.request().body, "{\"a\"");
    EXPECT_TRUE(p.request().keep_alive);
  }
}

// The header limit holds for the header as a whole however it arrives (Beast checks it within
// one call, and takes complete lines over several), and a chunk-size line may be as long as the
// limit after a chunk as before the first.
TEST(HttpRequestParser, LimitsHoldWhateverPiecesTheBytesComeIn) {
  const std::string start = "POST / HTTP/1.1\r\nHost: a\r\n";   // 27 bytes
  auto field = [](size_t bytes) { return "X: " + std::string(bytes - 5, 'a') + "\r\n"; };
  std::string exact = start + "Content-Length: 1\r\n";   // 47 bytes
  while (exact.size() + 100 <= 1022) exact += field(100);
  exact += field(1022 - exact.size()) + "\r\n";           // 1024 with the blank line
  ASSERT_EQ(exact.size(), 1024u);
  for (size_t piece : {size_t{1}, size_t{7}, size_t{100}, size_t{4096}}) {
    for (bool over : {false, true}) {
      const std::string bytes = (over ? start + "Y: b\r\n" + exact.substr(start.size()) : exact) + "z";
      HttpRequestParser p(1024, 1024);
      std::string buffer;
      State state = State::kNeedMore;
      for (size_t off = 0; off < bytes.size() && state == State::kNeedMore; off += piece) {
        buffer += bytes.substr(off, piece);
        state = p.Feed(&buffer);
      }
      EXPECT_EQ(state, over ? State::kError : State::kDone) << "pieces of " << piece;
      if (over) EXPECT_EQ(p.error(), "a header over 1024 bytes") << "pieces of " << piece;
      else EXPECT_EQ(p.request().body, "z");
    }
  }
  auto chunked = [](size_t line) {   // a chunk, then one whose size line (CRLF included) is `line`
    return "POST / HTTP/1.1\r\nHost: a\r\nTransfer-Encoding: chunked\r\n\r\n2\r\nab\r\n1;e=" +
           std::string(line - 6, 'x') + "\r\nc\r\n0\r\n\r\n";
  };
  for (size_t line : {size_t{1024}, size_t{1025}}) {
    HttpRequestParser p(1024, 4096);
    std::string b = chunked(line);
    EXPECT_EQ(p.Feed(&b), line <= 1024 ? State::kDone : State::kError) << line;
    if (line <= 1024) EXPECT_EQ(p.request().body, "abc");
    else EXPECT_EQ(p.error(), "a chunk line or trailer over 1024 bytes");
  }
}

TEST(HttpRequestParser, ChunkedBodyAndConnectionClose) {
  HttpRequestParser p(1024, 1024);
  std::string b = "POST /v1/completions HTTP/1.1\r\nHost: a\r\nConnection: close\r\n"
                  "Transfer-Encoding: chunked\r\n\r\n3\r\nabc\r\n2\r\nde\r\n0\r\n\r\n";
  ASSERT_EQ(p.Feed(&b), State::kDone);
  EXPECT_EQ(p.request().body, "abcde");
  EXPECT_FALSE(p.request().keep_alive);
  // Chunks longer than the header limit, lines and trailers within it, all in one read.
  HttpRequestParser big(64, 8192);
  const std::string data(3000, 'x');
  b = "POST / HTTP/1.1\r\nHost: a\r\nTransfer-Encoding: chunked\r\n\r\nbb8\r\n" + data + "\r\n10;e=1\r\n" +
      data.substr(0, 16) + "\r\n0\r\nX-T: " + std::string(50, 't') + "\r\n\r\nGET";
  ASSERT_EQ(big.Feed(&b), State::kDone) << big.error();
  EXPECT_EQ(big.request().body, data + data.substr(0, 16));
  EXPECT_EQ(b, "GET");
}

TEST(HttpRequestParser, LimitsAndGarbageAreErrorsWithTheirStatus) {
  struct Case { std::string bytes; int status; };
  const Case cases[] = {
      {"GARBAGE\r\n\r\n", 400},
      {"GET / HTTP/1.1\r\nHost: a\r\nContent-Length: x\r\n\r\n", 400},
      {"POST / HTTP/1.1\r\nHost: a\r\nContent-Length: 2000\r\n\r\n", 413},
      {"GET / HTTP/1.1\r\nX: " + std::string(2000, 'a') + "\r\n\r\n", 431},
      // A chunk-size line or a trailer that never ends (Beast bounds neither).
      {"POST / HTTP/1.1\r\nHost: a\r\nTransfer-Encoding: chunked\r\n\r\n1;x=" + std::string(2000, 'a'), 431},
      {"POST / HTTP/1.1\r\nHost: a\r\nTransfer-Encoding: chunked\r\n\r\n1\r\nb\r\n0\r\nX-T: " +
           std::string(2000, 'a'), 431},
      // The same complete, arriving at once with the rest of the body (1500 bytes < two limits).
      {"POST / HTTP/1.1\r\nHost: a\r\nTransfer-Encoding: chunked\r\n\r\n1;x=" + std::string(1500, 'a') +
           "\r\nb\r\n0\r\n\r\n", 431},
      {"POST / HTTP/1.1\r\nHost: a\r\nTransfer-Encoding: chunked\r\n\r\n1\r\nb\r\n0\r\nX-T: " +
           std::string(1500, 'a') + "\r\n\r\n", 431},
      // A coding this server does not decode.
      {"POST / HTTP/1.1\r\nHost: a\r\nTransfer-Encoding: gzip, chunked\r\n\r\n1\r\nb\r\n0\r\n\r\n", 501},
  };
  for (const auto& c : cases) {
    HttpRequestParser p(1024, 1024);
    std::string b = c.bytes;
    EXPECT_EQ(p.Feed(&b), State::kError) << c.bytes.substr(0, 60);
    EXPECT_EQ(p.error_status(), c.status) << c.bytes.substr(0, 60);
    EXPECT_FALSE(p.error().empty());
    // A limit says which and how much (the server adds "malformed HTTP request" to 400s only).
    if (c.status == 413) {
      EXPECT_EQ(p.error(), "a body over 1024 bytes");
    }
    if (c.status == 431 && c.bytes.rfind("GET", 0) == 0) {
      EXPECT_EQ(p.error(), "a header over 1024 bytes");
    }
  }
}

// Error messages quote a refused value, and dumping a value recurses once a level: 100,000
// levels (a 200 kB body) ended the daemon. Brackets inside strings do not count.
TEST(DecodeOpenAiRequest, NestingPastTheLimitIsRefusedBeforeAnyValueIsRead) {
  const auto nested = [](size_t depth) {
    return R"({"prompt": "hi", "tools": )" + std::string(depth, '[') + std::string(depth, ']') + "}";
  };
  auto deep = DecodeOpenAiRequest(nested(100000), false);
  ASSERT_FALSE(deep.ok());
  EXPECT_EQ(deep.status().code(), Code::kInvalidArgument);
  EXPECT_EQ(deep.status().message(), "body: JSON nested deeper than 64 levels");
  auto at_limit = DecodeOpenAiRequest(nested(63), false);   // 64 with the body's object
  ASSERT_FALSE(at_limit.ok());
  EXPECT_EQ(at_limit.status().message().rfind("tools: [[[", 0), 0u) << at_limit.status().ToString();
  auto in_string = DecodeOpenAiRequest(R"({"prompt": ")" + std::string(1000, '[') + R"("})", false);
  EXPECT_TRUE(in_string.ok()) << in_string.status().ToString();
}

// A 4 MiB body of "{}," would cost ~160 MB parsed: objects, arrays and strings past 65536, and
// numbers and literals past 2^20 (more positions than a context has), are refused before any is
// built, wherever they are (an ignored field too). Brackets and quotes inside strings, and the
// digits of one number, count once or not at all.
TEST(DecodeOpenAiRequest, BodiesOfMoreValuesThanARequestNeedsAreRefusedBeforeParsing) {
  const auto list = [](const std::string& item, size_t n) {
    std::string s = R"({"prompt": "hi", "x": [)";
    for (size_t i = 0; i < n; ++i) s += (i ? "," : "") + item;
    return s + "]}";
  };
  // The body's object, "prompt", "hi", "x" and the array: 5 nodes besides the items.
  EXPECT_TRUE(DecodeOpenAiRequest(list("{}", kMaxJsonNodes - 5), false).ok());
  auto objects = DecodeOpenAiRequest(list("{}", kMaxJsonNodes - 4), false);
  ASSERT_FALSE(objects.ok());
  EXPECT_EQ(objects.status().message(), "body: more than 65536 JSON objects, arrays and strings");
  auto strings = DecodeOpenAiRequest(list(R"("a")", kMaxJsonNodes), false);
  EXPECT_EQ(strings.status().message(), "body: more than 65536 JSON objects, arrays and strings");
  EXPECT_TRUE(DecodeOpenAiRequest(list(R"("[{\"")", 1000), false).ok()) << "one string each";
  EXPECT_TRUE(DecodeOpenAiRequest(list("-12.5e+3", kMaxJsonScalars), false).ok());
  auto scalars = DecodeOpenAiRequest(list("7,true,false,null", kMaxJsonScalars / 4 + 1), false);
  ASSERT_FALSE(scalars.ok());
  EXPECT_EQ(scalars.status().message(), "body: more than 1048576 JSON numbers, true, false and null");
  // A prompt of token ids as long as a context is numbers, not nodes.
  std::string ids = R"({"prompt": [)";
  for (int i = 0; i < 200000; ++i) ids += (i ? ", " : "") + std::to_string(100 + i % 3000);
  auto prompt = DecodeOpenAiRequest(ids + "]}", false);
  ASSERT_TRUE(prompt.ok()) << prompt.status().ToString();
  EXPECT_EQ(prompt->prompts.at(0).ids.size(), 200000u);
}

// An assistant turn as this API returns it in thinking mode, sent back by a multi-turn client:
// its reasoning_content is ignored (the template drops earlier reasoning) and a null content
// (the reasoning took every token) is an empty one, as OpenAI allows.
TEST(DecodeOpenAiRequest, AnAssistantTurnWithReasoningAndNullContentIsAccepted) {
  auto r = DecodeOpenAiRequest(R"({"messages": [{"role": "user", "content": "hi"},
      {"role": "assistant", "reasoning_content": "hmm", "content": null},
      {"role": "user", "content": "well?"}]})", /*chat=*/true);
  ASSERT_TRUE(r.ok()) << r.status().ToString();
  ASSERT_EQ(r->messages.size(), 3u);
  EXPECT_EQ(r->messages[1].role, "assistant");
  EXPECT_EQ(r->messages[1].content, "");
}

// vLLM's /tokenize: a completions body, or a chat body when it has messages; add_special_tokens
// (completions' BOS) and return_token_strs decoded, a chat's add_special_tokens refused unless
// false (its template writes the BOS). /detokenize: token ids, errors naming the element.
TEST(DecodeOpenAiRequest, TokenizeAndDetokenizeBodies) {
  auto t = DecodeTokenizeRequest(R"({"prompt": "hi", "add_special_tokens": false, "return_token_strs": true})");
  ASSERT_TRUE(t.ok()) << t.status().ToString();
  EXPECT_FALSE(t->input.chat);
  EXPECT_EQ(t->input.prompts.at(0).text, "hi");
  EXPECT_FALSE(t->input.add_special_tokens);
  EXPECT_TRUE(t->return_token_strs);
  auto c = DecodeTokenizeRequest(R"({"messages": [{"role": "user", "content": "x"}],
      "chat_template_kwargs": {"thinking": true}, "add_special_tokens": false})");
  ASSERT_TRUE(c.ok()) << c.status().ToString();
  EXPECT_TRUE(c->input.chat && c->input.thinking);
  EXPECT_FALSE(c->return_token_strs);
  EXPECT_TRUE(DecodeOpenAiRequest(R"({"prompt": "x"})", false)->add_special_tokens) << "vLLM's default";
  // An empty text is counted (vLLM's /tokenize), not generated from.
  ASSERT_TRUE(DecodeTokenizeRequest(R"({"prompt": ""})").ok());
  EXPECT_FALSE(DecodeOpenAiRequest(R"({"prompt": ""})", false).ok());
  EXPECT_FALSE(DecodeTokenizeRequest(R"({"prompt": []})").ok()) << "no ids is no prompt";
  for (const auto& [body, field] : std::vector<std::pair<std::string, std::string>>{
           {R"({"messages": [{"role": "user", "content": "x"}], "add_special_tokens": true})", "add_special_tokens"},
           {R"({"prompt": "x", "add_special_tokens": "no"})", "add_special_tokens"},
           {R"({"prompt": "x", "return_token_strs": 1})", "return_token_strs"},
           {R"({"return_token_strs": true})", "prompt"}}) {
    auto bad = DecodeTokenizeRequest(body);
    ASSERT_FALSE(bad.ok()) << body;
    EXPECT_EQ(bad.status().message().rfind(field + ":", 0), 0u) << bad.status().ToString();
  }
  auto d = DecodeDetokenizeRequest(R"({"model": "m", "tokens": [0, 7, 2147483647]})");
  ASSERT_TRUE(d.ok()) << d.status().ToString();
  EXPECT_EQ(*d, (std::vector<int32_t>{0, 7, 2147483647}));
  for (const auto& [body, field] : std::vector<std::pair<std::string, std::string>>{
           {R"({})", "tokens"}, {R"({"tokens": "1 2"})", "tokens"}, {R"({"tokens": [1, -1]})", "tokens[1]"},
           {R"({"tokens": [1, 2.5]})", "tokens[1]"}, {R"({"tokens": [2147483648]})", "tokens[0]"}, {R"([1])", "body"}}) {
    auto bad = DecodeDetokenizeRequest(body);
    ASSERT_FALSE(bad.ok()) << body;
    EXPECT_EQ(bad.status().message().rfind(field + ":", 0), 0u) << bad.status().ToString();
  }
}

TEST(DecodeOpenAiRequest, ChatFieldsAndDefaults) {
  auto r = DecodeOpenAiRequest(R"({"model": "m", "messages": [{"role": "system", "content": "Be brief."},
      {"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]}],
      "max_tokens": 5, "max_completion_tokens": 7, "temperature": 0, "top_p": 0.5, "top_k": -1,
      "seed": 42, "stop": "\n", "stream": true, "stream_options": {"include_usage": true},
      "logprobs": true, "top_logprobs": 2, "n": 1, "frequency_penalty": 0, "user": null})",
                               /*chat=*/true);
  ASSERT_TRUE(r.ok()) << r.status().ToString();
  ASSERT_EQ(r->messages.size(), 2u);
  EXPECT_EQ(r->messages[1].role, "user");
  EXPECT_EQ(r->messages[1].content, "ab");
  EXPECT_EQ(r->max_tokens, 7) << "max_completion_tokens wins";
  EXPECT_EQ(r->temperature, 0);
  EXPECT_EQ(r->top_p, 0.5);
  EXPECT_EQ(r->top_k, 0) << "-1 is vLLM's off";
  EXPECT_EQ(r->seed.value(), 42u);
  EXPECT_EQ(r->stop, std::vector<std::string>{"\n"});
  // As many stop strings as lm-evaluation-harness sends (a task's and the end-of-sentence text).
  auto sixteen = DecodeOpenAiRequest(R"({"prompt": "x", "stop": ["a", "b", "c", "d", "e", "f", "g", "h", "i", "j",
      "k", "l", "m", "n", "o", "p"]})", false);
  ASSERT_TRUE(sixteen.ok()) << sixteen.status().ToString();
  EXPECT_EQ(sixteen->stop.size(), 16u);
  EXPECT_TRUE(r->stream && r->include_usage && r->logprobs);
  EXPECT_EQ(r->top_logprobs, 2);

  auto d = DecodeOpenAiRequest(R"({"messages": [{"role": "user", "content": "hi"}]})", true);
  ASSERT_TRUE(d.ok());
  EXPECT_EQ(d->max_tokens, 0);
  EXPECT_EQ(d->temperature, 1.0) << "OpenAI's default";
  EXPECT_FALSE(d->seed.has_value());
  EXPECT_FALSE(d->stream);
}

TEST(DecodeOpenAiRequest, CompletionPrompts) {
  auto ids = DecodeOpenAiRequest(R"({"prompt": [1, 2.0, 3], "logprobs": 0})", false);
  ASSERT_TRUE(ids.ok()) << ids.status().ToString();
  ASSERT_EQ(ids->prompts.size(), 1u);
  EXPECT_EQ(ids->prompts[0].ids, (std::vector<int32_t>{1, 2, 3}));
  EXPECT_TRUE(ids->logprobs);
  auto one = DecodeOpenAiRequest(R"({"prompt": ["hello"]})", false);
  ASSERT_TRUE(one.ok());
  ASSERT_EQ(one->prompts.size(), 1u);
  EXPECT_EQ(one->prompts[0].text, "hello");
  auto nested = DecodeOpenAiRequest(R"({"prompt": [[7, 8]]})", false);
  ASSERT_TRUE(nested.ok());
  EXPECT_EQ(nested->prompts.at(0).ids, (std::vector<int32_t>{7, 8}));
  // OpenAI's batch: several prompts, texts and ids mixed, each named prompt[i] in errors; n
  // choices of each, 128 in all at most.
  auto batch = DecodeOpenAiRequest(R"({"prompt": ["a", [7, 8], "b"], "n": 2})", false);
  ASSERT_TRUE(batch.ok()) << batch.status().ToString();
  ASSERT_EQ(batch->prompts.size(), 3u);
  EXPECT_EQ(batch->prompts[0].text, "a");
  EXPECT_EQ(batch->prompts[1].ids, (std::vector<int32_t>{7, 8}));
  EXPECT_EQ(batch->prompts[2].text, "b");
  for (const auto& [body, message] : std::vector<std::pair<std::string, std::string>>{
           {R"({"prompt": ["a", ""]})", "prompt[1]: empty"},
           {R"({"prompt": [[1], [2, -3]]})", "prompt[1][1]: -3 is not a token id"},
           {R"({"prompt": ["a", 5]})", "prompt[1]: expected a string or an array of token ids"},
           {R"({"prompt": ["a", "b"], "n": 65})", "n: 65 choices of 2 prompts, more than 128 in all"}}) {
    auto bad = DecodeOpenAiRequest(body, false);
    ASSERT_FALSE(bad.ok()) << body;
    EXPECT_EQ(bad.status().message().rfind(message, 0), 0u) << bad.status().ToString();
  }
  EXPECT_FALSE(DecodeTokenizeRequest(R"({"prompt": ["a", "b"]})").ok()) << "/tokenize takes one prompt";
}

// The same fields at the values that change nothing are accepted, as OpenAI clients often send
// them filled in.
TEST(DecodeOpenAiRequest, UnsupportedFieldsAtTheirNeutralValuesAreAccepted) {
  auto r = DecodeOpenAiRequest(R"({"messages": [{"role": "user", "content": "x"}], "presence_penalty": 0,
      "frequency_penalty": 0.0, "repetition_penalty": 1, "logit_bias": {}, "tools": [], "tool_choice": "none",
      "response_format": {"type": "text"}, "min_tokens": 0, "user": "me", "stop_token_ids": null})", true);
  EXPECT_TRUE(r.ok()) << r.status().ToString();
  auto c = DecodeOpenAiRequest(R"({"prompt": "x", "echo": false, "suffix": "", "best_of": 1})", false);
  EXPECT_TRUE(c.ok()) << c.status().ToString();
  EXPECT_FALSE(c->echo);
  auto echo = DecodeOpenAiRequest(R"({"prompt": "x", "echo": true, "logprobs": 1})", false);
  ASSERT_TRUE(echo.ok()) << echo.status().ToString();
  EXPECT_TRUE(echo->echo);
  EXPECT_FALSE(echo->prompt_logprobs);
  EXPECT_FALSE(echo->prompt_only);
  auto alone = DecodeOpenAiRequest(R"({"prompt": [1, 2], "echo": true, "max_tokens": 0})", false);
  ASSERT_TRUE(alone.ok()) << alone.status().ToString();
  EXPECT_TRUE(alone->prompt_only);
  EXPECT_EQ(alone->max_tokens, 1) << "one token runs; the answer leaves it out";
  auto scored = DecodeOpenAiRequest(R"({"messages": [{"role": "user", "content": "x"}], "prompt_logprobs": 0})", true);
  ASSERT_TRUE(scored.ok()) << scored.status().ToString();
  EXPECT_EQ(scored->prompt_logprobs, 0);
  auto streamed = DecodeOpenAiRequest(R"({"prompt": "x", "prompt_logprobs": 0, "stream": true})", false);
  ASSERT_TRUE(streamed.ok()) << streamed.status().ToString();
  EXPECT_FALSE(streamed->prompt_logprobs) << "vLLM ignores 0 with stream";
  auto v = DecodeOpenAiRequest(R"({"messages": [{"role": "user", "content": "x"}], "skip_special_tokens": true,
      "include_stop_str_in_output": false, "bad_words": [], "allowed_token_ids": null, "add_generation_prompt": true,
      "continue_final_message": false, "modalities": ["text"], "reasoning_effort": null,
      "chat_template_kwargs": {"enable_thinking": true}})", true);
  ASSERT_TRUE(v.ok()) << v.status().ToString();
  EXPECT_FALSE(v->thinking) << "the template takes chat_template_kwargs.thinking only";
  // The chat template's fields mean nothing to a completion.
  auto t = DecodeOpenAiRequest(R"({"prompt": "x", "add_generation_prompt": false, "reasoning_effort": "high"})", false);
  EXPECT_TRUE(t.ok()) << t.status().ToString();
  auto think = DecodeOpenAiRequest(R"({"messages": [{"role": "user", "content": "x"}],
      "chat_template_kwargs": {"thinking": true}})", true);
  ASSERT_TRUE(think.ok()) << think.status().ToString();
  EXPECT_TRUE(think->thinking);
}

// The penalties, min-p, logit_bias, stop_token_ids and min_tokens (OpenAI's, and vLLM's /
// llama.cpp's extensions) are decoded as given.
TEST(DecodeOpenAiRequest, PenaltiesAndMinP) {
  auto r = DecodeOpenAiRequest(R"({"messages": [{"role": "user", "content": "x"}], "presence_penalty": -1.5,
      "frequency_penalty": 2, "repetition_penalty": 1.15, "min_p": 0.05})", true);
  ASSERT_TRUE(r.ok()) << r.status().ToString();
  EXPECT_EQ(r->presence_penalty, -1.5);
  EXPECT_EQ(r->frequency_penalty, 2.0);
  EXPECT_EQ(r->repetition_penalty, 1.15);
  EXPECT_EQ(r->min_p, 0.05);
  auto b = DecodeOpenAiRequest(R"({"prompt": "x", "logit_bias": {"7": -100, "12": 2.5}, "stop_token_ids": [3, 4],
      "min_tokens": 2})", false);
  ASSERT_TRUE(b.ok()) << b.status().ToString();
  EXPECT_EQ(b->logit_bias, (std::vector<std::pair<int32_t, float>>{{12, 2.5f}, {7, -100.0f}}));
  EXPECT_EQ(b->stop_token_ids, (std::vector<int32_t>{3, 4}));
  EXPECT_EQ(b->min_tokens, 2);
  EXPECT_EQ(b->n, 1);
  auto spaced = DecodeOpenAiRequest(R"({"prompt": "x", "logit_bias": {" 5": 1, "+6 ": 2, "00000000007": 3}})", false);
  ASSERT_TRUE(spaced.ok()) << spaced.status().ToString();
  EXPECT_EQ(spaced->logit_bias, (std::vector<std::pair<int32_t, float>>{{5, 1.0f}, {6, 2.0f}, {7, 3.0f}}));
  auto n = DecodeOpenAiRequest(R"({"prompt": "x", "n": 128})", false);
  ASSERT_TRUE(n.ok()) << n.status().ToString();
  EXPECT_EQ(n->n, 128);
  auto d = DecodeOpenAiRequest(R"({"prompt": "x"})", false);
  ASSERT_TRUE(d.ok());
  EXPECT_EQ(d->presence_penalty, 0.0);
  EXPECT_EQ(d->frequency_penalty, 0.0);
  EXPECT_EQ(d->repetition_penalty, 1.0);
  EXPECT_EQ(d->min_p, 0.0);
}

TEST(DecodeOpenAiRequest, ErrorsNameTheField) {
  struct Case { const char* body; bool chat; const char* param; };
  const Case cases[] = {
      {"{", true, "body"},
      {"3", true, "body"},
      {R"({})", true, "messages"},
      {R"({"messages": []})", true, "messages"},
      {R"({"messages": [{"content": "x"}]})", true, "messages[0].role"},
      {R"({"messages": [{"role": "user", "content": [{"type": "image_url"}]}]})", true, "messages[0].content[0].type"},
      {R"({"messages": [{"role": "user", "content": "x"}], "temperature": -1})", true, "temperature"},
      {R"({"messages": [{"role": "user", "content": "x"}], "top_p": 0})", true, "top_p"},
      {R"({"messages": [{"role": "user", "content": "x"}], "top_k": -2})", true, "top_k"},
      {R"({"messages": [{"role": "user", "content": "x"}], "max_tokens": 0})", true, "max_tokens"},
      {R"({"messages": [{"role": "user", "content": "x"}], "max_completion_tokens": 2.5})", true, "max_completion_tokens"},
      {R"({"messages": [{"role": "user", "content": "x"}], "n": 0})", true, "n"},
      {R"({"messages": [{"role": "user", "content": "x"}], "n": 129})", true, "n"},
      {R"({"messages": [{"role": "user", "content": "x"}], "stop": ["a", ""]})", true, "stop[1]"},
      {R"({"messages": [{"role": "user", "content": "x"}], "stop": ["a", "b", "c", "d", "e", "f", "g", "h", "i", "j",
          "k", "l", "m", "n", "o", "p", "q"]})", true, "stop"},
      {R"({"messages": [{"role": "user", "content": "x"}], "stream_options": {"include_usage": 1}})", true, "stream_options.include_usage"},
      {R"({"messages": [{"role": "user", "content": "x"}], "top_logprobs": 3})", true, "top_logprobs"},
      {R"({"messages": [{"role": "user", "content": "x"}], "seed": 18446744073709551615})", true, "seed"},
      {R"({"prompt": ""})", false, "prompt"},
      {R"({"prompt": [1, "a"]})", false, "prompt[1]"},
      {R"({"prompt": [1, -1]})", false, "prompt[1]"},
      {R"({"prompt": "x", "logprobs": 21})", false, "logprobs"},
      {R"({"messages": [{"role": "user", "content": "x"}], "presence_penalty": 2.5})", true, "presence_penalty"},
      {R"({"messages": [{"role": "user", "content": "x"}], "frequency_penalty": "a"})", true, "frequency_penalty"},
      {R"({"messages": [{"role": "user", "content": "x"}], "frequency_penalty": -3})", true, "frequency_penalty"},
      {R"({"messages": [{"role": "user", "content": "x"}], "repetition_penalty": 0})", true, "repetition_penalty"},
      {R"({"prompt": "x", "repetition_penalty": 1e300})", false, "repetition_penalty"},
      {R"({"prompt": "x", "min_p": 1.01})", false, "min_p"},
      {R"({"prompt": "x", "min_p": true})", false, "min_p"},
      {R"({"prompt": "x", "logit_bias": {"5": 100.5}})", false, "logit_bias.5"},
      {R"({"prompt": "x", "logit_bias": {"a": 1}})", false, "logit_bias"},
      {R"({"prompt": "x", "logit_bias": {"99999999999": 1}})", false, "logit_bias"},
      {R"({"prompt": "x", "logit_bias": {"5 6": 1}})", false, "logit_bias"},
      {R"({"prompt": "x", "logit_bias": {"7": 1, "007": 2}})", false, "logit_bias.7"},
      {R"({"prompt": "x", "logit_bias": [5]})", false, "logit_bias"},
      {R"({"prompt": "x", "stop_token_ids": [7, -1]})", false, "stop_token_ids[1]"},
      {R"({"prompt": "x", "stop_token_ids": 7})", false, "stop_token_ids"},
      {R"({"prompt": "x", "min_tokens": -1})", false, "min_tokens"},
      // Known fields that would change the output, which this server does not do.
      {R"({"messages": [{"role": "user", "content": "x"}], "response_format": {"type": "json_object"}})", true, "response_format"},
      {R"({"messages": [{"role": "user", "content": "x"}], "tools": [{"type": "function"}]})", true, "tools"},
      {R"({"messages": [{"role": "user", "content": "x"}], "tool_choice": "required"})", true, "tool_choice"},
      {R"({"messages": [{"role": "user", "content": "x"}], "echo": true})", true, "echo"},
      {R"({"prompt": "x", "echo": 1})", false, "echo"},
      {R"({"prompt": "x", "suffix": "end"})", false, "suffix"},
      {R"({"prompt": "x", "best_of": 2})", false, "best_of"},
      {R"({"prompt": "x", "guided_regex": "[a-z]+"})", false, "guided_regex"},
      {R"({"messages": [{"role": "user", "content": "x"}], "guided_json": {}})", true, "guided_json"},
      {R"({"prompt": "x", "use_beam_search": true})", false, "use_beam_search"},
      {R"({"prompt": "x", "include_stop_str_in_output": true, "stop": ["a"]})", false, "include_stop_str_in_output"},
      {R"({"prompt": "x", "allowed_token_ids": [5]})", false, "allowed_token_ids"},
      {R"({"prompt": "x", "bad_words": ["a"]})", false, "bad_words"},
      {R"({"prompt": "x", "skip_special_tokens": false})", false, "skip_special_tokens"},
      {R"({"prompt": "x", "truncate_prompt_tokens": 1})", false, "truncate_prompt_tokens"},
      {R"({"prompt": "x", "prompt_logprobs": 21})", false, "prompt_logprobs"},
      {R"({"prompt": "x", "max_tokens": 0})", false, "max_tokens"},
      {R"({"prompt": "x", "max_tokens": 0, "echo": false})", false, "max_tokens"},
      {R"({"messages": [{"role": "user", "content": "x"}], "max_tokens": 0})", true, "max_tokens"},
      {R"({"prompt": "x", "prompt_logprobs": -1})", false, "prompt_logprobs"},
      {R"({"prompt": "x", "prompt_logprobs": true})", false, "prompt_logprobs"},
      {R"({"messages": [{"role": "user", "content": "x"}], "prompt_logprobs": 1, "stream": true})", true, "prompt_logprobs"},
      {R"({"messages": [{"role": "user", "content": "x"}], "reasoning_effort": "high"})", true, "reasoning_effort"},
      {R"({"messages": [{"role": "user", "content": "x"}], "add_generation_prompt": false})", true, "add_generation_prompt"},
      {R"({"messages": [{"role": "user", "content": "x"}], "continue_final_message": true})", true, "continue_final_message"},
      {R"({"messages": [{"role": "user", "content": "x"}], "chat_template": "{{x}}"})", true, "chat_template"},
      {R"({"messages": [{"role": "user", "content": "x"}], "modalities": ["text", "audio"]})", true, "modalities"},
      {R"({"messages": [{"role": "user", "content": "x"}], "chat_template_kwargs": {"thinking": 1}})", true, "chat_template_kwargs.thinking"},
      {R"({"messages": [{"role": "user", "content": "x"}], "chat_template_kwargs": true})", true, "chat_template_kwargs"},
  };
  for (const auto& c : cases) {
    auto r = DecodeOpenAiRequest(c.body, c.chat);
    ASSERT_FALSE(r.ok()) << c.body;
    OpenAiError e = ErrorFromStatus(r.status());
    EXPECT_EQ(e.http_status, 400) << c.body;
    EXPECT_EQ(e.param, c.param) << c.body << ": " << r.status().message();
    auto j = nlohmann::json::parse(e.ToJson());
    EXPECT_EQ(j["error"]["param"], c.param);
    EXPECT_EQ(j["error"]["type"], "invalid_request_error");
    EXPECT_TRUE(j["error"]["code"].is_null());
  }
}

// Numbers past their range say so, not that the body is not JSON or the value not an integer;
// JSON that does not parse says where and why.
TEST(DecodeOpenAiRequest, OutOfRangeNumbersAndBadJsonSayWhatIsWrong) {
  const std::string chat = R"({"messages": [{"role": "user", "content": "x"}], )";
  auto message = [&](const std::string& body) {
    auto r = DecodeOpenAiRequest(body, true);
    EXPECT_FALSE(r.ok()) << body;
    return r.ok() ? std::string() : r.status().message();
  };
  EXPECT_EQ(message(chat + R"("max_tokens": 99999999999999999999})").rfind("max_tokens: 1e+20 is out of range (", 0), 0u);
  EXPECT_EQ(message(chat + R"("seed": 18446744073709551616})").rfind("seed: 1.8446744073709552e+19 is out of range (", 0), 0u);
  EXPECT_EQ(message(chat + R"("max_tokens": -1e20})").rfind("max_tokens: -1e+20 is out of range (", 0), 0u);
  EXPECT_EQ(message(chat + R"("seed": 18446744073709551615})"), "seed: 18446744073709551615 is too large");
  EXPECT_LT(message(chat + R"("stop": ")" + std::string(100000, 'a')).size(), 300u);
  EXPECT_EQ(message(chat + R"("temperature": 1e400})").rfind("body: not valid JSON (", 0), 0u);
  EXPECT_NE(message(chat + R"("temperature": 1e400})").find("1e400"), std::string::npos);
  EXPECT_EQ(message(R"({"messages": [})"),
            "body: not valid JSON (parse error at line 1, column 15: syntax error while parsing value - "
            "unexpected '}'; expected '[', '{', or a literal)");
}

TEST(ErrorFromStatus, StatusCodesAndTypes) {
  EXPECT_EQ(ErrorFromStatus(Unauthenticated("no token")).http_status, 401);
  EXPECT_EQ(ErrorFromStatus(Unauthenticated("no token")).code, "invalid_api_key");
  EXPECT_EQ(ErrorFromStatus(ResourceExhausted("queue full")).http_status, 429);
  EXPECT_EQ(ErrorFromStatus(ResourceExhausted("the request queue is full (64 waiting)")).code,
            "queue_full");
  // A worker's KV budget refusal (ShardRuntime::StartSequence's words, behind the node).
  const Status kv = ResourceExhausted("node w1: KV cache budget of 1024 bytes is full: ...");
  EXPECT_EQ(ErrorFromStatus(kv).http_status, 429);
  EXPECT_EQ(ErrorFromStatus(kv).code, "kv_cache_full");
  EXPECT_EQ(ErrorFromStatus(Unavailable("node w1 is down")).http_status, 503);
  EXPECT_EQ(ErrorFromStatus(Internal("x")).http_status, 500);
  EXPECT_EQ(ErrorFromStatus(InvalidArgument("input: 70 prompt tokens leave no room")).param, "input");
  EXPECT_EQ(ErrorFromStatus(InvalidArgument("the whole thing: bad")).param, "") << "not a field name";
}

// The thinking split, fed one token's text at a time as a stream is: the tag is found where it
// straddles two tokens, a possible tag start is not released as reasoning until it is ruled out,
// and each released range splits into reasoning and content without the tag.
TEST(Reasoning, StreamedTextSplitsAtTheFirstEndTag) {
  const std::vector<std::string> tokens = {"Let", " me</", "th", "ink", "> The", " </think> end"};
  std::string text, reasoning, content;
  size_t end = std::string::npos, searched = 0, sent = 0;
  std::vector<size_t> releasable;
  for (const auto& t : tokens) {
    text += t;
    FindThinkEnd(text, &end, &searched);
    const size_t upto = end == std::string::npos ? ReleasableReasoning(text) : text.size();
    releasable.push_back(upto);
    const ReasoningParts p = SplitReasoning(text, end, sent, upto);
    reasoning += p.reasoning;
    content += p.content;
    sent = upto;
  }
  EXPECT_EQ(end, 6u);
  // "Let" all; " me</" holds "</", "th" "</th", "ink" "</think"; "> The" completes the tag.
  EXPECT_EQ(releasable, (std::vector<size_t>{3, 6, 6, 6, 18, 31}));
  EXPECT_EQ(reasoning, "Let me");
  EXPECT_EQ(content, " The </think> end") << "only the first tag ends the reasoning";
}

// The reasoning ended only where the text holds the whole tag: a stop string cutting the text
// inside or at the start of the tag leaves it unended.
TEST(Reasoning, TheReasoningEndsOnlyWithTheWholeTag) {
  EXPECT_EQ(ReasoningEnd(2, 10), 2u);
  EXPECT_EQ(ReasoningEnd(2, 12), 2u);
  EXPECT_EQ(ReasoningEnd(2, 9), std::string::npos);
  EXPECT_EQ(ReasoningEnd(2, 2), std::string::npos);
  EXPECT_EQ(ReasoningEnd(std::string::npos, 100), std::string::npos);
}

TEST(Reasoning, HeldBackBytesThatNeverBecomeTheTagAreReasoning) {
  EXPECT_EQ(ReleasableReasoning("a <"), 2u);
  EXPECT_EQ(ReleasableReasoning("a </think"), 2u);
  EXPECT_EQ(ReleasableReasoning("a </thin k"), 10u);
  EXPECT_EQ(ReleasableReasoning("</x"), 3u);
  EXPECT_EQ(ReleasableReasoning(""), 0u);
  // At the end of the generation everything left is released: still reasoning without a tag.
  const ReasoningParts p = SplitReasoning("a </thi", std::string::npos, 2, 7);
  EXPECT_EQ(p.reasoning, "</thi");
  EXPECT_EQ(p.content, "");
  // A range that ends inside the tag releases the reasoning before it and no content; the next
  // range starts past the tag.
  const std::string text = "ab</think>cd";
  EXPECT_EQ(SplitReasoning(text, 2, 0, 5).reasoning, "ab");
  EXPECT_EQ(SplitReasoning(text, 2, 0, 5).content, "");
  EXPECT_EQ(SplitReasoning(text, 2, 5, 12).reasoning, "");
  EXPECT_EQ(SplitReasoning(text, 2, 5, 12).content, "cd");
  EXPECT_EQ(SplitReasoning(text, 2, 0, 12).reasoning, "ab");
  EXPECT_EQ(SplitReasoning(text, 2, 0, 12).content, "cd");
}

}  // namespace
}  // namespace fm
