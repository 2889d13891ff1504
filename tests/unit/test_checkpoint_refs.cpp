// CheckpointRefs (coordinator/checkpoint_refs.h): the coordinator's copy is the reference; a
// file it lacks takes the first node's copy; a node with another checkpoint is refused by name.
#include <gtest/gtest.h>

#include <filesystem>

#include "coordinator/checkpoint_refs.h"
#include "model/checkpoint.h"
#include "model/mkmodel.h"
#include "tests/unit/test_checkpoint_util.h"

namespace fm {
namespace {

namespace fs = std::filesystem;

std::vector<FileFingerprint> Files(const std::string& dir) {
  auto f = FingerprintCheckpoint(dir);
  EXPECT_TRUE(f.ok()) << f.status().ToString();
  return f.ok() ? *f : std::vector<FileFingerprint>{};
}

struct TwoSeeds {
  std::string a = testing_ck::TempDir("refs_a"), b = testing_ck::TempDir("refs_b");
  TwoSeeds() {
    EXPECT_TRUE(WritePresetCheckpoint(a, "tiny", 1).ok());
    EXPECT_TRUE(WritePresetCheckpoint(b, "tiny", 2).ok());
  }
};

TEST(CheckpointRefs, TheCoordinatorsCopyIsTheReference) {
  TwoSeeds m;
  CheckpointRefs refs(m.a);
  const std::vector<FileFingerprint> expected = refs.Expected();
  ASSERT_EQ(expected.size(), CheckpointFiles(m.a).size());
  for (const FileFingerprint& f : expected) EXPECT_EQ(f.source, "the coordinator's") << f.name;
  EXPECT_TRUE(refs.Admit("w0", Files(m.a)).ok());
  Status s = refs.Admit("w1", Files(m.b));
  ASSERT_FALSE(s.ok());
  EXPECT_NE(s.message().find("node w1: checkpoint file " + CheckpointFiles(m.a)[2] +
                             " differs from the coordinator's copy (here "),
            std::string::npos)
      << s.message();
  EXPECT_NE(s.message().find("every node must load the same checkpoint"), std::string::npos);
  EXPECT_EQ(refs.Expected().size(), expected.size());   // nothing learnt from either node
}

TEST(CheckpointRefs, AFileTheCoordinatorLacksTakesTheFirstNodesCopy) {
  TwoSeeds m;
  // A coordinator that holds config.json and the tokenizer only.
  const std::string only = testing_ck::TempDir("refs_config_only");
  fs::create_directories(only);
  fs::copy_file(m.a + "/config.json", only + "/config.json");
  CheckpointRefs refs(only);
  ASSERT_EQ(refs.Expected().size(), 1u);
  EXPECT_EQ(refs.Expected()[0].name, "config.json");

  // A node whose config.json is not the coordinator's is refused and teaches nothing.
  std::vector<FileFingerprint> odd = Files(m.a);
  odd[0].crc32c ^= 1;
  Status s = refs.Admit("w2", odd);
  ASSERT_FALSE(s.ok());
  EXPECT_NE(s.message().find("node w2: checkpoint file config.json differs from the coordinator's copy"),
            std::string::npos)
      << s.message();
  EXPECT_EQ(refs.Expected().size(), 1u);

  ASSERT_TRUE(refs.Admit("w0", Files(m.a)).ok());
  const std::vector<FileFingerprint> expected = refs.Expected();
  ASSERT_EQ(expected.size(), CheckpointFiles(m.a).size());
  for (size_t i = 1; i < expected.size(); ++i) EXPECT_EQ(expected[i].source, "node w0's") << expected[i].name;
  s = refs.Admit("w1", Files(m.b));
  ASSERT_FALSE(s.ok());
  EXPECT_NE(s.message().find("node w1: checkpoint file " + CheckpointFiles(m.a)[2] +
                             " differs from node w0's copy"),
            std::string::npos)
      << s.message();
  EXPECT_TRUE(refs.Admit("w1", Files(m.a)).ok());
}

TEST(CheckpointRefs, NoModelDirectoryNoReferences) {
  EXPECT_TRUE(CheckpointRefs("").Expected().empty());
  EXPECT_TRUE(CheckpointRefs(testing_ck::TempDir("refs_missing")).Expected().empty());
}

}  // namespace
}  // namespace fm
