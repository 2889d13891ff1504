#include <gtest/gtest.h>
#include <unistd.h>

#include <filesystem>
#include <fstream>
#include <string>
#include <vector>

#include "model/mkmodel.h"
#include "model/tokenizer.h"

namespace fm {
namespace {

namespace fs = std::filesystem;

std::string TempDir(const std::string& name) {
  fs::path p = fs::temp_directory_path() /
               ("fm_tok_" + name + "_" + std::to_string(getpid()));  // ctest runs cases in parallel
  fs::remove_all(p);
  return p.string();
}

void WriteFile(const std::string& path, const std::string& text) {
  std::ofstream(path, std::ios::binary | std::ios::trunc) << text;
}

Tokenizer TestTokenizer(int64_t vocab) {
  std::string dir = TempDir("v" + std::to_string(vocab));
  Status st = WriteTestTokenizer(dir, vocab);
  EXPECT_TRUE(st.ok()) << st.ToString();
  auto t = Tokenizer::Load(dir);
  EXPECT_TRUE(t.ok()) << t.status().ToString();
  fs::remove_all(dir);
  return *t;
}

// A hand-written tokenizer: bytes a b c d space, merges in the given order.
std::string MiniJson(const std::string& merges) {
  return R"({
    "added_tokens": [{"id": 9, "content": "<|x|>", "special": true},
                     {"id": 10, "content": "<|xy|>", "special": false}],
    "normalizer": null,
    "pre_tokenizer": {"type": "ByteLevel", "add_prefix_space": false, "use_regex": true},
    "decoder": {"type": "ByteLevel"},
    "model": {"type": "BPE", "vocab": {"a": 0, "b": 1, "c": 2, "Ġ": 3, "ab": 4, "bc": 5,
              "abc": 6, "Ġa": 7, "d": 8},
              "merges": )" + merges + "}}";
}

Tokenizer Mini(const std::string& merges) {
  auto t = Tokenizer::FromJson(MiniJson(merges), "mini.json");
  EXPECT_TRUE(t.ok()) << t.status().ToString();
  return *t;
}

std::vector<int32_t> Ids(const Tokenizer& t, const std::string& s) {
  auto r = t.Encode(s);
  EXPECT_TRUE(r.ok()) << r.status().ToString();
  return r.ok() ? *r : std::vector<int32_t>{};
}

TEST(Tokenizer, MiniExactIds) {
  Tokenizer t = Mini(R"(["a b", "b c", "ab c", "Ġ a"])");
  EXPECT_EQ(Ids(t, "abc"), (std::vector<int32_t>{6}));
  EXPECT_EQ(Ids(t, "ab"), (std::vector<int32_t>{4}));
  EXPECT_EQ(Ids(t, "cab"), (std::vector<int32_t>{2, 4}));
  // " ab": (a,b) has rank 0, (Ġ,a) rank 3: ab merges first, then Ġ + ab has no merge.
  EXPECT_EQ(Ids(t, " ab"), (std::vector<int32_t>{3, 4}));
  EXPECT_EQ(Ids(t, " ac"), (std::vector<int32_t>{7, 2}));
  EXPECT_EQ(Ids(t, "aaa"), (std::vector<int32_t>{0, 0, 0}));
}

TEST(Tokenizer, MergesPriorityDecides) {
  // Same vocab, merges as [a, b] pairs with "b c" before "a b": abc -> a + bc (no "a bc" merge).
  Tokenizer t = Mini(R"([["b", "c"], ["a", "b"], ["ab", "c"]])");
  EXPECT_EQ(Ids(t, "abc"), (std::vector<int32_t>{0, 5}));
  EXPECT_EQ(Ids(t, "abab"), (std::vector<int32_t>{4, 4}));
}

