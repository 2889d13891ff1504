// Activations: a step's manifold X [rows, hc, H] f32 in the memory its shard computes on
// (ShardModel::NewActivations): host memory for the CPU shard, device memory for a device shard.
// The shard's Embed / ForwardLayers / Logits / SampleNext take pointers into it, so a worker
// keeps X where the shard is between the embedding, the layers and the head, and X crosses to
// the host only where a host must read it (a TCP hop, a test). docs/gpu.md "Where X lives".
#pragma once
#include <cstdint>
#include <memory>
#include <vector>

#include "common/status.h"

namespace fm {

class Activations {
 public:
  explicit Activations(int64_t row_floats) : row_floats_(row_floats) {}
  virtual ~Activations() = default;
  Activations(const Activations&) = delete;
  Activations& operator=(const Activations&) = delete;

  // Whether data() is device memory (then only the shard's kernels and the copies below, or an
  // NCCL transfer, may touch it).
  virtual bool device() const = 0;
  int64_t rows() const { return rows_; }
  int64_t row_floats() const { return row_floats_; }
  size_t bytes() const { return static_cast<size_t>(rows_ * row_floats_) * sizeof(float); }
  float* data() const { return data_; }
  float* row(int64_t r) const { return data_ + r * row_floats_; }

  // Holds `rows` rows from now on. Grows the memory when it must (rarely: to the largest step
  // seen; the old contents are then lost), never shrinks it.
  virtual Status Resize(int64_t rows) = 0;
  // Rows [row0, row0 + n) from / to host memory (n rows of row_floats() floats).
  virtual Status CopyFromHost(int64_t row0, int64_t n, const float* src) = 0;
  virtual Status CopyToHost(int64_t row0, int64_t n, float* dst) const = 0;
  // Rows [src_row, src_row + n) of `src` (the same kind of memory) to rows [row0, row0 + n).
  virtual Status CopyRows(int64_t row0, const Activations& src, int64_t src_row, int64_t n) = 0;

 protected:
  // OutOfRange naming `what` when rows [row0, row0 + n) are not all inside rows().
  Status CheckRows(const char* what, int64_t row0, int64_t n) const;

  float* data_ = nullptr;
  int64_t rows_ = 0;
  const int64_t row_floats_;
};

// Activations in host memory (the CPU shard's, and a host stand-in wherever X must be on the host).
std::unique_ptr<Activations> NewHostActivations(int64_t row_floats);

}  // namespace fm
