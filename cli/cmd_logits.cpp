// flashmesh logits --model DIR --tokens 3,17,42 [--mode prefill|decode] [--threads N] --out FILE
// Runs the whole model in this process and writes raw little-endian float32 logits [T, vocab];
// prints each position's argmax, space-separated, on one line (used by external tools).
#include <bit>
#include <cerrno>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <memory>
#include <string>
#include <vector>

#include "cli/commands.h"
#include "common/thread_pool.h"
#include "model/checkpoint.h"
#include "model/forward.h"
#include "model/kv_cache.h"

namespace fm::cli {
namespace {

const char* kUsage =
    "usage: flashmesh logits --model DIR --tokens 3,17,42 [--mode prefill|decode] [--threads N]\n"
    "                        --out FILE\n"
    "  prefill: all tokens in one forward; decode: the first token, then one token per step.\n"
    "  FILE gets raw little-endian float32 logits [T, vocab]; stdout gets each row's argmax.\n";

Result<std::vector<int32_t>> ParseTokens(const std::string& s) {
  std::vector<int32_t> out;
  size_t i = 0;
  while (i <= s.size()) {
    const size_t j = s.find(',', i);
    const std::string item = s.substr(i, j == std::string::npos ? std::string::npos : j - i);
    char* end = nullptr;
    errno = 0;
    const long v = std::strtol(item.c_str(), &end, 10);
    if (item.empty() || *end || errno || v < 0 || v > INT32_MAX)
      return InvalidArgument("--tokens: '" + item + "' is not a token id (non-negative integer)");
    out.push_back(static_cast<int32_t>(v));
    if (j == std::string::npos) break;
    i = j + 1;
  }
  return out;
}

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
  auto cache = shard->NewSequence(T);
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
  std::string model, tokens_arg, mode = "prefill", out;
  int threads = 0;
  for (int i = 1; i < argc; ++i) {
    const std::string a = argv[i];
    if (a == "--help" || a == "-h") {
      std::fputs(kUsage, stdout);
      return 0;
    }
    const bool takes_value =
        a == "--model" || a == "--tokens" || a == "--mode" || a == "--threads" || a == "--out";
    if (!takes_value) {
      std::fprintf(stderr, "logits: unknown argument '%s'\n%s", a.c_str(), kUsage);
      return 2;
    }
    if (i + 1 >= argc) {
      std::fprintf(stderr, "logits: %s needs a value\n%s", a.c_str(), kUsage);
      return 2;
    }
    const std::string v = argv[++i];
    if (a == "--model") model = v;
    else if (a == "--tokens") tokens_arg = v;
    else if (a == "--mode") mode = v;
    else if (a == "--out") out = v;
    else {
      char* end = nullptr;
      const long n = std::strtol(v.c_str(), &end, 10);
      if (v.empty() || *end || n < 1 || n > 1024) {
        std::fprintf(stderr, "logits: --threads must be an integer in [1, 1024], got '%s'\n",
                     v.c_str());
        return 2;
      }
      threads = static_cast<int>(n);
    }
  }
  if (model.empty() || tokens_arg.empty() || out.empty()) {
    std::fprintf(stderr, "logits: --model, --tokens and --out are required\n%s", kUsage);
    return 2;
  }
  if (mode != "prefill" && mode != "decode") {
    std::fprintf(stderr, "logits: --mode must be prefill or decode, got '%s'\n", mode.c_str());
    return 2;
  }
  auto tokens = ParseTokens(tokens_arg);
  if (!tokens.ok()) {
    std::fprintf(stderr, "logits: %s\n", tokens.status().ToString().c_str());
    return 2;
  }
  const Status st = Run(model, *tokens, mode == "decode", threads, out);
  if (!st.ok()) {
    std::fprintf(stderr, "logits: %s\n", st.ToString().c_str());
    return 1;
  }
  return 0;
}

}  // namespace fm::cli
