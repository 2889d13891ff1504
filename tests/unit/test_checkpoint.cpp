// Checkpoint loader, tensor schema, mkmodel and inspect on real files.
#include <fcntl.h>
#include <gtest/gtest.h>
#include <unistd.h>

#include <cmath>
#include <cstring>

#include "common/numfmt.h"
#include "kernels/cpu/matvec.h"
#include "model/checkpoint.h"
#include "model/inspect.h"
#include "model/safetensors.h"
#include "model/tensor_schema.h"
#include "tests/unit/test_checkpoint_util.h"

namespace fm {
namespace {

using namespace testing_ck;

// kPrivate: Load reads exactly the asked runs into private memory (bytes outside them stay
// zero), and a file that shrank after Open is an error naming the file, not a crash.
TEST(Safetensors, PrivateBytesAreReadByLoadAndAShrunkFileIsAnError) {
  const std::string d = TempDir("private");
  fs::create_directories(d);
  const std::string p = d + "/a.safetensors";
  auto w = SafetensorsWriter::Create(p, {{"x", DType::kF32, {4}}, {"y", DType::kF32, {4}}});
  ASSERT_TRUE(w.ok()) << w.status().ToString();
  const float x[4] = {1, 2, 3, 4}, y[4] = {5, 6, 7, 8};
  ASSERT_TRUE((*w)->Append(x, 16).ok());
  ASSERT_TRUE((*w)->Append(y, 16).ok());
  ASSERT_TRUE((*w)->Finish().ok());
  {
    auto f = SafetensorsFile::Open(p, TensorBytes::kPrivate);
    ASSERT_TRUE(f.ok()) << f.status().ToString();
    const SafetensorsTensor* ty = (*f)->header().Find("y");
    ASSERT_TRUE((*f)->Load({{ty->begin, ty->end}}).ok());
    float got[4];
    std::memcpy(got, (*f)->data(*ty), 16);
    EXPECT_EQ(got[3], 8.0f);
    std::memcpy(got, (*f)->data(*(*f)->header().Find("x")), 16);
    EXPECT_EQ(got[0], 0.0f);   // not asked for: never read
    EXPECT_FALSE((*f)->Load({}).ok()) << "a second Load has no file to read from";
  }
  auto f = SafetensorsFile::Open(p, TensorBytes::kPrivate);
  ASSERT_TRUE(f.ok());
  ASSERT_EQ(::truncate(p.c_str(), static_cast<off_t>((*f)->header().data_offset + 20)), 0);
  const SafetensorsTensor* ty = (*f)->header().Find("y");
  const Status st = (*f)->Load({{0, ty->end}});
  EXPECT_FALSE(st.ok());
  EXPECT_NE(st.ToString().find(p), std::string::npos) << st.ToString();
  EXPECT_NE(st.ToString().find("file shrank"), std::string::npos) << st.ToString();
}

ModelConfig RealConfig() {
  ModelConfig c;
  c.vocab_size = 129280, c.hidden_size = 4096, c.num_hidden_layers = 43;
  c.num_attention_heads = 64, c.head_dim = 512, c.qk_rope_head_dim = 64;
  c.q_lora_rank = 1024, c.o_lora_rank = 1024, c.o_groups = 8;
  c.n_routed_experts = 256, c.num_experts_per_tok = 6, c.moe_intermediate_size = 2048;
  c.sliding_window = 128, c.num_hash_layers = 3, c.index_n_heads = 64;
  c.index_head_dim = 128, c.index_topk = 512, c.num_nextn_predict_layers = 1;
  c.compress_ratios = {0, 0};
  for (int l = 2; l < 43; ++l) c.compress_ratios.push_back(l % 2 == 0 ? 4 : 128);
  c.compress_ratios.push_back(0);
  return c;
}

TEST(Safetensors, WriterRoundTripAndAlignment) {
  const std::string d = TempDir("roundtrip");
  fs::create_directories(d);
  const std::string p = d + "/a.safetensors";
  auto w = SafetensorsWriter::Create(p, {{"x", DType::kF32, {2, 3}}, {"e", DType::kI64, {0}},
                                         {"y", DType::kBF16, {5}}});
  ASSERT_TRUE(w.ok()) << w.status().ToString();
  const float x[6] = {1, 2, 3, 4, 5, 6};
  ASSERT_TRUE((*w)->Append(x, 12).ok());
  ASSERT_TRUE((*w)->Append(x + 3, 12).ok());  // a tensor may arrive in pieces
  const uint16_t y[5] = {1, 2, 3, 4, 5};
  ASSERT_TRUE((*w)->Append(y, 10).ok());
  ASSERT_TRUE((*w)->Finish().ok());
  auto f = SafetensorsFile::Open(p);
  ASSERT_TRUE(f.ok()) << f.status().ToString();
  EXPECT_EQ((*f)->header().data_offset % 8, 0u);
  ASSERT_EQ((*f)->header().tensors.size(), 3u);
  const SafetensorsTensor* t = (*f)->header().Find("x");
  ASSERT_NE(t, nullptr);
  EXPECT_EQ(t->shape, (std::vector<int64_t>{2, 3}));
  float back[6];
  std::memcpy(back, (*f)->data(*t), 24);
  EXPECT_EQ(back[5], 6.0f);
  EXPECT_EQ((*f)->header().Find("y")->begin, 24u);
  EXPECT_EQ((*f)->file_size(), (*f)->header().data_offset + 34);
}

TEST(Safetensors, WriterRejectsShortTensor) {
  const std::string d = TempDir("short");
  fs::create_directories(d);
  auto w = SafetensorsWriter::Create(d + "/a.safetensors", {{"x", DType::kF32, {4}}});
  ASSERT_TRUE(w.ok());
  const float x[2] = {1, 2};
  ASSERT_TRUE((*w)->Append(x, 8).ok());
  const Status s = (*w)->Finish();
  EXPECT_FALSE(s.ok());
  EXPECT_NE(s.message().find("'x' was not written in full"), std::string::npos);
}

TEST(Mkmodel, QuantizersMatchNumfmt) {
  for (int c = 0; c < 256; ++c) {
    const float v = E4m3ToF32(static_cast<uint8_t>(c));
    if (std::isnan(v)) continue;
    EXPECT_EQ(QuantizeE4m3(v), F32ToE4m3(v)) << "code " << c;
    if (c < 0x7E) {  // exact midpoints exercise round-half-to-even
      const float mid = (v + E4m3ToF32(static_cast<uint8_t>(c + 1))) * 0.5f;
      if ((c & 0x7F) < 0x7E) {
        EXPECT_EQ(QuantizeE4m3(mid), F32ToE4m3(mid)) << "mid " << c;
      }
    }
  }
  uint64_t s = 12345;
  for (int i = 0; i < 200000; ++i) {
    s = s * 6364136223846793005ull + 1442695040888963407ull;
    const float x = static_cast<float>(static_cast<int64_t>(s >> 11) % 2000000) / 3000.0f - 333.0f;
    ASSERT_EQ(QuantizeE4m3(x), F32ToE4m3(x)) << x;
    ASSERT_EQ(QuantizeFp4(x / 50.0f), F32ToFp4(x / 50.0f)) << x / 50.0f;
  }
  for (float x : {0.25f, 0.75f, 1.25f, 1.75f, 2.5f, 3.5f, 5.0f, -5.0f, 7.0f, -0.0f})
    EXPECT_EQ(QuantizeFp4(x), F32ToFp4(x)) << x;
}

TEST(TensorSchema, RealModelSizes) {
  const ModelConfig c = RealConfig();
  const ModelBytes b = ComputeModelBytes(c);
  // One FP4 expert: 3 * (2048*4096/2 + 2048*4096/32) bytes.
  EXPECT_EQ(b.expert[10], 3u * (2048u * 4096u / 2 + 2048u * 4096u / 32));
  EXPECT_EQ(b.embed, 129280u * 4096u * 2u);
  // ~149 GB on disk (MODEL.md); the schema must land in that neighbourhood.
  EXPECT_GT(b.total, 140e9);
  EXPECT_LT(b.total, 170e9);
  uint64_t sum = b.embed + b.head;
  for (size_t l = 0; l < b.layer_dense.size(); ++l) sum += b.layer_total(l, 256);
  EXPECT_EQ(sum, b.total);
  // Hash layers carry tid2eid instead of gate.bias; the MTP block is score routed.
  const auto specs = ExpectedTensors(c);
  auto has = [&](const std::string& n) {
    for (const auto& s : specs)
      if (s.name == n) return true;
    return false;
  };
  EXPECT_TRUE(has("layers.2.ffn.gate.tid2eid"));
  EXPECT_FALSE(has("layers.2.ffn.gate.bias"));
  EXPECT_TRUE(has("layers.3.ffn.gate.bias"));
  EXPECT_TRUE(has("mtp.0.ffn.gate.bias"));
  EXPECT_TRUE(has("layers.2.attn.indexer.compressor.ape"));
  EXPECT_FALSE(has("layers.3.attn.indexer.wq_b.weight"));
  EXPECT_TRUE(has("layers.3.attn.compressor.wkv.weight"));
  EXPECT_FALSE(has("layers.0.attn.compressor.wkv.weight"));
  EXPECT_TRUE(has("mtp.0.e_proj.scale"));
  EXPECT_TRUE(has("layers.42.ffn.experts.255.w2.scale"));
}

TEST(Mkmodel, TinyLayoutSizeAndDeterminism) {
  const std::string a = TempDir("det_a"), b = TempDir("det_b"), c = TempDir("det_c");
  ASSERT_TRUE(WritePresetCheckpoint(a, "tiny", 3).ok());
  ASSERT_TRUE(WritePresetCheckpoint(b, "tiny", 3).ok());
  ASSERT_TRUE(WritePresetCheckpoint(c, "tiny", 4).ok());
  uint64_t bytes = 0;
  int shards = 0;
  for (const auto& e : fs::directory_iterator(a)) {
    const std::string n = e.path().filename().string();
    if (n.find(".safetensors") != std::string::npos && n.find("index") == std::string::npos) {
      ++shards;
      bytes += fs::file_size(e.path());
      EXPECT_EQ(ReadAll(e.path().string()), ReadAll(b + "/" + n)) << n;
      EXPECT_NE(ReadAll(e.path().string()), ReadAll(c + "/" + n)) << n;
    }
  }
  EXPECT_GE(shards, 2);
  EXPECT_LT(bytes, 1u << 20);
  for (const char* f : {"config.json", "model.safetensors.index.json", "tokenizer.json",
                        "tokenizer_config.json"})
    EXPECT_TRUE(fs::exists(a + "/" + f)) << f;
  auto cfg = LoadModelConfig(a + "/config.json");
  ASSERT_TRUE(cfg.ok()) << cfg.status().ToString();
  auto preset = PresetConfig("tiny");
  EXPECT_EQ(ConfigJson(*cfg), ConfigJson(*preset));
  EXPECT_EQ(cfg->compress_ratios, (std::vector<int64_t>{0, 0, 4, 128, 4, 128, 0}));
}

TEST(Checkpoint, MkmodelCreatesMissingParentDirectories) {
  // The README's main job writes out/small on a fresh clone, where out/ does not exist yet.
  const std::string d = TempDir("fresh") + "/out/tiny";
  ASSERT_TRUE(WritePresetCheckpoint(d, "tiny", 7).ok());
  auto ck = Checkpoint::Open(d);
  ASSERT_TRUE(ck.ok()) << ck.status().ToString();
  EXPECT_EQ((*ck)->config().num_hidden_layers, 6);
}

TEST(Checkpoint, TinyLoadsWeightsWithTheirFormats) {
  const std::string d = TinyCopy("load");
  auto ck = Checkpoint::Open(d);
  ASSERT_TRUE(ck.ok()) << ck.status().ToString();
  const ModelConfig& c = (*ck)->config();
  EXPECT_EQ((*ck)->tensor_names().size(), ExpectedTensors(c).size());
  auto wq = (*ck)->Weight("layers.2.attn.wq_b");
  ASSERT_TRUE(wq.ok());
  EXPECT_EQ(wq->format, WeightFormat::kFP8Block);
  EXPECT_EQ(wq->rows, 4 * 32);  // heads * head_dim
  EXPECT_EQ(wq->cols, 32);
  auto w1 = (*ck)->Weight("layers.4.ffn.experts.7.w1");
  ASSERT_TRUE(w1.ok());
  EXPECT_EQ(w1->format, WeightFormat::kFP4Block32);
  EXPECT_EQ(w1->rows, 32);  // moe_intermediate_size
  EXPECT_EQ(w1->cols, 64);  // hidden_size
  auto gate = (*ck)->Weight("layers.3.ffn.gate");
  ASSERT_TRUE(gate.ok());
  EXPECT_EQ(gate->format, WeightFormat::kBF16);
  EXPECT_EQ((*ck)->Weight("layers.9.attn.wq_a").status().code(), Code::kNotFound);

  // Dequantized weights are ~N(0, 1/in): mean square close to 1/in.
  for (const QWeight& q : {*wq, *w1}) {
    std::vector<float> x(static_cast<size_t>(q.cols), 0.0f), y(static_cast<size_t>(q.rows));
    double ms = 0;
    for (int64_t i = 0; i < q.cols; ++i) {
      std::fill(x.begin(), x.end(), 0.0f);
      x[static_cast<size_t>(i)] = 1.0f;
      MatvecRef(q, x.data(), y.data());
      for (float v : y) ms += static_cast<double>(v) * v;
    }
    ms /= static_cast<double>(q.rows * q.cols);
    EXPECT_NEAR(ms * static_cast<double>(q.cols), 1.0, 0.25);
  }
  auto norm = (*ck)->GetF32("layers.0.attn_norm.weight");
  ASSERT_TRUE(norm.ok());
  ASSERT_EQ(norm->size(), 64u);
  for (float v : *norm) EXPECT_NEAR(v, 1.0f, 0.5f);
  auto tid = (*ck)->GetI64("layers.1.ffn.gate.tid2eid");
  ASSERT_TRUE(tid.ok());
  ASSERT_EQ(tid->size(), 512u * 2u);
  for (size_t r = 0; r < 512; ++r) {
    EXPECT_NE((*tid)[2 * r], (*tid)[2 * r + 1]) << "row " << r;
    EXPECT_LT((*tid)[2 * r], 8);
  }
}

// Another tool wrote I32 tid2eid and F32 norms: accepted and converted on load.
TEST(Checkpoint, AcceptsOtherSmallTensorDtypes) {
  const std::string d = TinyCopy("other_dtypes");
  auto orig = Checkpoint::Open(d);
  ASSERT_TRUE(orig.ok());
  const std::vector<int64_t> tid = *(*orig)->GetI64("layers.0.ffn.gate.tid2eid");
  const std::vector<float> norm = *(*orig)->GetF32("layers.0.ffn_norm.weight");
  orig->reset();
  const std::string shard = ShardOf(d, "layers.0.ffn.gate.tid2eid");
  ASSERT_EQ(shard, ShardOf(d, "layers.0.ffn_norm.weight"));
  // Rewrite the shard with the two tensors converted.
  std::vector<SafetensorsDecl> decls;
  std::vector<std::string> payloads;
  {
    auto f = SafetensorsFile::Open(shard);
    ASSERT_TRUE(f.ok());
    for (const auto& t : (*f)->header().tensors) {
      std::string bytes(reinterpret_cast<const char*>((*f)->data(t)), t.end - t.begin);
      DType dt = t.dtype;
      if (t.name == "layers.0.ffn.gate.tid2eid") {
        dt = DType::kI32;
        bytes.clear();
        for (int64_t v : tid) bytes.append(reinterpret_cast<const char*>(&v), 4);  // LE
      } else if (t.name == "layers.0.ffn_norm.weight") {
        dt = DType::kF32;
        bytes.assign(reinterpret_cast<const char*>(norm.data()), norm.size() * 4);
      }
      decls.push_back({t.name, dt, t.shape});
      payloads.push_back(bytes);
    }
  }
  auto w = SafetensorsWriter::Create(shard, decls);
  ASSERT_TRUE(w.ok());
  for (const auto& p : payloads) ASSERT_TRUE((*w)->Append(p.data(), p.size()).ok());
  ASSERT_TRUE((*w)->Finish().ok());
  auto ck = Checkpoint::Open(d);
  ASSERT_TRUE(ck.ok()) << ck.status().ToString();
  EXPECT_EQ((*ck)->Get("layers.0.ffn.gate.tid2eid")->dtype, DType::kI32);
  EXPECT_EQ(*(*ck)->GetI64("layers.0.ffn.gate.tid2eid"), tid);
  EXPECT_EQ(*(*ck)->GetF32("layers.0.ffn_norm.weight"), norm);
}

// An e4m3 NaN byte (0x7F / 0xFF) in a weight is a damaged file: refused at load, naming the
// tensor and the byte (the CPU's exact decode reads it as +-480, a GPU as NaN).
TEST(Checkpoint, AnE4m3NanByteInAWeightIsRefusedNamingTheTensor) {
  for (const uint8_t code : {uint8_t{0x7F}, uint8_t{0xFF}}) {
    const std::string d = TinyCopy(code == 0x7F ? "fp8_nan_pos" : "fp8_nan_neg");
    const std::string name = "layers.0.attn.wq_a.weight";
    const std::string shard = ShardOf(d, name);
    uint64_t at = 0;
    {
      auto f = SafetensorsFile::Open(shard);
      ASSERT_TRUE(f.ok());
      for (const auto& t : (*f)->header().tensors)
        if (t.name == name) {
          ASSERT_EQ(t.dtype, DType::kF8E4M3);
          at = (*f)->header().data_offset + t.begin + 5;
        }
    }
    ASSERT_GT(at, 0u);
    const int fd = open(shard.c_str(), O_WRONLY);
    ASSERT_GE(fd, 0);
    ASSERT_EQ(pwrite(fd, &code, 1, static_cast<off_t>(at)), 1);
    close(fd);
    auto ck = Checkpoint::Open(d);
    ASSERT_FALSE(ck.ok());
    EXPECT_EQ(ck.status().code(), Code::kInvalidArgument);
    EXPECT_NE(ck.status().message().find("tensor '" + name + "' byte 5 is an e4m3 NaN code"),
              std::string::npos) << ck.status().message();
  }
}

// Overwrites byte(s) of tensor `name` at `offset` within it; the tensor's dtype.
DType Poke(const std::string& dir, const std::string& name, uint64_t offset, const std::string& bytes) {
  const std::string shard = ShardOf(dir, name);
  uint64_t at = 0;
  DType dtype = DType::kU8;
  auto f = SafetensorsFile::Open(shard);
  EXPECT_TRUE(f.ok());
  if (!f.ok()) return dtype;
  for (const auto& t : (*f)->header().tensors)
    if (t.name == name) {
      dtype = t.dtype;
      at = (*f)->header().data_offset + t.begin + offset;
    }
  EXPECT_GT(at, 0u) << name;
  const int fd = open(shard.c_str(), O_WRONLY);
  EXPECT_GE(fd, 0);
  EXPECT_EQ(pwrite(fd, bytes.data(), bytes.size(), static_cast<off_t>(at)), static_cast<ssize_t>(bytes.size()));
  close(fd);
  return dtype;
}

// An e8m0 scale of 0xFF (NaN: 2^128 does not exist) is refused at load like an e4m3 NaN; a NaN
// or infinity in a small float tensor (a bias that steers routing) when it is read, naming it.
TEST(Checkpoint, NanScalesAndNonFiniteSmallTensorsAreRefusedNamingTheTensor) {
  const std::string d = TinyCopy("e8m0_nan");
  const std::string scale = "layers.0.attn.wq_a.scale";
  ASSERT_EQ(Poke(d, scale, 0, std::string(1, '\xFF')), DType::kF8E8M0);
  auto ck = Checkpoint::Open(d);
  ASSERT_FALSE(ck.ok());
  EXPECT_NE(ck.status().message().find("tensor '" + scale + "' byte 0 is an e8m0 NaN code"),
            std::string::npos) << ck.status().message();

  const std::string f = TinyCopy("f32_nan");
  const std::string bias = "layers.2.ffn.gate.bias";
  const DType dtype = Poke(f, bias, 0, "");
  const std::string nan = dtype == DType::kBF16 ? std::string("\xC0\x7F", 2)
                                                : std::string("\x00\x00\xC0\x7F", 4);
  const std::string inf = dtype == DType::kBF16 ? std::string("\x80\x7F", 2)
                                                : std::string("\x00\x00\x80\x7F", 4);
  Poke(f, bias, 3 * nan.size(), nan);
  auto opened = Checkpoint::Open(f);
  ASSERT_TRUE(opened.ok()) << opened.status().ToString();
  auto v = (*opened)->GetF32(bias);
  ASSERT_FALSE(v.ok());
  EXPECT_NE(v.status().message().find("tensor '" + bias + "' element 3 is NaN"), std::string::npos)
      << v.status().message();
  Poke(f, bias, 3 * nan.size(), inf);
  auto reopened = Checkpoint::Open(f);
  ASSERT_TRUE(reopened.ok());
  v = (*reopened)->GetF32(bias);
  ASSERT_FALSE(v.ok());
  EXPECT_NE(v.status().message().find("element 3 is infinite"), std::string::npos) << v.status().message();
}

TEST(Inspect, TinyFigures) {
  const std::string d = TinyCopy("inspect");
  auto r = InspectCheckpoint(d);
  ASSERT_TRUE(r.ok()) << r.status().ToString();
  const ModelConfig& c = r->cfg;
  EXPECT_EQ(r->embed_row_bytes, 64u * 2u);  // one BF16 row
  // One FP4 expert: w1, w3 [32, 64] and w2 [64, 32]: 3 * (32*64/2 + 32*64/32) bytes.
  EXPECT_EQ(r->layers[3].expert_bytes, 3u * (1024u + 64u));
  EXPECT_EQ(r->routed_bytes, 6u * 2u * r->layers[3].expert_bytes);
  // Shared expert FP8: w1, w3 [32, 64] + w2 [64, 32], one scale byte each.
  EXPECT_EQ(r->shared_bytes, 6u * 3u * (32u * 64u + 1u));
  // norm + head (BF16) + hc_head_fn/base/scale (tiny writes them BF16).
  EXPECT_EQ(r->head_bytes, 64u * 2u + 512u * 64u * 2u + 4u * 256u * 2u + 4u * 2u + 2u);
  EXPECT_EQ(r->bytes_per_token(), r->embed_row_bytes + r->dense_bytes + r->shared_bytes +
                                      r->routed_bytes + r->head_bytes);
  EXPECT_EQ(r->kv_bytes_per_seq.at(0), 16.0 * 32.0 * 4.0);  // window * head_dim * f32
  // A compressed layer adds its pending rows: the figures are the charge plan and kv_cache_gib
  // make (KvBytesPerSequence), at a context where every ratio divides it.
  for (const int64_t ctx : {int64_t{1024}, int64_t{4096}}) {
    const double tokens = static_cast<double>(ctx);
    double inspect_total = 0, charged = 0;
    for (const auto& [ratio, n] : r->layers_by_ratio)
      inspect_total += static_cast<double>(n) *
                       (r->kv_bytes_per_seq.at(ratio) + r->kv_bytes_per_token.at(ratio) * tokens);
    for (size_t l = 0; l < r->layers.size(); ++l)
      if (!r->layers[l].mtp)
        charged += static_cast<double>(KvBytesPerSequence(c, static_cast<int64_t>(l), ctx));
    EXPECT_EQ(inspect_total, charged) << "context " << ctx;
  }
  EXPECT_GT(r->kv_bytes_per_seq.at(4), r->kv_bytes_per_seq.at(0));
  EXPECT_EQ(r->kv_bytes_per_token.at(0), 0.0);
  EXPECT_EQ(r->kv_bytes_per_token.at(4), 32.0 * 4 / 4 + 32.0 * 4 / 4);
  EXPECT_EQ(r->kv_bytes_per_token.at(128), 32.0 * 4 / 128);
  EXPECT_EQ(r->layers_by_ratio, (std::map<int64_t, int64_t>{{0, 2}, {4, 2}, {128, 2}}));
  EXPECT_EQ(r->layers[0].kind, "window, hash-routed");
  EXPECT_EQ(r->layers[2].kind, "ratio-4+indexer, score-routed");
  EXPECT_EQ(r->layers[6].kind, "window, score-routed, MTP");
  uint64_t params = 0;
  for (const auto& s : ExpectedTensors(c)) {
    uint64_t n = 1;
    for (int64_t x : s.shape) n *= static_cast<uint64_t>(x);
    if (s.role == TensorRole::kFp4Weight) params += 2 * n;
    else if (s.role != TensorRole::kFp8Scale && s.role != TensorRole::kFp4Scale) params += n;
  }
  EXPECT_EQ(r->params, params);
  EXPECT_EQ(r->by_dtype.at("F8_E8M0").params, 0u);
  const std::string text = FormatInspectReport(*r);
  EXPECT_NE(text.find("ratio-128, score-routed"), std::string::npos);
  EXPECT_NE(text.find("bytes read per decoded token"), std::string::npos);
}

// Writes out dirty pages and drops the files from the page cache.
bool DropFromPageCache(const std::string& dir) {
  for (const auto& e : fs::directory_iterator(dir)) {
    const int fd = ::open(e.path().c_str(), O_RDONLY);
    if (fd < 0) return false;
    ::fdatasync(fd);
    ::posix_fadvise(fd, 0, 0, POSIX_FADV_DONTNEED);
    ::close(fd);
  }
  return true;
}

// Partial loading: a worker holding layers [2, 4) and experts {1, 6} maps only the shards it
// needs and brings (almost) only its own bytes into memory.
TEST(Checkpoint, PartialLoadTouchesOnlyTheSelection) {
  const std::string d = TempDir("partial");
  ASSERT_TRUE(WritePresetCheckpoint(d, "small", 1).ok());
  ShardSelection sel;
  sel.layer_begin = 2;
  sel.layer_end = 4;
  sel.embed = sel.head = sel.mtp = false;
  sel.experts = {6, 1};
  ASSERT_TRUE(DropFromPageCache(d));
  auto ck = Checkpoint::Open(d, sel);
  ASSERT_TRUE(ck.ok()) << ck.status().ToString();
  EXPECT_EQ((*ck)->selection().experts, (std::vector<int64_t>{1, 6}));
  EXPECT_FALSE((*ck)->Has("layers.2.ffn.experts.0.w1.weight"));
  EXPECT_TRUE((*ck)->Has("layers.3.ffn.experts.6.w2.scale"));
  EXPECT_FALSE((*ck)->Has("layers.4.attn_norm.weight"));
  EXPECT_FALSE((*ck)->Has("embed.weight"));
  const ModelBytes mb = ComputeModelBytes((*ck)->config());
  EXPECT_EQ((*ck)->selected_bytes(), mb.layer_total(2, 2) + mb.layer_total(3, 2));
  EXPECT_LT((*ck)->mapped_bytes(), (*ck)->total_bytes());  // one shard of three stays closed

  uint64_t sum = 0;  // touch every byte of the selection
  for (const auto& n : (*ck)->tensor_names()) {
    auto v = (*ck)->Get(n);
    for (size_t i = 0; i < v->nbytes; ++i) sum += v->data[i];
  }
  EXPECT_GT(sum, 0u);
  const size_t resident = (*ck)->resident_bytes();
  const size_t selected = (*ck)->selected_bytes();
  EXPECT_GE(resident, selected * 9 / 10);
  // Page rounding at every tensor edge (a few hundred tensors) is the only overhead allowed.
  EXPECT_LT(resident, selected + (*ck)->tensor_names().size() * 2 * 4096 + (1u << 20));
  EXPECT_LT(resident * 5, (*ck)->total_bytes()) << "selection is ~8% of the model";

  // The same selection mapped instead of read: every tensor has the same bytes.
  auto mapped = Checkpoint::Open(d, sel, TensorBytes::kMapped);
  ASSERT_TRUE(mapped.ok()) << mapped.status().ToString();
  for (const auto& n : (*ck)->tensor_names()) {
    auto a = (*ck)->Get(n), b = (*mapped)->Get(n);
    ASSERT_EQ(a->nbytes, b->nbytes) << n;
    EXPECT_NE(a->data, b->data) << n;
    EXPECT_EQ(std::memcmp(a->data, b->data, a->nbytes), 0) << n;
  }
}

}  // namespace
}  // namespace fm
