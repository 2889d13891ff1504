// SequenceCache: one sequence's decode state on one shard (MODEL.md "Decode state"): the
// AttentionCache of each of the shard's layers, the MTP layer's own cache when the shard holds
// the MTP block, and the next position. Made by ShardModel::NewSequence.
#pragma once
#include <cstddef>
#include <cstdint>
#include <memory>
#include <vector>

#include "common/status.h"
#include "model/attention.h"

namespace fm {

class SequenceCache {
 public:
  SequenceCache(int64_t layer_begin, std::vector<std::unique_ptr<AttentionCache>> layers,
                std::unique_ptr<AttentionCache> mtp, int64_t max_context);

  int64_t layer_begin() const { return layer_begin_; }
  int64_t num_layers() const { return static_cast<int64_t>(layers_.size()); }
  // The cache of absolute layer `layer` (layer_begin() <= layer < layer_begin() + num_layers()).
  AttentionCache* layer(int64_t layer) const { return layers_[layer - layer_begin_].get(); }
  AttentionCache* mtp() const { return mtp_.get(); }  // null when the shard has no MTP block

  int64_t max_context() const { return max_context_; }
  // Positions the shard's layers have consumed; the MTP block counts its own (mtp_next_pos).
  int64_t next_pos() const { return next_pos_; }
  int64_t mtp_next_pos() const { return mtp_ ? mtp_->next_pos() : 0; }
  size_t bytes() const;

  // Called by ShardModel after a successful ForwardLayers over n positions.
  void Advance(int64_t n) { next_pos_ += n; }
  // Every layer's state (and the MTP block's) and the position become src's: a sequence of the
  // same shard (ShardModel::CopySequence). On an error this cache is left half copied.
  Status CopyFrom(const SequenceCache& src);

 private:
  int64_t layer_begin_;
  std::vector<std::unique_ptr<AttentionCache>> layers_;
  std::unique_ptr<AttentionCache> mtp_;
  int64_t max_context_;
  int64_t next_pos_ = 0;
};

}  // namespace fm
