// flashmesh mkmodel --preset tiny|small|bench|flash [--layers N] [--seed N] OUT
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <string>

#include "cli/commands.h"
#include "model/mkmodel.h"

namespace fm::cli {

int CmdMkmodel(int argc, char** argv) {
  const char* usage =
      "usage: flashmesh mkmodel --preset tiny|small|bench|flash [--layers N] [--seed N] OUT\n"
      "  writes a random, well-scaled checkpoint in the official DeepSeek-V4 layout to OUT\n"
      "  tiny < 1 MB, small ~43 MB, bench ~2.3 GB (8 layers at reduced shapes)\n"
      "  flash: DeepSeek-V4-Flash's real shapes and config, its first N layers (--layers N,\n"
      "         required, 1..43) + the MTP block: 3.6 GB a layer + 5.7 GB; for measuring\n"
      "         per-layer costs (bench decode). --layers is accepted only with flash.\n";
  std::string preset, out;
  uint64_t seed = 0;
  int64_t layers = 0;
  for (int i = 1; i < argc; ++i) {
    const std::string a = argv[i];
    if (a == "--help" || a == "-h") {
      std::fputs(usage, stdout);
      return 0;
    }
    if ((a == "--preset" || a == "--seed" || a == "--layers") && i + 1 >= argc) {
      std::fprintf(stderr, "mkmodel: %s needs a value\n%s", a.c_str(), usage);
      return 2;
    }
    if (a == "--preset") {
      preset = argv[++i];
    } else if (a == "--seed") {
      char* end = nullptr;
      const char* v = argv[++i];
      seed = std::strtoull(v, &end, 10);
      if (!*v || *end || v[0] == '-') {
        std::fprintf(stderr, "mkmodel: --seed must be a non-negative integer, got '%s'\n", v);
        return 2;
      }
    } else if (a == "--layers") {
      char* end = nullptr;
      const char* v = argv[++i];
      const long long n = std::strtoll(v, &end, 10);
      if (!*v || *end || n < 1 || n > kFlashLayers) {
        std::fprintf(stderr, "mkmodel: --layers must be an integer in [1, %lld], got '%s'\n",
                     static_cast<long long>(kFlashLayers), v);
        return 2;
      }
      layers = n;
    } else if (!a.empty() && a[0] == '-') {
      std::fprintf(stderr, "mkmodel: unknown option '%s'\n%s", a.c_str(), usage);
      return 2;
    } else if (out.empty()) {
      out = a;
    } else {
      std::fprintf(stderr, "mkmodel: more than one output directory given\n%s", usage);
      return 2;
    }
  }
  if (preset.empty() || out.empty()) {
    std::fputs(usage, stderr);
    return 2;
  }
  if (const Result<ModelConfig> cfg = PresetConfig(preset, layers); !cfg.ok()) {
    std::fprintf(stderr, "%s\n%s", cfg.status().message().c_str(), usage);
    return 2;
  }
  Status s = WritePresetCheckpoint(out, preset, seed, layers);
  if (!s.ok()) {
    std::fprintf(stderr, "mkmodel: %s\n", s.ToString().c_str());
    return 1;
  }
  std::printf("wrote %s checkpoint (seed %llu) to %s\n", preset.c_str(),
              static_cast<unsigned long long>(seed), out.c_str());
  return 0;
}

}  // namespace fm::cli
