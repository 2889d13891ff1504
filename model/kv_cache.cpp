#include "model/kv_cache.h"

#include <string>

namespace fm {

SequenceCache::SequenceCache(int64_t layer_begin,
                             std::vector<std::unique_ptr<AttentionCache>> layers,
                             std::unique_ptr<AttentionCache> mtp, int64_t max_context)
    : layer_begin_(layer_begin),
      layers_(std::move(layers)),
      mtp_(std::move(mtp)),
      max_context_(max_context) {}

size_t SequenceCache::bytes() const {
  size_t total = mtp_ ? mtp_->bytes() : 0;
  for (const auto& c : layers_) total += c->bytes();
  return total;
}

Status SequenceCache::CopyFrom(const SequenceCache& src) {
  if (src.layer_begin_ != layer_begin_ || src.layers_.size() != layers_.size() ||
      (src.mtp_ == nullptr) != (mtp_ == nullptr))
    return InvalidArgument("copying the decode state of another shard's layers");
  if (src.next_pos_ > max_context_)
    return OutOfRange("copying a sequence of " + std::to_string(src.next_pos_) +
                      " positions into one of max_context " + std::to_string(max_context_));
  for (size_t i = 0; i < layers_.size(); ++i) {
    Status st = layers_[i]->CopyFrom(*src.layers_[i]);
    if (!st.ok()) return st.Wrap("layer " + std::to_string(layer_begin_ + static_cast<int64_t>(i)));
  }
  if (mtp_) FM_RETURN_IF_ERROR(mtp_->CopyFrom(*src.mtp_));
  next_pos_ = src.next_pos_;
  return Status::Ok();
}

}  // namespace fm
