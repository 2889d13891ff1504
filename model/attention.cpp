#include "model/attention.h"

#include <algorithm>
#include <cmath>
#include <unordered_set>

#include "kernels/cpu/attention_core.h"
#include "kernels/cpu/matvec.h"
#include "kernels/cpu/rmsnorm.h"
#include "kernels/cpu/rope.h"
#include "model/tp.h"

namespace fm {

namespace {

std::string Shape2(int64_t a, int64_t b) {
  std::string s = "[";
  s += std::to_string(a);
  s += ", ";
  s += std::to_string(b);
  s += "]";
  return s;
}

Status CheckWeight(const QWeight& w, int64_t rows, int64_t cols, const std::string& name) {
  if (w.rows != rows || w.cols != cols) {
    return InvalidArgument(name + ": shape " + Shape2(w.rows, w.cols) + ", expected " +
                           Shape2(rows, cols));
  }
  if (!w.data) return InvalidArgument(name + ": no data");
  return Status::Ok();
}

Status CheckVector(const std::vector<float>& v, int64_t n, const std::string& name) {
  if (static_cast<int64_t>(v.size()) != n) {
    return InvalidArgument(name + ": " + std::to_string(v.size()) + " values, expected " +
                           std::to_string(n));
  }
  return Status::Ok();
}

// Calls fn(begin, end) over [0, n): on the pool when there is one.
void ForRange(ThreadPool* pool, size_t n, size_t grain,
              const std::function<void(size_t, size_t)>& fn) {
  if (n == 0) return;
  if (pool) {
    pool->ParallelFor(n, grain, fn);
  } else {
    fn(0, n);
  }
}

class AttentionCacheImpl final : public AttentionCache {
 public:
  AttentionCacheImpl(const ModelConfig& cfg, int64_t ratio, int64_t max_context)
      : ratio(ratio),
        max_context(max_context),
        window(cfg.sliding_window),
        dim(cfg.head_dim),
        comp(ratio > 1 ? ratio : 1, cfg.head_dim, ratio == 4),
        index_comp(ratio == 4 ? 4 : 1, cfg.index_head_dim, true) {}

  int64_t next_pos() const override { return pos; }
  size_t bytes() const override {
    size_t b = ring.capacity() * sizeof(float);
    if (ratio > 1) b += comp.bytes();
    if (ratio == 4) b += index_comp.bytes();
    return b;
  }

  Status CopyFrom(const AttentionCache& other) override {
    const auto* src = dynamic_cast<const AttentionCacheImpl*>(&other);
    if (!src || src->ratio != ratio || src->window != window || src->dim != dim)
      return InvalidArgument("copying the attention cache of another kind of layer");
    if (src->pos > max_context)
      return OutOfRange("copying an attention cache of " + std::to_string(src->pos) +
                        " positions into one of max_context " + std::to_string(max_context));
    pos = src->pos;
    ring = src->ring;
    comp = src->comp;
    index_comp = src->index_comp;
    return Status::Ok();
  }

  const float* RingRow(int64_t s) const { return ring.data() + (s % window) * dim; }