TEST(Tokenizer, MiniAddedTokensMatchedFirstLongest) {
  Tokenizer t = Mini(R"(["a b"])");
  EXPECT_EQ(Ids(t, "a<|x|>b"), (std::vector<int32_t>{0, 9, 1}));
  EXPECT_EQ(Ids(t, "<|xy|>ab<|x|>"), (std::vector<int32_t>{10, 4, 9}));
  EXPECT_TRUE(t.IsSpecial(9));
  EXPECT_FALSE(t.IsSpecial(10));
  EXPECT_EQ(*t.Decode({0, 9, 10, 1}), "a<|x|><|xy|>b");
  EXPECT_EQ(*t.Decode({0, 9, 10, 1}, /*skip_special=*/true), "a<|xy|>b");
  EXPECT_EQ(t.vocab_size(), 11);
  // IdToToken: tokenizer.json's spelling (Ġ for the space byte), an added token's content.
  EXPECT_EQ(*t.IdToToken(7), "Ġa");
  EXPECT_EQ(*t.IdToToken(3), "Ġ");
  EXPECT_EQ(*t.IdToToken(4), "ab");
  EXPECT_EQ(*t.IdToToken(10), "<|xy|>");
  EXPECT_EQ(t.IdToToken(11).status().code(), Code::kOutOfRange);
  for (int32_t id = 0; id <= 10; ++id) EXPECT_EQ(t.TokenToId(*t.IdToToken(id)), id) << id;
}

// Added tokens that share a prefix: at each position the longest one the text holds, even where a
// longer one starts the same way and then differs.
TEST(Tokenizer, AddedTokensSharingAPrefixMatchTheLongestPresent) {
  std::string json = MiniJson(R"(["a b"])");
  const std::string added = R"([{"id": 9, "content": "<|x|>", "special": true},
                     {"id": 10, "content": "<|xy|>", "special": false}])";
  const size_t at = json.find(added);
  ASSERT_NE(at, std::string::npos);
  json.replace(at, added.size(), R"([{"id": 20, "content": "aaab"}, {"id": 21, "content": "aa"},
                                    {"id": 22, "content": "aa"}])");
  auto t = Tokenizer::FromJson(json, "prefix.json");
  ASSERT_TRUE(t.ok()) << t.status().ToString();
  EXPECT_EQ(Ids(*t, "aaab"), (std::vector<int32_t>{20}));
  EXPECT_EQ(Ids(*t, "aaaab"), (std::vector<int32_t>{21, 21, 1}));
  EXPECT_EQ(Ids(*t, "baaabaa"), (std::vector<int32_t>{1, 20, 21}));
  EXPECT_EQ(Ids(*t, "aaa"), (std::vector<int32_t>{21, 0}));
  EXPECT_EQ(t->TokenToId("aa"), 21);  // the duplicate's first id, as the encoder picks
}

TEST(Tokenizer, MiniErrors) {
  Tokenizer t = Mini(R"(["a b"])");
  auto missing = t.Encode("ae");
  ASSERT_FALSE(missing.ok());
  EXPECT_NE(missing.status().message().find("no token for byte 0x65"), std::string::npos);
  auto bad_id = t.Decode({0, 42});
  ASSERT_FALSE(bad_id.ok());
  EXPECT_EQ(bad_id.status().code(), Code::kOutOfRange);
  EXPECT_NE(bad_id.status().message().find("42"), std::string::npos);
  EXPECT_FALSE(t.Encode("\xC3(").ok());  // invalid UTF-8 input
}

TEST(Tokenizer, BadJsonNamesFileAndPath) {
  auto expect_error = [](const std::string& text, const std::string& needle) {
    auto t = Tokenizer::FromJson(text, "bad.json");
    ASSERT_FALSE(t.ok()) << needle;
    EXPECT_NE(t.status().message().find("bad.json"), std::string::npos) << t.status().message();
    EXPECT_NE(t.status().message().find(needle), std::string::npos) << t.status().message();
  };
  expect_error("{ not json", "not a valid JSON");
  std::string lowercase = MiniJson("[]");
  lowercase.replace(lowercase.find(R"("normalizer": null)"), 18,
                    R"("normalizer": {"type": "Lowercase"})");
  expect_error(lowercase, "/normalizer");
  expect_error(R"({"model": {"type": "Unigram"}})", "/model/type");
  expect_error(R"({"model": {"type": "BPE", "merges": []}})", "/model/vocab");
  expect_error(MiniJson(R"(["a b", "abc"])"), "/model/merges/1");
  expect_error(MiniJson(R"(["a b", ["c", "d"]])"), "/model/merges/1");
  expect_error(MiniJson(R"(["a b", 7])"), "/model/merges/1");
  std::string removed = MiniJson("[]");
  removed.replace(removed.find(R"({"type": "ByteLevel", "add_prefix_space")"),
                  std::string(R"({"type": "ByteLevel", "add_prefix_space": false, "use_regex": true})").size(),
                  R"({"type": "Sequence", "pretokenizers": [{"type": "Split",
                     "pattern": {"Regex": "a"}, "behavior": "Removed", "invert": false}]})");
  expect_error(removed, "/pre_tokenizer/pretokenizers/0/behavior");
  std::string bad_regex = removed;
  bad_regex.replace(bad_regex.find(R"("Regex": "a")"), 12, R"("Regex": "(a")");
  bad_regex.replace(bad_regex.find("Removed"), 7, "Isolated");
  expect_error(bad_regex, "/pre_tokenizer/pretokenizers/0/pattern");
  std::string bad_added = MiniJson("[]");
  bad_added.replace(bad_added.find(R"("id": 10)"), 8, R"("id": "x")");
  expect_error(bad_added, "/added_tokens/1/id");
  auto missing = Tokenizer::LoadFile("/nonexistent/tokenizer.json");
  ASSERT_FALSE(missing.ok());
  EXPECT_EQ(missing.status().code(), Code::kNotFound);
}

