// Helpers for the checkpoint tests: fresh temp directories with a mkmodel checkpoint, and
// raw edits of a shard's header.
#pragma once
#include <filesystem>
#include <fstream>
#include <functional>
#include <stdexcept>
#include <nlohmann/json.hpp>
#include <string>
#include <unistd.h>

#include "model/mkmodel.h"

namespace fm::testing_ck {

namespace fs = std::filesystem;

// Per process: ctest runs each test as its own process, several at once.
inline std::string TempDir(const std::string& name) {
  struct ProcessDir {  // removed when the test process exits
    fs::path path = fs::path(FM_BINARY_DIR) / "test_checkpoint_tmp" / std::to_string(::getpid());
    ~ProcessDir() { std::error_code ec; fs::remove_all(path, ec); }
  };
  static const ProcessDir root;
  const fs::path p = root.path / name;
  fs::remove_all(p);
  fs::create_directories(p.parent_path());
  return p.string();
}

// The tiny checkpoint (seed 7), written once per test binary, copied for each test.
inline std::string TinyCopy(const std::string& name) {
  static const std::string master = [] {
    const std::string d = TempDir("tiny_master");
    const Status s = WritePresetCheckpoint(d, "tiny", 7);
    if (!s.ok()) throw std::runtime_error(s.ToString());
    return d;
  }();
  const std::string d = TempDir(name);
  fs::copy(master, d, fs::copy_options::recursive);
  return d;
}

inline std::string ReadAll(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  return std::string(std::istreambuf_iterator<char>(in), {});
}
inline void WriteAll(const std::string& path, const std::string& bytes) {
  std::ofstream out(path, std::ios::binary | std::ios::trunc);
  out << bytes;
}

// Rewrites the header JSON of a shard, keeping its data section.
inline void EditHeader(const std::string& path, const std::function<void(nlohmann::json&)>& fn) {
  const std::string all = ReadAll(path);
  uint64_t n = 0;
  for (int i = 7; i >= 0; --i) n = (n << 8) | static_cast<unsigned char>(all[i]);
  nlohmann::json j = nlohmann::json::parse(all.substr(8, n));
  fn(j);
  const std::string text = j.dump();
  std::string head(8, '\0');
  for (int i = 0; i < 8; ++i) head[i] = static_cast<char>((text.size() >> (8 * i)) & 0xff);
  WriteAll(path, head + text + all.substr(8 + n));
}

// The shard file holding `tensor`, from the index.
inline std::string ShardOf(const std::string& dir, const std::string& tensor) {
  auto j = nlohmann::json::parse(ReadAll(dir + "/model.safetensors.index.json"));
  return dir + "/" + j["weight_map"][tensor].get<std::string>();
}

}  // namespace fm::testing_ck