  const int64_t ratio, max_context, window, dim;
  int64_t pos = 0;
  std::vector<float> ring;  // [W, D]: kv of position s at row s mod W
  CompressorState comp, index_comp;
};

// Per-row bookkeeping of one pass.
struct RowInfo {
  AttentionCacheImpl* cache;
  int64_t pos;   // absolute position
  int64_t p0;    // the sequence's first position in this pass
  int64_t row0;  // the sequence's first row in this pass
};

}  // namespace

std::vector<float> AttentionRopeInvFreq(const ModelConfig& cfg, int64_t ratio) {
  if (ratio == 0) return RopeInvFreqDefault(cfg.rope_theta, cfg.qk_rope_head_dim);
  const RopeScaling& y = cfg.rope_scaling;
  return RopeInvFreqYarn(cfg.compress_rope_theta, cfg.qk_rope_head_dim, y.factor, y.beta_fast,
                         y.beta_slow, y.original_max_position_embeddings);
}

Status ValidateAttention(const ModelConfig& cfg, const AttentionWeights& w,
                         const std::string& prefix) {
  const int64_t H = cfg.hidden_size, nH = cfg.num_attention_heads, D = cfg.head_dim;
  const int64_t G = cfg.o_groups, R = cfg.o_lora_rank, rd = cfg.qk_rope_head_dim;
  if (w.ratio < 0 || w.ratio == 1) {
    return InvalidArgument(prefix + ": compress ratio " + std::to_string(w.ratio) +
                           " (0 = window only, 4 = sparse, > 1 = heavily compressed)");
  }
  if (G <= 0 || nH % G != 0) {
    return InvalidArgument("config: num_attention_heads " + std::to_string(nH) +
                           " not divisible by o_groups " + std::to_string(G));
  }
  if (rd <= 0 || rd % 2 != 0 || rd > D || rd > kRopeMaxDim) {
    return InvalidArgument("config: qk_rope_head_dim " + std::to_string(rd) +
                           " must be even, <= head_dim and <= " + std::to_string(kRopeMaxDim));
  }
  if (cfg.sliding_window <= 0) return InvalidArgument("config: sliding_window must be > 0");
  FM_RETURN_IF_ERROR(CheckWeight(w.wq_a, cfg.q_lora_rank, H, prefix + "wq_a"));
  FM_RETURN_IF_ERROR(CheckVector(w.q_norm, cfg.q_lora_rank, prefix + "q_norm.weight"));
  FM_RETURN_IF_ERROR(CheckWeight(w.wq_b, nH * D, cfg.q_lora_rank, prefix + "wq_b"));
  FM_RETURN_IF_ERROR(CheckWeight(w.wkv, D, H, prefix + "wkv"));
  FM_RETURN_IF_ERROR(CheckVector(w.kv_norm, D, prefix + "kv_norm.weight"));
  FM_RETURN_IF_ERROR(CheckWeight(w.wo_a, G * R, nH * D / G, prefix + "wo_a"));
  FM_RETURN_IF_ERROR(CheckWeight(w.wo_b, H, G * R, prefix + "wo_b"));
  FM_RETURN_IF_ERROR(CheckVector(w.attn_sink, nH, prefix + "attn_sink"));
  FM_RETURN_IF_ERROR(CheckVector(w.rope_inv_freq, rd / 2, prefix + "(rope frequencies)"));
  if (w.ratio > 1) {
    if (w.compressor.ratio != w.ratio || w.compressor.dim != D) {
      return InvalidArgument(prefix + "compressor: ratio/width do not match the layer");
    }
    FM_RETURN_IF_ERROR(ValidateCompressor(w.compressor, H, prefix + "compressor."));
  }
  if (w.ratio == 4) {
    const int64_t nI = cfg.index_n_heads, dI = cfg.index_head_dim;
    if (rd > dI) return InvalidArgument("config: qk_rope_head_dim > index_head_dim");
    if (cfg.index_topk <= 0) return InvalidArgument("config: index_topk must be > 0");
    if (w.index_compressor.ratio != 4 || w.index_compressor.dim != dI) {
      return InvalidArgument(prefix + "indexer.compressor: ratio/width do not match the layer");
    }
    FM_RETURN_IF_ERROR(
        ValidateCompressor(w.index_compressor, H, prefix + "indexer.compressor."));
    FM_RETURN_IF_ERROR(CheckWeight(w.index_wq_b, nI * dI, cfg.q_lora_rank, prefix + "indexer.wq_b"));
    FM_RETURN_IF_ERROR(
        CheckWeight(w.index_weights_proj, nI, H, prefix + "indexer.weights_proj"));
  }
  return Status::Ok();
}

Result<std::unique_ptr<AttentionWeights>> BindAttention(const Checkpoint& ckpt,
                                                        const std::string& prefix, int64_t ratio) {
  const ModelConfig& cfg = ckpt.config();
  auto w = std::make_unique<AttentionWeights>();
  w->ratio = ratio;
  FM_ASSIGN_OR_RETURN(w->wq_a, ckpt.Weight(prefix + "wq_a"));
  FM_ASSIGN_OR_RETURN(w->q_norm, ckpt.GetF32(prefix + "q_norm.weight"));
  FM_ASSIGN_OR_RETURN(w->wq_b, ckpt.Weight(prefix + "wq_b"));
  FM_ASSIGN_OR_RETURN(w->wkv, ckpt.Weight(prefix + "wkv"));
  FM_ASSIGN_OR_RETURN(w->kv_norm, ckpt.GetF32(prefix + "kv_norm.weight"));
  FM_ASSIGN_OR_RETURN(w->wo_a, ckpt.Weight(prefix + "wo_a"));
  FM_ASSIGN_OR_RETURN(w->wo_b, ckpt.Weight(prefix + "wo_b"));
  FM_ASSIGN_OR_RETURN(w->attn_sink, ckpt.GetF32(prefix + "attn_sink"));
  w->rope_inv_freq = AttentionRopeInvFreq(cfg, ratio);
  if (ratio > 1) {
    FM_ASSIGN_OR_RETURN(w->compressor, BindCompressor(ckpt, prefix + "compressor.", ratio,
                                                      cfg.head_dim, cfg.hidden_size));
  }
  if (ratio == 4) {
    FM_ASSIGN_OR_RETURN(w->index_compressor,
                        BindCompressor(ckpt, prefix + "indexer.compressor.", ratio,
                                       cfg.index_head_dim, cfg.hidden_size));
    FM_ASSIGN_OR_RETURN(w->index_wq_b, ckpt.Weight(prefix + "indexer.wq_b"));
    FM_ASSIGN_OR_RETURN(w->index_weights_proj, ckpt.Weight(prefix + "indexer.weights_proj"));
  }
  FM_RETURN_IF_ERROR(ValidateAttention(cfg, *w, prefix));
  return w;
}

std::unique_ptr<AttentionCache> NewAttentionCache(const ModelConfig& cfg, int64_t ratio,
                                                  int64_t max_context) {
  return std::make_unique<AttentionCacheImpl>(cfg, ratio, max_context);
}

namespace {

// One slice of a sequence inside a pass: `rows` rows from the cache's current position.
struct PassSeq {
  AttentionCacheImpl* cache;
  int64_t rows;
};

// Rows per pass: bounds the per-row buffers (q and o are nH*D floats a row: 128 KiB on the real
// model) of a long prefill. The result does not depend on it (decode == prefill).
constexpr int64_t kPassRows = 256;
// Heads that share one pass over the key rows (a unit of parallel work with its row).
constexpr int64_t kHeadBlock = 4;

// tp: this member computes heads [h0, h0 + nh) and output groups [g0, g0 + nG) and gathers
// the rest (model/tp.h); null = every head here.
Status AttentionPass(const ModelConfig& cfg, const AttentionWeights& w,
                     const std::vector<PassSeq>& seqs, const float* x, float* out,
                     ThreadPool* pool, TpGroup* tp) {
  const int64_t nH = cfg.num_attention_heads, D = cfg.head_dim;
  const int64_t QL = cfg.q_lora_rank, G = cfg.o_groups, R = cfg.o_lora_rank;
  const int64_t rd = cfg.qk_rope_head_dim, W = cfg.sliding_window;
  const int64_t nI = cfg.index_n_heads, dI = cfg.index_head_dim;
  const float eps = static_cast<float>(cfg.rms_norm_eps);
  const int64_t ratio = w.ratio;
  const int me = tp ? tp->rank() : 0, members = tp ? tp->size() : 1;
  const TpRange heads = TpShare(nH, me, members), groups = TpShare(G, me, members);
  const int64_t h0 = heads.begin, nh = heads.size();

  std::vector<RowInfo> rows;
  for (const PassSeq& s : seqs) {
    const int64_t row0 = static_cast<int64_t>(rows.size());
    for (int64_t j = 0; j < s.rows; ++j) {
      rows.push_back({s.cache, s.cache->pos + j, s.cache->pos, row0});
    }
  }
  const int64_t N = static_cast<int64_t>(rows.size());
  if (N == 0) return Status::Ok();

  // 1-2: queries and the shared kv, all rows at once (Matmul is row-independent). The products
  // of x run as one MatmulMany pass, then those of cq: 2 thread rendezvous instead of up to 9.
  std::vector<float> cq(N * QL), q(N * nh * D), kv(N * D);
  std::vector<float> ca, cz, ia, iz, iq, iw;
  std::vector<MatmulJob> of_x = {{&w.wq_a, x, N, cq.data()}, {&w.wkv, x, N, kv.data()}};
  if (ratio > 1) {
    ca.resize(N * w.compressor.width());
    cz.resize(N * w.compressor.width());
    of_x.push_back({&w.compressor.wkv, x, N, ca.data()});
    of_x.push_back({&w.compressor.wgate, x, N, cz.data()});
  }
  if (ratio == 4) {
    ia.resize(N * w.index_compressor.width());
    iz.resize(N * w.index_compressor.width());
    iq.resize(N * nI * dI);
    iw.resize(N * nI);
    of_x.push_back({&w.index_compressor.wkv, x, N, ia.data()});
    of_x.push_back({&w.index_compressor.wgate, x, N, iz.data()});
    of_x.push_back({&w.index_weights_proj, x, N, iw.data()});
  }
  MatmulMany(of_x, pool);
  RmsNormRows_rd(cq.data(), w.q_norm.data(), N, QL, eps, cq.data());
  RmsNormRows_rd(kv.data(), w.kv_norm.data(), N, D, eps, kv.data());
  // This member's heads: rows [h0*D, (h0+nh)*D) of wq_b.
  QWeight wq_b;
  const bool q_sliced = SliceRows(w.wq_b, h0 * D, nh * D, &wq_b);
  std::vector<MatmulJob> of_cq;
  if (q_sliced) of_cq.push_back({&wq_b, cq.data(), N, q.data()});
  if (ratio == 4) of_cq.push_back({&w.index_wq_b, cq.data(), N, iq.data()});
  MatmulMany(of_cq, pool);
  if (!q_sliced) MatmulRowRange(w.wq_b, {h0 * D, (h0 + nh) * D}, cq.data(), N, q.data(), pool);
  RmsNormRows_rd(q.data(), nullptr, N * nh, D, eps, q.data());

  const float* freq = w.rope_inv_freq.data();
  ForRange(pool, N, 1, [&](size_t b, size_t e) {
    for (size_t r = b; r < e; ++r) {
      RopeRows_nd(q.data() + r * nh * D, nh, D, rd, rows[r].pos, freq, false);
      RopeRows_nd(kv.data() + r * D, 1, D, rd, rows[r].pos, freq, false);
      if (ratio == 4) RopeRows_nd(iq.data() + r * nI * dI, nI, dI, rd, rows[r].pos, freq, false);
    }
  });

  // 4: the compressors consume their tokens in position order, sequence by sequence.
  if (ratio > 1) {
    for (int64_t r = 0; r < N; ++r) {
      AttentionCacheImpl* c = rows[r].cache;
      const int64_t cw = w.compressor.width();
      c->comp.Push(w.compressor, ca.data() + r * cw, cz.data() + r * cw, rows[r].pos, freq, rd,
                   eps);
      if (ratio == 4) {
        const int64_t iwd = w.index_compressor.width();
        c->index_comp.Push(w.index_compressor, ia.data() + r * iwd, iz.data() + r * iwd,
                           rows[r].pos, freq, rd, eps);
      }
    }
  }

  // 3, 5, 6: the key rows of every query: its window, then its chosen compressed entries.
  std::vector<std::vector<const float*>> keys(N);
  ForRange(pool, N, 1, [&](size_t b, size_t e) {
    std::vector<int32_t> picks;
    for (size_t r = b; r < e; ++r) {
      const RowInfo& ri = rows[r];
      std::vector<const float*>& k = keys[r];
      for (int64_t s = std::max<int64_t>(0, ri.pos - W + 1); s <= ri.pos; ++s) {
        k.push_back(s >= ri.p0 ? kv.data() + (ri.row0 + s - ri.p0) * D : ri.cache->RingRow(s));
      }
      if (ratio <= 1) continue;
      const int64_t visible = (ri.pos + 1) / ratio;
      const float* entries = ri.cache->comp.entries();
      if (ratio != 4) {
        for (int64_t v = 0; v < visible; ++v) k.push_back(entries + v * D);
        continue;
      }
      IndexerSelect(iq.data() + r * nI * dI, iw.data() + r * nI, nI, dI,
                    ri.cache->index_comp.entries(), visible, cfg.index_topk, &picks);
      for (int32_t v : picks) k.push_back(entries + static_cast<int64_t>(v) * D);
    }
  });

  // 7: sink softmax attention per (row, block of heads), then the inverse rope of the output.
  // Each head's result is that of the head alone, whatever block it shares.
  std::vector<float> o(N * nh * D);
  const float scale = 1.0f / std::sqrt(static_cast<float>(D));
  const int64_t blocks = (nh + kHeadBlock - 1) / kHeadBlock;
  ForRange(pool, N * blocks, 1, [&](size_t b, size_t e) {
    std::vector<float> scratch;
    for (size_t i = b; i < e; ++i) {
      const int64_t r = i / blocks, hb = (i % blocks) * kHeadBlock;
      const int64_t nb = std::min(kHeadBlock, nh - hb);
      const int64_t n = static_cast<int64_t>(keys[r].size());
      scratch.resize(static_cast<size_t>(nb * n));
      float* oh = o.data() + (r * nh + hb) * D;
      SinkAttentionHeads_hd(q.data() + (r * nh + hb) * D, nb, keys[r].data(), n, D,
                            w.attn_sink.data() + h0 + hb, scale, scratch.data(), oh);
      RopeRows_nd(oh, nb, D, rd, rows[r].pos, freq, /*inverse=*/true);
    }
  });

  // The window ring keeps the last W kv rows of each sequence for the next call.
  for (int64_t r = 0; r < N; ++r) {
    AttentionCacheImpl* c = rows[r].cache;
    if (c->ring.empty()) c->ring.resize(static_cast<size_t>(W * D));
    std::copy(kv.data() + r * D, kv.data() + (r + 1) * D, c->ring.data() + (rows[r].pos % W) * D);
    c->pos = rows[r].pos + 1;
  }

  // 8: grouped output projection; group g reads heads [g*nH/G, (g+1)*nH/G) and its rows
  // [g*R, (g+1)*R) of wo_a. When those rows start inside an FP8 scale block (o_lora_rank not a
  // multiple of 128: test presets), the group input goes through all of wo_a and rows
  // [g*R, (g+1)*R) of the result are kept: the same values, as Matmul rows are independent.
  // With tp, this member's groups [g0, g0 + nG), whose heads it computed.
  const int64_t gin = nH * D / G, g0 = groups.begin, nG = groups.size();
  std::vector<float> xin(N * gin), ug, u(N * nG * R);
  for (int64_t g = g0; g < g0 + nG; ++g) {
    for (int64_t r = 0; r < N; ++r) {
      const float* og = o.data() + r * nh * D + (g - g0) * gin;
      std::copy(og, og + gin, xin.data() + r * gin);
    }
    QWeight wg;
    const bool sliced = SliceRows(w.wo_a, g * R, R, &wg);
    const int64_t ug_width = sliced ? R : G * R, ug_off = sliced ? 0 : g * R;
    ug.resize(static_cast<size_t>(N * ug_width));
    Matmul(sliced ? wg : w.wo_a, xin.data(), N, ug.data(), pool);
    for (int64_t r = 0; r < N; ++r) {
      const float* src = ug.data() + r * ug_width + ug_off;
      std::copy(src, src + R, u.data() + r * nG * R + (g - g0) * R);
    }
  }
  if (!tp) {
    Matmul(w.wo_b, u.data(), N, out, pool);
    return Status::Ok();
  }
  // All-gather the o_lora outputs; wo_b by output rows; all-gather those rows.
  FM_ASSIGN_OR_RETURN(auto u_pieces, tp->AllGather(u));
  FM_ASSIGN_OR_RETURN(std::vector<float> u_all,
                      JoinColumns(u_pieces, N, std::vector<int64_t>(members, nG * R)));
  const TpRange hid = TpShare(cfg.hidden_size, me, members);
  std::vector<float> mine(N * hid.size());
  MatmulRowRange(w.wo_b, hid, u_all.data(), N, mine.data(), pool);
  FM_ASSIGN_OR_RETURN(auto out_pieces, tp->AllGather(mine));
  FM_ASSIGN_OR_RETURN(std::vector<float> joined,
                      JoinColumns(out_pieces, N, std::vector<int64_t>(members, hid.size())));
  std::copy(joined.begin(), joined.end(), out);
  return Status::Ok();
}

}  // namespace

Status AttentionForward(const ModelConfig& cfg, const AttentionWeights& w,
                        std::span<const AttentionSeq> seqs, const float* x, float* out,
                        ThreadPool* pool, TpGroup* tp) {
  // Validate the whole batch before any cache moves.
  std::unordered_set<const AttentionCache*> seen;
  for (const AttentionSeq& s : seqs) {
    auto* c = dynamic_cast<AttentionCacheImpl*>(s.cache);
    if (!c) return InvalidArgument("attention: a sequence without an attention cache");
    if (!seen.insert(c).second) return InvalidArgument("attention: a cache appears twice in a batch");
    if (c->ratio != w.ratio || c->dim != cfg.head_dim || c->window != cfg.sliding_window) {
      return InvalidArgument("attention: cache made for ratio " + std::to_string(c->ratio) +
                             ", layer has ratio " + std::to_string(w.ratio));
    }
    if (s.rows < 0) return InvalidArgument("attention: negative row count");
    if (c->pos + s.rows > c->max_context) {
      return OutOfRange("attention: context of " + std::to_string(c->pos + s.rows) +
                        " positions exceeds max_context " + std::to_string(c->max_context));
    }
  }
  // Passes of at most kPassRows consecutive rows; a long sequence spans several, in order.
  const int64_t H = cfg.hidden_size;
  std::vector<PassSeq> pass;
  int64_t pass_rows = 0, done = 0;
  auto flush = [&]() -> Status {
    FM_RETURN_IF_ERROR(AttentionPass(cfg, w, pass, x + done * H, out + done * H, pool, tp));
    done += pass_rows;
    pass.clear();
    pass_rows = 0;
    return Status::Ok();
  };
  for (const AttentionSeq& s : seqs) {
    auto* c = static_cast<AttentionCacheImpl*>(s.cache);
    for (int64_t left = s.rows; left > 0;) {
      const int64_t n = std::min(left, kPassRows - pass_rows);
      pass.push_back({c, n});
      pass_rows += n;
      left -= n;
      if (pass_rows == kPassRows) FM_RETURN_IF_ERROR(flush());
    }
  }
  if (pass_rows > 0) FM_RETURN_IF_ERROR(flush());
  return Status::Ok();
}

}  // namespace fm
