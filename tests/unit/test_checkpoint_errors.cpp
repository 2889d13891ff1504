// Bad checkpoints: each error names the file and the tensor or field, Open fails cleanly
// (no crash, no partial state), and `flashmesh inspect` exits non-zero with that message.
#include <gtest/gtest.h>
#include <sys/stat.h>

#include <algorithm>
#include <filesystem>
#include <fstream>
#include <vector>

#include "cli/commands.h"
#include "model/checkpoint.h"
#include "model/config.h"
#include "model/safetensors.h"
#include "tests/unit/test_checkpoint_util.h"

namespace fm {
namespace {

using namespace testing_ck;
using json = nlohmann::json;

// Opens dir (full selection) expecting failure; returns the message. Also runs the CLI.
std::string OpenError(const std::string& dir) {
  auto ck = Checkpoint::Open(dir);
  EXPECT_FALSE(ck.ok()) << dir << " unexpectedly opened";
  if (ck.ok()) return "";
  std::string arg0 = "inspect", arg1 = dir;
  char* argv[] = {arg0.data(), arg1.data(), nullptr};
  ::testing::internal::CaptureStderr();
  const int rc = cli::CmdInspect(2, argv);
  const std::string err = ::testing::internal::GetCapturedStderr();
  EXPECT_EQ(rc, 1);
  EXPECT_NE(err.find(ck.status().message()), std::string::npos) << err;
  return ck.status().message();
}

#define EXPECT_HAS(msg, part) EXPECT_NE((msg).find(part), std::string::npos) << (msg)

const char* kNorm = "layers.1.attn_norm.weight";
const char* kWqa = "layers.2.attn.wq_a.weight";

TEST(CheckpointErrors, CorruptConfigJsonNamesLineAndColumn) {
  auto c = ParseModelConfig("{\n  \"vocab_size\": 10,\n  oops\n}\n", "m/config.json");
  ASSERT_FALSE(c.ok());
  EXPECT_EQ(c.status().message(), "m/config.json:3:3: not valid JSON");
  // A number beyond a double is nlohmann's out_of_range, not a parse_error: it used to escape
  // as an exception and end the process (found by fuzz_model_config).
  auto big = ParseModelConfig("{\"vocab_size\": 1E444}", "m/config.json");
  ASSERT_FALSE(big.ok());
  EXPECT_HAS(big.status().message(), "m/config.json: not valid JSON");
}

// Values that parse but would break the load or the first request: a count the loader lists
// (layers x experts tensors: gigabytes before any check), a window that sizes every cache, a
// loop count, or a real that makes NaN or zero logits. Each is refused naming the field.
TEST(CheckpointErrors, ConfigValuesOutOfRangeNameTheField) {
  const std::string d = TinyCopy("config_ranges");
  std::ifstream in(d + "/config.json");
  const json good = json::parse(in);
  ASSERT_TRUE(ParseModelConfig(good.dump(), "m/config.json").ok());
  const std::vector<std::pair<std::string, json>> cases = {
      {"n_routed_experts", 100000000},      {"num_hidden_layers", 2000000},
      {"sliding_window", int64_t{1} << 59}, {"hc_sinkhorn_iters", int64_t{1} << 60},
      {"vocab_size", int64_t{1} << 40},     {"rms_norm_eps", 1e300},
      {"hc_eps", -1},                       {"rope_theta", 0},
      {"routed_scaling_factor", 1e300},     {"max_position_embeddings", -5}};
  for (const auto& [key, value] : cases) {
    json bad = good;
    bad[key] = value;
    auto c = ParseModelConfig(bad.dump(), "m/config.json");
    ASSERT_FALSE(c.ok()) << key;
    EXPECT_HAS(c.status().message(), "m/config.json: field '" + key + "' must be");
  }
  for (const auto& [key, value] : std::vector<std::pair<std::string, json>>{
           {"factor", 0}, {"original_max_position_embeddings", -5}}) {
    json bad = good;
    bad["rope_scaling"][key] = value;
    auto c = ParseModelConfig(bad.dump(), "m/config.json");
    ASSERT_FALSE(c.ok()) << key;
    EXPECT_HAS(c.status().message(), "field 'rope_scaling." + key + "' must be");
  }
}

// Bytes after the last tensor: what a header length a few bytes short looks like (the padding
// spaces after the JSON still parse), which shifts every tensor. Refused, naming the shard.
TEST(CheckpointErrors, BytesAfterTheLastTensorAreRefused) {
  const std::string d = TinyCopy("trailing");
  const std::string shard = ShardOf(d, "head.weight");
  std::ofstream(shard, std::ios::app | std::ios::binary).write("\0\0\0\0", 4);
  const std::string m = OpenError(d);
  EXPECT_HAS(m, shard);
  EXPECT_HAS(m, "but its tensors end at");
}

// config.json as a device that never ends, or a FIFO nobody writes: an error naming the path,
// not an OOM or a reader blocked forever.
TEST(CheckpointErrors, AConfigThatIsNotARegularFileIsRefused) {
  const std::string zero = TinyCopy("config_dev_zero");
  fs::remove(zero + "/config.json");
  fs::create_symlink("/dev/zero", zero + "/config.json");
  EXPECT_HAS(OpenError(zero), zero + "/config.json: not a regular file");
  const std::string fifo = TinyCopy("config_fifo");
  fs::remove(fifo + "/config.json");
  ASSERT_EQ(mkfifo((fifo + "/config.json").c_str(), 0600), 0);
  EXPECT_HAS(OpenError(fifo), fifo + "/config.json: not a regular file");
}

TEST(CheckpointErrors, TruncatedShard) {
  const std::string d = TinyCopy("truncated");
  const std::string shard = ShardOf(d, "head.weight");
  fs::resize_file(shard, fs::file_size(shard) - 100);
  const std::string m = OpenError(d);
  EXPECT_HAS(m, shard);
  EXPECT_HAS(m, "beyond the data section");
  EXPECT_HAS(m, "tensor '");
}

TEST(CheckpointErrors, HeaderLengthBeyondFile) {
  const std::string d = TinyCopy("hdrlen");
  const std::string shard = ShardOf(d, kNorm);
  std::string all = ReadAll(shard);
  const uint64_t huge = all.size() + 1;
  for (int i = 0; i < 8; ++i) all[i] = static_cast<char>((huge >> (8 * i)) & 0xff);
  WriteAll(shard, all);
  const std::string m = OpenError(d);
  EXPECT_HAS(m, shard);
  EXPECT_HAS(m, "header length " + std::to_string(huge) + " is beyond the file size");
}

TEST(CheckpointErrors, DataOffsetsOutOfRange) {
  const std::string d = TinyCopy("offsets");
  const std::string shard = ShardOf(d, kNorm);
  EditHeader(shard, [](json& j) { j[kNorm]["data_offsets"] = {1u << 30, (1u << 30) + 128}; });
  const std::string m = OpenError(d);
  EXPECT_HAS(m, shard);
  EXPECT_HAS(m, std::string("tensor '") + kNorm + "'");
  EXPECT_HAS(m, "beyond the data section");
}

TEST(CheckpointErrors, DataOffsetsOverlap) {
  const std::string d = TinyCopy("overlap");
  const std::string shard = ShardOf(d, kNorm);
  const std::string other = "layers.1.ffn_norm.weight";  // same dtype and shape
  ASSERT_EQ(ShardOf(d, other), shard);
  EditHeader(shard, [&](json& j) { j[other]["data_offsets"] = j[kNorm]["data_offsets"]; });
  const std::string m = OpenError(d);
  EXPECT_HAS(m, shard);
  EXPECT_HAS(m, kNorm);
  EXPECT_HAS(m, other);
  EXPECT_HAS(m, "overlap");
}

// A zero-size tensor sorted between two overlapping ones does not hide the overlap.
TEST(CheckpointErrors, OverlapBehindAZeroSizeTensor) {
  const std::string header =
      R"({"A": {"dtype": "F32", "shape": [2], "data_offsets": [0, 8]},)"
      R"( "Z": {"dtype": "F32", "shape": [0], "data_offsets": [4, 4]},)"
      R"( "B": {"dtype": "F32", "shape": [1], "data_offsets": [4, 8]}})";
  std::vector<uint8_t> file(8 + header.size() + 8, 0);
  for (int i = 0; i < 8; ++i) file[i] = static_cast<uint8_t>(header.size() >> (8 * i));
  std::copy(header.begin(), header.end(), file.begin() + 8);
  auto h = ParseSafetensorsHeader(file.data(), file.size(), file.size(), "x.safetensors");
  ASSERT_FALSE(h.ok());
  EXPECT_HAS(h.status().message(), "x.safetensors: tensors 'A' [0, 8) and 'B' [4, 8) overlap");
}

TEST(CheckpointErrors, SpanDoesNotMatchShape) {
  const std::string d = TinyCopy("span");
  const std::string shard = ShardOf(d, kNorm);
  EditHeader(shard, [](json& j) { j[kNorm]["shape"] = {63}; });
  const std::string m = OpenError(d);
  EXPECT_HAS(m, shard);
  EXPECT_HAS(m, kNorm);
  EXPECT_HAS(m, "needs 126");
}

TEST(CheckpointErrors, WrongDtype) {
  const std::string d = TinyCopy("dtype");
  const std::string shard = ShardOf(d, kNorm);
  EditHeader(shard, [](json& j) { j[kNorm]["dtype"] = "F16"; });  // same size as BF16
  const std::string m = OpenError(d);
  EXPECT_HAS(m, shard);
  EXPECT_HAS(m, std::string("tensor '") + kNorm + "' has dtype F16, want BF16 or F32");
}

TEST(CheckpointErrors, ShapeDoesNotMatchConfig) {
  const std::string d = TinyCopy("shape");
  const std::string shard = ShardOf(d, kWqa);
  EditHeader(shard, [](json& j) { j[kWqa]["shape"] = {64, 32}; });  // transposed, same bytes
  const std::string m = OpenError(d);
  EXPECT_HAS(m, shard);
  EXPECT_HAS(m, std::string("tensor '") + kWqa + "' has shape [64, 32]");
  EXPECT_HAS(m, "config.json implies [32, 64]");
}

TEST(CheckpointErrors, MissingTensorInIndex) {
  const std::string d = TinyCopy("missing_index");
  const std::string index = d + "/model.safetensors.index.json";
  json j = json::parse(ReadAll(index));
  j["weight_map"].erase("layers.3.attn.compressor.ape");
  WriteAll(index, j.dump());
  const std::string m = OpenError(d);
  EXPECT_HAS(m, index);
  EXPECT_HAS(m, "missing tensor 'layers.3.attn.compressor.ape'");
}

TEST(CheckpointErrors, MissingTensorInShard) {
  const std::string d = TinyCopy("missing_shard_tensor");
  const std::string shard = ShardOf(d, kNorm);
  EditHeader(shard, [](json& j) { j.erase(kNorm); });
  const std::string m = OpenError(d);
  EXPECT_HAS(m, shard);
  EXPECT_HAS(m, std::string("tensor '") + kNorm + "' is listed in");
}

TEST(CheckpointErrors, MissingShardFile) {
  const std::string d = TinyCopy("missing_shard");
  const std::string shard = ShardOf(d, "head.weight");
  fs::remove(shard);
  const std::string m = OpenError(d);
  EXPECT_HAS(m, shard);
  EXPECT_HAS(m, "model.safetensors.index.json");
  EXPECT_HAS(m, "does not exist");
}

TEST(CheckpointErrors, NonJsonHeader) {
  const std::string d = TinyCopy("nonjson");
  const std::string shard = ShardOf(d, kNorm);
  std::string all = ReadAll(shard);
  all[8] = 'x';  // '{' -> 'x'
  WriteAll(shard, all);
  const std::string m = OpenError(d);
  EXPECT_HAS(m, shard);
  EXPECT_HAS(m, "header is not valid JSON");
}

TEST(CheckpointErrors, ConfigMissingField) {
  const std::string d = TinyCopy("cfg_missing");
  json j = json::parse(ReadAll(d + "/config.json"));
  j.erase("moe_intermediate_size");
  WriteAll(d + "/config.json", j.dump());
  const std::string m = OpenError(d);
  EXPECT_HAS(m, d + "/config.json");
  EXPECT_HAS(m, "missing required field 'moe_intermediate_size'");
}

TEST(CheckpointErrors, ConfigMistypedField) {
  const std::string d = TinyCopy("cfg_mistyped");
  json j = json::parse(ReadAll(d + "/config.json"));
  j["hidden_size"] = "64";
  WriteAll(d + "/config.json", j.dump());
  const std::string m = OpenError(d);
  EXPECT_HAS(m, d + "/config.json");
  EXPECT_HAS(m, "field 'hidden_size' must be an integer");
}

// A huge MTP layer count is an error naming the field (it padded compress_ratios to it:
// bad_alloc, the process ended).
TEST(CheckpointErrors, ConfigHugeMtpLayerCount) {
  const std::string d = TinyCopy("cfg_mtp");
  json j = json::parse(ReadAll(d + "/config.json"));
  j["num_nextn_predict_layers"] = int64_t{1000000000000};
  WriteAll(d + "/config.json", j.dump());
  const std::string m = OpenError(d);
  EXPECT_HAS(m, d + "/config.json");
  EXPECT_HAS(m, "num_nextn_predict_layers");
  EXPECT_HAS(m, "must be in [0, 64]");
}

// A config.json that disagrees with the tensors (more experts than the files hold).
TEST(CheckpointErrors, ConfigDisagreesWithTensors) {
  const std::string d = TinyCopy("cfg_experts");
  json j = json::parse(ReadAll(d + "/config.json"));
  j["n_routed_experts"] = 9;
  WriteAll(d + "/config.json", j.dump());
  const std::string m = OpenError(d);
  EXPECT_HAS(m, "missing tensor 'layers.0.ffn.experts.8.w1.weight'");
}

TEST(CheckpointErrors, Tid2eidOutOfRange) {
  const std::string d = TinyCopy("tid_range");
  const std::string name = "layers.0.ffn.gate.tid2eid";
  const std::string shard = ShardOf(d, name);
  uint64_t begin = 0, data_offset = 0;
  {
    std::string all = ReadAll(shard);
    uint64_t n = 0;
    for (int i = 7; i >= 0; --i) n = (n << 8) | static_cast<unsigned char>(all[i]);
    data_offset = 8 + n;
    begin = json::parse(all.substr(8, n))[name]["data_offsets"][0].get<uint64_t>();
    const int64_t bad = 8;  // experts are 0..7
    std::memcpy(all.data() + data_offset + begin + 8 * 5, &bad, 8);
    WriteAll(shard, all);
  }
  const std::string m = OpenError(d);
  EXPECT_HAS(m, shard);
  EXPECT_HAS(m, "tensor '" + name + "' entry 5 is expert 8");
}

TEST(CheckpointErrors, BadSelection) {
  const std::string d = TinyCopy("selection");
  ShardSelection sel;
  sel.layer_begin = 4;
  sel.layer_end = 7;
  auto ck = Checkpoint::Open(d, sel);
  ASSERT_FALSE(ck.ok());
  EXPECT_HAS(ck.status().message(), "layer range [4, 7)");
  sel = {};
  sel.experts = {3, 8};
  ck = Checkpoint::Open(d, sel);
  ASSERT_FALSE(ck.ok());
  EXPECT_HAS(ck.status().message(), "expert 8 is outside [0, 8)");
}

// A partial load only validates what it maps: a broken shard outside the selection is fine.
TEST(CheckpointErrors, PartialLoadIgnoresUnselectedShard) {
  const std::string d = TinyCopy("partial_ok");
  const std::string head_shard = ShardOf(d, "head.weight");
  const std::string embed_shard = ShardOf(d, "embed.weight");
  ASSERT_NE(head_shard, embed_shard);
  WriteAll(head_shard, "garbage");
  ShardSelection sel;
  sel.layer_end = 1;
  sel.head = sel.mtp = false;
  auto ck = Checkpoint::Open(d, sel);
  ASSERT_TRUE(ck.ok()) << ck.status().ToString();
  EXPECT_TRUE((*ck)->Has("embed.weight"));
  EXPECT_FALSE(Checkpoint::Open(d).ok());
}

}  // namespace
}  // namespace fm
