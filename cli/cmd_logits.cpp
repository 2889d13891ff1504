// flashmesh logits --model DIR --tokens 3,17,42 [--mode prefill|decode] [--threads N] --out FILE
// Runs the whole model in this process and writes raw little-endian float32 logits [T, vocab];
// prints each position's argmax, space-separated, on one line (used by external tools).
#include <bit>
#include <cerrno>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "cli/commands.h"
#include "cli/flags.h"
#include "common/thread_pool.h"
#include "model/checkpoint.h"
#include "model/forward.h"
#include "model/kv_cache.h"

namespace fm::cli {
namespace {

const CommandSpec kSpec{
    "logits",
    "prefill: all tokens in one forward; decode: the first token, then one token per step.\n"
    "FILE gets raw little-endian float32 logits [T, vocab]; stdout gets each row's argmax.",
    {{"model", "DIR", "checkpoint directory", true},
     {"tokens", "IDS", "comma-separated token ids", true},
     {"out", "FILE", "where the logits go", true},
     {"mode", "prefill|decode", "how the tokens are run (default prefill)"},
     {"threads", "N", "kernel threads (default: all cores)"}}};

Status WriteLogits(const std::string& path, const std::vector<float>& logits) {
  std::FILE* f = std::fopen(path.c_str(), "wb");
  if (!f) return InvalidArgument("--out " + path + ": " + std::strerror(errno));
  std::vector<uint32_t> bits(logits.size());
  for (size_t i = 0; i < logits.size(); ++i) {
    uint32_t u = std::bit_cast<uint32_t>(logits[i]);
    if constexpr (std::endian::native == std::endian::big) u = __builtin_bswap32(u);
    bits[i] = u;
  }
  const size_t n = std::fwrite(bits.data(), 4, bits.size(), f);
  const bool ok = std::fclose(f) == 0 && n == bits.size();
  return ok ? Status::Ok() : Internal("--out " + path + ": short write");
}

Status Run(const std::string& model, const std::vector<int32_t>& tokens, bool decode,
           int threads, const std::string& out) {
  FM_ASSIGN_OR_RETURN(auto ckpt, Checkpoint::Open(model));
  ThreadPool pool(threads);
  FM_ASSIGN_OR_RETURN(auto shard, ShardModel::Create(*ckpt, &pool));
  const ModelConfig& cfg = shard->config();
  const int64_t T = static_cast<int64_t>(tokens.size()), V = cfg.vocab_size;
  const int64_t row = cfg.hc_mult * cfg.hidden_size;
  FM_ASSIGN_OR_RETURN(std::unique_ptr<SequenceCache> cache, shard->NewSequence(T));
  std::vector<float> logits(T * V);
  const std::span<const int32_t> all(tokens);
  const int64_t first = decode ? 1 : T;
  for (int64_t pos = 0; pos < T;) {
    const int64_t n = pos == 0 ? first : 1;
    const auto step = all.subspan(pos, n);
    std::vector<float> x(n * row);
    FM_RETURN_IF_ERROR(shard->Embed(step, x.data()));
    BatchItem item{cache.get(), step};
    FM_RETURN_IF_ERROR(shard->ForwardLayers({&item, 1}, x.data()));
    FM_RETURN_IF_ERROR(shard->Logits(x.data(), n, logits.data() + pos * V));
    pos += n;
  }
  FM_RETURN_IF_ERROR(WriteLogits(out, logits));
  std::string line;
  for (int64_t t = 0; t < T; ++t) {
    const float* r = logits.data() + t * V;
    int64_t best = 0;
    for (int64_t v = 1; v < V; ++v)
      if (r[v] > r[best]) best = v;
    line += (t ? " " : "") + std::to_string(best);
  }
  std::printf("%s\n", line.c_str());
  return Status::Ok();
}

}  // namespace

int CmdLogits(int argc, char** argv) {
  int rc = 0;
  const std::optional<Flags> flags = StartCommand(kSpec, argc, argv, &rc);
  if (!flags) return rc;
  const std::string model = flags->Get("model"), mode = flags->Get("mode", "prefill");
  const std::string out = flags->Get("out");
  const Result<int64_t> threads = flags->GetInt("threads", 0, 1, kMaxThreads);
  if (!threads.ok()) return UsageError(kSpec, threads.status().message());
  if (mode != "prefill" && mode != "decode")
    return UsageError(kSpec, "--mode: expected prefill or decode, got '" + mode + "'");
  const Result<std::vector<int32_t>> tokens = ParseTokenIds("tokens", flags->Get("tokens"));
  if (!tokens.ok()) return UsageError(kSpec, tokens.status().message());
  const Status st = Run(model, *tokens, mode == "decode", static_cast<int>(*threads), out);
  if (!st.ok()) {
    std::fprintf(stderr, "logits: %s\n", st.ToString().c_str());
    return 1;
  }
  return 0;
}

}  // namespace fm::cli
