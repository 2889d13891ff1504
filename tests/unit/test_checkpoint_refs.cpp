// CheckpointRefs (coordinator/checkpoint_refs.h): a node must match the coordinator's copy (read
// again when it changes) and every other admitted node's, never its own earlier load; a node
// with another checkpoint is refused by name.
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

// A directory holding config.json alone (as a coordinator with the tokenizer and no weights).
std::string ConfigOnly(const std::string& from, const std::string& name) {
  const std::string d = testing_ck::TempDir(name);
  fs::create_directories(d);
  fs::copy_file(from + "/config.json", d + "/config.json");
  return d;
}

// Every file of `from` written over its namesake in `to` (an operator's copy).
void CopyOver(const std::string& from, const std::string& to) {
  for (const auto& f : fs::directory_iterator(from))
    fs::copy_file(f.path(), to + "/" + f.path().filename().string(), fs::copy_options::overwrite_existing);
}

TEST(CheckpointRefs, TheCoordinatorsCopyIsTheReference) {
  TwoSeeds m;
  CheckpointRefs refs(m.a);
  const std::vector<FileFingerprint> expected = refs.Expected("w0");
  ASSERT_EQ(expected.size(), CheckpointFiles(m.a).size());
  for (const FileFingerprint& f : expected) {
    EXPECT_EQ(f.source, "the coordinator's") << f.name;
    EXPECT_EQ(f.path, m.a + "/" + f.name);
  }
  EXPECT_TRUE(refs.Admit("w0", m.a, Files(m.a)).ok());
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
  CopyOver(m.a, c);
  EXPECT_TRUE(refs.Admit("w0", m.a, Files(m.a)).ok());
}

TEST(CheckpointRefs, AFileTheCoordinatorLacksTakesAnAdmittedOtherNodesCopy) {
  TwoSeeds m;
  CheckpointRefs refs(ConfigOnly(m.a, "refs_config_only"));
  ASSERT_EQ(refs.Expected("w2").size(), 1u);

  // A node whose config.json is not the coordinator's is refused and teaches nothing.
  std::vector<FileFingerprint> odd = Files(m.a);
  odd[0].crc32c ^= 1;
  Status s = refs.Admit("w2", m.a, odd);
  ASSERT_FALSE(s.ok());
  EXPECT_NE(s.message().find("node w2: checkpoint file " + m.a + "/config.json differs from the coordinator's copy"),
            std::string::npos)
      << s.message();
  EXPECT_EQ(refs.Expected("w1").size(), 1u);

  ASSERT_TRUE(refs.Admit("w0", m.a, Files(m.a)).ok());
  const std::vector<FileFingerprint> expected = refs.Expected("w1");
  ASSERT_EQ(expected.size(), 1 + CheckpointFiles(m.a).size());   // config.json twice
  EXPECT_EQ(expected[0].source, "the coordinator's");
  EXPECT_EQ(expected[0].holder, "");
  for (size_t i = 1; i < expected.size(); ++i) {
    EXPECT_EQ(expected[i].source, "node w0's loaded") << expected[i].name;
    EXPECT_EQ(expected[i].holder, "w0") << expected[i].name;
    EXPECT_EQ(expected[i].path, m.a + "/" + expected[i].name);
  }
  s = refs.Admit("w1", m.b, Files(m.b));
  ASSERT_FALSE(s.ok());
  EXPECT_NE(s.message().find("node w1: checkpoint file " + m.b + "/" + CheckpointFiles(m.a)[2] +
                             " differs from node w0's loaded copy " + m.a + "/"),
            std::string::npos)
      << s.message();
  EXPECT_TRUE(refs.Admit("w1", m.a, Files(m.a)).ok());
}

// The first node to load had the wrong files; the operator fixes them and restarts it: its own
// earlier copy must not refuse it (nor, through it, every other node).
TEST(CheckpointRefs, ANodeIsNoReferenceForItsOwnNextLoad) {
  TwoSeeds m;
  CheckpointRefs refs(ConfigOnly(m.a, "refs_own"));
  ASSERT_TRUE(refs.Admit("w0", m.b, Files(m.b)).ok());   // wrong, but first
  EXPECT_FALSE(refs.Admit("w1", m.a, Files(m.a)).ok());  // right, refused against w0's copy
  EXPECT_EQ(refs.Expected("w0").size(), 1u);             // w0 loads again: only config.json
  ASSERT_TRUE(refs.Admit("w0", m.a, Files(m.a)).ok());
  EXPECT_TRUE(refs.Admit("w1", m.a, Files(m.a)).ok());
}

