// Checkpoint fingerprints: every node of a cluster must load the same checkpoint, or the stages
// compute with different weights of the same shapes and the output is silently wrong. A file's
// fingerprint is cheap (at most 1 MiB read): its size and a CRC32C of sampled bytes. It tells a
// different checkpoint (another seed, another fine-tune, another conversion) from the same one;
// it is not a check of every byte (a flipped bit in the middle of a shard can pass).
#pragma once
#include <cstdint>
#include <string>
#include <vector>

#include "common/status.h"

namespace fm {

struct FileFingerprint {
  std::string name;       // within the checkpoint directory (CheckpointFiles)
  uint64_t size = 0;
  // CRC32C of the whole file when it holds at most kFingerprintWhole bytes; otherwise of
  // kFingerprintChunks chunks of kFingerprintChunk bytes spread evenly, the first at offset 0
  // and the last ending at the end of the file.
  uint32_t crc32c = 0;
  std::string source;     // whose copy, for messages: "the coordinator's", "node w0's"
};

inline constexpr uint64_t kFingerprintChunk = 64 << 10;
inline constexpr int kFingerprintChunks = 16;
inline constexpr uint64_t kFingerprintWhole = kFingerprintChunk * kFingerprintChunks;

// The fingerprint of dir/name; an error naming the path when it cannot be read.
Result<FileFingerprint> FingerprintFile(const std::string& dir, const std::string& name);
// The fingerprints of CheckpointFiles(dir) (model/checkpoint.h), in that order.
Result<std::vector<FileFingerprint>> FingerprintCheckpoint(const std::string& dir);

// The first file of `mine` that `expected` lists under its name with another size or CRC is
// an error naming it (prefixed with `dir` + "/" unless dir is empty) and both copies; files only
// one side lists are no error.
Status MatchFingerprints(const std::vector<FileFingerprint>& mine, const std::string& dir,
                         const std::vector<FileFingerprint>& expected);

// "14168812 bytes, sampled CRC32C 5e6f7a8b" (or "CRC32C" alone for a file read whole).
std::string DescribeFingerprint(const FileFingerprint& f);

}  // namespace fm
