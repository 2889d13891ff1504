// CheckpointRefs: the checkpoint every node must load (model/checkpoint_fingerprint.h), file by
// file. A file's reference is the coordinator's own copy when it has one (it reads config.json
// and the tokenizer from its model directory, and may hold the weights too; read again when a
// file's size or modification time changes), otherwise the copy of a node whose load was
// admitted, never the node's own: a node that loads again (restarted, its files fixed) is no
// reference for itself. Each LoadShard carries Expected(), so a worker with another checkpoint
// refuses before it reads a weight; Admit compares what a node loaded once its load succeeded
// (two nodes that loaded a file the coordinator lacks at the same time).
#pragma once
#include <cstdint>
#include <map>
#include <mutex>
#include <string>
#include <vector>

#include "common/status.h"
#include "model/checkpoint_fingerprint.h"

namespace fm {

class CheckpointRefs {
 public:
  // Fingerprints the coordinator's copy in model_dir (the files it has; none for "").
  explicit CheckpointRefs(std::string model_dir);
  // The references for `node`'s next load, each with its source and path, and forgets what
  // `node` loaded before (a load replaces it).
  std::vector<FileFingerprint> BeginLoad(const std::string& node);
  // The files `node` loaded from `dir`: an error naming the first one that differs from the
  // reference (or a list without config.json: a worker that does not fingerprint); otherwise
  // they become references for the other nodes' files the coordinator lacks.
  Status Admit(const std::string& node, const std::string& dir, std::vector<FileFingerprint> files);

 private:
  // Under mu_: the coordinator's copy again where a file changed (size, mtime) or came or went.
  void RefreshOwn();
  std::vector<FileFingerprint> ReferencesFor(const std::string& node);   // under mu_

  std::string model_dir_;
  std::mutex mu_;
  struct OwnFile {
    FileFingerprint f;
    int64_t mtime_ns = 0;
  };
  std::vector<OwnFile> own_;
  std::map<std::string, std::vector<FileFingerprint>> admitted_;   // by node
};

}  // namespace fm
