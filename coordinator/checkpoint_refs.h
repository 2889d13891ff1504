// CheckpointRefs: the checkpoint every node must load (model/checkpoint_fingerprint.h), file by
// file. A file's reference is the coordinator's own copy when it has one (it reads config.json
// and the tokenizer from its model directory, and may hold the weights too), otherwise the copy
// of the first node that loaded it. Each LoadShard carries Expected(), so a worker with another
// checkpoint refuses before it reads a weight; Admit compares what a node loaded once its load
// succeeded (two nodes that both loaded a file the coordinator lacks, at the same time).
#pragma once
#include <mutex>
#include <string>
#include <vector>

#include "common/status.h"
#include "model/checkpoint_fingerprint.h"

namespace fm {

class CheckpointRefs {
 public:
  // Fingerprints the coordinator's copy in model_dir (the files it has; none for "").
  explicit CheckpointRefs(const std::string& model_dir);
  // The references known now, each with its source ("the coordinator's", "node w0's").
  std::vector<FileFingerprint> Expected() const;
  // The files `node` loaded: an error naming the first one that differs from its reference;
  // otherwise those without a reference become references (that node's copy).
  Status Admit(const std::string& node, const std::vector<FileFingerprint>& files);

 private:
  mutable std::mutex mu_;
  std::vector<FileFingerprint> refs_;
};

}  // namespace fm
