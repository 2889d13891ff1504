// flashmesh mkmodel --preset tiny|small|bench|flash [--layers N] [--seed N] OUT (a tool: it
// links the test fixtures, docs/architecture.md)
#include <cstdio>
#include <filesystem>
#include <optional>
#include <string>

#include "cli/commands.h"
#include "cli/flags.h"
#include "model/mkmodel.h"

namespace fm::cli {

namespace {

const CommandSpec kSpec{
    "mkmodel",
    "writes a random, well-scaled checkpoint in the official DeepSeek-V4 layout to OUT\n"
    "tiny < 1 MB, small ~43 MB, bench ~2.3 GB (8 layers at reduced shapes)\n"
    "flash: DeepSeek-V4-Flash's real shapes and config, its first N layers (--layers N,\n"
    "       required, 1..43) + the MTP block: 3.6 GB a layer + 5.7 GB; for measuring\n"
    "       per-layer costs (bench decode). --layers is accepted only with flash.",
    {{"preset", "tiny|small|bench|flash", "the model's size", true},
     {"layers", "N", "flash: its first N layers"},
     {"seed", "N", "the random weights' seed (default 0); same seed, same files"},
     {"force", nullptr, "write over a checkpoint already in OUT (it has a config.json)"}},
    "OUT"};

}  // namespace

int CmdMkmodel(int argc, char** argv) {
  int rc = 0;
  const std::optional<Flags> flags = StartCommand(kSpec, argc, argv, &rc);
  if (!flags) return rc;
  const std::string preset = flags->Get("preset"), out = flags->operand();
  const Result<uint64_t> seed = flags->GetSeed("seed");
  if (!seed.ok()) return UsageError(kSpec, seed.status().message());
  const Result<int64_t> layers = flags->GetInt("layers", 0, 1, kFlashLayers);
  if (!layers.ok()) return UsageError(kSpec, layers.status().message());
  if (const Result<ModelConfig> cfg = PresetConfig(preset, *layers); !cfg.ok())
    return UsageError(kSpec, cfg.status().message());
  // A checkpoint's config.json is written last: one that is there is a whole checkpoint (maybe a
  // real one), which a mistyped OUT would leave with another config and index.
  std::error_code ec;
  if (!flags->Has("force") && std::filesystem::exists(std::filesystem::path(out) / "config.json", ec)) {
    std::fprintf(stderr, "mkmodel: %s already holds a checkpoint (config.json); --force writes over it\n",
                 out.c_str());
    return 1;
  }
  Status s = WritePresetCheckpoint(out, preset, *seed, *layers);
  if (!s.ok()) {
    std::fprintf(stderr, "mkmodel: %s\n", s.ToString().c_str());
    return 1;
  }
  std::printf("wrote %s checkpoint (seed %llu) to %s\n", preset.c_str(),
              static_cast<unsigned long long>(*seed), out.c_str());
  return 0;
}

}  // namespace fm::cli
