// Golden output: `flashmesh logits` on the small preset (every layer kind, hash layers, MTP
// weights present) gives exactly the recorded bytes. Speed work must leave these unchanged
// (the reduction order is fixed, docs/performance.md); a change of numerics that is meant
// updates kLogitsFnv1a and kArgmax in the same commit and says why.
#include <gtest/gtest.h>

#include <chrono>
#include <cstdint>
#include <filesystem>
#include <fstream>
#include <iterator>
#include <sstream>
#include <string>
#include <vector>

#include "tests/integration/cluster_fixture.h"

namespace fm::it {
namespace {

constexpr char kTokens[] = "5,17,42,99,7,1,250,8,13,21,34,55,89,144,233,377,610,987,1597,2584,4095,0,3,9";
constexpr uint64_t kLogitsFnv1a = 0x981860feb8849f76ull;   // [24, 4096] f32, little-endian
constexpr char kArgmax[] =
    "3408 1664 2118 2491 198 1299 3453 1825 1101 3072 2732 804 486 1022 666 3519 4019 3072 1098 "
    "408 3587 3473 51 2521";

uint64_t Fnv1a(const std::string& bytes) {
  uint64_t h = 0xcbf29ce484222325ull;
  for (unsigned char b : bytes) h = (h ^ b) * 0x100000001b3ull;
  return h;
}

// The stdout line of argmax ids (the log lines around it start with a level letter).
std::string ArgmaxLine(const std::string& out) {
  std::istringstream in(out);
  for (std::string line; std::getline(in, line);)
    if (!line.empty() && line.find_first_not_of("0123456789 ") == std::string::npos) return line;
  return "";
}

void ExpectGolden(const std::string& mode, const std::string& threads) {
  const std::string path = ::testing::TempDir() + "golden_" + mode + "_" + threads + ".bin";
  std::filesystem::remove(path);   // an earlier run's bytes must not pass for this run's
  std::string out;
  ASSERT_EQ(RunFlashmesh({"logits", "--model", SmallModel(), "--tokens", kTokens, "--mode", mode,
                          "--threads", threads, "--out", path},
                         &out, std::chrono::seconds(120)),
            0)
      << out;
  std::ifstream f(path, std::ios::binary);
  const std::string bytes((std::istreambuf_iterator<char>(f)), std::istreambuf_iterator<char>());
  EXPECT_EQ(bytes.size(), 24u * 4096u * 4u);
  EXPECT_EQ(Fnv1a(bytes), kLogitsFnv1a) << "mode " << mode << ", " << threads << " threads";
  EXPECT_EQ(ArgmaxLine(out), kArgmax) << out;
}

TEST(GoldenOutput, SmallPresetPrefillLogitsAreTheRecordedBytes) { ExpectGolden("prefill", "2"); }

// Decode (one token at a time, one thread) reproduces prefill's bytes exactly.
TEST(GoldenOutput, SmallPresetDecodeLogitsAreTheRecordedBytes) { ExpectGolden("decode", "1"); }

}  // namespace
}  // namespace fm::it
