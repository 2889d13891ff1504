// Checkpoint fingerprints (model/checkpoint_fingerprint.h): which files a load reads, what a
// fingerprint covers, and the refusal that names the file and both copies.
#include <gtest/gtest.h>

#include <filesystem>
#include <set>

#include "common/crc32c.h"
#include "model/checkpoint.h"
#include "model/checkpoint_fingerprint.h"
#include "tests/unit/test_checkpoint_util.h"

namespace fm {
namespace {

using testing_ck::ReadAll;
using testing_ck::TempDir;
using testing_ck::TinyCopy;
using testing_ck::WriteAll;

TEST(CheckpointFiles, ConfigThenIndexThenTheShardsItNames) {
  const std::string d = TinyCopy("files");
  const std::vector<std::string> files = CheckpointFiles(d);
  ASSERT_GE(files.size(), 3u);
  EXPECT_EQ(files[0], "config.json");
  EXPECT_EQ(files[1], "model.safetensors.index.json");
  auto index = nlohmann::json::parse(ReadAll(d + "/model.safetensors.index.json"));
  std::set<std::string> shards;
  for (auto& [tensor, file] : index["weight_map"].items()) shards.insert(file.get<std::string>());
  EXPECT_EQ(std::vector<std::string>(files.begin() + 2, files.end()),
            std::vector<std::string>(shards.begin(), shards.end()));
  // The tokenizer is the coordinator's alone; no worker reads it.
  for (const std::string& f : files) EXPECT_EQ(f.find("tokenizer"), std::string::npos) << f;

  // What exists: a directory with config.json alone (a coordinator's), one with a single
  // model.safetensors, an index that does not parse (Open names what is wrong with it).
  const std::string only = TempDir("files_config_only");
  std::filesystem::create_directories(only);
  std::filesystem::copy_file(d + "/config.json", only + "/config.json");
  EXPECT_EQ(CheckpointFiles(only), std::vector<std::string>{"config.json"});
  WriteAll(only + "/model.safetensors", "x");
  EXPECT_EQ(CheckpointFiles(only), (std::vector<std::string>{"config.json", "model.safetensors"}));
  WriteAll(only + "/model.safetensors.index.json", "{");
  EXPECT_EQ(CheckpointFiles(only), (std::vector<std::string>{"config.json", "model.safetensors.index.json"}));
  EXPECT_TRUE(CheckpointFiles(TempDir("files_none")).empty());
}

TEST(FingerprintFile, ASmallFileIsReadWhole) {
  const std::string d = TempDir("fp_small");
  std::filesystem::create_directories(d);
  const std::string bytes = "{\"hidden_size\": 4096}";
  WriteAll(d + "/config.json", bytes);
  auto f = FingerprintFile(d, "config.json");
  ASSERT_TRUE(f.ok()) << f.status().ToString();
  EXPECT_EQ(f->name, "config.json");
  EXPECT_EQ(f->size, bytes.size());
  EXPECT_EQ(f->crc32c, Crc32c(bytes.data(), bytes.size()));
  EXPECT_EQ(DescribeFingerprint(*f).find("sampled"), std::string::npos);

  auto missing = FingerprintFile(d, "model.safetensors");
  ASSERT_FALSE(missing.ok());
  EXPECT_NE(missing.status().message().find(d + "/model.safetensors: cannot open"), std::string::npos)
      << missing.status().message();
  std::filesystem::create_directories(d + "/sub");
  auto dir = FingerprintFile(d, "sub");
  ASSERT_FALSE(dir.ok());
  EXPECT_NE(dir.status().message().find("not a regular file"), std::string::npos);
}

TEST(FingerprintFile, ALargeFileIsSampledAtSixteenEvenlySpreadChunks) {
  const std::string d = TempDir("fp_large");
  std::filesystem::create_directories(d);
  std::string bytes(3 * kFingerprintWhole + 12345, '\0');
  for (size_t i = 0; i < bytes.size(); ++i) bytes[i] = static_cast<char>((i * 2654435761u) >> 13);
  WriteAll(d + "/shard.safetensors", bytes);
  auto f = FingerprintFile(d, "shard.safetensors");
  ASSERT_TRUE(f.ok()) << f.status().ToString();
  EXPECT_EQ(f->size, bytes.size());
  uint32_t want = 0;
  for (int i = 0; i < kFingerprintChunks; ++i) {
    const uint64_t at = (bytes.size() - kFingerprintChunk) * i / (kFingerprintChunks - 1);
    want = Crc32c(bytes.data() + at, kFingerprintChunk, want);
  }
  EXPECT_EQ(f->crc32c, want);
  EXPECT_NE(DescribeFingerprint(*f).find(std::to_string(bytes.size()) + " bytes, sampled CRC32C "),
            std::string::npos);

  // A byte of the first or the last chunk changes it; one between two chunks does not (a
  // fingerprint tells checkpoints apart, it does not check every byte).
  auto changed_at = [&](size_t at) {
    std::string b = bytes;
    b[at] ^= 1;
    WriteAll(d + "/shard.safetensors", b);
    auto g = FingerprintFile(d, "shard.safetensors");
    return g.ok() && g->crc32c != f->crc32c;
  };
  EXPECT_TRUE(changed_at(0));
  EXPECT_TRUE(changed_at(bytes.size() - 1));
  EXPECT_FALSE(changed_at(kFingerprintChunk + 10));   // the second chunk starts past 200 KiB
}

TEST(MatchFingerprints, NamesTheFileAndBothCopies) {
  const FileFingerprint mine{"model-00002-of-00003.safetensors", 14168812, 0x1a2b3c4d, "", "", ""};
  const FileFingerprint same{"model-00002-of-00003.safetensors", 14168812, 0x1a2b3c4d, "the coordinator's",
                             "/c/model-00002-of-00003.safetensors", ""};
  const FileFingerprint config{"config.json", 1371, 0x11111111, "the coordinator's", "/c/config.json", ""};
  EXPECT_TRUE(MatchFingerprints({mine}, "/m", {config, same}).ok());
  // A file only one side lists is no error (a coordinator holding config.json alone).
  EXPECT_TRUE(MatchFingerprints({mine}, "/m", {config}).ok());
  EXPECT_TRUE(MatchFingerprints({}, "/m", {config}).ok());

  FileFingerprint other = same;
  other.crc32c = 0x5e6f7a8b;
  Status s = MatchFingerprints({mine}, "/m", {config, other});
  ASSERT_FALSE(s.ok());
  EXPECT_EQ(s.code(), Code::kInvalidArgument);
  EXPECT_EQ(s.message(),
            "checkpoint file /m/model-00002-of-00003.safetensors differs from the coordinator's copy "
            "/c/model-00002-of-00003.safetensors (here 14168812 bytes, sampled CRC32C 1a2b3c4d; there "
            "14168812 bytes, sampled CRC32C 5e6f7a8b): every node must load the same checkpoint");
  other = same;
  other.size = 99;
  other.source = "node w0's loaded";
  other.path = "";
  other.holder = "w0";
  s = MatchFingerprints({mine}, "", {other});
  EXPECT_EQ(s.message(),
            "checkpoint file model-00002-of-00003.safetensors differs from node w0's loaded copy "
            "(here 14168812 bytes, sampled CRC32C 1a2b3c4d; there 99 bytes, CRC32C 1a2b3c4d): every node "
            "must load the same checkpoint (if w0's is the wrong one, fix its files and restart w0: it "
            "keeps the copy it loaded)");
}

// The same file names compared alone would let a checkpoint in one model.safetensors pass beside
// an index and its shards (only config.json in common): another layout is refused.
TEST(MatchFingerprints, AnotherLayoutIsRefused) {
  const FileFingerprint config{"config.json", 1371, 0x11111111, "", "", ""};
  const FileFingerprint index{"model.safetensors.index.json", 149824, 0x22222222, "the coordinator's",
                              "/c/model.safetensors.index.json", ""};
  const FileFingerprint shard{"model-00001-of-00003.safetensors", 14069642, 0x33333333, "", "", ""};
  const FileFingerprint single{"model.safetensors", 42000000, 0x44444444, "node w0's loaded", "/w0/model.safetensors", "w0"};
  Status s = MatchFingerprints({config, single}, "/m", {config, index, shard});
  ASSERT_FALSE(s.ok());
  EXPECT_EQ(s.message(),
            "the checkpoint in /m is laid out otherwise than the coordinator's copy "
            "/c/model.safetensors.index.json (here model.safetensors; there model.safetensors.index.json "
            "and the shards it names): every node must load the same checkpoint files");
  s = MatchFingerprints({config, index, shard}, "", {config, single});
  ASSERT_FALSE(s.ok());
  EXPECT_NE(s.message().find("the checkpoint in this node's model directory is laid out otherwise than "
                             "node w0's loaded copy /w0/model.safetensors (here model.safetensors.index.json and "
                             "the shards it names; there model.safetensors): every node must load the same "
                             "checkpoint files (if w0's is the wrong one, fix its files and restart w0"),
            std::string::npos)
      << s.message();
  s = MatchFingerprints({config}, "/m", {config, single});
  EXPECT_NE(s.message().find("(here no weights; there model.safetensors)"), std::string::npos) << s.message();
  // A reference without weights (a coordinator's config.json alone) takes any layout.
  EXPECT_TRUE(MatchFingerprints({config, single}, "/m", {config}).ok());
  EXPECT_TRUE(MatchFingerprints({config, index, shard}, "/m", {config}).ok());
}

TEST(FingerprintCheckpoint, AnotherSeedDiffersInEveryShardButNotInConfigOrIndex) {
  const std::string a = TempDir("fp_seed_a"), b = TempDir("fp_seed_b");
  ASSERT_TRUE(WritePresetCheckpoint(a, "tiny", 1).ok());
  ASSERT_TRUE(WritePresetCheckpoint(b, "tiny", 2).ok());
  auto fa = FingerprintCheckpoint(a), fb = FingerprintCheckpoint(b);
  ASSERT_TRUE(fa.ok() && fb.ok());
  ASSERT_EQ(fa->size(), CheckpointFiles(a).size());
  ASSERT_EQ(fa->size(), fb->size());
  for (size_t i = 0; i < fa->size(); ++i) {
    const bool shard = (*fa)[i].name.ends_with(".safetensors");
    EXPECT_EQ((*fa)[i].name, (*fb)[i].name);
    EXPECT_EQ((*fa)[i].crc32c != (*fb)[i].crc32c, shard) << (*fa)[i].name;
  }
  Status s = MatchFingerprints(*fb, b, *fa);
  ASSERT_FALSE(s.ok());
  EXPECT_NE(s.message().find("checkpoint file " + b + "/" + (*fa)[2].name + " differs from the reference copy (here "),
            std::string::npos)
      << s.message();
  // A shard the index names that is not a regular file is left out (Open names it).
  std::filesystem::remove(b + "/" + (*fb).back().name);
  std::filesystem::create_directory(b + "/" + (*fb).back().name);
  auto broken = FingerprintCheckpoint(b);
  ASSERT_TRUE(broken.ok());
  EXPECT_EQ(broken->size(), fb->size() - 1);
}

}  // namespace
}  // namespace fm
