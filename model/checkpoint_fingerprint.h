// Checkpoint fingerprints: every node of a cluster must load the same checkpoint, or the stages
// compute with different weights of the same shapes and the output is silently wrong. A file's
// fingerprint is cheap (at most 1 MiB read): its size and a CRC32C of sampled bytes. It tells a
// different checkpoint (another seed, another fine-tune, another conversion) from the same one
// with high likelihood; it is not a check of every byte (a flipped bit in the middle of a shard
// passes).
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
  // For messages about a reference: whose copy ("the coordinator's", "node w0's loaded"), where
  // it is on that machine ("/models/v4/config.json"; may be empty), and the node that holds it
  // loaded (empty for the coordinator's copy): if that one is wrong, it must be restarted.
  std::string source, path, holder;
};

inline constexpr uint64_t kFingerprintChunk = 64 << 10;
inline constexpr int kFingerprintChunks = 16;
inline constexpr uint64_t kFingerprintWhole = kFingerprintChunk * kFingerprintChunks;

// The fingerprint of dir/name; an error naming the path when it cannot be read.
Result<FileFingerprint> FingerprintFile(const std::string& dir, const std::string& name);
// The fingerprints of CheckpointFiles(dir) (model/checkpoint.h), in that order.
Result<std::vector<FileFingerprint>> FingerprintCheckpoint(const std::string& dir);

// Whether the checkpoint `mine` (read from `dir`) is the one `expected` describes: an error
// naming the first file that `expected` lists under its name with another size or CRC, or, when
// `expected` holds an index or a single model.safetensors, a checkpoint laid out otherwise (the
// same weights could be in other files, but another layout is another checkpoint's as often).
// Files only one side lists are otherwise no error (a coordinator holding config.json alone).
// `dir` prefixes the file names in the message unless empty.
Status MatchFingerprints(const std::vector<FileFingerprint>& mine, const std::string& dir,
                         const std::vector<FileFingerprint>& expected);

// "14168812 bytes, sampled CRC32C 5e6f7a8b" (or "CRC32C" alone for a file read whole).
std::string DescribeFingerprint(const FileFingerprint& f);

}  // namespace fm
