// Helpers of the tests that run a ShardModel end to end (tests/unit/test_forward.cpp on CPU,
// tests/gpu/test_cuda_shard.cpp on the device): random token ids, one call of embed + layers +
// logits over a batch, and the relative error the tolerances are stated in.
#pragma once
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <functional>
#include <limits>
#include <map>
#include <memory>
#include <random>
#include <span>
#include <vector>

#include "common/status.h"
#include "model/forward.h"
#include "model/mkmodel.h"

namespace fm::modeltest {

// n token ids in [0, vocab), the same for the same seed.
inline std::vector<int32_t> RandomTokens(int n, uint32_t seed, int32_t vocab) {
  std::mt19937 rng(seed);
  std::vector<int32_t> t(static_cast<size_t>(n));
  for (auto& v : t) v = static_cast<int32_t>(rng() % static_cast<uint32_t>(vocab));
  return t;
}

// The directory of a `preset` checkpoint (mkmodel, seed 7) written once per process into a
// temporary directory, which is removed when the process exits.
inline const std::string& PresetDir(const std::string& preset) {
  struct Dirs {
    std::map<std::string, std::string> by_preset;
    ~Dirs() {
      for (const auto& [name, dir] : by_preset) std::filesystem::remove_all(dir);
    }
  };
  static Dirs dirs;
  auto it = dirs.by_preset.find(preset);
  if (it != dirs.by_preset.end()) return it->second;
  std::string tmpl = "/tmp/fm_" + preset + "_XXXXXX";
  const char* made = mkdtemp(tmpl.data());
  const Status st = made ? WritePresetCheckpoint(tmpl, preset, 7) : Internal("mkdtemp " + tmpl);
  if (!st.ok()) std::fprintf(stderr, "PresetDir(%s): %s\n", preset.c_str(), st.ToString().c_str());
  return dirs.by_preset[preset] = tmpl;
}

// Host rows [rows, hc, H] into a new buffer in m's activation memory (the device's for a device
// shard), and a buffer's rows back to the host.
inline Result<std::unique_ptr<Activations>> ToShard(const ShardModel& m,
                                                    const std::vector<float>& host) {
  FM_ASSIGN_OR_RETURN(std::unique_ptr<Activations> x, m.NewActivations());
  const int64_t rows = static_cast<int64_t>(host.size()) / x->row_floats();
  FM_RETURN_IF_ERROR(x->Resize(rows));
  FM_RETURN_IF_ERROR(x->CopyFromHost(0, rows, host.data()));
  return x;
}
inline std::vector<float> ToHostRows(const Activations& x) {
  std::vector<float> host(static_cast<size_t>(x.rows() * x.row_floats()));
  if (!x.CopyToHost(0, x.rows(), host.data()).ok()) host.clear();
  return host;
}

// fn(x) on a copy of the host rows *host in m's activation memory, then the rows back into *host
// (a test's X on the host around a device shard's call).
inline Status OnShard(const ShardModel& m, std::vector<float>* host,
                      const std::function<Status(float*)>& fn) {
  FM_ASSIGN_OR_RETURN(std::unique_ptr<Activations> x, ToShard(m, *host));
  FM_RETURN_IF_ERROR(fn(x->data()));
  *host = ToHostRows(*x);
  return Status::Ok();
}

// Embed + ForwardLayers + Logits over `items` (each sequence's next tokens, rows in item order)
// with X in m's activation memory; appends the logits [T, V] to logits and, when given, the
// final manifold [T, hc, H] to state.
inline Status RunItems(const ShardModel& m, std::span<const BatchItem> items,
                       std::vector<float>* logits, std::vector<float>* state = nullptr) {
  const auto& cfg = m.config();
  std::vector<int32_t> toks;
  for (const BatchItem& it : items) toks.insert(toks.end(), it.tokens.begin(), it.tokens.end());
  const int64_t T = static_cast<int64_t>(toks.size());
  std::vector<float> lg(T * cfg.vocab_size);
  FM_ASSIGN_OR_RETURN(std::unique_ptr<Activations> x, m.NewActivations());
  FM_RETURN_IF_ERROR(x->Resize(T));
  FM_RETURN_IF_ERROR(m.Embed(toks, x->data()));
  FM_RETURN_IF_ERROR(m.ForwardLayers(items, x->data()));
  FM_RETURN_IF_ERROR(m.Logits(x->data(), T, lg.data()));
  logits->insert(logits->end(), lg.begin(), lg.end());
  if (state) {
    const std::vector<float> rows = ToHostRows(*x);
    state->insert(state->end(), rows.begin(), rows.end());
  }
  return Status::Ok();
}

// max |a - b| / max |b|; NaN when any element of either is NaN (std::max would skip it, and
// a NaN output, e.g. a row a kernel never wrote, would pass), infinity when the sizes differ.
inline double RelErr(const std::vector<float>& a, const std::vector<float>& b) {
  if (a.size() != b.size()) return std::numeric_limits<double>::infinity();
  double num = 0.0, den = 0.0;
  for (size_t i = 0; i < a.size(); ++i) {
    const double d = std::fabs(static_cast<double>(a[i]) - b[i]);
    if (!std::isnan(num) && !(d <= num)) num = d;   // a NaN, once there, stays
    den = std::max(den, std::fabs(static_cast<double>(b[i])));
  }
  return num / den;
}

// The largest RelErr of one row of `width` (one step's logits of one sequence): every step is
// held to the bound, not only the steps with the largest logits. Sizes that are not whole rows
// of the same count give infinity.
inline double RowRelErr(const std::vector<float>& a, const std::vector<float>& b, int64_t width) {
  if (width <= 0 || a.size() != b.size() || a.size() % static_cast<size_t>(width) != 0)
    return std::numeric_limits<double>::infinity();
  double worst = 0.0;
  for (size_t r = 0; r < a.size(); r += static_cast<size_t>(width)) {
    const std::vector<float> ra(a.begin() + r, a.begin() + r + width),
        rb(b.begin() + r, b.begin() + r + width);
    const double e = RelErr(ra, rb);
    if (!std::isnan(worst) && !(e <= worst)) worst = e;   // a NaN, once there, stays
  }
  return worst;
}

}  // namespace fm::modeltest
