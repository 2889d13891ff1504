// CheckpointRefs (coordinator/checkpoint_refs.h): the coordinator's copy is the reference (read
// again when it changes); a file it lacks takes an admitted other node's copy, never the node's
// own; a node with another checkpoint is refused by name.
#include <gtest/gtest.h>

#include <chrono>
#include <filesystem>
#include <thread>

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

// A directory holding config.json alone (as a coordinator with the tokenizer and no weights).
std::string ConfigOnly(const std::string& from, const std::string& name) {
  const std::string d = testing_ck::TempDir(name);
  fs::create_directories(d);
  fs::copy_file(from + "/config.json", d + "/config.json");
  return d;
}

TEST(CheckpointRefs, TheCoordinatorsCopyIsTheReference) {
  TwoSeeds m;
  CheckpointRefs refs(m.a);
  const std::vector<FileFingerprint> expected = refs.BeginLoad("w0");
  ASSERT_EQ(expected.size(), CheckpointFiles(m.a).size());
  for (const FileFingerprint& f : expected) {
    EXPECT_EQ(f.source, "the coordinator's") << f.name;
    EXPECT_EQ(f.path, m.a + "/" + f.name);
  }
  EXPECT_TRUE(refs.Admit("w0", m.a, Files(m.a)).ok());
  refs.BeginLoad("w1");
  Status s = refs.Admit("w1", m.b, Files(m.b));
  ASSERT_FALSE(s.ok());
  const std::string shard = CheckpointFiles(m.a)[2];
  EXPECT_NE(s.message().find("node w1: checkpoint file " + m.b + "/" + shard + " differs from the coordinator's copy " +
                             m.a + "/" + shard + " (here "),
            std::string::npos)
      << s.message();
  EXPECT_NE(s.message().find("every node must load the same checkpoint"), std::string::npos);
  // A list without config.json is no proof of anything (a worker that does not fingerprint).
  s = refs.Admit("w2", m.a, {});
  ASSERT_FALSE(s.ok());
  EXPECT_NE(s.message().find("node w2 reported no fingerprint of its checkpoint's config.json"), std::string::npos)
      << s.message();
}

TEST(CheckpointRefs, TheCoordinatorsCopyIsReadAgainWhenItChanges) {
  TwoSeeds m;
  const std::string c = testing_ck::TempDir("refs_changing");
  fs::copy(m.b, c, fs::copy_options::recursive);
  CheckpointRefs refs(c);
  EXPECT_FALSE(refs.Admit("w0", m.a, Files(m.a)).ok());
  // The operator puts the right files there: the next load compares with them.
  std::this_thread::sleep_for(std::chrono::milliseconds(20));   // a later mtime on any clock
  for (const auto& f : fs::directory_iterator(m.a))
    fs::copy_file(f.path(), c + "/" + f.path().filename().string(), fs::copy_options::overwrite_existing);
  refs.BeginLoad("w0");
  EXPECT_TRUE(refs.Admit("w0", m.a, Files(m.a)).ok());
}

TEST(CheckpointRefs, AFileTheCoordinatorLacksTakesAnAdmittedOtherNodesCopy) {
  TwoSeeds m;
  CheckpointRefs refs(ConfigOnly(m.a, "refs_config_only"));
  ASSERT_EQ(refs.BeginLoad("w2").size(), 1u);

  // A node whose config.json is not the coordinator's is refused and teaches nothing.
  std::vector<FileFingerprint> odd = Files(m.a);
  odd[0].crc32c ^= 1;
  Status s = refs.Admit("w2", m.a, odd);
  ASSERT_FALSE(s.ok());
  EXPECT_NE(s.message().find("node w2: checkpoint file " + m.a + "/config.json differs from the coordinator's copy"),
            std::string::npos)
      << s.message();
  EXPECT_EQ(refs.BeginLoad("w1").size(), 1u);

  refs.BeginLoad("w0");
  ASSERT_TRUE(refs.Admit("w0", m.a, Files(m.a)).ok());
  const std::vector<FileFingerprint> expected = refs.BeginLoad("w1");
  ASSERT_EQ(expected.size(), CheckpointFiles(m.a).size());
  for (size_t i = 1; i < expected.size(); ++i) {
    EXPECT_EQ(expected[i].source, "node w0's") << expected[i].name;
    EXPECT_EQ(expected[i].path, m.a + "/" + expected[i].name);
  }
  s = refs.Admit("w1", m.b, Files(m.b));
  ASSERT_FALSE(s.ok());
  EXPECT_NE(s.message().find("node w1: checkpoint file " + m.b + "/" + CheckpointFiles(m.a)[2] +
                             " differs from node w0's copy " + m.a + "/"),
            std::string::npos)
      << s.message();
  EXPECT_TRUE(refs.Admit("w1", m.a, Files(m.a)).ok());
}

// The first node to load had the wrong files; the operator fixes them and restarts it: its own
// earlier copy must not refuse it (nor, through it, every other node).
TEST(CheckpointRefs, ANodeIsNoReferenceForItsOwnNextLoad) {
  TwoSeeds m;
  CheckpointRefs refs(ConfigOnly(m.a, "refs_own"));
  refs.BeginLoad("w0");
  ASSERT_TRUE(refs.Admit("w0", m.b, Files(m.b)).ok());   // wrong, but first
  refs.BeginLoad("w1");
  EXPECT_FALSE(refs.Admit("w1", m.a, Files(m.a)).ok());  // right, refused against w0's copy
  EXPECT_EQ(refs.BeginLoad("w0").size(), 1u);             // w0 loads again: only config.json
  EXPECT_EQ(refs.BeginLoad("w1").size(), 1u);             // and meanwhile is no one's reference
  ASSERT_TRUE(refs.Admit("w0", m.a, Files(m.a)).ok());
  refs.BeginLoad("w1");
  EXPECT_TRUE(refs.Admit("w1", m.a, Files(m.a)).ok());
}

TEST(CheckpointRefs, NoModelDirectoryNoReferences) {
  EXPECT_TRUE(CheckpointRefs("").BeginLoad("w0").empty());
  EXPECT_TRUE(CheckpointRefs(testing_ck::TempDir("refs_missing")).BeginLoad("w0").empty());
}

}  // namespace
}  // namespace fm
