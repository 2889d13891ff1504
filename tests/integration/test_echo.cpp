// Prompt logprobs end to end on a 2-stage cluster whose prompts go in chunks of 4 tokens:
// completions' echo (with and without logprobs, streamed or not) and gRPC's prompt_logprobs
// score a prompt's tokens with the bits its generation reported for them, across chunk edges.
// This is what lm-evaluation-harness's loglikelihood tasks read (echo, logprobs, max_tokens 1).
#include <gtest/gtest.h>

#include <nlohmann/json.hpp>

#include "tests/integration/cluster_fixture.h"
#include "tests/integration/http_client.h"

namespace fm::it {
namespace {

using namespace std::chrono_literals;
using EchoJson = nlohmann::ordered_json;   // the server's key order kept

class EchoTest : public ::testing::Test {
 protected:
  static void SetUpTestSuite() {
    ClusterSpec spec;
    spec.stages = 2;
    spec.max_step_tokens = 4;
    spec.http = true;
    cluster_ = new Cluster(spec);
    cluster_->StartAll();
    ASSERT_TRUE(WaitHealthy(cluster_->api(), 90s)) << cluster_->Logs();
  }
  static void TearDownTestSuite() { delete cluster_; }
  static EchoJson Post(const EchoJson& body) {
    HttpResult r = HttpCall(cluster_->http_port(), "POST", "/v1/completions", body.dump());
    EXPECT_EQ(r.status, 200) << r.raw;
    EchoJson j = EchoJson::parse(r.body, nullptr, false);
    EXPECT_FALSE(j.is_discarded()) << r.raw;
    return j;
  }
  static Cluster* cluster_;
};
Cluster* EchoTest::cluster_ = nullptr;

// Every SSE event's "choices"[0], in order.
std::vector<EchoJson> EchoChunks(const std::string& body) {
  std::vector<EchoJson> out;
  for (size_t p = 0; (p = body.find("data: {", p)) != std::string::npos; ++p)
    out.push_back(EchoJson::parse(body.substr(p + 6, body.find("\n\n", p) - p - 6))["choices"][0]);
  return out;
}

// A greedy generation of 8 tokens after a 6-token prompt; then that prompt and the first 7
// generated tokens (13 tokens: chunks 4, 4, 4, 1) echoed with logprobs and max_tokens 1 (as
// lm-eval asks): the 7 generated tokens come back with the logprobs and alternatives their
// generation gave them, bit for bit, and the one new token is the generation's 8th.
TEST_F(EchoTest, EchoedLogprobsOfAPromptAreThoseItsGenerationReported) {
  const std::vector<int32_t> prompt = {1, 45, 300, 17, 88, 5};
  EchoJson gen = Post({{"prompt", prompt}, {"max_tokens", 8}, {"temperature", 0}, {"logprobs", 2},
                       {"ignore_eos", true}});
  const EchoJson& g = gen["choices"][0]["logprobs"];
  ASSERT_EQ(g["tokens"].size(), 8u) << gen.dump();
  // The ids of the generated tokens, from gRPC (the HTTP body names tokens by their text).
  auto stub = Connect(cluster_->api());
  Generation ids = Generate(stub.get(), TokensRequest(prompt, 8));
  ASSERT_TRUE(ids.status.ok()) << ids.status.error_message();
  std::vector<int32_t> echoed = prompt;
  echoed.insert(echoed.end(), ids.ids.begin(), ids.ids.begin() + 7);
  EchoJson body = {{"prompt", echoed}, {"max_tokens", 1}, {"temperature", 0}, {"logprobs", 2},
                   {"echo", true}, {"ignore_eos", true}};
  EchoJson e = Post(body);
  const EchoJson& c = e["choices"][0];
  const EchoJson& lp = c["logprobs"];
  ASSERT_EQ(lp["tokens"].size(), 14u) << e.dump();
  EXPECT_TRUE(lp["token_logprobs"][0].is_null());
  EXPECT_TRUE(lp["top_logprobs"][0].is_null());
  for (size_t k = 1; k < 6; ++k) {   // the prompt's own: the 2 most likely, and the token itself
    EXPECT_LE(lp["token_logprobs"][k].get<double>(), 0.0) << k;
    const EchoJson& top = lp["top_logprobs"][k];
    EXPECT_TRUE(top.size() == 2 || top.size() == 3) << top.dump();
    EXPECT_EQ(top[lp["tokens"][k].get<std::string>()], lp["token_logprobs"][k]) << k;
  }
  for (size_t k = 0; k < 8; ++k) {
    EXPECT_EQ(lp["tokens"][6 + k], g["tokens"][k]) << k;
    EXPECT_EQ(lp["token_logprobs"][6 + k], g["token_logprobs"][k]) << "generated token " << k;
    EXPECT_EQ(lp["top_logprobs"][6 + k], g["top_logprobs"][k]) << "generated token " << k;
  }
  // The text: the prompt's, then the new token's; offsets count characters from the start.
  const std::string text = c["text"];
  const std::string prompt_text = EchoJson(Post({{"prompt", echoed}, {"max_tokens", 1}, {"temperature", 0},
                                                 {"echo", true}, {"ignore_eos", true}}))["choices"][0]["text"];
  EXPECT_EQ(text, prompt_text) << "the same text with or without logprobs";
  EXPECT_EQ(lp["text_offset"][0], 0);
  for (size_t k = 1; k < 14; ++k) EXPECT_GE(lp["text_offset"][k], lp["text_offset"][k - 1]) << k;
  EXPECT_EQ(e["usage"]["prompt_tokens"], 13);
  // Streamed: the echo first (the prompt's text and its 13 entries), then the token.
  body["stream"] = true;
  HttpResult r = HttpCall(cluster_->http_port(), "POST", "/v1/completions", body.dump());
  ASSERT_EQ(r.status, 200) << r.raw;
  std::vector<EchoJson> chunks = EchoChunks(r.body);
  ASSERT_GE(chunks.size(), 2u) << r.body;
  EXPECT_EQ(chunks[0]["logprobs"]["tokens"].size(), 13u);
  std::string streamed;
  EchoJson tokens = EchoJson::array(), lps = EchoJson::array(), tops = EchoJson::array(), offsets = EchoJson::array();
  for (const EchoJson& ch : chunks) {
    streamed += ch["text"].get<std::string>();
    if (ch["logprobs"].is_null()) continue;
    for (const char* key : {"tokens", "token_logprobs", "top_logprobs", "text_offset"})
      for (const EchoJson& v : ch["logprobs"][key])
        (std::string(key) == "tokens" ? tokens : std::string(key) == "token_logprobs" ? lps
         : std::string(key) == "top_logprobs" ? tops : offsets).push_back(v);
  }
  EXPECT_EQ(streamed, text);
  EXPECT_EQ(tokens, lp["tokens"]);
  EXPECT_EQ(lps, lp["token_logprobs"]);
  EXPECT_EQ(tops, lp["top_logprobs"]);
  EXPECT_EQ(offsets, lp["text_offset"]);
}

// gRPC's prompt_logprobs: the scores of positions 1.. in one event before the first token, the
// same values as the HTTP echo's; a text prompt echoes its own text.
TEST_F(EchoTest, GrpcPromptLogprobsAndATextPromptsEcho) {
  const std::vector<int32_t> prompt = {1, 9, 250, 31, 7, 402};
  auto stub = Connect(cluster_->api());
  auto req = TokensRequest(prompt, 2);
  req.set_prompt_logprobs(3);
  Generation g = Generate(stub.get(), req);
  ASSERT_TRUE(g.status.ok()) << g.status.error_message();
  EXPECT_EQ(g.prompt_events, 1);
  ASSERT_EQ(g.prompt.size(), 5u);
  EchoJson e = Post({{"prompt", prompt}, {"max_tokens", 2}, {"temperature", 0}, {"logprobs", 3}, {"echo", true},
                     {"ignore_eos", true}});
  const EchoJson& lp = e["choices"][0]["logprobs"];
  for (size_t k = 0; k < 5; ++k) {
    EXPECT_EQ(g.prompt[k].id(), prompt[k + 1]);
    EXPECT_EQ(lp["token_logprobs"][k + 1].get<float>(), g.prompt[k].logprob()) << k;
    EXPECT_EQ(g.prompt[k].top_logprobs_size(), 3);
  }
  EchoJson text = Post({{"prompt", "hello world"}, {"max_tokens", 12}, {"temperature", 0}, {"echo", true},
                        {"ignore_eos", true}});
  EchoJson plain = Post({{"prompt", "hello world"}, {"max_tokens", 12}, {"temperature", 0}, {"ignore_eos", true}});
  EXPECT_FALSE(plain["choices"][0]["text"].get<std::string>().empty()) << plain.dump();
  EXPECT_EQ(text["choices"][0]["text"], "hello world" + plain["choices"][0]["text"].get<std::string>());
  EXPECT_TRUE(text["choices"][0]["logprobs"].is_null());
  // Chat has no echo; gRPC bounds prompt_logprobs as top_logprobs.
  HttpResult chat = HttpCall(cluster_->http_port(), "POST", "/v1/chat/completions",
                             EchoJson({{"messages", {{{"role", "user"}, {"content", "hi"}}}}, {"echo", true}}).dump());
  EXPECT_EQ(chat.status, 400);
  EXPECT_NE(chat.body.find("\"param\":\"echo\""), std::string::npos) << chat.body;
  // A prompt of one token has nothing to score: one empty event all the same.
  auto one = TokensRequest({7}, 2);
  one.set_prompt_logprobs(0);
  Generation g1 = Generate(stub.get(), one);
  ASSERT_TRUE(g1.status.ok()) << g1.status.error_message();
  EXPECT_EQ(g1.prompt_events, 1);
  EXPECT_TRUE(g1.prompt.empty());
  EXPECT_EQ(g1.ids.size(), 2u);
  req.set_prompt_logprobs(21);
  Generation bad = Generate(stub.get(), req);
  EXPECT_EQ(bad.status.error_code(), grpc::StatusCode::INVALID_ARGUMENT);
  EXPECT_EQ(bad.status.error_message(), "prompt_logprobs: 21 outside [0, 20]");
}

// vLLM's prompt_logprobs: per prompt token after the first {"id": {logprob, rank, decoded_token}},
// the token itself first, then its N most likely (ranks 1..N); the values are the echo's; a
// chat's list is the response's (its prompt: the rendered template); not with stream.
TEST_F(EchoTest, VllmPromptLogprobsListEachTokensLogprobAndRank) {
  const std::vector<int32_t> prompt = {1, 9, 250, 31, 7, 402, 13, 13, 90};
  EchoJson body = {{"prompt", prompt}, {"max_tokens", 1}, {"temperature", 0}, {"logprobs", 2}, {"echo", true},
                   {"prompt_logprobs", 2}};
  EchoJson e = Post(body);
  const EchoJson& c = e["choices"][0];
  const EchoJson& pl = c["prompt_logprobs"];
  ASSERT_EQ(pl.size(), prompt.size()) << e.dump();
  EXPECT_TRUE(pl[0].is_null());
  for (size_t k = 1; k < prompt.size(); ++k) {
    const std::string id = std::to_string(prompt[k]);
    ASSERT_TRUE(pl[k].contains(id)) << pl[k].dump();
    EXPECT_EQ(pl[k].begin().key(), id) << "the token itself first";
    EXPECT_EQ(pl[k][id]["logprob"], c["logprobs"]["token_logprobs"][k]) << k;
    // Its text (U+FFFD for bytes that are not whole UTF-8, where tokens spells them bytes:\xNN).
    const std::string token = c["logprobs"]["tokens"][k];
    if (token.rfind("bytes:", 0) != 0) {
      EXPECT_EQ(pl[k][id]["decoded_token"], token) << k;
    }
    const int64_t rank = pl[k][id]["rank"];
    EXPECT_GE(rank, 1);
    // The alternatives: ranks 1 and 2, most likely first; the token's own rank places it.
    std::vector<std::pair<int64_t, double>> alts;
    for (const auto& [key, v] : pl[k].items())
      if (key != id) alts.emplace_back(v["rank"].get<int64_t>(), v["logprob"].get<double>());
    EXPECT_EQ(alts.size(), rank <= 2 ? 1u : 2u) << pl[k].dump();
    for (size_t a = 0; a < alts.size(); ++a) {
      EXPECT_LE(alts[a].first, 2);
      if (a > 0) {
        EXPECT_GE(alts[a - 1].second, alts[a].second);
      }
      if (alts[a].first < rank) {
        EXPECT_GE(alts[a].second, pl[k][id]["logprob"].get<double>());
      }
    }
  }
  EchoJson chat = EchoJson::parse(HttpCall(cluster_->http_port(), "POST", "/v1/chat/completions",
                                           EchoJson({{"messages", {{{"role", "user"}, {"content", "hi there"}}}},
                                                     {"max_tokens", 2}, {"temperature", 0}, {"prompt_logprobs", 0}})
                                               .dump())
                                      .body);
  ASSERT_TRUE(chat.contains("prompt_logprobs")) << chat.dump();
  EXPECT_EQ(chat["prompt_logprobs"].size(), chat["usage"]["prompt_tokens"].get<size_t>());
  EXPECT_TRUE(chat["prompt_logprobs"][0].is_null());
  EXPECT_EQ(chat["prompt_logprobs"][1].size(), 1u) << "prompt_logprobs 0: the token alone";
  body["stream"] = true;
  HttpResult r = HttpCall(cluster_->http_port(), "POST", "/v1/completions", body.dump());
  EXPECT_EQ(r.status, 400);
  EXPECT_NE(r.body.find("\"param\":\"prompt_logprobs\""), std::string::npos) << r.body;
}

// max_tokens 0 with echo (OpenAI's legacy way to score a text): the prompt and its logprobs
// alone, the same entries as with a generated token after them; no completion tokens.
TEST_F(EchoTest, MaxTokensZeroWithEchoAnswersThePromptAlone) {
  const std::vector<int32_t> prompt = {1, 45, 300, 17, 88, 5, 61};
  EchoJson body = {{"prompt", prompt}, {"max_tokens", 0}, {"temperature", 0}, {"logprobs", 1}, {"echo", true}};
  EchoJson alone = Post(body);
  body["max_tokens"] = 1;
  EchoJson one = Post(body);
  const EchoJson& a = alone["choices"][0];
  const EchoJson& o = one["choices"][0];
  ASSERT_EQ(a["logprobs"]["tokens"].size(), prompt.size()) << alone.dump();
  for (const char* key : {"tokens", "token_logprobs", "top_logprobs", "text_offset"})
    for (size_t k = 0; k < prompt.size(); ++k) EXPECT_EQ(a["logprobs"][key][k], o["logprobs"][key][k]) << key << k;
  EXPECT_EQ(a["finish_reason"], "length");
  EXPECT_EQ(alone["usage"]["completion_tokens"], 0);
  EXPECT_EQ(alone["usage"]["prompt_tokens"], 7);
  const std::string text = a["text"];
  EXPECT_EQ(o["text"].get<std::string>().rfind(text, 0), 0u) << "the prompt's text, then the token's";
  body["max_tokens"] = 0;
  body["stream"] = true;
  HttpResult r = HttpCall(cluster_->http_port(), "POST", "/v1/completions", body.dump());
  ASSERT_EQ(r.status, 200) << r.raw;
  std::string streamed;
  size_t entries = 0;
  for (const EchoJson& ch : EchoChunks(r.body)) {
    streamed += ch["text"].get<std::string>();
    if (!ch["logprobs"].is_null()) entries += ch["logprobs"]["tokens"].size();
  }
  EXPECT_EQ(streamed, text);
  EXPECT_EQ(entries, prompt.size());
}

}  // namespace
}  // namespace fm::it
