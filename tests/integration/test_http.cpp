// The coordinator's HTTP API (OpenAI-compatible completions, /v1/models, /health, /metrics) and
// the standard gRPC health service, against a 2-stage cluster: answers equal the gRPC API's,
// SSE framing byte for byte, errors, cancellation, queue limits, auth, metrics, and the official
// `openai` npm client.
#include <gtest/gtest.h>
#include <signal.h>

#include <cstdio>
#include <fstream>
#include <map>
#include <regex>
#include <set>
#include <thread>

#include <nlohmann/json.hpp>

#include "grpc/health/v1/health.grpc.pb.h"
#include "grpc/reflection/v1alpha/reflection.grpc.pb.h"
#include "tests/integration/cluster_fixture.h"
#include "tests/integration/http_client.h"

namespace fm::it {
namespace {

using namespace std::chrono_literals;
using Json = nlohmann::json;
using grpc::health::v1::HealthCheckResponse;

Json ChatBody(const std::string& prompt, int max_tokens) {
  return {{"model", "flashmesh"},
          {"messages", Json::array({{{"role", "user"}, {"content", prompt}}})},
          {"max_tokens", max_tokens},
          {"temperature", 0},
          {"ignore_eos", true}};
}

flashmesh::v1::GenerateRequest GreedyText(const std::string& text, int max_tokens, bool raw = false) {
  flashmesh::v1::GenerateRequest req;
  req.set_text(text);
  req.set_raw(raw);
  req.set_max_tokens(max_tokens);
  req.set_ignore_eos(true);
  req.mutable_sampling()->set_greedy(true);
  return req;
}

Json ParseBody(const HttpResult& r) {
  Json j = Json::parse(r.body, nullptr, false);
  EXPECT_FALSE(j.is_discarded()) << "not JSON: " << r.raw;
  return j;
}

// Prometheus text format 0.0.4: every line a comment (# HELP / # TYPE) or `name{labels} value`;
// samples keyed by "name{labels}" as printed.
std::map<std::string, double> ParseMetrics(const std::string& text) {
  static const std::regex sample(R"(^([a-zA-Z_:][a-zA-Z0-9_:]*(\{[a-zA-Z_][a-zA-Z0-9_]*="(?:[^"\\]|\\.)*"(,[a-zA-Z_][a-zA-Z0-9_]*="(?:[^"\\]|\\.)*")*\})?) (\S+)$)");
  static const std::regex comment(R"(^# (HELP [a-zA-Z_:][a-zA-Z0-9_:]* .*|TYPE [a-zA-Z_:][a-zA-Z0-9_:]* (counter|gauge|histogram|summary|untyped))$)");
  std::map<std::string, double> out;
  size_t pos = 0;
  while (pos < text.size()) {
    size_t eol = text.find('\n', pos);
    EXPECT_NE(eol, std::string::npos) << "the exposition must end with a newline";
    if (eol == std::string::npos) break;
    std::string line = text.substr(pos, eol - pos);
    pos = eol + 1;
    if (line.empty()) continue;
    std::smatch m;
    if (line[0] == '#') {
      EXPECT_TRUE(std::regex_match(line, comment)) << "bad comment line: " << line;
      continue;
    }
    EXPECT_TRUE(std::regex_match(line, m, sample)) << "bad sample line: " << line;
    if (!m.empty()) out[m[1]] = std::stod(m[4]);
  }
  return out;
}

std::map<std::string, double> Scrape(int port) {
  HttpResult r = HttpCall(port, "GET", "/metrics");
  EXPECT_EQ(r.status, 200) << r.raw;
  EXPECT_EQ(r.headers["content-type"], "text/plain; version=0.0.4; charset=utf-8");
  return ParseMetrics(r.body);
}

HealthCheckResponse::ServingStatus GrpcHealth(const std::string& api, const std::string& service) {
  auto stub = grpc::health::v1::Health::NewStub(grpc::CreateChannel(api, grpc::InsecureChannelCredentials()));
  grpc::ClientContext ctx;
  ctx.set_deadline(std::chrono::system_clock::now() + 2s);
  grpc::health::v1::HealthCheckRequest req;
  req.set_service(service);
  HealthCheckResponse resp;
  grpc::Status s = stub->Check(&ctx, req, &resp);
  return s.ok() ? resp.status() : HealthCheckResponse::UNKNOWN;
}

class HttpApiTest : public ::testing::Test {
 protected:
  static void SetUpTestSuite() {
    ClusterSpec spec;
    spec.stages = 2;
    spec.max_context = 4096;
    spec.max_tokens = 4000;
    spec.http = true;
    cluster_ = new Cluster(spec);
    cluster_->StartAll();
    ASSERT_TRUE(WaitHealthy(cluster_->api(), 90s)) << cluster_->Logs();
  }
  static void TearDownTestSuite() { delete cluster_; }
  int port() const { return cluster_->http_port(); }
  static Cluster* cluster_;
};
Cluster* HttpApiTest::cluster_ = nullptr;

TEST_F(HttpApiTest, ChatCompletionEqualsGrpcGenerate) {
  auto stub = Connect(cluster_->api());
  auto req = GreedyText("hello world", 8);
  req.mutable_sampling()->set_top_logprobs(3);
  Generation want = Generate(stub.get(), req);
  ASSERT_TRUE(want.status.ok()) << want.status.error_message();
  Json body = ChatBody("hello world", 8);
  body["logprobs"] = true;
  body["top_logprobs"] = 3;
  body["some_future_field"] = {{"ignored", true}};   // unknown fields are ignored, as OpenAI does
  HttpResult r = HttpCall(port(), "POST", "/v1/chat/completions", body.dump());
  ASSERT_EQ(r.status, 200) << r.raw;
  EXPECT_EQ(r.headers["content-type"], "application/json");
  Json j = ParseBody(r);
  EXPECT_EQ(j["object"], "chat.completion");
  EXPECT_EQ(j["id"].get<std::string>().rfind("chatcmpl-", 0), 0u);
  // A random per-process part and a counter: 32 hex digits.
  EXPECT_EQ(j["id"].get<std::string>().size(), 9u + 32u) << j["id"];
  ASSERT_EQ(j["choices"].size(), 1u);
  const Json& c = j["choices"][0];
  EXPECT_EQ(c["message"]["role"], "assistant");
  EXPECT_EQ(c["message"]["content"], want.text);
  EXPECT_EQ(c["finish_reason"], "length");
  EXPECT_EQ(j["usage"]["prompt_tokens"], want.finish.usage().prompt_tokens());
  EXPECT_EQ(j["usage"]["completion_tokens"], 8);
  EXPECT_EQ(j["usage"]["total_tokens"], want.finish.usage().prompt_tokens() + 8);
  ASSERT_EQ(c["logprobs"]["content"].size(), 8u);
  for (size_t i = 0; i < 8; ++i) {
    const Json& e = c["logprobs"]["content"][i];
    EXPECT_EQ(static_cast<float>(e["logprob"].get<double>()), want.logprobs[i]) << i;
    // The 3 most likely tokens, as gRPC gave them; greedy's first is the chosen one.
    ASSERT_EQ(e["top_logprobs"].size(), 3u) << e;
    ASSERT_EQ(want.top[i].size(), 3u);
    for (size_t j = 0; j < 3; ++j)
      EXPECT_EQ(static_cast<float>(e["top_logprobs"][j]["logprob"].get<double>()), want.top[i][j].second) << e;
    EXPECT_EQ(e["top_logprobs"][0]["token"], e["token"]);
    EXPECT_EQ(e["top_logprobs"][0]["bytes"], e["bytes"]);
    EXPECT_GT(e["top_logprobs"][1]["logprob"].get<double>(), e["top_logprobs"][2]["logprob"].get<double>() - 1e-9);
  }
}

TEST_F(HttpApiTest, StreamedChatIsByteExactSse) {
  auto stub = Connect(cluster_->api());
  Generation want = Generate(stub.get(), GreedyText("The cat", 6));
  ASSERT_TRUE(want.status.ok()) << want.status.error_message();
  Json body = ChatBody("The cat", 6);
  body["stream"] = true;
  body["stream_options"] = {{"include_usage", true}};
  HttpResult r = HttpCall(port(), "POST", "/v1/chat/completions", body.dump());
  ASSERT_EQ(r.status, 200) << r.raw;
  EXPECT_EQ(r.headers["content-type"], "text/event-stream");
  EXPECT_EQ(r.headers.count("content-length"), 0u) << "an SSE body ends with the connection";
  // id, created and model come from the first event; everything else is rebuilt from gRPC, with
  // OpenAI's key order (ordered_json keeps the order written).
  using OJson = nlohmann::ordered_json;
  ASSERT_EQ(r.body.rfind("data: {", 0), 0u) << r.body;
  OJson first = OJson::parse(r.body.substr(6, r.body.find("\n\n") - 6));
  auto chunk = [&](OJson choices, OJson usage) {
    OJson c = {{"id", first["id"]}, {"object", "chat.completion.chunk"}, {"created", first["created"]},
               {"model", first["model"]}, {"choices", choices}, {"usage", usage}};
    return "data: " + c.dump() + "\n\n";
  };
  auto choice = [](OJson delta, OJson finish) {
    return OJson::array({{{"index", 0}, {"delta", delta}, {"logprobs", nullptr}, {"finish_reason", finish}}});
  };
  std::string expected = chunk(choice({{"role", "assistant"}, {"content", ""}}, nullptr), nullptr);
  for (const auto& piece : want.pieces) expected += chunk(choice({{"content", piece}}, nullptr), nullptr);
  expected += chunk(choice(OJson::object(), "length"), nullptr);
  const int prompt = want.finish.usage().prompt_tokens();
  expected += chunk(OJson::array(), {{"prompt_tokens", prompt}, {"completion_tokens", 6}, {"total_tokens", prompt + 6}});
  expected += "data: [DONE]\n\n";
  EXPECT_EQ(r.body, expected);
}

TEST_F(HttpApiTest, CompletionsWithTextAndTokenPrompts) {
  auto stub = Connect(cluster_->api());
  Generation ids_want = Generate(stub.get(), TokensRequest({5, 6, 7}, 5));
  ASSERT_TRUE(ids_want.status.ok()) << ids_want.status.error_message();
  Json body = {{"model", "m"}, {"prompt", {5, 6, 7}}, {"max_tokens", 5}, {"temperature", 0}, {"ignore_eos", true}};
  HttpResult r = HttpCall(port(), "POST", "/v1/completions", body.dump());
  ASSERT_EQ(r.status, 200) << r.raw;
  Json j = ParseBody(r);
  EXPECT_EQ(j["object"], "text_completion");
  EXPECT_EQ(j["choices"][0]["text"], ids_want.text);
  EXPECT_EQ(j["usage"]["prompt_tokens"], 3);
  EXPECT_EQ(j["usage"]["completion_tokens"], 5);

  Generation text_want = Generate(stub.get(), GreedyText("Once upon", 5, /*raw=*/true));
  ASSERT_TRUE(text_want.status.ok()) << text_want.status.error_message();
  body["prompt"] = "Once upon";
  r = HttpCall(port(), "POST", "/v1/completions", body.dump());
  ASSERT_EQ(r.status, 200) << r.raw;
  EXPECT_EQ(ParseBody(r)["choices"][0]["text"], text_want.text);
}

// vLLM's /tokenize gives the ids a completion or a chat of the same body is prefilled with
// (BOS first for a completion unless add_special_tokens is false), and /detokenize turns them
// back into the text.
TEST_F(HttpApiTest, TokenizeAndDetokenizeAgreeWithWhatIsGenerated) {
  Json tok = {{"prompt", "Once upon a time"}, {"return_token_strs", true}};
  HttpResult r = HttpCall(port(), "POST", "/tokenize", tok.dump());
  ASSERT_EQ(r.status, 200) << r.raw;
  const Json with_bos = ParseBody(r);
  const std::vector<int32_t> ids = with_bos["tokens"];
  ASSERT_GE(ids.size(), 3u) << r.body;
  EXPECT_EQ(with_bos["count"], ids.size());
  EXPECT_EQ(with_bos["max_model_len"], 4096);
  EXPECT_EQ(with_bos["token_strs"].size(), ids.size());
  // The text prompt and its ids generate the same, from prompts of the same length.
  Json body = {{"prompt", "Once upon a time"}, {"max_tokens", 4}, {"temperature", 0}, {"ignore_eos", true}};
  HttpResult text = HttpCall(port(), "POST", "/v1/completions", body.dump());
  body["prompt"] = ids;
  HttpResult by_ids = HttpCall(port(), "POST", "/v1/completions", body.dump());
  ASSERT_EQ(text.status, 200) << text.raw;
  ASSERT_EQ(by_ids.status, 200) << by_ids.raw;
  EXPECT_EQ(ParseBody(text)["choices"][0]["text"], ParseBody(by_ids)["choices"][0]["text"]);
  EXPECT_EQ(ParseBody(text)["usage"]["prompt_tokens"], ids.size());
  // Without the BOS: the same ids less the first, for tokenize and for the completion.
  tok["add_special_tokens"] = false;
  r = HttpCall(port(), "POST", "/tokenize", tok.dump());
  ASSERT_EQ(r.status, 200) << r.raw;
  const std::vector<int32_t> bare = ParseBody(r)["tokens"];
  EXPECT_EQ(bare, std::vector<int32_t>(ids.begin() + 1, ids.end()));
  // token_strs as tokenizer.json spells the tokens (vLLM's convert_ids_to_tokens): a space is Ġ.
  std::string spelled;
  const Json strs = ParseBody(r)["token_strs"];
  for (const auto& s : strs) spelled += s.get<std::string>();
  for (size_t at; (at = spelled.find("Ġ")) != std::string::npos;) spelled.replace(at, 2, " ");
  EXPECT_EQ(spelled, "Once upon a time") << r.body;
  body["prompt"] = "Once upon a time";
  body["add_special_tokens"] = false;
  text = HttpCall(port(), "POST", "/v1/completions", body.dump());
  ASSERT_EQ(text.status, 200) << text.raw;
  EXPECT_EQ(ParseBody(text)["usage"]["prompt_tokens"], bare.size());
  r = HttpCall(port(), "POST", "/detokenize", Json{{"tokens", bare}}.dump());
  ASSERT_EQ(r.status, 200) << r.raw;
  EXPECT_EQ(ParseBody(r)["prompt"], "Once upon a time");
  // A chat body: the template's ids, as many as the chat completion's prompt.
  Json chat = ChatBody("Why is the sky blue?", 2);
  r = HttpCall(port(), "POST", "/tokenize", Json{{"messages", chat["messages"]}}.dump());
  ASSERT_EQ(r.status, 200) << r.raw;
  HttpResult c = HttpCall(port(), "POST", "/v1/chat/completions", chat.dump());
  ASSERT_EQ(c.status, 200) << c.raw;
  EXPECT_EQ(ParseBody(r)["count"], ParseBody(c)["usage"]["prompt_tokens"]);
  // An empty text is counted: the BOS, or nothing.
  r = HttpCall(port(), "POST", "/tokenize", R"({"prompt": ""})");
  ASSERT_EQ(r.status, 200) << r.raw;
  EXPECT_EQ(ParseBody(r)["tokens"], Json::array({ids[0]}));
  r = HttpCall(port(), "POST", "/tokenize", R"({"prompt": "", "add_special_tokens": false})");
  ASSERT_EQ(r.status, 200) << r.raw;
  EXPECT_EQ(ParseBody(r)["count"], 0);
  // Errors name the field, as a generation of the same body would; both paths take POST only.
  r = HttpCall(port(), "POST", "/detokenize", R"({"tokens": [1, 99999999]})");
  EXPECT_EQ(r.status, 400) << r.raw;
  EXPECT_EQ(ParseBody(r)["error"]["param"], "tokens[1]") << r.body;
  for (const char* path : {"/tokenize", "/v1/completions"}) {
    r = HttpCall(port(), "POST", path, R"({"prompt": [1, 99999999]})");
    EXPECT_EQ(r.status, 400) << r.raw;
    EXPECT_EQ(ParseBody(r)["error"]["param"], "prompt[1]") << path << ": " << r.body;
  }
  r = HttpCall(port(), "GET", "/tokenize", "");
  EXPECT_EQ(r.status, 405) << r.raw;
}

// chat_template_kwargs.thinking (vLLM's switch for DeepSeek models) renders the last user turn's
// assistant prefix as "<think>": the chat answers as a raw completion of that text does, and
// without it as one of the chat-mode text ("</think>"). In thinking mode that answer is the
// reasoning (reasoning_content) until a "</think>", which this model does not write here.
TEST_F(HttpApiTest, ChatTemplateKwargsThinkingOpensTheReasoning) {
  Json chat = ChatBody("Why is the sky blue?", 6);
  chat["chat_template_kwargs"] = {{"thinking", true}, {"enable_thinking", true}};
  Json completion = {{"prompt", "<｜User｜>Why is the sky blue?<｜Assistant｜><think>"},
                     {"max_tokens", 6}, {"temperature", 0}, {"ignore_eos", true}};
  for (bool thinking : {true, false}) {
    chat["chat_template_kwargs"]["thinking"] = thinking;
    if (!thinking) completion["prompt"] = "<｜User｜>Why is the sky blue?<｜Assistant｜></think>";
    HttpResult c = HttpCall(port(), "POST", "/v1/chat/completions", chat.dump());
    HttpResult raw = HttpCall(port(), "POST", "/v1/completions", completion.dump());
    ASSERT_EQ(c.status, 200) << c.raw;
    ASSERT_EQ(raw.status, 200) << raw.raw;
    const Json message = ParseBody(c)["choices"][0]["message"];
    const std::string text = ParseBody(raw)["choices"][0]["text"];
    if (thinking) {
      ASSERT_EQ(text.find("</think>"), std::string::npos) << text;
      EXPECT_EQ(message["reasoning_content"], text);
      EXPECT_TRUE(message["content"].is_null()) << message;
    } else {
      EXPECT_EQ(message["content"], text);
      EXPECT_FALSE(message.contains("reasoning_content")) << message;
    }
    EXPECT_EQ(ParseBody(c)["usage"]["prompt_tokens"], ParseBody(raw)["usage"]["prompt_tokens"]);
  }
}

// Every SSE event's JSON object, in order ([DONE] excluded).
std::vector<Json> Events(const std::string& body) {
  std::vector<Json> out;
  for (size_t p = 0; (p = body.find("data: {", p)) != std::string::npos; ++p)
    out.push_back(Json::parse(body.substr(p + 6, body.find("\n\n", p) - p - 6)));
  return out;
}

// Thinking mode splits the answer at the first "</think>": reasoning_content before it, content
// after it, the tag in neither, streamed (the reasoning's deltas first) or not. A logit bias on
// the tag's token has this model write it mid-answer (the first of a few prompts and biases
// that puts text on both sides); the raw completion of the same prompt is the whole text.
TEST_F(HttpApiTest, ThinkingSplitsReasoningFromContentAtTheEndTag) {
  auto stub = Connect(cluster_->api());
  flashmesh::v1::TokenizeRequest tq;
  tq.set_text("</think>");
  flashmesh::v1::TokenizeResponse tr;
  grpc::ClientContext ctx;
  ASSERT_TRUE(stub->Tokenize(&ctx, tq, &tr).ok());
  ASSERT_EQ(tr.ids_size(), 1);
  Json completion = {{"max_tokens", 16}, {"temperature", 0}, {"ignore_eos", true}};
  std::string raw, prompt;
  size_t at = std::string::npos;
  auto both_sides = [&] { return at != std::string::npos && at > 0 && at + 8 < raw.size(); };
  for (const char* p : {"The cat", "hello world", "Tell me a story", "Why is the sky blue?"}) {
    for (int tenths = 10; tenths <= 30 && !both_sides(); tenths += 2) {
      completion["prompt"] = std::string("<｜User｜>") + p + "<｜Assistant｜><think>";
      completion["logit_bias"] = {{std::to_string(tr.ids(0)), tenths / 10.0}};
      HttpResult r = HttpCall(port(), "POST", "/v1/completions", completion.dump());
      ASSERT_EQ(r.status, 200) << r.raw;
      raw = ParseBody(r)["choices"][0]["text"];
      at = raw.find("</think>");
      prompt = p;
    }
    if (both_sides()) break;
  }
  ASSERT_TRUE(both_sides()) << "no prompt and bias put text on both sides of the tag: " << raw;
  Json chat = ChatBody(prompt, 16);
  chat["chat_template_kwargs"] = {{"thinking", true}};
  chat["logit_bias"] = completion["logit_bias"];
  HttpResult r = HttpCall(port(), "POST", "/v1/chat/completions", chat.dump());
  ASSERT_EQ(r.status, 200) << r.raw;
  const Json message = ParseBody(r)["choices"][0]["message"];
  EXPECT_EQ(message["reasoning_content"], raw.substr(0, at)) << raw;
  EXPECT_EQ(message["content"], raw.substr(at + 8)) << raw;

  chat["stream"] = true;
  r = HttpCall(port(), "POST", "/v1/chat/completions", chat.dump());
  ASSERT_EQ(r.status, 200) << r.raw;
  std::string reasoning, content;
  for (const Json& e : Events(r.body)) {
    const Json& delta = e["choices"][0]["delta"];
    if (delta.contains("reasoning_content")) {
      EXPECT_TRUE(content.empty()) << "reasoning after the content: " << r.body;
      reasoning += delta["reasoning_content"].get<std::string>();
    }
    if (delta.contains("content")) content += delta["content"].get<std::string>();
  }
  EXPECT_EQ(reasoning, raw.substr(0, at)) << r.body;
  EXPECT_EQ(content, raw.substr(at + 8)) << r.body;

  // A stop string that ends the text at or inside the tag: the reasoning never ended, so the
  // whole text (the tag's first bytes included) is reasoning and content is null.
  for (const char* stop : {"</think>", "ink>", "</"}) {
    completion["stop"] = stop;
    HttpResult cut = HttpCall(port(), "POST", "/v1/completions", completion.dump());
    ASSERT_EQ(cut.status, 200) << cut.raw;
    const std::string text = ParseBody(cut)["choices"][0]["text"];
    ASSERT_LE(text.size(), at + 8) << stop << ": " << text;
    chat["stop"] = stop;
    chat["stream"] = false;
    r = HttpCall(port(), "POST", "/v1/chat/completions", chat.dump());
    ASSERT_EQ(r.status, 200) << r.raw;
    EXPECT_EQ(ParseBody(r)["choices"][0]["message"]["reasoning_content"], text) << stop;
    EXPECT_TRUE(ParseBody(r)["choices"][0]["message"]["content"].is_null()) << stop << ": " << r.body;
    chat["stream"] = true;
    r = HttpCall(port(), "POST", "/v1/chat/completions", chat.dump());
    ASSERT_EQ(r.status, 200) << r.raw;
    reasoning.clear(), content.clear();
    for (const Json& e : Events(r.body)) {
      const Json& delta = e["choices"][0]["delta"];
      if (delta.contains("reasoning_content")) reasoning += delta["reasoning_content"].get<std::string>();
      if (delta.contains("content")) content += delta["content"].get<std::string>();
    }
    EXPECT_EQ(reasoning, text) << stop << ": " << r.body;
    EXPECT_EQ(content, "") << stop << ": " << r.body;
  }
  chat.erase("stop");
  chat["stream"] = false;
  // A conversation ending with a system turn opens no reply, so no reasoning either: the answer
  // is content, whatever it holds.
  chat["messages"].push_back({{"role", "system"}, {"content", "be brief"}});
  r = HttpCall(port(), "POST", "/v1/chat/completions", chat.dump());
  ASSERT_EQ(r.status, 200) << r.raw;
  EXPECT_FALSE(ParseBody(r)["choices"][0]["message"].contains("reasoning_content")) << r.body;
  EXPECT_TRUE(ParseBody(r)["choices"][0]["message"]["content"].is_string()) << r.body;
}

// OpenAI's batch of prompts: each prompt gets n choices (index prompt * n + j), each the
// generation a request of that prompt alone gets (seed + j), streamed or not; usage counts
// each prompt once.
TEST_F(HttpApiTest, ABatchOfPromptsAnswersEachAsItsOwnRequestWould) {
  const std::vector<std::string> prompts = {"Once upon", "The cat sat"};
  Json one = {{"max_tokens", 5}, {"temperature", 0.9}, {"seed", 7}, {"n", 2}, {"ignore_eos", true}};
  std::vector<std::string> want;
  int prompt_tokens = 0;
  for (const auto& p : prompts) {
    one["prompt"] = p;
    HttpResult r = HttpCall(port(), "POST", "/v1/completions", one.dump());
    ASSERT_EQ(r.status, 200) << r.raw;
    const Json body = ParseBody(r);
    for (const auto& c : body["choices"]) want.push_back(c["text"]);
    prompt_tokens += body["usage"]["prompt_tokens"].get<int>();
  }
  Json batch = one;
  batch["prompt"] = prompts;
  HttpResult r = HttpCall(port(), "POST", "/v1/completions", batch.dump());
  ASSERT_EQ(r.status, 200) << r.raw;
  const Json body = ParseBody(r);
  ASSERT_EQ(body["choices"].size(), 4u) << r.body;
  for (size_t k = 0; k < 4; ++k) {
    EXPECT_EQ(body["choices"][k]["index"], k);
    EXPECT_EQ(body["choices"][k]["text"], want[k]) << "choice " << k;
  }
  EXPECT_EQ(body["usage"]["prompt_tokens"], prompt_tokens);
  EXPECT_EQ(body["usage"]["completion_tokens"], 20);
  batch["stream"] = true;
  r = HttpCall(port(), "POST", "/v1/completions", batch.dump());
  ASSERT_EQ(r.status, 200) << r.raw;
  std::vector<std::string> streamed(4);
  for (const Json& e : Events(r.body))
    for (const Json& c : e["choices"]) streamed.at(c["index"].get<size_t>()) += c["text"].get<std::string>();
  EXPECT_EQ(streamed, want) << r.body;
  // Errors name the prompt of the batch.
  batch["prompt"] = Json::array({"ok", Json::array({1, 99999999})});
  batch["stream"] = false;
  r = HttpCall(port(), "POST", "/v1/completions", batch.dump());
  EXPECT_EQ(r.status, 400) << r.raw;
  EXPECT_EQ(ParseBody(r)["error"]["param"], "prompt[1][1]") << r.body;
  // More generations than a client may run at once: with n = 1 the batch is what to shrink.
  batch["prompt"] = std::vector<std::string>(65, "a");
  batch["n"] = 1;
  r = HttpCall(port(), "POST", "/v1/completions", batch.dump());
  EXPECT_EQ(r.status, 400) << r.raw;
  EXPECT_EQ(ParseBody(r)["error"]["message"],
            "prompt: a batch of 65 prompts, more than the 64 generations a client may run at once "
            "(limits.max_streams_per_client)") << r.body;
}

TEST_F(HttpApiTest, StreamedLogprobsAndStreamedCompletions) {
  auto stub = Connect(cluster_->api());
  Generation want = Generate(stub.get(), GreedyText("hello world", 5));
  ASSERT_TRUE(want.status.ok()) << want.status.error_message();
  Json body = ChatBody("hello world", 5);
  body["stream"] = true;
  body["logprobs"] = true;
  body["top_logprobs"] = 2;
  HttpResult r = HttpCall(port(), "POST", "/v1/chat/completions", body.dump());
  ASSERT_EQ(r.status, 200) << r.raw;
  std::vector<Json> events = Events(r.body);
  ASSERT_EQ(events.size(), 1u + 5 + 1) << r.body;
  for (size_t i = 0; i < 5; ++i) {
    const Json& lp = events[1 + i]["choices"][0]["logprobs"]["content"];
    ASSERT_EQ(lp.size(), 1u) << events[1 + i];
    EXPECT_EQ(static_cast<float>(lp[0]["logprob"].get<double>()), want.logprobs[i]);
    ASSERT_EQ(lp[0]["top_logprobs"].size(), 2u);
    EXPECT_EQ(lp[0]["top_logprobs"][0]["token"], lp[0]["token"]);
    EXPECT_LE(lp[0]["top_logprobs"][1]["logprob"].get<double>(), lp[0]["logprob"].get<double>());
  }

  Generation ids_want = Generate(stub.get(), TokensRequest({9, 8, 7}, 6));
  ASSERT_TRUE(ids_want.status.ok()) << ids_want.status.error_message();
  Json c = {{"prompt", {9, 8, 7}}, {"max_tokens", 6}, {"temperature", 0}, {"ignore_eos", true}, {"stream", true}};
  r = HttpCall(port(), "POST", "/v1/completions", c.dump());
  ASSERT_EQ(r.status, 200) << r.raw;
  events = Events(r.body);
  ASSERT_EQ(events.size(), 6u + 1) << "one per token, then the finish";
  std::string text;
  for (const auto& e : events) {
    EXPECT_EQ(e["object"], "text_completion");
    text += e["choices"][0]["text"].get<std::string>();
  }
  EXPECT_EQ(text, ids_want.text);
  EXPECT_EQ(events.back()["choices"][0]["finish_reason"], "length");
  EXPECT_EQ(r.body.substr(r.body.size() - 14), "data: [DONE]\n\n");

  // text_offset counts the whole text, also while a stop string holds some of it back: the
  // streamed offsets are the non-streamed ones.
  c["logprobs"] = 0;
  c["stop"] = "\x01never-in-the-text";
  c["stream"] = false;
  r = HttpCall(port(), "POST", "/v1/completions", c.dump());
  ASSERT_EQ(r.status, 200) << r.raw;
  const Json want_offsets = ParseBody(r)["choices"][0]["logprobs"]["text_offset"];
  ASSERT_EQ(want_offsets.size(), 6u) << r.body;
  // logprobs N: each token's N most likely, plus the chosen one (OpenAI's "up to N + 1");
  // greedy's chosen token is the most likely, so 3 entries holding the chosen token's logprob.
  c["logprobs"] = 3;
  r = HttpCall(port(), "POST", "/v1/completions", c.dump());
  ASSERT_EQ(r.status, 200) << r.raw;
  const Json lps = ParseBody(r)["choices"][0]["logprobs"];
  ASSERT_EQ(lps["top_logprobs"].size(), 6u) << r.body;
  for (size_t i = 0; i < 6; ++i) {
    const Json& top = lps["top_logprobs"][i];
    EXPECT_EQ(top.size(), 3u) << top;
    ASSERT_TRUE(top.contains(lps["tokens"][i].get<std::string>())) << top;
    EXPECT_EQ(top[lps["tokens"][i].get<std::string>()], lps["token_logprobs"][i]) << top;
    for (const auto& [token, lp] : top.items()) EXPECT_LE(lp.get<double>(), lps["token_logprobs"][i].get<double>());
  }
  // 20 alternatives of a text prompt: byte tokens that are not whole characters among them
  // (this model's vocabulary has many) keep keys of their own ("bytes:\xNN"), so none is lost.
  Json many = {{"prompt", "hello"}, {"max_tokens", 4}, {"temperature", 0}, {"logprobs", 20}};
  r = HttpCall(port(), "POST", "/v1/completions", many.dump());
  ASSERT_EQ(r.status, 200) << r.raw;
  const Json many_lps = ParseBody(r)["choices"][0]["logprobs"];
  int byte_keys = 0;
  for (size_t i = 0; i < many_lps["top_logprobs"].size(); ++i) {
    const Json& top = many_lps["top_logprobs"][i];
    EXPECT_EQ(top.size(), 20u) << top;
    EXPECT_EQ(top[many_lps["tokens"][i].get<std::string>()], many_lps["token_logprobs"][i]) << top;
    for (const auto& [token, lp] : top.items()) byte_keys += token.rfind("bytes:\\x", 0) == 0;
  }
  EXPECT_EQ(many_lps["top_logprobs"].size(), 4u);
  // The object lists them most likely first, as OpenAI does (clients that show "the top
  // alternatives" take the first keys).
  const auto ordered = nlohmann::ordered_json::parse(r.body)["choices"][0]["logprobs"]["top_logprobs"];
  for (const auto& top : ordered) {
    double last = 0;
    for (const auto& [token, lp] : top.items()) {
      EXPECT_LE(lp.get<double>(), last) << token << " in " << top;
      last = lp.get<double>();
    }
  }
  EXPECT_GT(byte_keys, 0) << many_lps << ": no byte token among 80 alternatives, not exercised";
  c["logprobs"] = 0;
  c["stream"] = true;
  r = HttpCall(port(), "POST", "/v1/completions", c.dump());
  ASSERT_EQ(r.status, 200) << r.raw;
  Json offsets = Json::array();
  for (const Json& e : Events(r.body))
    if (e["choices"][0]["logprobs"].is_object())
      for (const Json& o : e["choices"][0]["logprobs"]["text_offset"]) offsets.push_back(o);
  EXPECT_EQ(offsets, want_offsets) << r.body;
}

// text_offset counts characters, as OpenAI's and vLLM's (Python's len), not bytes: each token's
// text is found at its offset in the text, counted in code points, also after a character of
// several bytes (this prompt's greedy text has two U+FFFD before its last tokens).
TEST_F(HttpApiTest, TextOffsetsCountCharactersNotBytes) {
  auto stub = Connect(cluster_->api());
  const std::vector<int32_t> prompt = {9, 8, 7};
  Generation want = Generate(stub.get(), TokensRequest(prompt, 24));
  ASSERT_TRUE(want.status.ok()) << want.status.error_message();
  Json c = {{"prompt", prompt}, {"max_tokens", 24}, {"temperature", 0}, {"ignore_eos", true}, {"logprobs", 0}};
  HttpResult r = HttpCall(port(), "POST", "/v1/completions", c.dump());
  ASSERT_EQ(r.status, 200) << r.raw;
  const Json choice = ParseBody(r)["choices"][0];
  const std::string text = choice["text"];
  EXPECT_EQ(text, want.text);
  const Json& offsets = choice["logprobs"]["text_offset"];
  ASSERT_EQ(offsets.size(), want.pieces.size()) << r.body;
  std::vector<size_t> byte_of_char;   // where each code point of text starts, and the end
  for (size_t b = 0; b < text.size(); ++b)
    if ((static_cast<unsigned char>(text[b]) & 0xC0) != 0x80) byte_of_char.push_back(b);
  byte_of_char.push_back(text.size());
  bool after_a_wide_char = false;
  for (size_t i = 0; i < offsets.size(); ++i) {
    const size_t at = offsets[i].get<size_t>();
    ASSERT_LT(at, byte_of_char.size()) << "token " << i << ": " << r.body;
    EXPECT_EQ(text.compare(byte_of_char[at], want.pieces[i].size(), want.pieces[i]), 0)
        << "token " << i << " '" << want.pieces[i] << "' is not at character " << at << " of '" << text << "'";
    after_a_wide_char = after_a_wide_char || (!want.pieces[i].empty() && byte_of_char[at] != at);
  }
  EXPECT_TRUE(after_a_wide_char) << "no token after a character of several bytes: not exercised: " << text;
}

// logit_bias, stop_token_ids, min_tokens and the penalties over HTTP: the same tokens as gRPC.
TEST_F(HttpApiTest, LogitBiasStopTokenIdsAndPenaltiesEqualGrpc) {
  auto stub = Connect(cluster_->api());
  // Several entries: the worker's copy of the map verifies (the cluster has a secret) however
  // protobuf orders it.
  auto req = TokensRequest({9, 8, 7}, 6);
  Json bias = Json::object();
  for (int k = 0; k < 12; ++k) {
    (*req.mutable_sampling()->mutable_logit_bias())[40 + 3 * k] = k == 0 ? 100.0f : -1.0f - k;
    bias[std::to_string(40 + 3 * k)] = k == 0 ? 100.0 : -1.0 - k;
  }
  for (int call = 0; call < 4; ++call) {
    Generation biased = Generate(stub.get(), req);
    ASSERT_TRUE(biased.status.ok()) << "call " << call << ": " << biased.status.error_message();
    EXPECT_EQ(biased.ids, std::vector<int32_t>(6, 40));
  }
  Generation biased = Generate(stub.get(), req);
  Json c = {{"prompt", {9, 8, 7}}, {"max_tokens", 6}, {"temperature", 0}, {"ignore_eos", true},
            {"logit_bias", bias}};
  HttpResult r = HttpCall(port(), "POST", "/v1/completions", c.dump());
  ASSERT_EQ(r.status, 200) << r.raw;
  EXPECT_EQ(ParseBody(r)["choices"][0]["text"], biased.text);

  auto pen = TokensRequest({9, 8, 7}, 6);
  pen.mutable_sampling()->set_frequency_penalty(-2.0f);
  pen.mutable_sampling()->set_repetition_penalty(0.5f);
  pen.add_stop_token_ids(11);
  pen.set_min_tokens(2);
  Generation want = Generate(stub.get(), pen);
  ASSERT_TRUE(want.status.ok()) << want.status.error_message();
  c = {{"prompt", {9, 8, 7}}, {"max_tokens", 6}, {"temperature", 0}, {"ignore_eos", true}, {"logprobs", 0},
       {"frequency_penalty", -2.0}, {"repetition_penalty", 0.5}, {"stop_token_ids", {11}}, {"min_tokens", 2}};
  r = HttpCall(port(), "POST", "/v1/completions", c.dump());
  ASSERT_EQ(r.status, 200) << r.raw;
  const Json j = ParseBody(r);
  EXPECT_EQ(j["choices"][0]["text"], want.text);
  ASSERT_EQ(j["choices"][0]["logprobs"]["token_logprobs"].size(), want.logprobs.size());
  for (size_t i = 0; i < want.logprobs.size(); ++i)
    EXPECT_EQ(static_cast<float>(j["choices"][0]["logprobs"]["token_logprobs"][i].get<double>()), want.logprobs[i]);
}

// n choices: choice i is the generation of seed + i (what gRPC gives for that seed), streamed
// or not; usage counts the prompt once and the tokens of every choice.
// A stop string that ends before min_tokens' token does not stop the request, and the text is
// cut at the occurrence that did (not at the first one), streamed or not.
TEST_F(HttpApiTest, MinTokensCutsTheTextAtTheStopThatCounted) {
  auto stub = Connect(cluster_->api());
  const Generation plain = Generate(stub.get(), TokensRequest({9, 8, 7}, 16));
  ASSERT_TRUE(plain.status.ok()) << plain.status.error_message();
  // A letter in the text of the first tokens and again after min_tokens' token starts.
  int min_tokens = 0;
  std::string stop;
  for (int m = 3; m <= 8 && stop.empty(); ++m) {
    std::string before;
    for (int t = 0; t < m - 1; ++t) before += plain.pieces[t];
    const std::string after = plain.text.substr(before.size());
    for (char ch = 'a'; ch <= 'z' && stop.empty(); ++ch)
      if (before.find(ch) != std::string::npos && after.find(ch) != std::string::npos) {
        stop = std::string(1, ch);
        min_tokens = m;
      }
  }
  ASSERT_FALSE(stop.empty()) << "no letter repeats in " << plain.text;
  std::string before;
  for (int t = 0; t < min_tokens - 1; ++t) before += plain.pieces[t];
  const size_t want_cut = plain.text.find(stop, before.size());

  auto req = TokensRequest({9, 8, 7}, 16);
  req.add_stop(stop);
  req.set_min_tokens(min_tokens);
  const Generation g = Generate(stub.get(), req);
  ASSERT_TRUE(g.status.ok()) << g.status.error_message();
  EXPECT_EQ(g.finish.reason(), flashmesh::v1::FINISH_REASON_STOP);
  EXPECT_EQ(g.finish.stop_string(), stop);
  EXPECT_EQ(g.finish.stop_offset(), static_cast<int64_t>(want_cut)) << plain.text << " / " << stop;
  Json c = {{"prompt", {9, 8, 7}}, {"max_tokens", 16}, {"temperature", 0}, {"ignore_eos", true},
            {"stop", stop}, {"min_tokens", min_tokens}};
  HttpResult r = HttpCall(port(), "POST", "/v1/completions", c.dump());
  ASSERT_EQ(r.status, 200) << r.raw;
  EXPECT_EQ(ParseBody(r)["choices"][0]["text"], plain.text.substr(0, want_cut)) << stop << " " << min_tokens;
  c["stream"] = true;
  r = HttpCall(port(), "POST", "/v1/completions", c.dump());
  ASSERT_EQ(r.status, 200) << r.raw;
  std::string streamed;
  for (const Json& e : Events(r.body)) streamed += e["choices"][0]["text"].get<std::string>();
  EXPECT_EQ(streamed, plain.text.substr(0, want_cut));
}

TEST_F(HttpApiTest, NChoicesAreTheGenerationsOfConsecutiveSeeds) {
  auto stub = Connect(cluster_->api());
  constexpr int kN = 3, kTokens = 5;
  std::vector<Generation> want;
  for (int i = 0; i < kN; ++i) {
    auto req = TokensRequest({9, 8, 7}, kTokens);
    auto* s = req.mutable_sampling();
    s->set_greedy(false);
    s->set_temperature(1.5f);
    s->set_seed(40 + i);
    s->set_has_seed(true);
    want.push_back(Generate(stub.get(), req));
    ASSERT_TRUE(want.back().status.ok()) << want.back().status.error_message();
  }
  ASSERT_NE(want[0].ids, want[1].ids) << "the seeds gave one text: not exercised";
  Json c = {{"prompt", {9, 8, 7}}, {"max_tokens", kTokens}, {"temperature", 1.5}, {"seed", 40},
            {"ignore_eos", true}, {"n", kN}, {"logprobs", 0}};
  HttpResult r = HttpCall(port(), "POST", "/v1/completions", c.dump());
  ASSERT_EQ(r.status, 200) << r.raw;
  Json j = ParseBody(r);
  ASSERT_EQ(j["choices"].size(), static_cast<size_t>(kN)) << j;
  for (int i = 0; i < kN; ++i) {
    EXPECT_EQ(j["choices"][i]["index"], i);
    EXPECT_EQ(j["choices"][i]["text"], want[i].text) << i;
    EXPECT_EQ(j["choices"][i]["finish_reason"], "length");
    ASSERT_EQ(j["choices"][i]["logprobs"]["token_logprobs"].size(), static_cast<size_t>(kTokens));
    for (int t = 0; t < kTokens; ++t)
      EXPECT_EQ(static_cast<float>(j["choices"][i]["logprobs"]["token_logprobs"][t].get<double>()), want[i].logprobs[t]);
  }
  EXPECT_EQ(j["usage"]["prompt_tokens"], 3);
  EXPECT_EQ(j["usage"]["completion_tokens"], kN * kTokens);

  // Streamed chat: one role chunk per choice, each choice's pieces under its index, a finish
  // chunk each, then the usage of all.
  Json chat = ChatBody("hello world", kTokens);
  chat["temperature"] = 1.5;
  chat["seed"] = 7;
  chat["n"] = kN;
  chat["stream"] = true;
  chat["stream_options"] = {{"include_usage", true}};
  r = HttpCall(port(), "POST", "/v1/chat/completions", chat.dump());
  ASSERT_EQ(r.status, 200) << r.raw;
  std::vector<std::string> text(kN);
  std::vector<int> roles(kN), finishes(kN);
  Json usage;
  for (const Json& e : Events(r.body)) {
    if (e["choices"].empty()) {
      usage = e["usage"];
      continue;
    }
    const Json& ch = e["choices"][0];
    const int i = ch["index"].get<int>();
    ASSERT_TRUE(i >= 0 && i < kN) << e;
    if (ch["delta"].contains("role")) ++roles[i];
    if (ch["delta"].contains("content")) text[i] += ch["delta"]["content"].get<std::string>();
    if (!ch["finish_reason"].is_null()) ++finishes[i];
  }
  EXPECT_EQ(r.body.substr(r.body.size() - 14), "data: [DONE]\n\n");
  chat["stream"] = false;
  chat.erase("stream_options");
  r = HttpCall(port(), "POST", "/v1/chat/completions", chat.dump());
  ASSERT_EQ(r.status, 200) << r.raw;
  j = ParseBody(r);
  for (int i = 0; i < kN; ++i) {
    EXPECT_EQ(roles[i], 1) << i;
    EXPECT_EQ(finishes[i], 1) << i;
    EXPECT_EQ(text[i], j["choices"][i]["message"]["content"]) << i;
  }
  EXPECT_EQ(usage["completion_tokens"], j["usage"]["completion_tokens"]) << r.body;
  EXPECT_EQ(usage["prompt_tokens"], j["usage"]["prompt_tokens"]);
}

// The n choices share one prefill of their prompt (a prefix sequence runs all of it but the
// last token once, each choice forks from it, on both stages): each choice is still exactly the
// seeded generation it is alone, and the first stage sends about one request's rows, not n.
TEST_F(HttpApiTest, NChoicesShareOnePrefillOfTheirPrompt) {
  auto stub = Connect(cluster_->api());
  std::vector<int32_t> prompt;
  for (int k = 0; k < 40; ++k) prompt.push_back(10 + (k * 37) % 250);
  constexpr int kN = 3, kTokens = 2;
  const std::string sent = "flashmesh_node_data_plane_bytes_total{direction=\"sent\",node=\"w0\"}";
  std::vector<Generation> want;
  double alone = 0;
  for (int i = 0; i < kN; ++i) {
    auto req = TokensRequest(prompt, kTokens);
    auto* s = req.mutable_sampling();
    s->set_greedy(false);
    s->set_temperature(1.5f);
    s->set_seed(60 + i);
    s->set_has_seed(true);
    auto before = Scrape(port());
    want.push_back(Generate(stub.get(), req));
    ASSERT_TRUE(want.back().status.ok()) << want.back().status.error_message();
    if (i == 0) alone = Scrape(port())[sent] - before[sent];
  }
  Json c = {{"prompt", prompt}, {"max_tokens", kTokens}, {"temperature", 1.5}, {"seed", 60},
            {"ignore_eos", true}, {"n", kN}, {"logprobs", 0}};
  auto before = Scrape(port());
  HttpResult r = HttpCall(port(), "POST", "/v1/completions", c.dump());
  const double shared = Scrape(port())[sent] - before[sent];
  ASSERT_EQ(r.status, 200) << r.raw;
  Json j = ParseBody(r);
  ASSERT_EQ(j["choices"].size(), static_cast<size_t>(kN)) << j;
  for (int i = 0; i < kN; ++i) {
    EXPECT_EQ(j["choices"][i]["text"], want[i].text) << i;
    ASSERT_EQ(j["choices"][i]["logprobs"]["token_logprobs"].size(), static_cast<size_t>(kTokens));
    for (int t = 0; t < kTokens; ++t)
      EXPECT_EQ(static_cast<float>(j["choices"][i]["logprobs"]["token_logprobs"][t].get<double>()), want[i].logprobs[t]);
  }
  // One request sends 40 + 1 rows; the three choices 39 + 3 + 3 (three prefills: 123).
  EXPECT_GT(alone, 0);
  EXPECT_LT(shared, 1.5 * alone) << "alone " << alone << " bytes";
  EXPECT_EQ(j["usage"]["prompt_tokens"], 40);
}

// The n choices enter the queue together: n up to limits.max_queue always gets in on an idle
// server (queued one by one, the queue filled before the scheduler took the first: a 429 at
// random), and more can never get in, a 400 naming n rather than a 429 retried for ever.
TEST(HttpChoices, AllChoicesEnterTheQueueTogetherOrTheRequestIsRefused) {
  using namespace std::chrono_literals;
  const int http = FreePort();
  Server server({"--http", "127.0.0.1:" + std::to_string(http), "--max-queue", "3", "--max-batch", "4"});
  ASSERT_TRUE(WaitHealthy(server.api(), 60s)) << server.process()->Log();
  Json c = {{"prompt", {9, 8, 7}}, {"max_tokens", 2}, {"temperature", 1.0}, {"n", 3}};
  for (int call = 0; call < 5; ++call) {
    HttpResult r = HttpCall(http, "POST", "/v1/completions", c.dump());
    ASSERT_EQ(r.status, 200) << "call " << call << ": " << r.raw;
    EXPECT_EQ(ParseBody(r)["choices"].size(), 3u);
  }
  c["n"] = 4;
  HttpResult r = HttpCall(http, "POST", "/v1/completions", c.dump());
  ASSERT_EQ(r.status, 400) << r.raw;
  EXPECT_EQ(ParseBody(r)["error"]["param"], "n");
  EXPECT_NE(r.body.find("limits.max_queue"), std::string::npos) << r.body;
}

TEST_F(HttpApiTest, StopStringIsCutFromTheText) {
  auto stub = Connect(cluster_->api());
  Generation full = Generate(stub.get(), GreedyText("hello world", 24));
  ASSERT_TRUE(full.status.ok()) << full.status.error_message();
  // The last non-empty piece (whole UTF-8 characters) after the first: the answer is the text
  // before its first occurrence.
  std::string stop;
  for (size_t i = 1; i < full.pieces.size(); ++i)
    if (!full.pieces[i].empty()) stop = full.pieces[i];
  ASSERT_FALSE(stop.empty()) << "the greedy text has too few characters: " << full.text;
  const std::string before = full.text.substr(0, full.text.find(stop));
  Json body = ChatBody("hello world", 24);
  body["stop"] = stop;
  for (bool stream : {false, true}) {
    body["stream"] = stream;
    HttpResult r = HttpCall(port(), "POST", "/v1/chat/completions", body.dump());
    ASSERT_EQ(r.status, 200) << r.raw;
    std::string text, finish;
    if (!stream) {
      Json j = ParseBody(r);
      text = j["choices"][0]["message"]["content"];
      finish = j["choices"][0]["finish_reason"];
    } else {
      for (const Json& c : Events(r.body)) {
        if (c["choices"][0]["delta"].contains("content")) text += c["choices"][0]["delta"]["content"].get<std::string>();
        if (!c["choices"][0]["finish_reason"].is_null()) finish = c["choices"][0]["finish_reason"];
      }
    }
    EXPECT_EQ(text, before) << "stream " << stream << ", stop '" << stop << "'";
    EXPECT_EQ(finish, "stop");
  }
}

TEST_F(HttpApiTest, ModelsAndHealth) {
  HttpResult r = HttpCall(port(), "GET", "/v1/models");
  ASSERT_EQ(r.status, 200) << r.raw;
  Json j = ParseBody(r);
  EXPECT_EQ(j["object"], "list");
  ASSERT_EQ(j["data"].size(), 1u);
  EXPECT_EQ(j["data"][0]["id"], SmallModel());
  EXPECT_EQ(j["data"][0]["max_model_len"], 4096);
  r = HttpCall(port(), "GET", "/health");
  EXPECT_EQ(r.status, 200) << r.raw;
  EXPECT_EQ(ParseBody(r)["status"], "ok");
  // The HTTP port given as the CLI's --server is a typo, not an outage: exit 3, not 2 (down).
  const std::string http = "127.0.0.1:" + std::to_string(port());
  std::string out;
  EXPECT_EQ(RunFlashmesh({"health", "--server", http}, &out, 10s), 3) << out;
  EXPECT_NE(out.find("health: " + http + " is not a coordinator's API: "), std::string::npos) << out;
}

TEST_F(HttpApiTest, BadRequestsAre400NamingTheField) {
  const Json good = ChatBody("hi", 2);
  auto with = [&](const char* key, Json v) {
    Json b = good;
    b[key] = v;
    return b.dump();
  };
  const std::vector<std::pair<std::string, std::string>> cases = {
      {"{\"messages\": [", "body"},
      {"[1, 2]", "body"},
      {with("messages", "hi"), "messages"},
      {with("messages", Json::array({{{"role", "wizard"}, {"content", "x"}}})), "messages[0].role"},
      {with("messages", Json::array({{{"role", "user"}, {"content", 5}}})), "messages[0].content"},
      {with("temperature", "hot"), "temperature"},
      {with("temperature", 7), "temperature"},
      {with("top_p", 1.5), "top_p"},
      {with("n", 0), "n"},
      {with("n", 65), "n"},   // more choices than limits.max_streams_per_client (64)
      {with("max_tokens", "8"), "max_tokens"},
      {with("max_tokens", 100000), "max_tokens"},
      {with("max_completion_tokens", 100000), "max_completion_tokens"},
      {with("stop", 5), "stop"},
      {with("stream", "yes"), "stream"},
      {with("seed", 1.5), "seed"},
      {with("logprobs", 1), "logprobs"},
      // Checked against the vocabulary by the gRPC validator, named as HTTP names them.
      {with("logit_bias", {{"999999", 5}}), "logit_bias"},
      {with("stop_token_ids", {999999}), "stop_token_ids[0]"},
      {with("min_tokens", 3), "min_tokens"},
      {with("frequency_penalty", 3), "frequency_penalty"},
      // More bytes than 32 x max_context (4096): refused before tokenizing.
      {with("messages", Json::array({{{"role", "user"}, {"content", std::string(200000, 'a')}}})), "messages"},
  };
  for (const auto& [body, param] : cases) {
    HttpResult r = HttpCall(port(), "POST", "/v1/chat/completions", body);
    ASSERT_EQ(r.status, 400) << body << "\n" << r.raw;
    Json e = ParseBody(r)["error"];
    EXPECT_EQ(e["type"], "invalid_request_error") << body;
    EXPECT_EQ(e["param"], param) << body;
    EXPECT_TRUE(e["code"].is_null()) << body;
    EXPECT_EQ(e["message"].get<std::string>().rfind(param + ": ", 0), 0u) << e["message"] << " vs " << param;
  }
  HttpResult r = HttpCall(port(), "POST", "/v1/completions", Json{{"prompt", {1, -4}}, {"max_tokens", 2}}.dump());
  EXPECT_EQ(r.status, 400) << r.raw;
  EXPECT_EQ(ParseBody(r)["error"]["param"], "prompt[1]");
  r = HttpCall(port(), "POST", "/v1/completions", Json{{"prompt", std::string(200000, 'a')}, {"max_tokens", 2}}.dump());
  EXPECT_EQ(r.status, 400) << r.raw.substr(0, 300);
  EXPECT_EQ(ParseBody(r)["error"]["param"], "prompt");
  EXPECT_NE(r.body.find("bytes, more than 131072 (32 x max_context)"), std::string::npos) << r.body;
  // A top_p below float's range is still in (0, 1]: the top candidate only, not an error.
  r = HttpCall(port(), "POST", "/v1/chat/completions", with("top_p", 1e-60));
  EXPECT_EQ(r.status, 200) << r.raw;
  // Malformed HTTP, an oversized body, unknown paths and methods: clear errors, no harm done.
  r = HttpRaw(port(), "GARBAGE\r\n\r\n", 5s);
  EXPECT_EQ(r.status, 400) << r.raw;
  r = HttpRaw(port(), "POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Length: 99999999\r\n\r\n{", 5s);
  EXPECT_EQ(r.status, 413) << r.raw;
  r = HttpRaw(port(), "GET / HTTP/1.1\r\nHost: x\r\nX-Big: " + std::string(64 << 10, 'a') + "\r\n\r\n", 5s);
  EXPECT_EQ(r.status, 431) << r.raw.substr(0, 200);
  r = HttpRaw(port(), "POST /v1/completions HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: gzip\r\n\r\n", 5s);
  EXPECT_EQ(r.raw.rfind("HTTP/1.1 501 Not Implemented\r\n", 0), 0u) << r.raw;
  EXPECT_EQ(HttpCall(port(), "GET", "/v2/nothing").status, 404);
  r = HttpCall(port(), "GET", "/v1/chat/completions");
  EXPECT_EQ(r.status, 405);
  EXPECT_EQ(r.headers["allow"], "POST");
  r = HttpCall(port(), "POST", "/v1/chat/completions", good.dump());
  ASSERT_EQ(r.status, 200) << r.raw;
  EXPECT_EQ(ParseBody(r)["usage"]["completion_tokens"], 2);
}

TEST_F(HttpApiTest, KeepAliveServesSeveralRequestsOnOneConnection) {
  const std::string body = ChatBody("hi", 2).dump();
  std::string one = "POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                    "Content-Length: " + std::to_string(body.size()) + "\r\n\r\n" + body;
  std::string last = "GET /health HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n";
  HttpResult r = HttpRaw(port(), one + one + last, 30s);   // pipelined
  size_t n = 0;
  for (size_t p = 0; (p = r.raw.find("HTTP/1.1 200 OK\r\n", p)) != std::string::npos; ++p) ++n;
  EXPECT_EQ(n, 3u) << r.raw;
}

TEST_F(HttpApiTest, ConnectionsBeyondTheCapAre503ButProbesAreAnsweredAndTheServerRecovers) {
  // 64 idle connections (HttpLimits::max_connections) hold every slot: the API is 503, /health
  // still answers (a probe slot: a liveness probe must not restart a busy coordinator).
  std::vector<std::unique_ptr<HttpStream>> idle;
  for (int i = 0; i < 64; ++i) idle.push_back(std::make_unique<HttpStream>(port(), ""));
  HttpResult r;
  EXPECT_TRUE(Eventually([&] { return (r = HttpCall(port(), "GET", "/v1/models", "", {}, 5s)).status == 503; }, 5s));
  EXPECT_NE(r.body.find("too many connections"), std::string::npos) << r.raw;
  EXPECT_TRUE(Eventually([&] { return (r = HttpCall(port(), "GET", "/health", "", {}, 5s)).status == 200; }, 5s))
      << r.raw;
  idle.clear();
  EXPECT_TRUE(Eventually([&] { return HttpCall(port(), "GET", "/v1/models", "", {}, 5s).status == 200; }, 5s));
}

TEST_F(HttpApiTest, ClientDisconnectMidStreamFreesTheSequence) {
  auto stub = Connect(cluster_->api());
  const auto before = Scrape(port());
  Json body = ChatBody("tell me a long story", 4000);
  body["stream"] = true;
  HttpStream s(port(), PostJson("/v1/chat/completions", body.dump()));
  std::string got = s.ReadUntil("data: ", 4, 60s);
  ASSERT_NE(got.find("HTTP/1.1 200 OK"), std::string::npos) << got;
  ASSERT_EQ(got.find("[DONE]"), std::string::npos) << "finished before the disconnect";
  EXPECT_EQ(Status(stub.get()).active_requests(), 1);
  s.Close();
  bool freed = Eventually([&] {
    auto st = Status(stub.get());
    if (st.active_requests() != 0 || st.nodes_size() != 2) return false;
    for (const auto& n : st.nodes())
      if (n.active_sequences() != 0) return false;
    return true;
  }, 10s);
  EXPECT_TRUE(freed) << Status(stub.get()).DebugString();
  const auto after = Scrape(port());
  const std::string key = "flashmesh_requests_total{api=\"http\",finish_reason=\"cancelled\"}";
  EXPECT_EQ(after.at(key) - (before.count(key) ? before.at(key) : 0), 1);
  // What it used counts too: its prompt, and the tokens it got (the role chunk, then >= 3).
  auto delta = [&](const std::string& k) { return after.at(k) - (before.count(k) ? before.at(k) : 0); };
  EXPECT_GT(delta("flashmesh_prompt_tokens_total"), 0);
  EXPECT_GE(delta("flashmesh_generation_tokens_total"), 3);
}

TEST_F(HttpApiTest, MetricsMoveByTheExpectedAmounts) {
  auto m0 = Scrape(port());
  // Series that nothing has counted yet are there at 0 (no gRPC request ends 504 in this suite).
  EXPECT_EQ(m0.count("flashmesh_request_errors_total{api=\"grpc\",code=\"504\"}"), 1u);
  EXPECT_EQ(m0.count("flashmesh_requests_total{api=\"grpc\",finish_reason=\"cancelled\"}"), 1u);
  const int n = 3, tokens = 4;
  int prompt = 0;
  for (int i = 0; i < n; ++i) {
    HttpResult r = HttpCall(port(), "POST", "/v1/chat/completions", ChatBody("count " + std::to_string(i), tokens).dump());
    ASSERT_EQ(r.status, 200) << r.raw;
    prompt += ParseBody(r)["usage"]["prompt_tokens"].get<int>();
  }
  EXPECT_EQ(HttpCall(port(), "POST", "/v1/chat/completions", "{").status, 400);
  auto m1 = Scrape(port());
  auto delta = [&](const std::string& key) {
    EXPECT_TRUE(m1.count(key)) << key;
    return m1[key] - (m0.count(key) ? m0[key] : 0);
  };
  EXPECT_EQ(delta("flashmesh_requests_total{api=\"http\",finish_reason=\"length\"}"), n);
  EXPECT_EQ(delta("flashmesh_request_errors_total{api=\"http\",code=\"400\"}"), 1);
  EXPECT_EQ(delta("flashmesh_prompt_tokens_total"), prompt);
  EXPECT_EQ(delta("flashmesh_generation_tokens_total"), n * tokens);
  EXPECT_EQ(delta("flashmesh_time_to_first_token_seconds_count"), n);
  EXPECT_EQ(delta("flashmesh_inter_token_latency_seconds_count"), n * (tokens - 1));
  EXPECT_GE(delta("flashmesh_node_step_latency_seconds_count{node=\"w0\"}"), n * tokens);
  EXPECT_GT(delta("flashmesh_node_data_plane_bytes_total{direction=\"sent\",node=\"w0\"}"), 0);
  EXPECT_EQ(m1["flashmesh_node_up{node=\"w0\"}"], 1);
  EXPECT_EQ(m1["flashmesh_node_up{node=\"w1\"}"], 1);
  EXPECT_EQ(m1["flashmesh_queue_depth"], 0);
  EXPECT_EQ(m1["flashmesh_active_sequences"], 0);
  EXPECT_EQ(m1["flashmesh_cluster_ready"], 1);
  EXPECT_TRUE(m1.count("flashmesh_node_kv_cache_bytes{node=\"w1\"}"));
  // CPU nodes copy nothing to or from a device (and the series exist).
  for (const std::string key :
       {"flashmesh_node_device_copy_bytes_total{direction=\"host_to_device\",node=\"w0\"}",
        "flashmesh_node_device_copy_bytes_total{direction=\"device_to_host\",node=\"w1\"}",
        "flashmesh_node_device_tokens_total{node=\"w1\"}"}) {
    ASSERT_TRUE(m1.count(key)) << key;
    EXPECT_EQ(m1[key], 0) << key;
  }
}

// A gRPC request still generating when its deadline passes timed out: it counts as a 504 error,
// as one that timed out in the queue does, not as a client's cancel.
TEST_F(HttpApiTest, AGrpcRequestPastItsDeadlineCountsAsATimeoutNotACancel) {
  auto stub = Connect(cluster_->api());
  const auto m0 = Scrape(port());
  grpc::ClientContext ctx;
  ctx.set_deadline(std::chrono::system_clock::now() + 700ms);
  auto reader = stub->Generate(&ctx, TokensRequest({5, 6, 7}, 4000));
  flashmesh::v1::GenerateResponse resp;
  ASSERT_TRUE(reader->Read(&resp)) << "the request should start well within its deadline";
  while (reader->Read(&resp)) {
  }
  EXPECT_EQ(reader->Finish().error_code(), grpc::StatusCode::DEADLINE_EXCEEDED);
  // The coordinator notices at its next poll: within a second.
  std::map<std::string, double> m1;
  const std::string timeout = "flashmesh_request_errors_total{api=\"grpc\",code=\"504\"}";
  const std::string cancelled = "flashmesh_requests_total{api=\"grpc\",finish_reason=\"cancelled\"}";
  const auto until = std::chrono::steady_clock::now() + 5s;
  do {
    std::this_thread::sleep_for(100ms);
    m1 = Scrape(port());
  } while (m1[timeout] == m0.at(timeout) && std::chrono::steady_clock::now() < until);
  EXPECT_EQ(m1[timeout] - m0.at(timeout), 1);
  EXPECT_EQ(m1[cancelled] - m0.at(cancelled), 0);
}

TEST_F(HttpApiTest, HealthFollowsTheCluster) {
  const std::string inference = "flashmesh.v1.Inference";
  // grpc.health follows the cluster's health within the coordinator's 100 ms watch period.
  EXPECT_TRUE(Eventually([&] {
    return GrpcHealth(cluster_->api(), "") == HealthCheckResponse::SERVING &&
           GrpcHealth(cluster_->api(), inference) == HealthCheckResponse::SERVING;
  }, 5s));
  cluster_->KillWorker(1, SIGKILL);
  HttpResult r;
  EXPECT_TRUE(Eventually([&] { return (r = HttpCall(port(), "GET", "/health")).status == 503; }, 10s)) << r.raw;
  EXPECT_NE(ParseBody(r)["reason"].get<std::string>().find("w1"), std::string::npos) << r.body;
  EXPECT_EQ(Scrape(port())["flashmesh_cluster_ready"], 0);  // /health's rule
  EXPECT_TRUE(Eventually([&] {
    return GrpcHealth(cluster_->api(), "") == HealthCheckResponse::NOT_SERVING &&
           GrpcHealth(cluster_->api(), inference) == HealthCheckResponse::NOT_SERVING;
  }, 5s));
  cluster_->StartWorker(1);
  EXPECT_TRUE(Eventually([&] { return HttpCall(port(), "GET", "/health").status == 200; }, 60s)) << cluster_->Logs();
  EXPECT_EQ(Scrape(port())["flashmesh_cluster_ready"], 1);
  EXPECT_TRUE(Eventually([&] { return GrpcHealth(cluster_->api(), inference) == HealthCheckResponse::SERVING; }, 5s));
  EXPECT_EQ(HttpCall(port(), "POST", "/v1/chat/completions", ChatBody("back", 2).dump()).status, 200);
}

TEST_F(HttpApiTest, GrpcReflectionListsTheServices) {
  auto channel = grpc::CreateChannel(cluster_->api(), grpc::InsecureChannelCredentials());
  auto stub = grpc::reflection::v1alpha::ServerReflection::NewStub(channel);
  grpc::ClientContext ctx;
  ctx.set_deadline(std::chrono::system_clock::now() + 5s);
  auto stream = stub->ServerReflectionInfo(&ctx);
  grpc::reflection::v1alpha::ServerReflectionRequest req;
  req.set_list_services("");
  ASSERT_TRUE(stream->Write(req));
  stream->WritesDone();
  grpc::reflection::v1alpha::ServerReflectionResponse resp;
  ASSERT_TRUE(stream->Read(&resp));
  std::set<std::string> names;
  for (const auto& s : resp.list_services_response().service()) names.insert(s.name());
  EXPECT_TRUE(names.count("flashmesh.v1.Inference")) << resp.DebugString();
  EXPECT_TRUE(names.count("grpc.health.v1.Health")) << resp.DebugString();
  while (stream->Read(&resp)) {
  }
  EXPECT_TRUE(stream->Finish().ok());
}

// The official `openai` npm package (installed by .ci/run into .npm/) streams a chat completion.
TEST_F(HttpApiTest, OfficialOpenAiNodeClientStreamsTheGrpcText) {
  const std::string modules = std::string(FM_SOURCE_DIR) + "/.npm/node_modules";
  const std::string env = "NODE_PATH='" + modules + "' ";
  if (std::system("node --version >/dev/null 2>&1") != 0) GTEST_SKIP() << "node is not installed";
  if (std::system((env + "node -e \"require('openai')\" >/dev/null 2>&1").c_str()) != 0)
    GTEST_SKIP() << "the openai npm package is not in " << modules << " (npm install --prefix .npm openai@4)";
  auto stub = Connect(cluster_->api());
  Generation want = Generate(stub.get(), GreedyText("hello world", 10));
  ASSERT_TRUE(want.status.ok()) << want.status.error_message();
  const std::string cmd = env + "timeout 90 node " + FM_SOURCE_DIR + "/tests/integration/openai_stream.cjs " +
                          "http://127.0.0.1:" + std::to_string(port()) + "/v1 flashmesh 'hello world' 10 2>&1";
  FILE* p = popen(cmd.c_str(), "r");
  ASSERT_NE(p, nullptr);
  std::string out;
  char buf[4096];
  while (size_t n = fread(buf, 1, sizeof buf, p)) out.append(buf, n);
  ASSERT_EQ(pclose(p), 0) << out;
  Json j = Json::parse(out, nullptr, false);
  ASSERT_FALSE(j.is_discarded()) << out;
  EXPECT_EQ(j["text"], want.text);
  EXPECT_EQ(j["finish"], "length");
  EXPECT_EQ(j["usage"]["completion_tokens"], 10);
  EXPECT_EQ(j["chunks"], 1 + 10 + 1 + 1) << "role, one per token, finish, usage";
}

TEST(HttpLimits, FullQueueIs429WithRetryAfter) {
  ClusterSpec spec;
  spec.stages = 2;
  spec.max_batch = 1;
  spec.max_queue = 1;
  spec.max_context = 8192;
  spec.max_tokens = 4000;
  spec.http = true;
  Cluster cluster(spec);
  cluster.StartAll();
  ASSERT_TRUE(WaitHealthy(cluster.api(), 90s)) << cluster.Logs();
  auto stub = Connect(cluster.api());
  Json body = ChatBody("long", 4000);
  body["stream"] = true;
  // One request generating, one queued behind it: the third finds the queue full.
  HttpStream running(cluster.http_port(), PostJson("/v1/chat/completions", body.dump()));
  ASSERT_NE(running.ReadUntil("data: ", 2, 60s).find("data: "), std::string::npos);
  HttpStream queued(cluster.http_port(), PostJson("/v1/chat/completions", body.dump()));
  ASSERT_TRUE(Eventually([&] { return Status(stub.get()).queued_requests() == 1; }, 10s));
  HttpResult r = HttpCall(cluster.http_port(), "POST", "/v1/chat/completions", ChatBody("x", 2).dump());
  EXPECT_EQ(r.status, 429) << r.raw;
  EXPECT_EQ(r.headers["retry-after"], "1");
  Json e = ParseBody(r)["error"];
  EXPECT_EQ(e["type"], "rate_limit_error");
  EXPECT_EQ(e["code"], "queue_full");
  EXPECT_NE(e["message"].get<std::string>().find("max_queue"), std::string::npos);
}

// A streamed request that fails before its first token gets that error's HTTP status (here a
// node frozen at the request's start: 503 naming it, with Retry-After), not a 200 whose stream
// holds an error event, so an OpenAI client retries it; once the node runs again, streams are
// 200 as before.
TEST(HttpLimits, AStreamThatFailsBeforeItsFirstTokenIsAnHttpError) {
  ClusterSpec spec;
  spec.stages = 2;
  spec.http = true;
  Cluster cluster(spec);
  cluster.StartAll();
  ASSERT_TRUE(WaitHealthy(cluster.api(), 90s)) << cluster.Logs();
  Json body = ChatBody("hello", 4);
  body["stream"] = true;
  // Sent at once, the request is queued while w1 still counts as up (its heartbeat timeout is
  // 2 s); its StartSequence on w1 then fails.
  cluster.worker(1)->Signal(SIGSTOP);
  HttpResult r = HttpCall(cluster.http_port(), "POST", "/v1/chat/completions", body.dump(), {}, 30s);
  // The next one fails too (its start times out, or the heartbeat has marked w1 down by then),
  // naming the node once.
  HttpResult down = HttpCall(cluster.http_port(), "POST", "/v1/chat/completions", body.dump(), {}, 30s);
  cluster.worker(1)->Signal(SIGCONT);
  EXPECT_EQ(down.status, 503) << down.raw;
  const std::string why = ParseBody(down)["error"].value("message", "");
  EXPECT_NE(why.find("node w1 ("), std::string::npos) << why;
  EXPECT_EQ(why.find("node w1 ("), why.rfind("node w1 (")) << why;
  ASSERT_EQ(r.status, 503) << r.raw;
  EXPECT_EQ(r.headers["content-type"], "application/json") << r.raw;
  EXPECT_EQ(r.headers["retry-after"], "1") << r.raw;
  Json e = ParseBody(r)["error"];
  EXPECT_EQ(e["type"], "service_unavailable") << r.raw;
  EXPECT_NE(e["message"].get<std::string>().find("w1"), std::string::npos) << r.raw;
  ASSERT_TRUE(WaitHealthy(cluster.api(), 30s)) << cluster.Logs();
  r = HttpCall(cluster.http_port(), "POST", "/v1/chat/completions", body.dump(), {}, 30s);
  EXPECT_EQ(r.status, 200) << r.raw;
  EXPECT_EQ(r.headers["content-type"], "text/event-stream") << r.raw;
  EXPECT_NE(r.body.find("data: [DONE]"), std::string::npos) << r.raw;
}

TEST(HttpAuth, BearerTokensOfTheTokenFile) {
  TempDir dir;
  std::ofstream(dir.path() + "/tokens") << "# API tokens\ns3cret\n";
  const int http = FreePort();
  Server server({"--token-file", dir.path() + "/tokens", "--http", "127.0.0.1:" + std::to_string(http),
                 "--max-streams-per-client", "2"});
  // Probes need no token.
  ASSERT_TRUE(Eventually([&] { return HttpCall(http, "GET", "/health").status == 200; }, 60s))
      << server.process()->Log();
  const std::string body = ChatBody("hi", 2).dump();
  HttpResult r = HttpCall(http, "POST", "/v1/chat/completions", body);
  EXPECT_EQ(r.status, 401) << r.raw;
  EXPECT_EQ(ParseBody(r)["error"]["type"], "authentication_error");
  EXPECT_EQ(HttpCall(http, "POST", "/v1/chat/completions", body, {"Authorization: Bearer wrong"}).status, 401);
  EXPECT_EQ(HttpCall(http, "GET", "/v1/models").status, 401);
  r = HttpCall(http, "POST", "/v1/chat/completions", body, {"Authorization: Bearer s3cret"});
  EXPECT_EQ(r.status, 200) << r.raw;
  EXPECT_EQ(HttpCall(http, "GET", "/metrics").status, 200);
  // A token is one client: with one generation of it running, a request of two choices is 429
  // (both or none: the message counts the one running), with OpenAI's rate-limit code (not
  // queue_full: the queue is empty); with two running, its next is.
  Json long_body = ChatBody("long", 2000);
  long_body["stream"] = true;
  const std::string long_request = "POST /v1/chat/completions HTTP/1.1\r\nAuthorization: Bearer s3cret\r\n"
                                   "Content-Type: application/json\r\nContent-Length: " +
                                   std::to_string(long_body.dump().size()) + "\r\n\r\n" + long_body.dump();
  HttpStream running(http, long_request);
  ASSERT_NE(running.ReadUntil("data: ", 2, 60s).find("data: "), std::string::npos);
  Json two = ChatBody("hi", 2);
  two["n"] = 2;
  r = HttpCall(http, "POST", "/v1/chat/completions", two.dump(), {"Authorization: Bearer s3cret"});
  EXPECT_EQ(r.status, 429) << r.raw;
  Json e = ParseBody(r)["error"];
  EXPECT_EQ(e["code"], "rate_limit_exceeded") << r.raw;
  EXPECT_NE(e["message"].get<std::string>().find(
                "already has 1 generations running; 2 more would pass limits.max_streams_per_client (2)"),
            std::string::npos) << r.raw;
  HttpStream running2(http, long_request);
  ASSERT_NE(running2.ReadUntil("data: ", 2, 60s).find("data: "), std::string::npos);
  r = HttpCall(http, "POST", "/v1/chat/completions", body, {"Authorization: Bearer s3cret"});
  EXPECT_EQ(r.status, 429) << r.raw;
  EXPECT_NE(ParseBody(r)["error"]["message"].get<std::string>().find("already has 2 generations running"),
            std::string::npos) << r.raw;
  // The same token over gRPC is the same client: no second generation there either.
  auto stub = Connect(server.api());
  Generation g = Generate(stub.get(), TokensRequest({5, 6}, 2), "s3cret");
  EXPECT_EQ(g.status.error_code(), grpc::StatusCode::RESOURCE_EXHAUSTED) << g.status.error_message();
}

}  // namespace
}  // namespace fm::it
