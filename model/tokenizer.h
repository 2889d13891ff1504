// Tokenizer: HF tokenizer.json byte-level BPE as DeepSeek-V4 ships it (model BPE with vocab +
// merges, added_tokens matched before pre-tokenization, pre_tokenizer Sequence of Split regexes
// (PCRE2, UTF + UCP) + ByteLevel, decoder ByteLevel), the DeepSeek-V4 chat format, and a
// streaming decoder that only emits complete UTF-8 characters.
#pragma once
#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "common/status.h"

namespace fm {

struct ChatMessage {
  std::string role;     // "system" | "user" | "assistant"
  std::string content;
};

class Tokenizer {
 public:
  // dir/tokenizer.json plus, when present, dir/tokenizer_config.json (bos/eos token names).
  static Result<Tokenizer> Load(const std::string& dir);
  // One tokenizer.json file; bos/eos default to the DeepSeek special tokens when present.
  static Result<Tokenizer> LoadFile(const std::string& tokenizer_json_path);
  // From the JSON text itself; `origin` names it in errors.
  static Result<Tokenizer> FromJson(const std::string& json_text, const std::string& origin);

  // text -> ids. Added tokens inside the text are matched first (longest at each position);
  // no BOS is prepended (ApplyChatTemplate writes it). Fails only if a byte has no token.
  Result<std::vector<int32_t>> Encode(const std::string& text) const;
  // ids -> text. Added tokens decode to their content (skipped when skip_special and the token
  // is special). Unknown ids are an OutOfRange error naming the id.
  Result<std::string> Decode(const std::vector<int32_t>& ids, bool skip_special = false) const;
  // Raw bytes of one token (byte-level decoded; for an added token its content).
  Result<std::string> TokenBytes(int32_t id) const;
  // Id of a vocab or added token string (as stored in tokenizer.json), -1 when absent.
  int32_t TokenToId(const std::string& token) const;
  // The inverse: the token as tokenizer.json stores it (a vocab token byte-mapped, " world" as
  // "Ġworld"; an added token its content), HF's convert_ids_to_tokens. Errors as TokenBytes.
  Result<std::string> IdToToken(int32_t id) const;
  bool IsSpecial(int32_t id) const;

  int32_t bos_id() const;
  int32_t eos_id() const;
  // 1 + the largest id defined (vocab or added token).
  int64_t vocab_size() const;

  // Raw text -> pre-tokenized pieces (raw bytes, before byte mapping and BPE), added tokens not
  // considered: what the pre_tokenizer Sequence yields. Exposed for tests and merge learning.
  Result<std::vector<std::string>> PreTokenize(const std::string& text) const;

  // DeepSeek-V4 chat prompt as the official encoding_dsv4.py renders plain messages (docs/api.md
  // "Chat"): BOS, each system content as is, "<｜User｜>" + content per user turn, content + EOS
  // per assistant turn; after a user turn followed by an assistant turn or ending the list,
  // "<｜Assistant｜>" + "</think>" (chat mode) or "<think>" (thinking, last user turn only).
  // Unknown roles are InvalidArgument naming the message index.
  Result<std::string> ApplyChatTemplate(const std::vector<ChatMessage>& messages,
                                        bool thinking = false) const;

  struct Impl;

 private:
  explicit Tokenizer(std::shared_ptr<const Impl> impl) : impl_(std::move(impl)) {}
  std::shared_ptr<const Impl> impl_;  // immutable after load: copies share it, thread-safe
};

// Turns a stream of token ids into text pieces that are always whole UTF-8 characters: bytes of
// a character split across tokens are held until the character is complete.
class StreamDecoder {
 public:
  explicit StreamDecoder(const Tokenizer& tok, bool skip_special = true)
      : tok_(tok), skip_special_(skip_special) {}
  // The text that became complete with this token (possibly empty).
  Result<std::string> Push(int32_t id);
  // Whatever is still held (an incomplete character at the end), each bad byte as U+FFFD.
  std::string Flush();

 private:
  Tokenizer tok_;
  bool skip_special_;
  std::string pending_;
};

}  // namespace fm
