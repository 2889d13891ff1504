// libFuzzer target: tokenizer.json (model/tokenizer.cpp) must turn any file into a tokenizer or
// an error, never a crash or an exception (nlohmann's typed accessors throw); whatever it
// accepts must encode and decode text without crashing.
#include <cstdint>
#include <string>

#include "model/tokenizer.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  const std::string text(reinterpret_cast<const char*>(data), size);
  auto t = fm::Tokenizer::FromJson(text, "fuzz.json");
  if (!t.ok()) return 0;
  for (const char* s : {"Hello world 123", "a b  c\n", "<｜User｜>hi<｜Assistant｜>", "\xE2\x82\xAC\xE2"}) {
    auto ids = t->Encode(s);
    if (!ids.ok()) continue;
    (void)t->Decode(*ids);
    fm::StreamDecoder sd(*t);
    for (int32_t id : *ids) (void)sd.Push(id);
    (void)sd.Flush();
  }
  return 0;
}
