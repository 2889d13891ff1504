#include "model/kv_cache.h"

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

}  // namespace fm