// Fields of the wrong JSON type are errors naming their path; they used to throw out of
// nlohmann's value() and end the process (serve and generate at start).
TEST(Tokenizer, FieldsOfTheWrongTypeAreErrorsNamingThePath) {
  auto expect_error = [](std::string text, const std::string& from, const std::string& to,
                         const std::string& needle) {
    const size_t at = text.find(from);
    ASSERT_NE(at, std::string::npos) << from;
    text.replace(at, from.size(), to);
    auto t = Tokenizer::FromJson(text, "bad.json");
    ASSERT_FALSE(t.ok()) << needle;
    EXPECT_NE(t.status().message().find("bad.json: " + needle), std::string::npos)
        << t.status().message();
  };
  const std::string mini = MiniJson("[]");
  expect_error(mini, R"("special": true)", R"("special": "yes")", "/added_tokens/0/special");
  expect_error(mini, R"("decoder": {"type": "ByteLevel"})", R"("decoder": "ByteLevel")", "/decoder");
  expect_error(mini, R"("pre_tokenizer": {"type": "ByteLevel", "add_prefix_space": false, "use_regex": true})",
               R"("pre_tokenizer": "x")", "/pre_tokenizer");
  expect_error(mini, R"("use_regex": true)", R"("use_regex": "no")", "/pre_tokenizer/use_regex");
  expect_error(mini, R"("model": {"type": "BPE")", R"("model": {"type": 5)", "/model/type");
  expect_error(mini, R"("normalizer": null)", R"("normalizer": {"type": 5})", "/normalizer");
  expect_error(mini, R"("id": 10)", R"("id": 2147483647)", "/added_tokens/1/id");
  expect_error(mini, R"("d": 8)", R"("d": 2000000000)", "/model/vocab/d");
  expect_error(mini, R"({"type": "ByteLevel", "add_prefix_space": false, "use_regex": true})",
               R"({"type": "Sequence", "pretokenizers": [{"type": "Split"}]})",
               "/pre_tokenizer/pretokenizers/0/pattern");
}

TEST(Tokenizer, TestTokenizerLayout) {
  for (int64_t v : {300, 512, 4096}) {
    Tokenizer t = TestTokenizer(v);
    EXPECT_EQ(t.vocab_size(), v);
    EXPECT_EQ(t.bos_id(), 0);
    EXPECT_EQ(t.eos_id(), 1);
    EXPECT_EQ(t.TokenToId("<｜User｜>"), v - 4);
    EXPECT_EQ(t.TokenToId("<｜Assistant｜>"), v - 3);
    EXPECT_EQ(t.TokenToId("</think>"), v - 1);
    EXPECT_EQ(t.TokenToId("!"), 3);  // byte tokens start at 3, in GPT-2 order
    EXPECT_TRUE(t.IsSpecial(t.TokenToId("<｜User｜>")));
    EXPECT_FALSE(t.IsSpecial(t.TokenToId("<think>")));
  }
  EXPECT_FALSE(WriteTestTokenizer(TempDir("small"), 299).ok());
}

TEST(Tokenizer, MergesCompressEnglish) {
  Tokenizer t = TestTokenizer(4096);
  const std::string s = "The quick brown fox jumps over the lazy dog.";
  std::vector<int32_t> ids = Ids(t, s);
  EXPECT_LT(ids.size(), s.size() / 3);  // learned merges cover the built-in text's words
  EXPECT_EQ(Ids(t, " the").size(), 1u);
}

