// The flash preset (mkmodel --preset flash --layers N): DeepSeek-V4-Flash's real config cut to
// its first N layers, checked against configs/models/deepseek-v4-flash/config.json, its tensor
// shapes, and the decode bytes per token that bench decode extrapolates with. Writing the real
// thing (9 GB for one layer) is too slow for ctest: tests/gpu/run.sh writes and runs it.
#include <gtest/gtest.h>

#include <filesystem>
#include <map>
#include <string>
#include <vector>

#include "model/config.h"
#include "model/inspect.h"
#include "model/mkmodel.h"
#include "model/tensor_schema.h"

namespace fm {
namespace {

namespace fs = std::filesystem;

ModelConfig RealConfig() {
  const fs::path p = fs::path(FM_SOURCE_DIR) / "configs/models/deepseek-v4-flash/config.json";
  Result<ModelConfig> c = LoadModelConfig(p.string());
  EXPECT_TRUE(c.ok()) << c.status().ToString();
  return c.ok() ? *c : ModelConfig{};
}

TEST(FlashPreset, AllLayersIsTheRealConfig) {
  const ModelConfig real = RealConfig();
  ASSERT_EQ(real.num_hidden_layers, kFlashLayers);
  Result<ModelConfig> flash = PresetConfig("flash", kFlashLayers);
  ASSERT_TRUE(flash.ok()) << flash.status().ToString();
  EXPECT_EQ(ConfigJson(*flash), ConfigJson(real));
}

TEST(FlashPreset, FirstLayersOfTheRealConfig) {
  const ModelConfig real = RealConfig();
  for (int64_t n : {1, 2, 3, 4, 17, 42}) {
    Result<ModelConfig> flash = PresetConfig("flash", n);
    ASSERT_TRUE(flash.ok()) << flash.status().ToString();
    // Only the layer count, the hash layers that fit and the ratios of those layers differ.
    ModelConfig want = real;
    want.num_hidden_layers = n;
    want.num_hash_layers = std::min<int64_t>(real.num_hash_layers, n);
    want.compress_ratios.assign(real.compress_ratios.begin(), real.compress_ratios.begin() + n);
    want.compress_ratios.push_back(real.compress_ratios.back());  // the MTP block's
    EXPECT_EQ(ConfigJson(*flash), ConfigJson(want)) << n;
    EXPECT_EQ(flash->hidden_size, 4096);
    EXPECT_EQ(flash->n_routed_experts, 256);
    EXPECT_EQ(flash->expert_dtype, "fp4");
    // The file round-trips through the loader's validation.
    Result<ModelConfig> parsed = ParseModelConfig(ConfigJson(*flash), "flash");
    ASSERT_TRUE(parsed.ok()) << parsed.status().ToString();
    EXPECT_EQ(ConfigJson(*parsed), ConfigJson(*flash));
  }
  EXPECT_EQ(PresetConfig("flash", 4)->compress_ratios, (std::vector<int64_t>{0, 0, 4, 128, 0}));
  EXPECT_EQ(PresetConfig("flash", 2)->num_hash_layers, 2);
}

TEST(FlashPreset, LayersFlagIsValidated) {
  for (int64_t n : {0, -1, 44, 1000}) {
    Result<ModelConfig> c = PresetConfig("flash", n);
    ASSERT_FALSE(c.ok()) << n;
    EXPECT_NE(c.status().message().find("--layers N in [1, 43]"), std::string::npos)
        << c.status().message();
  }
  for (const char* p : {"tiny", "small", "bench"}) {
    Result<ModelConfig> c = PresetConfig(p, 2);
    ASSERT_FALSE(c.ok()) << p;
    EXPECT_NE(c.status().message().find("--layers is only for --preset flash"), std::string::npos)
        << c.status().message();
    EXPECT_TRUE(PresetConfig(p).ok()) << p;
  }
  EXPECT_FALSE(WritePresetCheckpoint(fs::path(FM_BINARY_DIR) / "never-written", "flash", 0, 44)
                   .ok());
  EXPECT_FALSE(fs::exists(fs::path(FM_BINARY_DIR) / "never-written"));
}

TEST(FlashPreset, TensorShapesAreTheRealOnes) {
  const std::vector<TensorSpec> specs = ExpectedTensors(*PresetConfig("flash", 4));
  std::map<std::string, const TensorSpec*> by_name;
  for (const TensorSpec& s : specs) by_name[s.name] = &s;
  auto shape = [&](const std::string& n) {
    auto it = by_name.find(n);
    return it == by_name.end() ? std::vector<int64_t>{} : it->second->shape;
  };
  using V = std::vector<int64_t>;
  EXPECT_EQ(shape("embed.weight"), (V{129280, 4096}));
  EXPECT_EQ(shape("head.weight"), (V{129280, 4096}));
  EXPECT_EQ(shape("layers.0.hc_attn_fn"), (V{24, 16384}));
  EXPECT_EQ(shape("layers.0.attn.wq_a.weight"), (V{1024, 4096}));
  EXPECT_EQ(shape("layers.0.attn.wq_b.weight"), (V{32768, 1024}));
  EXPECT_EQ(shape("layers.0.attn.wq_b.scale"), (V{256, 8}));
  EXPECT_EQ(shape("layers.0.attn.wkv.weight"), (V{512, 4096}));
  EXPECT_EQ(shape("layers.0.attn.wo_a.weight"), (V{8192, 4096}));
  EXPECT_EQ(shape("layers.0.attn.wo_b.weight"), (V{4096, 8192}));
  EXPECT_EQ(shape("layers.0.ffn.gate.tid2eid"), (V{129280, 6}));
  EXPECT_EQ(shape("layers.2.ffn.gate.tid2eid"), (V{129280, 6}));
  EXPECT_EQ(shape("layers.3.ffn.gate.bias"), (V{256}));
  EXPECT_EQ(shape("layers.0.attn.compressor.wkv.weight"), V{});  // window-only
  EXPECT_EQ(shape("layers.2.attn.compressor.wkv.weight"), (V{1024, 4096}));
  EXPECT_EQ(shape("layers.2.attn.indexer.wq_b.weight"), (V{8192, 1024}));
  EXPECT_EQ(shape("layers.2.attn.indexer.compressor.wkv.weight"), (V{256, 4096}));
  EXPECT_EQ(shape("layers.3.attn.compressor.wkv.weight"), (V{512, 4096}));
  EXPECT_EQ(shape("layers.3.attn.compressor.ape"), (V{128, 512}));
  EXPECT_EQ(shape("layers.3.attn.indexer.wq_b.weight"), V{});
  EXPECT_EQ(shape("layers.3.ffn.experts.255.w1.weight"), (V{2048, 2048}));  // FP4 pairs
  EXPECT_EQ(shape("layers.3.ffn.experts.255.w1.scale"), (V{2048, 128}));
  EXPECT_EQ(shape("layers.3.ffn.experts.255.w2.weight"), (V{4096, 1024}));
  EXPECT_EQ(shape("layers.3.ffn.shared_experts.w2.weight"), (V{4096, 2048}));
  EXPECT_EQ(shape("mtp.0.ffn.experts.0.w3.weight"), (V{2048, 2048}));
  EXPECT_EQ(shape("layers.4.attn_norm.weight"), V{});
  EXPECT_EQ(by_name.at("layers.3.ffn.experts.7.w1.weight")->dtypes[0], DType::kI8);
  EXPECT_EQ(by_name.at("layers.3.attn.wo_b.weight")->dtypes[0], DType::kF8E4M3);
}

// One window-only hash layer at the real shapes, by hand: what one decode step reads of it.
TEST(FlashPreset, DecodeBytesPerTokenOfTheRealLayers) {
  const uint64_t H = 4096, fp8_scale_1024x4096 = 8 * 32;
  const uint64_t hc = 2 * (24 * 16384 * 4 + 24 * 4 + 3 * 4);
  const uint64_t norms = 2 * H * 2 + 1024 * 2 + 512 * 2;
  const uint64_t attn = (1024 * H + fp8_scale_1024x4096) + (32768 * 1024 + 256 * 8) +
                        (512 * H + 4 * 32) + (8192 * 4096 + 64 * 32) + (H * 8192 + 32 * 64) +
                        64 * 4;
  const uint64_t router = 256 * H * 2 + 129280 * 6 * 8;  // gate + tid2eid
  const uint64_t shared = 3 * (2048 * H + 16 * 32);
  const uint64_t expert = 2 * (2048 * 2048 + 2048 * 128) + (4096 * 1024 + 4096 * 64);
  const uint64_t layer0 = hc + norms + attn + router + shared + 6 * expert;
  const uint64_t head = 129280 * H * 2 + H * 2 + (4 * 16384 * 4 + 4 * 4 + 4);
  const uint64_t embed_row = H * 2;
  EXPECT_EQ(DecodeBytesPerToken(*PresetConfig("flash", 1)), embed_row + layer0 + head);
  EXPECT_EQ(DecodeBytesPerToken(*PresetConfig("flash", 2)), embed_row + 2 * layer0 + head);
  // Layer 2 adds the ratio-4 compressor (width 2 x 512) and the indexer (64 x 128, its
  // compressor of width 2 x 128); layer 3 the ratio-128 compressor (width 512) and is score
  // routed (gate.bias instead of tid2eid).
  const uint64_t ratio4 = (2 * 1024 * H * 2 + 4 * 1024 * 4 + 512 * 2) +
                          (8192 * 1024 + 64 * 8) + 64 * H * 2 + (2 * 256 * H * 2 + 4 * 256 * 4 + 128 * 2);
  const uint64_t ratio128 = 2 * 512 * H * 2 + 128 * 512 * 4 + 512 * 2;
  const uint64_t score_routed = 256 * 4, hash_routed = 129280 * 6 * 8;
  EXPECT_EQ(DecodeBytesPerToken(*PresetConfig("flash", 4)),
            embed_row + head + 4 * layer0 + ratio4 + ratio128 - hash_routed + score_routed);
  // The full model: 2 window-only, 21 ratio-4 and 20 ratio-128 layers, 3 of them hash routed:
  // 11.24 GB a token (~235 MB a layer and the 1.06 GB head).
  const uint64_t full = embed_row + head + 43 * layer0 + 21 * ratio4 + 20 * ratio128 +
                        40 * score_routed - 40 * hash_routed;
  EXPECT_EQ(DecodeBytesPerToken(*PresetConfig("flash", kFlashLayers)), full);
  EXPECT_EQ(full / 10000000, 1123u);
}

TEST(FlashPreset, DecodeBytesPerTokenIsWhatInspectReports) {
  const fs::path dir = fs::path(FM_BINARY_DIR) / "test_mkmodel_flash_small";
  fs::remove_all(dir);
  ASSERT_TRUE(WritePresetCheckpoint(dir.string(), "small", 3).ok());
  Result<InspectReport> r = InspectCheckpoint(dir.string());
  ASSERT_TRUE(r.ok()) << r.status().ToString();
  EXPECT_EQ(r->bytes_per_token(), DecodeBytesPerToken(*PresetConfig("small")));
  fs::remove_all(dir);
}

TEST(FlashPreset, FullModelOfAFlashCheckpointIsTheRealModel) {
  const std::string real = ConfigJson(RealConfig());
  for (int64_t n : {1, 2, 43}) EXPECT_EQ(ConfigJson(FullModelConfig(*PresetConfig("flash", n))), real);
  // Any other geometry is its own full model.
  const ModelConfig bench = *PresetConfig("bench");
  EXPECT_EQ(ConfigJson(FullModelConfig(bench)), ConfigJson(bench));
  ModelConfig other = *PresetConfig("flash", 2);
  other.vocab_size = 1000;
  EXPECT_EQ(FullModelConfig(other).num_hidden_layers, 2);
}

}  // namespace
}  // namespace fm
