// safetensors files: header parsing with full bounds checks, read-only mmap, streaming writer.
// Format: u64 little-endian header length N, N bytes of JSON
// {"name": {"dtype": "F8_E4M3", "shape": [..], "data_offsets": [begin, end]},
//  "__metadata__": {..}},
// then the data section; offsets are relative to the data section (byte 8 + N).
#pragma once
#include <cstdint>
#include <map>
#include <memory>
#include <string>
#include <unordered_map>
#include <utility>
#include <vector>

#include "common/status.h"
#include "common/tensor.h"

namespace fm {

struct SafetensorsTensor {
  std::string name;
  DType dtype = DType::kF32;
  std::vector<int64_t> shape;
  uint64_t begin = 0, end = 0;  // byte range inside the data section
};

struct SafetensorsHeader {
  uint64_t data_offset = 0;                     // 8 + header length: start of the data section
  std::vector<SafetensorsTensor> tensors;       // sorted by begin
  std::map<std::string, std::string> metadata;  // __metadata__ (string values only)
  std::unordered_map<std::string, size_t> by_name;  // name -> index into tensors
  const SafetensorsTensor* Find(const std::string& name) const;
};

// Largest header accepted: the official shards' headers are a few hundred KB, and all of
// DeepSeek-V4-Flash's ~70k tensors in one file would take ~10 MB. Parsing costs ~25x the
// header in memory, so the bound stays near that.
constexpr uint64_t kMaxSafetensorsHeaderBytes = 32ull << 20;

// Parses the header of a file of `file_size` bytes whose first `avail` bytes are `bytes`.
// Checks: length field within the file, JSON object, known dtypes, non-negative shapes,
// offsets ordered, inside the data section, matching dtype*shape, non-overlapping.
// Errors start with `origin` (the file path) and name the tensor.
Result<SafetensorsHeader> ParseSafetensorsHeader(const uint8_t* bytes, size_t avail,
                                                 uint64_t file_size, const std::string& origin);

// Where a shard's tensor bytes live.
enum class TensorBytes {
  // The read-only file mapping itself: nothing is read until a tensor is accessed. For tools
  // that only need shapes (inspect).
  kMapped,
  // Private anonymous memory that Load fills with pread. What serving uses: on the VMs this
  // project measures on, kernels streaming weights from file-backed pages ran 2.5-4x slower
  // than from anonymous pages (docs/performance.md), and a worker reads its weights every step.
  kPrivate,
};

// One shard: header parsed with pread; the data either mapped or held privately (TensorBytes).
// Pointers from data() are fixed from Open on; with kPrivate their bytes are zero until Load.
class SafetensorsFile {
 public:
  static Result<std::unique_ptr<SafetensorsFile>> Open(const std::string& path,
                                                       TensorBytes where = TensorBytes::kMapped);
  ~SafetensorsFile();
  SafetensorsFile(const SafetensorsFile&) = delete;
  SafetensorsFile& operator=(const SafetensorsFile&) = delete;

  const std::string& path() const { return path_; }
  const SafetensorsHeader& header() const { return header_; }
  uint64_t file_size() const { return size_; }
  // First byte of a tensor's data.
  const uint8_t* data(const SafetensorsTensor& t) const {
    return base_ + header_.data_offset + t.begin;
  }
  // Brings runs [begin, end) of the data section into memory, then makes the data read-only:
  // kMapped asks the kernel to read them ahead; kPrivate reads them (an error names the file).
  // Called once, before any tensor of the file is used.
  Status Load(const std::vector<std::pair<uint64_t, uint64_t>>& runs);
  // Bytes of the data that are resident (mincore; whole pages).
  size_t ResidentBytes() const;

 private:
  SafetensorsFile() = default;
  std::string path_;
  SafetensorsHeader header_;
  TensorBytes where_ = TensorBytes::kMapped;
  int fd_ = -1;                // kPrivate until Load: the source of the reads
  const uint8_t* base_ = nullptr;
  uint64_t size_ = 0;
};

// Writes a shard in one pass: the header is laid out from the declared tensors up front,
// then each tensor's bytes are appended in declaration order (streaming; nothing buffered).
struct SafetensorsDecl {
  std::string name;
  DType dtype = DType::kF32;
  std::vector<int64_t> shape;
};

class SafetensorsWriter {
 public:
  static Result<std::unique_ptr<SafetensorsWriter>> Create(
      const std::string& path, const std::vector<SafetensorsDecl>& tensors,
      const std::map<std::string, std::string>& metadata = {});
  ~SafetensorsWriter();
  SafetensorsWriter(const SafetensorsWriter&) = delete;
  SafetensorsWriter& operator=(const SafetensorsWriter&) = delete;

  // Appends bytes of the current tensor; may be called several times per tensor. The writer
  // moves to the next tensor when the current one is complete.
  Status Append(const void* data, size_t n);
  // Checks that every tensor was written in full and closes the file.
  Status Finish();

 private:
  SafetensorsWriter() = default;
  std::string path_;
  int fd_ = -1;
  std::vector<uint64_t> sizes_;
  std::vector<std::string> names_;
  size_t current_ = 0;
  uint64_t written_in_current_ = 0;
};

// Bytes of a tensor of `dtype` and `shape`; false on overflow or a negative dimension.
bool TensorNbytes(DType dtype, const std::vector<int64_t>& shape, uint64_t* out);
std::string ShapeString(const std::vector<int64_t>& shape);

}  // namespace fm