// The coordinator's copy is replaced while nodes run on the old one: a node loading the new
// files must still match the running nodes, so the cluster never mixes two checkpoints; once
// the other node is refused (or reloaded with the new files too), they serve together.
TEST(CheckpointRefs, ANewCoordinatorCopyDoesNotLetANodeJoinOthersOnTheOldOne) {
  TwoSeeds m;
  const std::string c = testing_ck::TempDir("refs_replaced");
  fs::copy(m.a, c, fs::copy_options::recursive);
  CheckpointRefs refs(c);
  ASSERT_TRUE(refs.Admit("w0", m.a, Files(m.a)).ok());
  ASSERT_TRUE(refs.Admit("w1", m.a, Files(m.a)).ok());
  CopyOver(m.b, c);
  Status s = refs.Admit("w0", m.b, Files(m.b));   // w0 restarted on the new files
  ASSERT_FALSE(s.ok());
  EXPECT_NE(s.message().find("differs from node w1's loaded copy " + m.a + "/"), std::string::npos) << s.message();
  ASSERT_TRUE(refs.Admit("w1", m.b, Files(m.b)).ok());   // w1 restarted on them too (w0 refused)
  EXPECT_TRUE(refs.Admit("w0", m.b, Files(m.b)).ok());
}

// `cp -p`, `rsync -a` and `tar x` keep the modification time, and checkpoints of the same shapes
// have the same sizes: the change time still shows the new contents.
TEST(CheckpointRefs, ACopyThatKeepsSizeAndMtimeIsStillSeen) {
  TwoSeeds m;
  const std::string c = testing_ck::TempDir("refs_same_mtime");
  fs::copy(m.b, c, fs::copy_options::recursive);
  CheckpointRefs refs(c);
  EXPECT_FALSE(refs.Admit("w0", m.a, Files(m.a)).ok());
  for (const auto& f : fs::directory_iterator(m.a)) {
    const std::string to = c + "/" + f.path().filename().string();
    const auto mtime = fs::last_write_time(to);
    ASSERT_EQ(fs::file_size(to), fs::file_size(f.path())) << to;
    fs::copy_file(f.path(), to, fs::copy_options::overwrite_existing);
    fs::last_write_time(to, mtime);
  }
  EXPECT_TRUE(refs.Admit("w0", m.a, Files(m.a)).ok());
}

// A node's entry is what it holds loaded: asking for references keeps it; a failed load or a
// restart (Forget) drops it, so a node whose files were fixed is not refused against its own
// old load through another node (an NCCL group loads all members together).
TEST(CheckpointRefs, ForgettingANodeDropsItsEntry) {
  TwoSeeds m;
  CheckpointRefs refs(ConfigOnly(m.a, "refs_refused"));
  ASSERT_TRUE(refs.Admit("w0", m.a, Files(m.a)).ok());
  const size_t files = CheckpointFiles(m.a).size();
  EXPECT_EQ(refs.Expected("w0").size(), 1u);
  EXPECT_EQ(refs.Expected("w1").size(), 1 + files);   // asked again and again: nothing dropped
  EXPECT_EQ(refs.Expected("w1").size(), 1 + files);
  refs.Forget("w0");
  EXPECT_EQ(refs.Expected("w1").size(), 1u);
  EXPECT_TRUE(refs.Admit("w1", m.b, Files(m.b)).ok());  // with w0 gone, w1's copy is the reference
  EXPECT_FALSE(refs.Admit("w0", m.a, Files(m.a)).ok());
}

// Shards copied into the coordinator's directory after it started (the index already there)
// are references from the next load on.
TEST(CheckpointRefs, ShardsAddedLaterToTheCoordinatorsCopyAreSeen) {
  TwoSeeds m;
  const std::string c = testing_ck::TempDir("refs_added");
  fs::create_directories(c);
  for (const char* f : {"config.json", "model.safetensors.index.json"})
    fs::copy_file(m.a + std::string("/") + f, c + "/" + f);
  CheckpointRefs refs(c);
  ASSERT_EQ(refs.Expected("w0").size(), 2u);
  for (const std::string& f : CheckpointFiles(m.a)) fs::copy_file(m.a + "/" + f, c + "/" + f, fs::copy_options::skip_existing);
  EXPECT_EQ(refs.Expected("w0").size(), CheckpointFiles(m.a).size());
  EXPECT_FALSE(refs.Admit("w0", m.b, Files(m.b)).ok());
}

TEST(CheckpointRefs, NoModelDirectoryNoReferences) {
  EXPECT_TRUE(CheckpointRefs("").Expected("w0").empty());
  EXPECT_TRUE(CheckpointRefs(testing_ck::TempDir("refs_missing")).Expected("w0").empty());
}

}  // namespace
}  // namespace fm
