#include "coordinator/checkpoint_refs.h"

#include <sys/stat.h>

#include "common/log.h"
#include "model/checkpoint.h"

namespace fm {

bool CheckpointRefs::Identify(const std::string& path, FileId* id) {
  struct stat st;
  if (::stat(path.c_str(), &st) != 0) return false;
  id->dev = static_cast<uint64_t>(st.st_dev);
  id->ino = static_cast<uint64_t>(st.st_ino);
  id->size = static_cast<uint64_t>(st.st_size);
  id->mtime_ns = static_cast<int64_t>(st.st_mtim.tv_sec) * 1000000000 + st.st_mtim.tv_nsec;
  id->ctime_ns = static_cast<int64_t>(st.st_ctim.tv_sec) * 1000000000 + st.st_ctim.tv_nsec;
  return true;
}

CheckpointRefs::CheckpointRefs(std::string model_dir) : model_dir_(std::move(model_dir)) {
  std::lock_guard<std::mutex> lock(mu_);
  RefreshOwn();
}

void CheckpointRefs::RefreshOwn() {
  if (model_dir_.empty()) return;
  // The file list comes from the index (a few MB of JSON for a real checkpoint): parsed again
  // only when config.json, the index or a single model.safetensors came, went or changed. It
  // holds every shard the index names; those that exist now are taken below.
  std::vector<FileId> listed(3);
  Identify(model_dir_ + "/config.json", &listed[0]);
  Identify(model_dir_ + "/model.safetensors.index.json", &listed[1]);
  Identify(model_dir_ + "/model.safetensors", &listed[2]);
  if (listed != listed_from_) {
    own_names_ = CheckpointFiles(model_dir_, /*shards_that_exist_only=*/false);
    listed_from_ = listed;
  }
  std::vector<OwnFile> now;
  for (const std::string& name : own_names_) {
    OwnFile o;
    if (!Identify(model_dir_ + "/" + name, &o.id)) continue;
    bool same = false;
    for (const OwnFile& before : own_)
      if (before.f.name == name && before.id == o.id) {
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

std::vector<FileFingerprint> CheckpointRefs::Expected(const std::string& node) {
  std::lock_guard<std::mutex> lock(mu_);
  return ReferencesFor(node);
}

std::vector<FileFingerprint> CheckpointRefs::ReferencesFor(const std::string& node) {
  RefreshOwn();
  std::vector<FileFingerprint> refs;
  for (const OwnFile& o : own_) refs.push_back(o.f);
  for (const auto& [other, files] : admitted_)
    if (other != node) refs.insert(refs.end(), files.begin(), files.end());
  return refs;
}

Status CheckpointRefs::Admit(const std::string& node, const std::string& dir,
                             std::vector<FileFingerprint> files) {
  bool config = false;
  for (const FileFingerprint& f : files) config = config || f.name == "config.json";
  // One lock from the references to the entry: two nodes admitted at once compare with each other.
  std::lock_guard<std::mutex> lock(mu_);
  if (!config) {
    admitted_.erase(node);
    return InvalidArgument("node " + node + " reported no fingerprint of its checkpoint's config.json "
                           "(a worker older than this coordinator?): it cannot show that it loaded "
                           "the same checkpoint as the other nodes");
  }
  if (Status same = MatchFingerprints(files, dir, ReferencesFor(node)).Wrap("node " + node); !same.ok()) {
    admitted_.erase(node);
    return same;
  }
  for (FileFingerprint& f : files) {
    f.source = "node " + node + "'s loaded";
    f.holder = node;
    f.path = dir.empty() ? "" : dir + "/" + f.name;
  }
  admitted_[node] = std::move(files);
  return Status::Ok();
}

void CheckpointRefs::Forget(const std::string& node) {
  std::lock_guard<std::mutex> lock(mu_);
  admitted_.erase(node);
}

}  // namespace fm
