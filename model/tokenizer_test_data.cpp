// WriteTestTokenizer: a small byte-level BPE in DeepSeek-V3/V4's tokenizer.json layout, with
// merges learned from a built-in English text through the same pre-tokenizer the loader runs.
#include <algorithm>
#include <filesystem>
#include <fstream>
#include <map>
#include <nlohmann/json.hpp>

#include "model/mkmodel.h"
#include "model/tokenizer.h"
#include "model/tokenizer_impl.h"

namespace fm {
namespace {

using json = nlohmann::json;

// DeepSeek-V3/V4's pre-tokenizer: digits in runs of up to 3; CJK ideographs + kana as runs;
// then words (one leading non-letter allowed), punctuation runs, newlines, whitespace.
constexpr char kDigitsPattern[] = "\\p{N}{1,3}";
constexpr char kCjkPattern[] = "[一-龥\u3040-ゟ゠-ヿ]+";
constexpr char kWordPattern[] =
    "[!\"#$%&'()*+,\\-./:;<=>?@\\[\\\\\\]^_`{|}~][A-Za-z]+|[^\r\n\\p{L}\\p{P}\\p{S}]?[\\p{L}\\p{M}]+|"
    " ?[\\p{P}\\p{S}]+[\r\n]*|\\s*[\r\n]+|\\s+(?!\\S)|\\s+";

constexpr char kCorpus[] =
    "The quick brown fox jumps over the lazy dog. A distributed inference daemon splits one "
    "large model across several machines, and every machine keeps only the weights it needs.\n"
    "When a request arrives, the coordinator tokenizes the prompt, schedules it with the other "
    "requests, and streams the generated tokens back to the client as soon as they are ready.\n"
    "In the beginning there was the word, and the word was split into tokens. Tokens are "
    "numbers; the model reads numbers and writes numbers, and the tokenizer turns them back "
    "into text that people can read.\n"
    "Hello, world! How are you today? I am fine, thank you. What time is it? It is 10:45 in the "
    "morning, on the 3rd of March 2025. The train leaves at 12:30 and costs $19.99.\n"
    "Mixture of experts: each token is sent to six of 256 experts, chosen by a router. The "
    "experts that are chosen most often are called hot experts; the others are cold.\n"
    "She said that she would come back tomorrow, but nobody believed her. They had heard the "
    "same promise many times before, and every time something else had happened instead.\n"
    "for (int i = 0; i < n; ++i) { sum += values[i] * weights[i]; }\n"
    "def main():\n    print(\"hello\")\n    return 0\n"
    "The weather was cold and the wind was strong, so we stayed inside, read books, drank tea "
    "and talked about the places we wanted to visit in the summer: the mountains, the sea, "
    "the old city with its narrow streets and its markets full of fruit and flowers.\n"
    "Numbers: 1 2 3 10 20 30 100 200 300 1000 2000 12345 67890 3.14159 2.71828.\n"
    "Questions and answers, user and assistant, system prompts and replies: a conversation is "
    "a list of messages, and each message has a role and a content.\n";

struct Trained {
  std::vector<std::string> token_bytes;                        // new tokens' raw bytes
  std::vector<std::pair<std::string, std::string>> merges;     // raw bytes of left, right
};

// Classic BPE training: count adjacent pairs over the pre-tokenized corpus words, merge the most
// frequent (ties: the pair whose bytes sort first), repeat until max_merges or no pair is left.
Trained LearnMerges(const std::vector<std::string>& words, int64_t max_merges) {
  std::map<std::string, int64_t> freq;
  for (const auto& w : words) ++freq[w];
  std::vector<std::pair<std::vector<std::string>, int64_t>> split;
  for (const auto& [w, f] : freq) {
    std::vector<std::string> syms;
    for (char c : w) syms.emplace_back(1, c);
    split.emplace_back(std::move(syms), f);
  }
  Trained t;
  while (static_cast<int64_t>(t.merges.size()) < max_merges) {
    std::map<std::pair<std::string, std::string>, int64_t> pairs;
    for (const auto& [syms, f] : split)
      for (size_t i = 0; i + 1 < syms.size(); ++i) pairs[{syms[i], syms[i + 1]}] += f;
    if (pairs.empty()) break;
    auto best = pairs.begin();
    for (auto it = pairs.begin(); it != pairs.end(); ++it)
      if (it->second > best->second) best = it;
    const auto [a, b] = best->first;
    for (auto& [syms, f] : split) {
      std::vector<std::string> merged;
      for (size_t i = 0; i < syms.size(); ++i) {
        if (i + 1 < syms.size() && syms[i] == a && syms[i + 1] == b) {
          merged.push_back(a + b);
          ++i;
        } else {
          merged.push_back(syms[i]);
        }
      }
      syms.swap(merged);
    }
    t.merges.emplace_back(a, b);
    t.token_bytes.push_back(a + b);
  }
  return t;
}

json AddedTokenJson(int64_t id, const std::string& content, bool special) {
  return json{{"id", id},          {"content", content}, {"single_word", false},
              {"lstrip", false},   {"rstrip", false},    {"normalized", !special},
              {"special", special}};
}

json TokenizerJson(const std::vector<json>& added, const json& vocab, const json& merges) {
  json split = json::array();
  for (const char* p : {kDigitsPattern, kCjkPattern, kWordPattern})
    split.push_back({{"type", "Split"},
                     {"pattern", {{"Regex", p}}},
                     {"behavior", "Isolated"},
                     {"invert", false}});
  split.push_back({{"type", "ByteLevel"},
                   {"add_prefix_space", false},
                   {"trim_offsets", true},
                   {"use_regex", false}});
  json byte_level = {{"type", "ByteLevel"},
                     {"add_prefix_space", true},
                     {"trim_offsets", false},
                     {"use_regex", true}};
  return json{{"version", "1.0"},
              {"truncation", nullptr},
              {"padding", nullptr},
              {"added_tokens", added},
              {"normalizer", {{"type", "Sequence"}, {"normalizers", json::array()}}},
              {"pre_tokenizer", {{"type", "Sequence"}, {"pretokenizers", split}}},
              {"post_processor", byte_level},
              {"decoder", byte_level},
              {"model",
               {{"type", "BPE"},
                {"dropout", nullptr},
                {"unk_token", nullptr},
                {"continuing_subword_prefix", nullptr},
                {"end_of_word_suffix", nullptr},
                {"fuse_unk", false},
                {"byte_fallback", false},
                {"vocab", vocab},
                {"merges", merges}}}};
}

Status WriteJson(const std::string& path, const json& j) {
  std::ofstream f(path, std::ios::binary | std::ios::trunc);
  if (!f) return InvalidArgument(path + ": cannot create");
  f << j.dump(1) << "\n";
  if (!f) return Internal(path + ": write failed");
  return Status::Ok();
}

}  // namespace

Status WriteTestTokenizer(const std::string& dir, int64_t vocab_size) {
  constexpr int64_t kMinVocab = 300;
  if (vocab_size < kMinVocab || vocab_size > INT32_MAX)
    return InvalidArgument("WriteTestTokenizer: vocab_size " + std::to_string(vocab_size) +
                           " outside [300, 2^31)");
  const std::string bos = "<｜begin▁of▁sentence｜>", eos = "<｜end▁of▁sentence｜>",
                    pad = "<｜▁pad▁｜>";
  // Layout like DeepSeek's: 0..2 bos/eos/pad, then the 256 byte tokens in GPT-2 order, the
  // merges, reserved placeholders, and the chat tokens at the very end.
  const std::vector<std::pair<std::string, bool>> tail = {
      {"<｜User｜>", true}, {"<｜Assistant｜>", true}, {"<think>", false}, {"</think>", false}};
  const int64_t first_merge = 3 + 256;
  const int64_t max_merges = vocab_size - first_merge - static_cast<int64_t>(tail.size());

  json vocab = json::object();
  vocab[bos] = 0;
  vocab[eos] = 1;
  vocab[pad] = 2;
  std::vector<int> order;
  for (int b = 0; b < 256; ++b) order.push_back(b);
  std::sort(order.begin(), order.end(),
            [](int x, int y) { return tok::ByteToCodepoint()[x] < tok::ByteToCodepoint()[y]; });
  for (int i = 0; i < 256; ++i) vocab[tok::ByteMap(std::string(1, static_cast<char>(order[i])))] = 3 + i;

  std::vector<json> added = {AddedTokenJson(0, bos, true), AddedTokenJson(1, eos, true),
                             AddedTokenJson(2, pad, true)};
  // Pre-tokenize the corpus with the loader itself, so training and encoding agree exactly.
  FM_ASSIGN_OR_RETURN(Tokenizer bytes_only,
                      Tokenizer::FromJson(TokenizerJson(added, vocab, json::array()).dump(),
                                          "WriteTestTokenizer"));
  FM_ASSIGN_OR_RETURN(std::vector<std::string> words, bytes_only.PreTokenize(kCorpus));
  Trained trained = LearnMerges(words, max_merges);

  json merges = json::array();
  int64_t next_id = first_merge;
  for (size_t i = 0; i < trained.merges.size(); ++i) {
    const auto& [a, b] = trained.merges[i];
    merges.push_back(tok::ByteMap(a) + " " + tok::ByteMap(b));
    vocab[tok::ByteMap(trained.token_bytes[i])] = next_id++;
  }
  const int64_t tail_begin = vocab_size - static_cast<int64_t>(tail.size());
  for (int64_t k = 0; next_id < tail_begin; ++k, ++next_id)
    added.push_back(AddedTokenJson(next_id, "<｜place▁holder▁no▁" + std::to_string(k) + "｜>", true));
  for (const auto& [content, special] : tail) added.push_back(AddedTokenJson(next_id++, content, special));

  std::error_code ec;
  std::filesystem::create_directories(dir, ec);
  if (ec) return InvalidArgument(dir + ": cannot create directory: " + ec.message());
  FM_RETURN_IF_ERROR(WriteJson(dir + "/tokenizer.json", TokenizerJson(added, vocab, merges)));
  auto token_obj = [](const std::string& s) {
    return json{{"__type", "AddedToken"}, {"content", s},       {"lstrip", false},
                {"normalized", true},     {"rstrip", false},    {"single_word", false}};
  };
  json cfg = {{"add_bos_token", true},
              {"add_eos_token", false},
              {"bos_token", token_obj(bos)},
              {"eos_token", token_obj(eos)},
              {"pad_token", token_obj(pad)},
              {"clean_up_tokenization_spaces", false},
              {"legacy", true},
              {"model_max_length", 1048576},
              {"sp_model_kwargs", json::object()},
              {"unk_token", nullptr},
              {"tokenizer_class", "LlamaTokenizerFast"}};
  return WriteJson(dir + "/tokenizer_config.json", cfg);
}

}  // namespace fm
