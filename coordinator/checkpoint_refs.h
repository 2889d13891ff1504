// CheckpointRefs: the checkpoint every node must load (model/checkpoint_fingerprint.h), file by
// file. A loading node's files are compared with the coordinator's own copy of each file it has
// (it reads config.json and the tokenizer from its model directory, and may hold the weights
// too; fingerprinted again when a file changes) and with the files of every other node whose
// load was admitted: a node must match them all, so a cluster never runs on two checkpoints,
// and a node is never compared with its own earlier load (restarted, its files fixed).
// A node's entry is what it holds loaded: from its admitted load until a load of it fails or
// its worker no longer holds that load (restarted); a node that is down but may still hold it
// (frozen, unreachable) keeps it, or it could come back beside nodes on other files. Each
// LoadShard carries the references, so a worker with another checkpoint refuses before it
// reads a weight; Admit compares what a node loaded once its load succeeded (nodes that loaded
// at the same time).
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
  // The references for `node`'s next load, each with its source and path: the coordinator's
  // copy, then every other admitted node's files (a file may appear several times).
  std::vector<FileFingerprint> Expected(const std::string& node);
  // The files `node` loaded from `dir`: an error naming the first one that differs from a
  // reference (or a list without config.json: a worker that does not fingerprint), after which
  // `node` is no reference; otherwise they are its entry, a reference for the other nodes.
  Status Admit(const std::string& node, const std::string& dir, std::vector<FileFingerprint> files);
  // `node` holds no admitted load any more (a load failed, or its worker restarted).
  void Forget(const std::string& node);

 private:
  // What identifies a file's contents without reading it: any write or copy changes one of
  // these (ctime too, which `cp -p` and `touch -r` cannot set back).
  struct FileId {
    uint64_t dev = 0, ino = 0, size = 0;
    int64_t mtime_ns = 0, ctime_ns = 0;
    bool operator==(const FileId&) const = default;
  };
  static bool Identify(const std::string& path, FileId* id);
  // Under mu_: the coordinator's copy again where a file changed or came or went.
  void RefreshOwn();
  std::vector<FileFingerprint> ReferencesFor(const std::string& node);   // under mu_, refreshed

  std::string model_dir_;
  std::mutex mu_;
  std::vector<FileId> listed_from_;   // config.json, index, model.safetensors when listed
  std::vector<std::string> own_names_;
  struct OwnFile {
    FileFingerprint f;
    FileId id;
  };
  std::vector<OwnFile> own_;
  std::map<std::string, std::vector<FileFingerprint>> admitted_;   // by node
};

}  // namespace fm
