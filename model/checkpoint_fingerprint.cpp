#include "model/checkpoint_fingerprint.h"

#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cerrno>
#include <cstdio>
#include <cstring>

#include "common/crc32c.h"
#include "model/checkpoint.h"

namespace fm {
namespace {

// Reads n bytes at offset into buf (retrying short reads and EINTR).
Status ReadAt(int fd, const std::string& path, uint64_t offset, uint64_t n, char* buf) {
  while (n > 0) {
    const ssize_t got = ::pread(fd, buf, n, static_cast<off_t>(offset));
    if (got < 0 && errno == EINTR) continue;
    if (got < 0) return Internal(path + ": read failed: " + std::strerror(errno));
    if (got == 0) return Internal(path + ": ended early (was it written to meanwhile?)");
    buf += got;
    offset += static_cast<uint64_t>(got);
    n -= static_cast<uint64_t>(got);
  }
  return Status::Ok();
}

}  // namespace

Result<FileFingerprint> FingerprintFile(const std::string& dir, const std::string& name) {
  const std::string path = dir + "/" + name;
  const int fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC);
  if (fd < 0) return NotFound(path + ": cannot open: " + std::strerror(errno));
  struct Close {
    int fd;
    ~Close() { ::close(fd); }
  } close_fd{fd};
  struct stat st;
  if (::fstat(fd, &st) != 0 || !S_ISREG(st.st_mode))
    return InvalidArgument(path + ": not a regular file");
  FileFingerprint f;
  f.name = name;
  f.size = static_cast<uint64_t>(st.st_size);
  std::string buf;
  if (f.size <= kFingerprintWhole) {
    buf.resize(f.size);
    FM_RETURN_IF_ERROR(ReadAt(fd, path, 0, f.size, buf.data()));
    f.crc32c = Crc32c(buf.data(), buf.size());
    return f;
  }
  buf.resize(kFingerprintChunk);
  for (int i = 0; i < kFingerprintChunks; ++i) {
    const uint64_t at = (f.size - kFingerprintChunk) * static_cast<uint64_t>(i) / (kFingerprintChunks - 1);
    FM_RETURN_IF_ERROR(ReadAt(fd, path, at, kFingerprintChunk, buf.data()));
    f.crc32c = Crc32c(buf.data(), buf.size(), f.crc32c);
  }
  return f;
}

Result<std::vector<FileFingerprint>> FingerprintCheckpoint(const std::string& dir) {
  std::vector<FileFingerprint> out;
  for (const std::string& name : CheckpointFiles(dir)) {
    FM_ASSIGN_OR_RETURN(FileFingerprint f, FingerprintFile(dir, name));
    out.push_back(std::move(f));
  }
  return out;
}

std::string DescribeFingerprint(const FileFingerprint& f) {
  char crc[16];
  std::snprintf(crc, sizeof crc, "%08x", f.crc32c);
  return std::to_string(f.size) + " bytes, " + (f.size > kFingerprintWhole ? "sampled " : "") +
         "CRC32C " + crc;
}

namespace {

constexpr const char* kIndex = "model.safetensors.index.json";
constexpr const char* kSingle = "model.safetensors";

// Which of the two layouts (CheckpointFiles) a list holds: the index, the single file, or "".
std::string LayoutOf(const std::vector<FileFingerprint>& files, const FileFingerprint** which) {
  for (const FileFingerprint& f : files)
    if (f.name == kIndex || f.name == kSingle) {
      if (which) *which = &f;
      return f.name;
    }
  return "";
}

std::string CopyOf(const FileFingerprint& ref) {
  return (ref.source.empty() ? std::string("the reference") : ref.source) + " copy" +
         (ref.path.empty() ? "" : " " + ref.path);
}

// A node's loaded copy stays the reference until that node loads again: fixing its files is
// not enough.
std::string RestartHint(const FileFingerprint& ref) {
  if (ref.holder.empty()) return "";
  return " (if " + ref.holder + "'s is the wrong one, fix its files and restart " + ref.holder +
         ": it keeps the copy it loaded)";
}

}  // namespace

Status MatchFingerprints(const std::vector<FileFingerprint>& mine, const std::string& dir,
                         const std::vector<FileFingerprint>& expected) {
  const std::string here = dir.empty() ? "" : dir + "/";
  for (const FileFingerprint& m : mine) {
    for (const FileFingerprint& e : expected) {
      if (e.name != m.name || (e.size == m.size && e.crc32c == m.crc32c)) continue;
      return InvalidArgument("checkpoint file " + here + m.name + " differs from " + CopyOf(e) +
                             " (here " + DescribeFingerprint(m) + "; there " + DescribeFingerprint(e) +
                             "): every node must load the same checkpoint" + RestartHint(e));
    }
  }
  const FileFingerprint* ref = nullptr;
  const std::string want = LayoutOf(expected, &ref);
  const std::string have = LayoutOf(mine, nullptr);
  if (!want.empty() && have != want) {
    auto layout = [](const std::string& l) {
      return l == kIndex ? std::string(kIndex) + " and the shards it names"
                         : l.empty() ? std::string("no weights") : l;
    };
    return InvalidArgument("the checkpoint in " + (dir.empty() ? std::string("this node's model directory") : dir) +
                           " is laid out otherwise than " + CopyOf(*ref) + " (here " + layout(have) +
                           "; there " + layout(want) + "): every node must load the same checkpoint files" +
                           RestartHint(*ref));
  }
  return Status::Ok();
}

}  // namespace fm
