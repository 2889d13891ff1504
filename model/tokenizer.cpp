// tokenizer.json loading, encode (added tokens -> Split regexes -> byte-level BPE), decode,
// streaming decode and the DeepSeek-V4 chat format. The byte map and UTF-8 helpers are in
// tokenizer_bytes.cpp.
#define PCRE2_CODE_UNIT_WIDTH 8
#include "model/tokenizer.h"

#include <pcre2.h>

#include <algorithm>
#include <nlohmann/json.hpp>
#include <queue>
#include <unordered_map>

#include "common/file.h"
#include "model/tokenizer_impl.h"

namespace fm {

using json = nlohmann::json;

namespace {

struct Pcre2CodeDeleter {
  void operator()(pcre2_code* c) const { pcre2_code_free(c); }
};
using RegexPtr = std::unique_ptr<pcre2_code, Pcre2CodeDeleter>;

// One step of the pre_tokenizer Sequence: an Isolated Split by a regex (ByteLevel with
// use_regex is the GPT-2 regex split), optionally prefixing a space to every piece.
struct SplitStep {
  RegexPtr regex;
  bool add_prefix_space = false;
};

constexpr char kGpt2Pattern[] =
    "'s|'t|'re|'ve|'m|'ll|'d| ?\\p{L}+| ?\\p{N}+| ?[^\\s\\p{L}\\p{N}]+|\\s+(?!\\S)|\\s+";
constexpr char kBos[] = "<｜begin▁of▁sentence｜>";
constexpr char kEos[] = "<｜end▁of▁sentence｜>";
constexpr char kUser[] = "<｜User｜>";
constexpr char kAssistant[] = "<｜Assistant｜>";
constexpr char kThinkStart[] = "<think>";
constexpr char kThinkEnd[] = "</think>";

struct AddedToken {
  std::string content;
  int32_t id;
  bool special;
};

Result<RegexPtr> CompileRegex(const std::string& pattern, bool literal, const std::string& where) {
  int err = 0;
  PCRE2_SIZE offset = 0;
  uint32_t opts = PCRE2_UTF | PCRE2_UCP | (literal ? PCRE2_LITERAL : 0);
  pcre2_code* code = pcre2_compile(reinterpret_cast<PCRE2_SPTR>(pattern.data()), pattern.size(),
                                   opts, &err, &offset, nullptr);
  if (!code) {
    PCRE2_UCHAR buf[256];
    pcre2_get_error_message(err, buf, sizeof(buf));
    return InvalidArgument(where + ": bad regex at offset " + std::to_string(offset) + ": " +
                           reinterpret_cast<char*>(buf));
  }
  pcre2_jit_compile(code, PCRE2_JIT_COMPLETE);  // a speed-up only; falls back to interpreting
  return RegexPtr(code);
}

// Isolated split: every match and every gap between matches becomes its own piece.
Status SplitIsolated(const pcre2_code* re, const std::string& s, std::vector<std::string>* out) {
  pcre2_match_data* md = pcre2_match_data_create_from_pattern(re, nullptr);
  PCRE2_SPTR subject = reinterpret_cast<PCRE2_SPTR>(s.data());
  size_t pos = 0, gap = 0;
  Status status;
  while (pos <= s.size()) {
    // The text was checked once (PreTokenize); PCRE2 would re-check all of it on every call.
    int rc = pcre2_match(re, subject, s.size(), pos, PCRE2_NO_UTF_CHECK, md, nullptr);
    if (rc == PCRE2_ERROR_NOMATCH) break;
    if (rc < 0) {
      PCRE2_UCHAR buf[256];
      pcre2_get_error_message(rc, buf, sizeof(buf));
      status = InvalidArgument(std::string("pre-tokenizer regex failed: ") +
                               reinterpret_cast<char*>(buf));
      break;
    }
    PCRE2_SIZE* ov = pcre2_get_ovector_pointer(md);
    size_t b = ov[0], e = ov[1];
    if (e == b) {  // empty match: step one character forward
      pos = b + 1;
      while (pos < s.size() && (static_cast<unsigned char>(s[pos]) & 0xC0) == 0x80) ++pos;
      continue;
    }
    if (b > gap) out->push_back(s.substr(gap, b - gap));
    out->push_back(s.substr(b, e - b));
    gap = pos = e;
  }
  if (status.ok() && gap < s.size()) out->push_back(s.substr(gap));
  pcre2_match_data_free(md);
  return status;
}

bool IsValidUtf8(const std::string& s) {
  std::string copy;
  copy.reserve(s.size());
  return tok::AppendValidUtf8(s, true, &copy) == s.size() && copy == s;
}

std::string JsonPath(const std::string& origin, const std::string& path) {
  return origin + ": " + path;
}

// Ids above this are refused (the real vocabulary has 129280): every id sizes the id tables.
constexpr int64_t kMaxTokenId = (int64_t{1} << 24) - 1;

// Member `key` of object `o` (at JSON path `where`): `fallback` when absent or null, an error
// naming the path when it has another type (nlohmann's value() would throw past every caller).
Result<std::string> OptString(const json& o, const char* key, const char* fallback,
                              const std::string& where) {
  if (!o.contains(key) || o[key].is_null()) return std::string(fallback);
  if (!o[key].is_string()) return InvalidArgument(where + "/" + key + ": expected a string");
  return o[key].get<std::string>();
}
Result<bool> OptBool(const json& o, const char* key, bool fallback, const std::string& where) {
  if (!o.contains(key) || o[key].is_null()) return fallback;
  if (!o[key].is_boolean()) return InvalidArgument(where + "/" + key + ": expected true or false");
  return o[key].get<bool>();
}

// A token string of tokenizer_config.json: "text" or {"content": "text", ...}.
Result<std::string> ConfigToken(const json& cfg, const char* key, const std::string& origin) {
  const json& v = cfg[key];
  if (v.is_string()) return v.get<std::string>();
  if (v.is_object() && v.contains("content") && v["content"].is_string())
    return v["content"].get<std::string>();
  return InvalidArgument(JsonPath(origin, std::string("/") + key) +
                         ": expected a string or an object with a string \"content\"");
}

// tokenizer.json of the real model is ~8 MB; a bound keeps /dev/zero or a FIFO an error.
Result<std::string> ReadFile(const std::string& path) { return ReadSmallFile(path, 256u << 20); }

}  // namespace

struct Tokenizer::Impl {
  std::string origin;
  std::unordered_map<std::string, int32_t> vocab;   // byte-mapped token string -> id
  std::vector<std::string> id_bytes;                // id -> raw bytes (added: content)
  std::vector<uint8_t> id_defined, id_special;
  std::array<int32_t, 256> byte_id{};               // single-byte token of each byte, -1 none
  // (left id << 32 | right id) -> (rank, merged id)
  std::unordered_map<uint64_t, std::pair<int32_t, int32_t>> merges;
  bool ignore_merges = false;
  std::vector<SplitStep> steps;
  std::vector<AddedToken> added;                    // in the file's order
  // The added tokens as a byte trie: node 0 is the root; edge (node << 8 | byte) -> child;
  // added_at[node]: the index into added of the token ending there, -1 none. Finding the
  // longest token at a position walks at most the longest token's bytes, whatever their count.
  std::unordered_map<uint64_t, int32_t> added_edges;
  std::vector<int32_t> added_at{-1};
  int32_t bos = -1, eos = -1;
  std::string bos_text, eos_text;

