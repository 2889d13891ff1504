// flashmesh bench <mode> ...: the benchmarks of bench/ (decode: bench/decode_bench.h, cluster:
// bench/cluster_bench.h) behind their flags.
#include <algorithm>
#include <cstdio>
#include <cstring>
#include <optional>
#include <string>
#include <thread>

#include "bench/cluster_bench.h"
#include "bench/decode_bench.h"
#include "cli/commands.h"
#include "cli/flags.h"
#include "config/cluster_config.h"

namespace fm::cli {
namespace {

const char* kModes =
    "usage: flashmesh bench decode|cluster [options]\n"
    "  decode: one process's decode speed against the measured memory bandwidth\n"
    "  cluster: a YAML's cluster against the single process, in one run\n"
    "  flashmesh bench MODE --help: the options of a mode\n";

const CommandSpec kDecodeSpec{
    "bench decode",
    "prefill --context tokens, decode --tokens tokens one at a time, report decode tok/s,\n"
    "weight bytes read per token, the measured memory bandwidth (a probe after each of 8\n"
    "decode rounds) and bw_efficiency = tok/s * bytes/token / bandwidth of the median round.\n"
    "Also: head_ms (embed + logits of a token, timed alone), layer_ms = (ms per token -\n"
    "head_ms) / layers, and the full model's predicted ms per token = layer_ms * its layers +\n"
    "head_ms next to its floor (its bytes per token / bandwidth); the full model is\n"
    "DeepSeek-V4-Flash (43 layers) for `mkmodel --preset flash --layers N`, else the\n"
    "checkpoint itself. head_rich_ms: head_ms with a sampling pick with 20 top logprobs,\n"
    "penalties and min-p (not in the prediction).",
    {{"model", "DIR", "checkpoint directory", true},
     {"context", "N", "prompt tokens prefilled first (default 64)"},
     {"tokens", "N", "tokens decoded (default 32)"},
     {"threads", "N", "kernel threads (default: all cores)"},
     {"streams", "B", "B sequences decode together, a step of B rows (default 1); tok/s counts\n"
                      "them all; on a device also the single stream first and streams_speedup;\n"
                      "the full-model prediction is of one stream (on cpu: with B = 1 only)"},
     {"device", "cpu|cuda:N", "cuda:N: the shard resident on GPU N; bandwidth = a device read\n"
                             "probe; also prefill tok/s (the context as batched device steps)"},
     {"eager", nullptr, "with cuda:N: launch every kernel of each decode step instead of\n"
                        "replaying the sequence's CUDA graph"},
     {"weight-core", "fma|tc", "with cuda:N: stream FP8/FP4 weights on f32 FMAs (default) or the\n"
                               "tensor cores (docs/gpu-kernels.md)"},
     {"launch-overlap", nullptr, "with cuda:N: each kernel may start while the one before it\n"
                                 "finishes (programmatic dependent launch; the weight kernels\n"
                                 "prefetch their rows into L2 first; docs/gpu-kernels.md)"},
     {"json", nullptr, "one JSON object on stdout"}}};

const CommandSpec kClusterSpec{
    "bench cluster",
    "starts the cluster of FILE (every worker and the coordinator) and a single-process\n"
    "`serve` of the same model, then measures both in the same run: decode tok/s at batch 1\n"
    "(best of 5, alternating), time to the first token (both sides chunk the prompt by the\n"
    "YAML's limits.max_step_tokens), aggregate tok/s of --streams concurrent requests, data-plane\n"
    "bytes per generated token (and the EP dispatch + combine or TP all-gather part of them),\n"
    "each next to the cost model's prediction for the same run (docs/performance.md). The\n"
    "YAML's ports must be free; the single process listens on a free loopback port it picks.",
    {{"config", "FILE", "the cluster YAML", true},
     {"model", "DIR", "checkpoint directory instead of the YAML's `model`"},
     {"tokens", "N", "new tokens per request (default 64)"},
     {"prompt", "N", "prompt tokens (default 16)"},
     {"streams", "N", "concurrent requests (default 8)"},
     {"threads", "N", "kernel threads per process (default: all cores)"},
     {"json", nullptr, "one JSON object on stdout"}}};

Result<bench::DecodeOptions> ParseDecode(const Flags& f) {
  bench::DecodeOptions o;
  o.model = f.Get("model");
  o.json = f.Has("json");
  o.eager = f.Has("eager");
  FM_ASSIGN_OR_RETURN(o.context, f.GetInt("context", o.context, 0));
  FM_ASSIGN_OR_RETURN(o.tokens, f.GetInt("tokens", o.tokens, 1));
  FM_ASSIGN_OR_RETURN(o.streams, f.GetInt("streams", o.streams, 1));
  FM_ASSIGN_OR_RETURN(const int64_t threads, f.GetInt("threads", 0, 0, kMaxThreads));
  o.threads = static_cast<int>(threads);
  constexpr int64_t kMaxTokens = int64_t{1} << 30;   // the caches hold context + tokens
  if (o.context > kMaxTokens || o.tokens > kMaxTokens)
    return InvalidArgument("--context, --tokens: at most " + std::to_string(kMaxTokens) + " each");
  Result<int> cuda = ParseDevice(f.Get("device", "cpu"));
  if (!cuda.ok()) return cuda.status().Wrap("--device");
  o.cuda_device = *cuda;
  if (o.eager && o.cuda_device < 0) return InvalidArgument("--eager: only with --device cuda:N");
  const std::string core = f.Get("weight-core", "fma");
  if (core != "fma" && core != "tc")
    return InvalidArgument("--weight-core: '" + core + "' (want fma or tc)");
  if (core == "tc" && o.cuda_device < 0)
    return InvalidArgument("--weight-core tc: only with --device cuda:N");
  o.tensor_cores = core == "tc";
  o.launch_overlap = f.Has("launch-overlap");
  if (o.launch_overlap && o.cuda_device < 0)
    return InvalidArgument("--launch-overlap: only with --device cuda:N");
  if (o.streams > 256) return InvalidArgument("--streams: " + std::to_string(o.streams) + " > 256");
  return o;
}

Result<bench::ClusterBenchOptions> ParseCluster(const Flags& f) {
  bench::ClusterBenchOptions o;
  o.config = f.Get("config");
  o.model = f.Get("model");
  o.json = f.Has("json");
  constexpr int64_t kMax = 1 << 20;
  FM_ASSIGN_OR_RETURN(o.tokens, f.GetInt("tokens", o.tokens, 2, kMax));
  FM_ASSIGN_OR_RETURN(o.prompt, f.GetInt("prompt", o.prompt, 1, kMax));
  FM_ASSIGN_OR_RETURN(o.streams, f.GetInt("streams", o.streams, 1, 256));
  FM_ASSIGN_OR_RETURN(o.threads, f.GetInt("threads", o.threads, 0, kMaxThreads));
  if (o.threads == 0) o.threads = std::max(1u, std::thread::hardware_concurrency());
  return o;
}

// Parses the mode's flags into its options and runs it: exit 0, 1 (it failed) or 2 (usage).
template <typename Options>
int RunMode(const CommandSpec& spec, int argc, char** argv,
            Result<Options> (*parse)(const Flags&), Status (*run)(const Options&)) {
  int rc = 0;
  const std::optional<Flags> flags = StartCommand(spec, argc, argv, &rc);
  if (!flags) return rc;
  const Result<Options> options = parse(*flags);
  if (!options.ok()) return UsageError(spec, options.status().message());
  if (const Status st = run(*options); !st.ok()) {
    std::fprintf(stderr, "%s: %s\n", spec.name, st.ToString().c_str());
    return 1;
  }
  return 0;
}

}  // namespace

int CmdBench(int argc, char** argv) {
  const std::string mode = argc < 2 ? "" : argv[1];
  // argv + 1: the mode is the subcommand of its flags.
  if (mode == "decode")
    return RunMode(kDecodeSpec, argc - 1, argv + 1, ParseDecode, bench::RunDecodeBench);
  if (mode == "cluster")
    return RunMode(kClusterSpec, argc - 1, argv + 1, ParseCluster, bench::RunClusterBench);
  if (mode == "--help" || mode == "-h") {
    std::fputs(kModes, stdout);
    return 0;
  }
  std::fprintf(stderr, "bench: %s\n%s",
               mode.empty() ? "a mode is required" : ("unknown mode '" + mode + "'").c_str(),
               kModes);
  return 2;
}

}  // namespace fm::cli
