#include "model/compressor.h"

#include <algorithm>
#include <cmath>
#include <numeric>

#include "kernels/cpu/compressor_pool.h"
#include "kernels/cpu/indexer.h"
#include "kernels/cpu/rmsnorm.h"
#include "kernels/cpu/rope.h"

namespace fm {

static Status CheckWeightShape(const QWeight& w, int64_t rows, int64_t cols,
                               const std::string& name) {
  if (w.rows != rows || w.cols != cols) {
    return InvalidArgument(name + ": shape [" + std::to_string(w.rows) + ", " +
                           std::to_string(w.cols) + "], expected [" + std::to_string(rows) +
                           ", " + std::to_string(cols) + "]");
  }
  if (!w.data) return InvalidArgument(name + ": no data");
  return Status::Ok();
}

Status ValidateCompressor(const CompressorWeights& w, int64_t hidden, const std::string& what) {
  if (w.ratio < 2) return InvalidArgument(what + ": compress ratio " + std::to_string(w.ratio));
  if (w.overlap != (w.ratio == 4)) {
    return InvalidArgument(what + ": overlapping windows go with ratio 4 only");
  }
  FM_RETURN_IF_ERROR(CheckWeightShape(w.wkv, w.width(), hidden, what + "wkv"));
  FM_RETURN_IF_ERROR(CheckWeightShape(w.wgate, w.width(), hidden, what + "wgate"));
  if (static_cast<int64_t>(w.ape.size()) != w.ratio * w.width()) {
    return InvalidArgument(what + "ape: " + std::to_string(w.ape.size()) + " values, expected [" +
                           std::to_string(w.ratio) + ", " + std::to_string(w.width()) + "]");
  }
  if (static_cast<int64_t>(w.norm.size()) != w.dim) {
    return InvalidArgument(what + "norm.weight: " + std::to_string(w.norm.size()) +
                           " values, expected " + std::to_string(w.dim));
  }
  return Status::Ok();
}

Result<CompressorWeights> BindCompressor(const Checkpoint& ckpt, const std::string& prefix,
                                         int64_t ratio, int64_t dim, int64_t hidden) {
  CompressorWeights w;
  w.ratio = ratio;
  w.dim = dim;
  w.overlap = ratio == 4;
  FM_ASSIGN_OR_RETURN(w.wkv, ckpt.Weight(prefix + "wkv"));
  FM_ASSIGN_OR_RETURN(w.wgate, ckpt.Weight(prefix + "wgate"));
  FM_ASSIGN_OR_RETURN(w.ape, ckpt.GetF32(prefix + "ape"));
  FM_ASSIGN_OR_RETURN(w.norm, ckpt.GetF32(prefix + "norm.weight"));
  FM_RETURN_IF_ERROR(ValidateCompressor(w, hidden, prefix));
  return w;
}

CompressorState::CompressorState(int64_t ratio, int64_t dim, bool overlap)
    : ratio_(ratio), dim_(dim), overlap_(overlap) {}

void CompressorState::Push(const CompressorWeights& w, const float* a, const float* gate,
                           int64_t pos, const float* inv_freq, int64_t rd, float eps) {
  const int64_t width = w.width();
  if (pend_a_.empty()) {
    pend_a_.resize(static_cast<size_t>(ratio_ * width));
    pend_z_.resize(static_cast<size_t>(ratio_ * width));
  }
  const int64_t slot = pos % ratio_;
  float* pa = pend_a_.data() + slot * width;
  float* pz = pend_z_.data() + slot * width;
  const float* ape = w.ape.data() + slot * width;
  for (int64_t c = 0; c < width; ++c) {
    pa[c] = a[c];
    pz[c] = gate[c] + ape[c];
  }
  if (slot != ratio_ - 1) return;

  const size_t at = entries_.size();
  entries_.resize(at + static_cast<size_t>(dim_));
  float* e = entries_.data() + at;
  CompressorPoolWindow_rd(pend_a_.data(), pend_z_.data(), has_prev_ ? prev_a_.data() : nullptr,
                          has_prev_ ? prev_z_.data() : nullptr, ratio_, dim_, overlap_, e);
  RmsNormRows_rd(e, w.norm.data(), 1, dim_, eps, e);
  RopeRows_nd(e, 1, dim_, rd, pos - slot, inv_freq, /*inverse=*/false);
  if (overlap_) {
    // Only the first-half channels of this window are read again (by the next window).
    prev_a_.swap(pend_a_);
    prev_z_.swap(pend_z_);
    pend_a_.resize(static_cast<size_t>(ratio_ * width));
    pend_z_.resize(static_cast<size_t>(ratio_ * width));
    has_prev_ = true;
  }
}

void IndexerSelect(const float* q, const float* proj, int64_t nI, int64_t dI, const float* keys,
                   int64_t visible, int64_t topk, std::vector<int32_t>* picks) {
  if (visible <= topk) {
    picks->resize(static_cast<size_t>(visible));
    std::iota(picks->begin(), picks->end(), 0);
    return;
  }
  // HF: relu(q.k) * dI^-1/2, times the head weight proj * nI^-1/2, summed over heads.
  std::vector<float> head_w(static_cast<size_t>(nI)), score(static_cast<size_t>(visible));
  const float weight_scale = 1.0f / std::sqrt(static_cast<float>(nI));
  for (int64_t h = 0; h < nI; ++h) head_w[h] = proj[h] * weight_scale;
  IndexerScores_hd(q, head_w.data(), nI, dI, keys, visible,
                   1.0f / std::sqrt(static_cast<float>(dI)), score.data());
  picks->resize(static_cast<size_t>(topk));
  TopKAscending_n(score.data(), visible, topk, picks->data());
}

size_t CompressorState::bytes() const {
  return sizeof(float) * (pend_a_.capacity() + pend_z_.capacity() + prev_a_.capacity() +
                          prev_z_.capacity() + entries_.capacity());
}

}  // namespace fm
