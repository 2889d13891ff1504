#include "coordinator/checkpoint_refs.h"

#include <sys/stat.h>

#include "common/log.h"
#include "model/checkpoint.h"

namespace fm {
namespace {

// Size and modification time of a file, or false when it cannot be stat'ed.
bool Stat(const std::string& path, uint64_t* size, int64_t* mtime_ns) {
  struct stat st;
  if (::stat(path.c_str(), &st) != 0) return false;
  *size = static_cast<uint64_t>(st.st_size);
  *mtime_ns = static_cast<int64_t>(st.st_mtim.tv_sec) * 1000000000 + st.st_mtim.tv_nsec;
  return true;
}

}  // namespace

CheckpointRefs::CheckpointRefs(std::string model_dir) : model_dir_(std::move(model_dir)) {
  std::lock_guard<std::mutex> lock(mu_);
  RefreshOwn();
}

void CheckpointRefs::RefreshOwn() {
  if (model_dir_.empty()) return;
  std::vector<OwnFile> now;
  for (const std::string& name : CheckpointFiles(model_dir_)) {
    OwnFile o;
    uint64_t size = 0;
    if (!Stat(model_dir_ + "/" + name, &size, &o.mtime_ns)) continue;
    bool same = false;
    for (const OwnFile& before : own_)
      if (before.f.name == name && before.f.size == size && before.mtime_ns == o.mtime_ns) {
        o = before;
        same = true;
      }
    if (!same) {
      Result<FileFingerprint> f = FingerprintFile(model_dir_, name);
      if (!f.ok()) {
        // The nodes' copies are then compared with one another only.
        FM_LOG(kWarn, "coordinator") << f.status().message() << "; not a reference for the workers' copies";
        continue;
      }
      o.f = std::move(f).value();
      o.f.source = "the coordinator's";
      o.f.path = model_dir_ + "/" + name;
    }
    now.push_back(std::move(o));
  }
  own_ = std::move(now);
}

std::vector<FileFingerprint> CheckpointRefs::ReferencesFor(const std::string& node) {
  std::vector<FileFingerprint> refs;
  for (const OwnFile& o : own_) refs.push_back(o.f);
  // Admitted nodes agree with one another on every file they share (each was compared with
  // those admitted before it): any of them will do for a file the coordinator lacks.
  for (const auto& [other, files] : admitted_) {
    if (other == node) continue;
    for (const FileFingerprint& f : files) {
      bool known = false;
      for (const FileFingerprint& r : refs) known = known || r.name == f.name;
      if (!known) refs.push_back(f);
    }
  }
  return refs;
}

std::vector<FileFingerprint> CheckpointRefs::BeginLoad(const std::string& node) {
  std::lock_guard<std::mutex> lock(mu_);
  admitted_.erase(node);
  RefreshOwn();
  return ReferencesFor(node);
}

Status CheckpointRefs::Admit(const std::string& node, const std::string& dir,
                             std::vector<FileFingerprint> files) {
  std::lock_guard<std::mutex> lock(mu_);
  bool config = false;
  for (const FileFingerprint& f : files) config = config || f.name == "config.json";
  if (!config)
    return InvalidArgument("node " + node + " reported no fingerprint of its checkpoint's config.json "
                              "(a worker older than this coordinator?): it cannot show that it loaded "
                              "the same checkpoint as the other nodes");
  FM_RETURN_IF_ERROR(MatchFingerprints(files, dir, ReferencesFor(node)).Wrap("node " + node));
  for (FileFingerprint& f : files) {
    f.source = "node " + node + "'s";
    f.path = dir.empty() ? "" : dir + "/" + f.name;
  }
  admitted_[node] = std::move(files);
  return Status::Ok();
}

}  // namespace fm
