#include "coordinator/checkpoint_refs.h"

#include "common/log.h"
#include "model/checkpoint.h"

namespace fm {

CheckpointRefs::CheckpointRefs(const std::string& model_dir) {
  if (model_dir.empty()) return;
  for (const std::string& name : CheckpointFiles(model_dir)) {
    Result<FileFingerprint> f = FingerprintFile(model_dir, name);
    if (!f.ok()) {
      // The nodes' copies are then compared with one another only.
      FM_LOG(kWarn, "coordinator") << f.status().message() << "; not a reference for the workers' copies";
      continue;
    }
    f->source = "the coordinator's";
    refs_.push_back(std::move(f).value());
  }
}

std::vector<FileFingerprint> CheckpointRefs::Expected() const {
  std::lock_guard<std::mutex> lock(mu_);
  return refs_;
}

Status CheckpointRefs::Admit(const std::string& node, const std::vector<FileFingerprint>& files) {
  std::lock_guard<std::mutex> lock(mu_);
  FM_RETURN_IF_ERROR(MatchFingerprints(files, "", refs_).Wrap("node " + node));
  for (const FileFingerprint& f : files) {
    bool known = false;
    for (const FileFingerprint& r : refs_) known = known || r.name == f.name;
    if (known) continue;
    refs_.push_back(f);
    refs_.back().source = "node " + node + "'s";
  }
  return Status::Ok();
}

}  // namespace fm