TEST(Tokenizer, RoundTrips) {
  for (int64_t v : {300, 4096}) {
    Tokenizer t = TestTokenizer(v);
    const std::vector<std::string> texts = {
        "Hello, world! How are you?",
        "日本語のテキストと中文字符",
        "emoji 😀👍🏽 and é, ñ, ß, Ω",
        "tabs\tand   spaces  \n\n\r\n  trailing   ",
        "1234567890 and 3.14159, 10:45",
        "<｜begin▁of▁sentence｜><｜User｜>hi<｜Assistant｜></think>ok<｜end▁of▁sentence｜>",
        "",
    };
    for (const std::string& s : texts) {
      auto d = t.Decode(Ids(t, s));
      ASSERT_TRUE(d.ok());
      EXPECT_EQ(*d, s) << "vocab " << v;
    }
  }
}

TEST(Tokenizer, DeepSeekPreTokenizerSplits) {
  Tokenizer t = TestTokenizer(512);
  auto pieces = [&](const std::string& s) { return *t.PreTokenize(s); };
  using V = std::vector<std::string>;
  EXPECT_EQ(pieces("12345678"), (V{"123", "456", "78"}));
  EXPECT_EQ(pieces("a 2025!"), (V{"a", " ", "202", "5", "!"}));
  EXPECT_EQ(pieces("Hello world"), (V{"Hello", " world"}));
  EXPECT_EQ(pieces("  hi"), (V{" ", " hi"}));
  EXPECT_EQ(pieces("don't"), (V{"don", "'t"}));
  EXPECT_EQ(pieces("你好世界abc"), (V{"你好世界", "abc"}));
  EXPECT_EQ(pieces("x\n\ny"), (V{"x", "\n\n", "y"}));
  EXPECT_EQ(pieces("end.  "), (V{"end", ".", "  "}));
}

TEST(Tokenizer, SpecialTokensInTextAreSingleIds) {
  Tokenizer t = TestTokenizer(512);
  std::vector<int32_t> ids = Ids(t, "<｜User｜>hi<｜Assistant｜>");
  ASSERT_GE(ids.size(), 3u);
  EXPECT_EQ(ids.front(), 508);
  EXPECT_EQ(ids.back(), 509);
  EXPECT_EQ(*t.Decode(ids, /*skip_special=*/true), "hi");
}

TEST(StreamDecoder, HoldsIncompleteCharacters) {
  Tokenizer t = TestTokenizer(300);
  // "€" is E2 82 AC: three byte tokens at 300 ids (no merge covers it).
  std::vector<int32_t> ids = Ids(t, "€");
  ASSERT_EQ(ids.size(), 3u);
  StreamDecoder sd(t);
  EXPECT_EQ(*sd.Push(ids[0]), "");
  EXPECT_EQ(*sd.Push(ids[1]), "");
  EXPECT_EQ(*sd.Push(ids[2]), "€");
  EXPECT_EQ(sd.Flush(), "");
  // An incomplete character at the end is flushed as U+FFFD.
  StreamDecoder cut(t);
  EXPECT_EQ(*cut.Push(ids[0]), "");
  EXPECT_EQ(cut.Flush(), "\xEF\xBF\xBD");
  EXPECT_FALSE(cut.Push(1 << 20).ok());
  // Cut after two of its three bytes: still one U+FFFD (the maximal subpart, as HF's decoder),
  // not one a byte.
  StreamDecoder two(t);
  EXPECT_EQ(*two.Push(ids[0]), "");
  EXPECT_EQ(*two.Push(ids[1]), "");
  EXPECT_EQ(two.Flush(), "\xEF\xBF\xBD");
  // E4 B8 then 'A': one U+FFFD for E4 B8, then the A; a stray continuation byte is one each.
  std::vector<int32_t> bad = Ids(t, "\xE4\xB8\xAD");   // 中: E4 B8 AD
  ASSERT_EQ(bad.size(), 3u);
  std::vector<int32_t> a = Ids(t, "A");
  EXPECT_EQ(*t.Decode({bad[0], bad[1], a[0]}), "\xEF\xBF\xBD" "A");
  EXPECT_EQ(*t.Decode({bad[1], bad[2], a[0]}), "\xEF\xBF\xBD\xEF\xBF\xBD" "A");
}