  Status ParseModel(const json& m);
  Status ParsePreTokenizer(const json& p);
  Status ParseAdded(const json& a);
  // The longest added token that text holds at byte i, or null.
  const AddedToken* LongestAddedAt(const std::string& text, size_t i) const;
  Status Bpe(const std::string& piece, std::vector<int32_t>* ids) const;
  Result<std::vector<std::string>> PreTokenize(const std::string& text) const;
  Status EncodePlain(const std::string& text, std::vector<int32_t>* ids) const;
};

Status Tokenizer::Impl::ParseModel(const json& m) {
  if (!m.is_object()) return InvalidArgument(JsonPath(origin, "/model") + ": missing object");
  FM_ASSIGN_OR_RETURN(const std::string type, OptString(m, "type", "", JsonPath(origin, "/model")));
  if (type != "BPE")
    return InvalidArgument(JsonPath(origin, "/model/type") + ": expected \"BPE\"");
  for (const char* key : {"continuing_subword_prefix", "end_of_word_suffix"})
    if (m.contains(key) && m[key].is_string() && !m[key].get<std::string>().empty())
      return InvalidArgument(JsonPath(origin, std::string("/model/") + key) + ": unsupported");
  if (m.contains("ignore_merges") && m["ignore_merges"].is_boolean())
    ignore_merges = m["ignore_merges"].get<bool>();
  if (!m.contains("vocab") || !m["vocab"].is_object())
    return InvalidArgument(JsonPath(origin, "/model/vocab") + ": missing object");
  int32_t max_id = -1;
  for (auto it = m["vocab"].begin(); it != m["vocab"].end(); ++it) {
    if (!it.value().is_number_integer() || it.value().get<int64_t>() < 0 ||
        it.value().get<int64_t>() > kMaxTokenId)
      return InvalidArgument(JsonPath(origin, "/model/vocab/" + it.key()) +
                             ": expected an integer id in [0, " + std::to_string(kMaxTokenId) + "]");
    int32_t id = it.value().get<int32_t>();
    vocab[it.key()] = id;
    max_id = std::max(max_id, id);
  }
  id_bytes.assign(max_id + 1, {});
  id_defined.assign(max_id + 1, 0);
  id_special.assign(max_id + 1, 0);
  for (const auto& [text, id] : vocab) {
    std::string raw;
    for (size_t i = 0; i < text.size();) {
      uint32_t cp;
      int n = tok::DecodeUtf8(text, i, &cp);
      int b = tok::CodepointToByte(cp);
      if (b >= 0) raw.push_back(static_cast<char>(b));
      else raw.append(text, i, n);  // not byte-level (e.g. a special token kept in vocab)
      i += n;
    }
    id_bytes[id] = raw;
    id_defined[id] = 1;
  }
  byte_id.fill(-1);
  for (int b = 0; b < 256; ++b) {
    std::string mapped;
    tok::AppendUtf8(tok::ByteToCodepoint()[b], &mapped);
    auto it = vocab.find(mapped);
    if (it != vocab.end()) byte_id[b] = it->second;
  }
  if (!m.contains("merges") || !m["merges"].is_array())
    return InvalidArgument(JsonPath(origin, "/model/merges") + ": missing array");
  const json& ms = m["merges"];
  for (size_t r = 0; r < ms.size(); ++r) {
    std::string where = JsonPath(origin, "/model/merges/" + std::to_string(r));
    std::string a, b;
    if (ms[r].is_string()) {
      const std::string s = ms[r].get<std::string>();
      size_t sp = s.find(' ');
      if (sp == std::string::npos || sp == 0 || sp + 1 >= s.size() ||
          s.find(' ', sp + 1) != std::string::npos)
        return InvalidArgument(where + ": expected \"left right\", got \"" + s + "\"");
      a = s.substr(0, sp);
      b = s.substr(sp + 1);
    } else if (ms[r].is_array() && ms[r].size() == 2 && ms[r][0].is_string() &&
               ms[r][1].is_string()) {
      a = ms[r][0].get<std::string>();
      b = ms[r][1].get<std::string>();
    } else {
      return InvalidArgument(where + ": expected \"left right\" or [left, right]");
    }
    auto ia = vocab.find(a), ib = vocab.find(b), iab = vocab.find(a + b);
    if (ia == vocab.end() || ib == vocab.end() || iab == vocab.end())
      return InvalidArgument(where + ": \"" + a + "\", \"" + b + "\" or their merge \"" + a + b +
                             "\" is not in /model/vocab");
    uint64_t key = (static_cast<uint64_t>(ia->second) << 32) | static_cast<uint32_t>(ib->second);
    merges.emplace(key, std::make_pair(static_cast<int32_t>(r), iab->second));  // first wins
  }
  return Status::Ok();
}

Status Tokenizer::Impl::ParsePreTokenizer(const json& p) {
  if (p.is_null()) return Status::Ok();
  if (!p.is_object()) return InvalidArgument(JsonPath(origin, "/pre_tokenizer") + ": expected an object");
  std::vector<std::pair<const json*, std::string>> list;
  FM_ASSIGN_OR_RETURN(const std::string top, OptString(p, "type", "", JsonPath(origin, "/pre_tokenizer")));
  if (top == "Sequence") {
    if (!p.contains("pretokenizers") || !p["pretokenizers"].is_array())
      return InvalidArgument(JsonPath(origin, "/pre_tokenizer/pretokenizers") + ": missing array");
    for (size_t i = 0; i < p["pretokenizers"].size(); ++i)
      list.emplace_back(&p["pretokenizers"][i], "/pre_tokenizer/pretokenizers/" + std::to_string(i));
  } else {
    list.emplace_back(&p, "/pre_tokenizer");
  }
  for (const auto& [step, path] : list) {
    const std::string where = JsonPath(origin, path);
    if (!step->is_object()) return InvalidArgument(where + ": expected an object");
    FM_ASSIGN_OR_RETURN(const std::string type, OptString(*step, "type", "", where));
    if (type == "Split") {
      static const json kNone;
      const json& pat = step->contains("pattern") ? (*step)["pattern"] : kNone;
      bool literal = pat.is_object() && pat.contains("String") && pat["String"].is_string();
      bool regex = pat.is_object() && pat.contains("Regex") && pat["Regex"].is_string();
      if (!literal && !regex)
        return InvalidArgument(where + "/pattern" +
                               ": expected {\"Regex\": ...} or {\"String\": ...}");
      FM_ASSIGN_OR_RETURN(const std::string behavior, OptString(*step, "behavior", "", where));
      if (behavior != "Isolated")
        return InvalidArgument(where + "/behavior" + ": only \"Isolated\" is supported");
      FM_ASSIGN_OR_RETURN(const bool invert, OptBool(*step, "invert", false, where));
      if (invert)
        return InvalidArgument(where + "/invert" + ": only false is supported");
      std::string text = literal ? pat["String"].get<std::string>() : pat["Regex"].get<std::string>();
      FM_ASSIGN_OR_RETURN(RegexPtr re, CompileRegex(text, literal, where + "/pattern"));
      steps.push_back({std::move(re), false});
    } else if (type == "ByteLevel") {
      // Byte mapping itself is implicit: BPE runs on the raw bytes of each piece.
      FM_ASSIGN_OR_RETURN(const bool prefix, OptBool(*step, "add_prefix_space", false, where));
      FM_ASSIGN_OR_RETURN(const bool use_regex, OptBool(*step, "use_regex", true, where));
      if (use_regex) {
        FM_ASSIGN_OR_RETURN(RegexPtr re, CompileRegex(kGpt2Pattern, false, "GPT-2 regex"));
        steps.push_back({std::move(re), prefix});
      } else if (prefix) {
        steps.push_back({nullptr, true});
      }
    } else {
      return InvalidArgument(where + "/type" + ": unsupported pre-tokenizer \"" +
                             type + "\" (Split and ByteLevel are)");
    }
  }
  return Status::Ok();
}

Status Tokenizer::Impl::ParseAdded(const json& a) {
  if (a.is_null()) return Status::Ok();
  if (!a.is_array()) return InvalidArgument(JsonPath(origin, "/added_tokens") + ": expected an array");
  for (size_t i = 0; i < a.size(); ++i) {
    std::string path = JsonPath(origin, "/added_tokens/" + std::to_string(i));
    const json& t = a[i];
    if (!t.is_object() || !t.contains("id") || !t["id"].is_number_integer() ||
        t["id"].get<int64_t>() < 0 || t["id"].get<int64_t>() > kMaxTokenId)
      return InvalidArgument(path + "/id: expected an integer in [0, " + std::to_string(kMaxTokenId) + "]");
    if (!t.contains("content") || !t["content"].is_string() ||
        t["content"].get<std::string>().empty())
      return InvalidArgument(path + "/content: expected a non-empty string");
    FM_ASSIGN_OR_RETURN(const bool special, OptBool(t, "special", false, path));
    AddedToken tok{t["content"].get<std::string>(), t["id"].get<int32_t>(), special};
    if (tok.id >= static_cast<int32_t>(id_bytes.size())) {
      id_bytes.resize(tok.id + 1);
      id_defined.resize(tok.id + 1, 0);
      id_special.resize(tok.id + 1, 0);
    }
    id_bytes[tok.id] = tok.content;
    id_defined[tok.id] = 1;
    id_special[tok.id] = tok.special;
    added.push_back(std::move(tok));
  }
  for (size_t k = 0; k < added.size(); ++k) {
    int32_t node = 0;
    for (unsigned char c : added[k].content) {
      auto [it, is_new] = added_edges.try_emplace(uint64_t(node) << 8 | c, static_cast<int32_t>(added_at.size()));
      if (is_new) added_at.push_back(-1);
      node = it->second;
    }
    if (added_at[node] < 0) added_at[node] = static_cast<int32_t>(k);  // a duplicate: the file's first
  }
  return Status::Ok();
}

const AddedToken* Tokenizer::Impl::LongestAddedAt(const std::string& text, size_t i) const {
  const AddedToken* hit = nullptr;
  for (int32_t node = 0; i < text.size(); ++i) {
    auto it = added_edges.find(uint64_t(node) << 8 | static_cast<unsigned char>(text[i]));
    if (it == added_edges.end()) break;
    node = it->second;
    if (added_at[node] >= 0) hit = &added[added_at[node]];
  }
  return hit;
}

Result<std::vector<std::string>> Tokenizer::Impl::PreTokenize(const std::string& text) const {
  if (!IsValidUtf8(text)) return InvalidArgument("text is not valid UTF-8");
  std::vector<std::string> pieces{text}, next;
  for (const SplitStep& step : steps) {
    next.clear();
    for (std::string& piece : pieces) {
      if (step.add_prefix_space && !piece.empty() && piece[0] != ' ') piece.insert(0, 1, ' ');
      if (step.regex) FM_RETURN_IF_ERROR(SplitIsolated(step.regex.get(), piece, &next));
      else next.push_back(std::move(piece));
    }
    pieces.swap(next);
  }
  std::erase_if(pieces, [](const std::string& p) { return p.empty(); });
  return pieces;
}

// Byte-level BPE of one piece: repeatedly merge the adjacent pair of lowest rank (leftmost
// first among equal ranks), as HF's word merge does with its (rank, position) heap.
Status Tokenizer::Impl::Bpe(const std::string& piece, std::vector<int32_t>* ids) const {
  if (ignore_merges) {
    auto it = vocab.find(tok::ByteMap(piece));
    if (it != vocab.end()) {
      ids->push_back(it->second);
      return Status::Ok();
    }
  }
  const int n = static_cast<int>(piece.size());
  std::vector<int32_t> sym(n), prev(n), next(n);
  for (int i = 0; i < n; ++i) {
    int32_t id = byte_id[static_cast<unsigned char>(piece[i])];
    if (id < 0) {
      char hex[8];
      std::snprintf(hex, sizeof(hex), "0x%02X", static_cast<unsigned char>(piece[i]));
      return InvalidArgument(origin + ": no token for byte " + hex + " (vocab lacks its byte token)");
    }
    sym[i] = id;
    prev[i] = i - 1;
    next[i] = i + 1 < n ? i + 1 : -1;
  }
  struct Cand {
    int32_t rank, left, right, a, b;
    bool operator>(const Cand& o) const { return rank != o.rank ? rank > o.rank : left > o.left; }
  };
  std::priority_queue<Cand, std::vector<Cand>, std::greater<Cand>> heap;
  auto push = [&](int l) {
    if (l < 0 || next[l] < 0) return;
    int r = next[l];
    uint64_t key = (static_cast<uint64_t>(sym[l]) << 32) | static_cast<uint32_t>(sym[r]);
    auto it = merges.find(key);
    if (it != merges.end()) heap.push({it->second.first, l, r, sym[l], sym[r]});
  };
  for (int i = 0; i + 1 < n; ++i) push(i);
  while (!heap.empty()) {
    Cand c = heap.top();
    heap.pop();
    if (sym[c.left] != c.a || next[c.left] != c.right || sym[c.right] != c.b) continue;  // stale
    uint64_t key = (static_cast<uint64_t>(c.a) << 32) | static_cast<uint32_t>(c.b);
    sym[c.left] = merges.at(key).second;
    sym[c.right] = -1;
    next[c.left] = next[c.right];
    if (next[c.left] >= 0) prev[next[c.left]] = c.left;
    push(prev[c.left]);
    push(c.left);
  }
  for (int i = 0; i >= 0 && n > 0; i = next[i]) ids->push_back(sym[i]);
  return Status::Ok();
}

Status Tokenizer::Impl::EncodePlain(const std::string& text, std::vector<int32_t>* ids) const {
  FM_ASSIGN_OR_RETURN(std::vector<std::string> pieces, PreTokenize(text));
  for (const std::string& p : pieces) FM_RETURN_IF_ERROR(Bpe(p, ids));
  return Status::Ok();
}

Result<Tokenizer> Tokenizer::FromJson(const std::string& json_text, const std::string& origin) {
  json j = json::parse(json_text, nullptr, /*allow_exceptions=*/false);
  if (j.is_discarded() || !j.is_object())
    return InvalidArgument(origin + ": not a valid JSON object");
  auto impl = std::make_shared<Impl>();
  impl->origin = origin;
  // DeepSeek ships an empty Sequence: the identity, like null.
  if (j.contains("normalizer") && !j["normalizer"].is_null() &&
      !(j["normalizer"].is_object() && j["normalizer"].contains("type") &&
        j["normalizer"]["type"] == "Sequence" &&
        j["normalizer"].contains("normalizers") && j["normalizer"]["normalizers"].is_array() &&
        j["normalizer"]["normalizers"].empty()))
    return InvalidArgument(JsonPath(origin, "/normalizer") +
                           ": only null or an empty Sequence is supported");
  if (!j.contains("model")) return InvalidArgument(JsonPath(origin, "/model") + ": missing");
  FM_RETURN_IF_ERROR(impl->ParseModel(j["model"]));
  FM_RETURN_IF_ERROR(impl->ParsePreTokenizer(j.contains("pre_tokenizer") ? j["pre_tokenizer"] : json()));
  FM_RETURN_IF_ERROR(impl->ParseAdded(j.contains("added_tokens") ? j["added_tokens"] : json()));
  if (j.contains("decoder") && !j["decoder"].is_null() &&
      !(j["decoder"].is_object() && j["decoder"].contains("type") && j["decoder"]["type"] == "ByteLevel"))
    return InvalidArgument(JsonPath(origin, "/decoder") + ": only {\"type\": \"ByteLevel\"} is supported");
  Tokenizer t(impl);
  impl->bos_text = kBos;
  impl->eos_text = kEos;
  impl->bos = t.TokenToId(kBos);
  impl->eos = t.TokenToId(kEos);
  return t;
}

Result<Tokenizer> Tokenizer::LoadFile(const std::string& path) {
  FM_ASSIGN_OR_RETURN(std::string text, ReadFile(path));
  return FromJson(text, path);
}

Result<Tokenizer> Tokenizer::Load(const std::string& dir) {
  FM_ASSIGN_OR_RETURN(Tokenizer t, LoadFile(dir + "/tokenizer.json"));
  const std::string cfg_path = dir + "/tokenizer_config.json";
  auto cfg_text = ReadFile(cfg_path);
  if (!cfg_text.ok()) return t;  // optional: defaults stay the DeepSeek names
  json cfg = json::parse(*cfg_text, nullptr, false);
  if (cfg.is_discarded() || !cfg.is_object())
    return InvalidArgument(cfg_path + ": not a valid JSON object");
  auto impl = std::const_pointer_cast<Impl>(t.impl_);
  for (auto [key, text, id] : {std::make_tuple("bos_token", &impl->bos_text, &impl->bos),
                               std::make_tuple("eos_token", &impl->eos_text, &impl->eos)}) {
    if (!cfg.contains(key) || cfg[key].is_null()) continue;
    FM_ASSIGN_OR_RETURN(std::string name, ConfigToken(cfg, key, cfg_path));
    int32_t found = t.TokenToId(name);
    if (found < 0)
      return InvalidArgument(JsonPath(cfg_path, std::string("/") + key) + ": \"" + name +
                             "\" is not a token of " + dir + "/tokenizer.json");
    *text = name;
    *id = found;
  }
  return t;
}

Result<std::vector<std::string>> Tokenizer::PreTokenize(const std::string& text) const {
  return impl_->PreTokenize(text);
}

Result<std::vector<int32_t>> Tokenizer::Encode(const std::string& text) const {
  if (!IsValidUtf8(text)) return InvalidArgument("Encode: text is not valid UTF-8");
  std::vector<int32_t> ids;
  size_t start = 0;  // beginning of the current stretch of plain text
  for (size_t i = 0; i < text.size();) {
    const AddedToken* hit = impl_->LongestAddedAt(text, i);
    if (!hit) {
      ++i;
      continue;
    }
    FM_RETURN_IF_ERROR(impl_->EncodePlain(text.substr(start, i - start), &ids));
    ids.push_back(hit->id);
    i += hit->content.size();
    start = i;
  }
  FM_RETURN_IF_ERROR(impl_->EncodePlain(text.substr(start), &ids));
  return ids;
}

Result<std::string> Tokenizer::TokenBytes(int32_t id) const {
  if (id < 0 || id >= static_cast<int32_t>(impl_->id_bytes.size()) || !impl_->id_defined[id])
    return OutOfRange("token id " + std::to_string(id) + " is not in the vocabulary of " +
                      impl_->origin);
  return impl_->id_bytes[id];
}

Result<std::string> Tokenizer::IdToToken(int32_t id) const {
  FM_ASSIGN_OR_RETURN(std::string bytes, TokenBytes(id));
  std::string mapped = tok::ByteMap(bytes);
  // A vocab token is stored byte-mapped; an added token (its id not the vocab's for those
  // bytes) as its content.
  auto it = impl_->vocab.find(mapped);
  return it != impl_->vocab.end() && it->second == id ? mapped : bytes;
}

Result<std::string> Tokenizer::Decode(const std::vector<int32_t>& ids, bool skip_special) const {
  std::string raw, out;
  for (int32_t id : ids) {
    FM_ASSIGN_OR_RETURN(std::string bytes, TokenBytes(id));
    if (!(skip_special && impl_->id_special[id])) raw += bytes;
  }
  tok::AppendValidUtf8(raw, true, &out);
  return out;
}

int32_t Tokenizer::TokenToId(const std::string& token) const {
  for (const AddedToken& a : impl_->added)
    if (a.content == token) return a.id;
  auto it = impl_->vocab.find(token);
  return it == impl_->vocab.end() ? -1 : it->second;
}

bool Tokenizer::IsSpecial(int32_t id) const {
  return id >= 0 && id < static_cast<int32_t>(impl_->id_special.size()) && impl_->id_special[id];
}

int32_t Tokenizer::bos_id() const { return impl_->bos; }
int32_t Tokenizer::eos_id() const { return impl_->eos; }
int64_t Tokenizer::vocab_size() const { return static_cast<int64_t>(impl_->id_bytes.size()); }

Result<std::string> Tokenizer::ApplyChatTemplate(const std::vector<ChatMessage>& messages,
                                                 bool thinking) const {
  int last_user = -1;
  for (size_t i = 0; i < messages.size(); ++i)
    if (messages[i].role == "user") last_user = static_cast<int>(i);
  std::string out = impl_->bos_text;
  for (size_t i = 0; i < messages.size(); ++i) {
    const ChatMessage& m = messages[i];
    if (m.role == "system") {
      out += m.content;
    } else if (m.role == "user") {
      out += kUser;
      out += m.content;
      bool answer_follows = i + 1 == messages.size() || messages[i + 1].role == "assistant";
      if (answer_follows) {
        out += kAssistant;
        // Thinking mode opens a reasoning block only for the turn being answered now; earlier
        // turns had their reasoning dropped, which the format marks with "</think>".
        out += thinking && static_cast<int>(i) == last_user ? kThinkStart : kThinkEnd;
      }
    } else if (m.role == "assistant") {
      if (thinking && static_cast<int>(i) > last_user) out += kThinkEnd;  // empty reasoning
      out += m.content;
      out += impl_->eos_text;
    } else {
      return InvalidArgument("messages[" + std::to_string(i) + "].role: \"" + m.role +
                             "\" (expected system, user or assistant)");
    }
  }
  return out;
}

Result<std::string> StreamDecoder::Push(int32_t id) {
  FM_ASSIGN_OR_RETURN(std::string bytes, tok_.TokenBytes(id));
  if (!(skip_special_ && tok_.IsSpecial(id))) pending_ += bytes;
  std::string out;
  size_t used = tok::AppendValidUtf8(pending_, false, &out);
  pending_.erase(0, used);
  return out;
}

std::string StreamDecoder::Flush() {
  std::string out;
  tok::AppendValidUtf8(pending_, true, &out);
  pending_.clear();
  return out;
}

}  // namespace fm
