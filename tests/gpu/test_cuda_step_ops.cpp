// The device step's position-driven kernels (counts and rows read from device memory), the
// compressor's window bookkeeping against a host model of it, and CUDA graph capture/replay.
// Device tests skip without a GPU; argument checks run everywhere.
#include <gtest/gtest.h>

#include <cmath>
#include <random>
#include <string>
#include <vector>

#include "kernels/cpu/attention_core.h"
#include "kernels/cuda/device.h"
#include "kernels/cuda/ops.h"
#include "tests/gpu/cuda_test_util.h"

namespace fm {
namespace {

using namespace cudatest;
using cuda::DeviceBuffer;

std::vector<int32_t> IntsToHost(const DeviceBuffer& b, size_t n) {
  std::vector<int32_t> v(n);
  const Status s = b.CopyToHost(v.data(), n * sizeof(int32_t));
  EXPECT_TRUE(s.ok()) << s.ToString();
  return v;
}

void SetInt(DeviceBuffer* b, int32_t v) { ASSERT_OK(b->CopyFromHost(&v, sizeof v)); }

TEST(CudaArgs, StepKernelsRejectBadShapes) {
  float f[4] = {};
  int32_t i[4] = {};
  cuda::CompressorStep st{};
  Status s = cuda::KeyIndex(i, 0, nullptr, nullptr, 0, 4, i);
  EXPECT_NE(s.message().find("KeyIndex: window 0"), std::string::npos) << s.ToString();
  s = cuda::ScatterRow(f, 8, f, 4, i);
  EXPECT_NE(s.message().find("stride must be >= width"), std::string::npos) << s.ToString();
  s = cuda::ScatterRow(f, 4, f, 4, nullptr);
  EXPECT_NE(s.message().find("null device pointer"), std::string::npos) << s.ToString();
  s = cuda::CompressorStore(f, f, f, 0, 4, &st, f, f);
  EXPECT_NE(s.message().find("ratio 0"), std::string::npos) << s.ToString();
  s = cuda::CompressorGather(f, f, 4, 0, true, &st, f, f, i);
  EXPECT_NE(s.message().find("dim 0"), std::string::npos) << s.ToString();
}

// A device count gives exactly the result of the host count it holds: attention over the first
// m keys, scores of the first m entries only (the rest untouched), top-k of m scores (all of
// them when m <= k), and a pool of no slots is zero.
TEST(CudaStep, DeviceCountsEqualTheHostCounts) {
  if (cuda::DeviceCount() == 0) GTEST_SKIP() << "no CUDA device";
  std::mt19937 rng(51);
  const int64_t nh = 4, d = 64, rows = 50;
  const std::vector<float> q = RandomNormal(nh * d, rng), kv = RandomNormal(rows * d, rng);
  const std::vector<float> sink = RandomNormal(nh, rng);
  std::vector<int32_t> idx(rows);
  for (int64_t i = 0; i < rows; ++i) idx[i] = static_cast<int32_t>((i * 7 + 3) % rows);
  DeviceBuffer dq = ToDevice(q), dkv = ToDevice(kv), ds = ToDevice(sink), di = ToDevice(idx);
  DeviceBuffer count = ToDevice(std::vector<int32_t>{0});
  const float scale = 0.125f;
  for (int32_t m : {0, 1, 17, 50}) {
    SetInt(&count, m);
    DeviceBuffer want = Zeros(nh * d), got = Zeros(nh * d);
    ASSERT_OK(cuda::SinkAttention(dq.as<float>(), nh, dkv.as<float>(), di.as<int32_t>(), m, d,
                                  ds.as<float>(), scale, want.as<float>()));
    ASSERT_OK(cuda::SinkAttention(dq.as<float>(), nh, dkv.as<float>(), di.as<int32_t>(), rows, d,
                                  ds.as<float>(), scale, got.as<float>(), count.as<int32_t>()));
    const std::vector<float> w = ToHost(want, nh * d), g = ToHost(got, nh * d);
    for (size_t i = 0; i < w.size(); ++i) ASSERT_TRUE(SameBits(w[i], g[i])) << "m " << m << " [" << i << "]";
  }
  // Scores: entries past the count keep their old value (-7).
  const int64_t n = 40, k = 8;
  const std::vector<float> keys = RandomNormal(n * d, rng), hw = RandomNormal(nh, rng);
  DeviceBuffer dk = ToDevice(keys), dw = ToDevice(hw);
  DeviceBuffer score = ToDevice(std::vector<float>(n, -7.0f)), all = Zeros(n);
  SetInt(&count, 25);
  ASSERT_OK(cuda::IndexerScores(dq.as<float>(), dw.as<float>(), nh, d, dk.as<float>(), n, scale,
                                score.as<float>(), count.as<int32_t>()));
  ASSERT_OK(cuda::IndexerScores(dq.as<float>(), dw.as<float>(), nh, d, dk.as<float>(), n, scale,
                                all.as<float>()));
  const std::vector<float> sc = ToHost(score, n), al = ToHost(all, n);
  for (int64_t e = 0; e < n; ++e) EXPECT_TRUE(SameBits(sc[e], e < 25 ? al[e] : -7.0f)) << e;
  // Top-k of the first m scores equals top-k over an array of m.
  for (int32_t m : {3, 8, 25, 40}) {
    SetInt(&count, m);
    const int64_t kk = std::min<int64_t>(m, k);
    auto got = DeviceBuffer::Alloc(k * sizeof(int32_t)), want = DeviceBuffer::Alloc(k * sizeof(int32_t));
    ASSERT_TRUE(got.ok() && want.ok());
    ASSERT_OK(cuda::TopKAscending(all.as<float>(), n, k, got->as<int32_t>(), count.as<int32_t>()));
    ASSERT_OK(cuda::TopKAscending(all.as<float>(), m, kk, want->as<int32_t>()));
    EXPECT_EQ(IntsToHost(*got, kk), IntsToHost(*want, kk)) << "m " << m;
  }
  SetInt(&count, 0);
  DeviceBuffer pooled = ToDevice(std::vector<float>(d, 3.0f));
  ASSERT_OK(cuda::CompressorPool(dkv.as<float>(), dkv.as<float>(), 4, d, pooled.as<float>(),
                                 count.as<int32_t>()));
  EXPECT_EQ(ToHost(pooled, d), std::vector<float>(d, 0.0f));
}

// The key rows: the ring oldest first, then entries (in order or through picks); ScatterRow
// writes row *row and nothing for a negative row.
TEST(CudaStep, KeyIndexAndScatterRowFollowTheirDeviceInputs) {
  if (cuda::DeviceCount() == 0) GTEST_SKIP() << "no CUDA device";
  const int64_t W = 8, max_keys = 14;
  DeviceBuffer win = ToDevice(std::vector<int32_t>{13, 8});  // positions 13..20 -> rows 5,6,7,0..4
  DeviceBuffer ent = ToDevice(std::vector<int32_t>{3});
  DeviceBuffer picks = ToDevice(std::vector<int32_t>{1, 4, 6});
  DeviceBuffer idx = ToDevice(std::vector<int32_t>(max_keys, -9));
  ASSERT_OK(cuda::KeyIndex(win.as<int32_t>(), W, ent.as<int32_t>(), picks.as<int32_t>(), W, max_keys,
                           idx.as<int32_t>()));
  EXPECT_EQ(IntsToHost(idx, max_keys),
            (std::vector<int32_t>{5, 6, 7, 0, 1, 2, 3, 4, 9, 12, 14, -9, -9, -9}));
  ASSERT_OK(cuda::KeyIndex(win.as<int32_t>(), W, ent.as<int32_t>(), nullptr, W, max_keys,
                           idx.as<int32_t>()));
  EXPECT_EQ(IntsToHost(idx, 11), (std::vector<int32_t>{5, 6, 7, 0, 1, 2, 3, 4, 8, 9, 10}));

  DeviceBuffer src = ToDevice(std::vector<float>{1, 2, 3});
  DeviceBuffer dst = ToDevice(std::vector<float>(12, 0.0f));
  DeviceBuffer row = ToDevice(std::vector<int32_t>{2});
  ASSERT_OK(cuda::ScatterRow(src.as<float>(), 3, dst.as<float>(), 4, row.as<int32_t>()));
  SetInt(&row, -1);
  ASSERT_OK(cuda::ScatterRow(src.as<float>(), 3, dst.as<float>(), 4, row.as<int32_t>()));
  EXPECT_EQ(ToHost(dst, 12), (std::vector<float>{0, 0, 0, 0, 0, 0, 0, 0, 1, 2, 3, 0}));
}

// The host's model of the compressor state (model/compressor.cpp): the window's pending rows,
// the previous window's, and what a completed window pools.
cuda::CompressorStep StepAt(int64_t pos, int64_t r) {
  cuda::CompressorStep s{};
  s.slot = static_cast<int32_t>(pos % r);
  s.parity = static_cast<int32_t>((pos / r) % 2);
  s.has_prev = pos >= r;
  s.emit = s.slot == r - 1;
  s.entry = s.emit ? static_cast<int32_t>(pos / r) : -1;
  s.window_pos = static_cast<int32_t>(pos + 1 - r);
  return s;
}

TEST(CudaStep, CompressorStoreAndGatherFollowTheWindows) {
  if (cuda::DeviceCount() == 0) GTEST_SKIP() << "no CUDA device";
  std::mt19937 rng(53);
  for (bool overlap : {false, true}) {
    const int64_t r = 4, d = 3, width = overlap ? 2 * d : d, steps = 3 * r;
    const std::vector<float> ape = RandomNormal(r * width, rng);
    DeviceBuffer dape = ToDevice(ape), pa = Zeros(2 * r * width), pz = Zeros(2 * r * width);
    DeviceBuffer ga = Zeros(2 * r * d), gz = Zeros(2 * r * d);
    DeviceBuffer count = ToDevice(std::vector<int32_t>{-1});
    auto st = DeviceBuffer::Alloc(sizeof(cuda::CompressorStep));
    ASSERT_TRUE(st.ok());
    std::vector<std::vector<float>> a_rows, z_rows;  // every position's a and z + ape[slot]
    for (int64_t pos = 0; pos < steps; ++pos) {
      const std::vector<float> a = RandomNormal(width, rng), z = RandomNormal(width, rng);
      std::vector<float> zs(width);
      for (int64_t c = 0; c < width; ++c) zs[c] = z[c] + ape[(pos % r) * width + c];
      a_rows.push_back(a);
      z_rows.push_back(zs);
      const cuda::CompressorStep s = StepAt(pos, r);
      ASSERT_OK(st->CopyFromHost(&s, sizeof s));
      DeviceBuffer da = ToDevice(a), dz = ToDevice(z);
      ASSERT_OK(cuda::CompressorStore(da.as<float>(), dz.as<float>(), dape.as<float>(), r, width,
                                      st->as<cuda::CompressorStep>(), pa.as<float>(), pz.as<float>()));
      ASSERT_OK(cuda::CompressorGather(pa.as<float>(), pz.as<float>(), r, d, overlap,
                                       st->as<cuda::CompressorStep>(), ga.as<float>(),
                                       gz.as<float>(), count.as<int32_t>()));
      const int32_t n = IntsToHost(count, 1)[0];
      if (!s.emit) {
        EXPECT_EQ(n, 0) << "pos " << pos;
        continue;
      }
      // Expected: previous window's first d channels (overlap, from the second window on),
      // then this window's channels [off, off + d).
      std::vector<float> want_a, want_z;
      const int64_t w0 = pos + 1 - r;
      if (overlap && w0 >= r)
        for (int64_t p = w0 - r; p < w0; ++p)
          for (int64_t c = 0; c < d; ++c) want_a.push_back(a_rows[p][c]), want_z.push_back(z_rows[p][c]);
      const int64_t off = overlap ? d : 0;
      for (int64_t p = w0; p <= pos; ++p)
        for (int64_t c = 0; c < d; ++c)
          want_a.push_back(a_rows[p][off + c]), want_z.push_back(z_rows[p][off + c]);
      ASSERT_EQ(n, static_cast<int32_t>(want_a.size() / d)) << "pos " << pos;
      EXPECT_EQ(ToHost(ga, want_a.size()), want_a) << "overlap " << overlap << " pos " << pos;
      EXPECT_EQ(ToHost(gz, want_z.size()), want_z) << "overlap " << overlap << " pos " << pos;
    }
  }
}

// A captured graph records the launches, not their results: replays read the device memory of
// the moment (a count changed after the capture is honoured); a blocking copy inside the
// capture fails it with the CUDA error.
TEST(CudaGraph, ReplayReadsTheDeviceInputsOfEachLaunch) {
  if (cuda::DeviceCount() == 0) GTEST_SKIP() << "no CUDA device";
  auto stream = cuda::Stream::Create();
  ASSERT_TRUE(stream.ok()) << stream.status().ToString();
  DeviceBuffer src = ToDevice(std::vector<float>{1, 2, 3, 4});
  DeviceBuffer dst = ToDevice(std::vector<float>(8, 0.0f));
  DeviceBuffer row = ToDevice(std::vector<int32_t>{0});
  auto graph = cuda::Graph::Capture(*stream, [&] {
    FM_RETURN_IF_ERROR(cuda::ScatterRow(src.as<float>(), 4, dst.as<float>(), 4, row.as<int32_t>()));
    return cuda::ScaleVector(src.as<float>(), 2.0f, src.as<float>(), 4);
  });
  ASSERT_TRUE(graph.ok()) << graph.status().ToString();
  EXPECT_EQ(graph->nodes(), 2u);
  EXPECT_EQ(ToHost(dst, 8), std::vector<float>(8, 0.0f)) << "capturing ran a kernel";
  ASSERT_OK(graph->Launch(*stream));
  ASSERT_OK(stream->Synchronize());
  SetInt(&row, 1);
  ASSERT_OK(graph->Launch(*stream));
  ASSERT_OK(stream->Synchronize());
  EXPECT_EQ(ToHost(dst, 8), (std::vector<float>{1, 2, 3, 4, 2, 4, 6, 8}));

  float host[4];
  auto bad = cuda::Graph::Capture(*stream, [&] { return src.CopyToHost(host, sizeof host); });
  EXPECT_FALSE(bad.ok());
  EXPECT_NE(bad.status().message().find("capturing a CUDA graph"), std::string::npos)
      << bad.status().ToString();
  // The stream works again after the failed capture.
  ASSERT_OK(graph->Launch(*stream));
  ASSERT_OK(stream->Synchronize());
  EXPECT_EQ(ToHost(dst, 8), (std::vector<float>{1, 2, 3, 4, 4, 8, 12, 16}));
}

TEST(CudaGraph, TheDefaultStreamCannotBeCaptured) {
  cuda::Stream none;
  auto g = cuda::Graph::Capture(none, [] { return Status::Ok(); });
  EXPECT_FALSE(g.ok());
  EXPECT_NE(g.status().message().find("default stream"), std::string::npos) << g.status().ToString();
}

}  // namespace
}  // namespace fm