TEST(StreamDecoder, PiecesAreWholeCharactersAndConcatenateToDecode) {
  Tokenizer t = TestTokenizer(512);
  const std::string s = "mixed 日本語 😀 text ñ 123 <｜User｜> done";
  std::vector<int32_t> ids = Ids(t, s);
  StreamDecoder sd(t, /*skip_special=*/false);
  std::string joined;
  for (int32_t id : ids) {
    std::string piece = *sd.Push(id);
    // Every piece is itself valid UTF-8: decoding it alone changes nothing.
    for (size_t i = 0; i < piece.size();) {
      unsigned char c = static_cast<unsigned char>(piece[i]);
      size_t n = c < 0x80 ? 1 : c < 0xE0 ? 2 : c < 0xF0 ? 3 : 4;
      ASSERT_LE(i + n, piece.size()) << "half a character emitted";
      for (size_t k = 1; k < n; ++k) ASSERT_EQ(static_cast<unsigned char>(piece[i + k]) & 0xC0, 0x80);
      i += n;
    }
    joined += piece;
  }
  joined += sd.Flush();
  EXPECT_EQ(joined, s);
  EXPECT_EQ(joined, *t.Decode(ids));
}

TEST(Chat, DeepSeekV4Format) {
  Tokenizer t = TestTokenizer(512);
  std::vector<ChatMessage> msgs = {{"system", "Be brief."},
                                   {"user", "Hi"},
                                   {"assistant", "Hello!"},
                                   {"user", "2+2?"}};
  EXPECT_EQ(*t.ApplyChatTemplate(msgs),
            "<｜begin▁of▁sentence｜>Be brief.<｜User｜>Hi<｜Assistant｜></think>Hello!"
            "<｜end▁of▁sentence｜><｜User｜>2+2?<｜Assistant｜></think>");
  EXPECT_EQ(*t.ApplyChatTemplate(msgs, /*thinking=*/true),
            "<｜begin▁of▁sentence｜>Be brief.<｜User｜>Hi<｜Assistant｜></think>Hello!"
            "<｜end▁of▁sentence｜><｜User｜>2+2?<｜Assistant｜><think>");
  // Two user turns in a row: no assistant marker between them.
  EXPECT_EQ(*t.ApplyChatTemplate({{"user", "a"}, {"user", "b"}}),
            "<｜begin▁of▁sentence｜><｜User｜>a<｜User｜>b<｜Assistant｜></think>");
  auto bad = t.ApplyChatTemplate({{"user", "a"}, {"robot", "b"}});
  ASSERT_FALSE(bad.ok());
  EXPECT_NE(bad.status().message().find("messages[1].role"), std::string::npos);
  std::vector<int32_t> ids = Ids(t, *t.ApplyChatTemplate({{"user", "Hi"}}));
  EXPECT_EQ(ids.front(), t.bos_id());
  EXPECT_EQ(ids[1], t.TokenToId("<｜User｜>"));
  EXPECT_EQ(ids.back(), t.TokenToId("</think>"));
}

TEST(Tokenizer, ConfigOverridesAndErrors) {
  std::string dir = TempDir("cfg");
  ASSERT_TRUE(WriteTestTokenizer(dir, 512).ok());
  WriteFile(dir + "/tokenizer_config.json", R"({"bos_token": "<｜User｜>", "eos_token": {"content": "</think>"}})");
  auto t = Tokenizer::Load(dir);
  ASSERT_TRUE(t.ok()) << t.status().ToString();
  EXPECT_EQ(t->bos_id(), 508);
  EXPECT_EQ(t->eos_id(), 511);
  WriteFile(dir + "/tokenizer_config.json", R"({"eos_token": "<nope>"})");
  auto bad = Tokenizer::Load(dir);
  ASSERT_FALSE(bad.ok());
  EXPECT_NE(bad.status().message().find("tokenizer_config.json: /eos_token"), std::string::npos)
      << bad.status().message();
  WriteFile(dir + "/tokenizer_config.json", R"({"bos_token": 3})");
  EXPECT_FALSE(Tokenizer::Load(dir).ok());
  fs::remove_all(dir);
}

}  // namespace
}  // namespace fm
