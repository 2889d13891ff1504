// The experts' launches (kernels/cuda/experts.cu: ExpertsUpGate, ExpertsDown) against the CPU
// references (MatvecRef, SwigluClampRef) and against themselves: a slot's result has the same
// bits whatever T and the other slots of the launch are. Device tests skip without a GPU.
#include <gtest/gtest.h>

#include <cmath>
#include <limits>
#include <random>
#include <string>
#include <vector>

#include "kernels/cpu/matvec.h"
#include "kernels/cpu/swiglu.h"
#include "kernels/cuda/ops.h"
#include "tests/gpu/cuda_test_util.h"

namespace fm {
namespace {

using namespace cudatest;
using cuda::DeviceBuffer;

// E routed FP4 experts w1, w3 [I, H], w2 [H, I] and an FP8 shared expert (Is), host and device.
struct Experts {
  int64_t E = 0, I = 0, H = 0, Is = 0;
  std::vector<HostWeight> w1, w3, w2;
  HostWeight s1, s3, s2;
  std::vector<cuda::DeviceWeight> d1, d3, d2;
  cuda::DeviceWeight ds1, ds3, ds2;
  DeviceBuffer p1, p3, p2, q1, q3, q2;  // device arrays of data / scale pointers

  cuda::DevExperts Set(const std::vector<cuda::DeviceWeight>& d, const DeviceBuffer& p,
                       const DeviceBuffer& q) const {
    return {d[0].format, d[0].rows, d[0].cols, E, p.as<const void* const>(),
            q.as<const uint8_t* const>()};
  }
  cuda::SharedExpert Shared() const { return {ds1.view(), ds3.view(), ds2.view()}; }
};

void UploadSet(const std::vector<HostWeight>& h, std::vector<cuda::DeviceWeight>* d,
               DeviceBuffer* datas, DeviceBuffer* scales) {
  std::vector<const void*> p;
  std::vector<const uint8_t*> q;
  for (const HostWeight& w : h) {
    auto u = cuda::UploadWeight(w.w);
    ASSERT_TRUE(u.ok()) << u.status().ToString();
    d->push_back(std::move(u).value());
    p.push_back(d->back().data.data());
    q.push_back(d->back().scale.as<const uint8_t>());
  }
  *datas = ToDevice(p);
  *scales = ToDevice(q);
}

cuda::DeviceWeight UploadOne(const HostWeight& h) {
  auto u = cuda::UploadWeight(h.w);
  EXPECT_TRUE(u.ok()) << u.status().ToString();
  return u.ok() ? std::move(u).value() : cuda::DeviceWeight();
}

void MakeExperts(Experts* x, std::mt19937& rng) {
  for (int64_t e = 0; e < x->E; ++e) {
    x->w1.push_back(RandomWeight(WeightFormat::kFP4Block32, x->I, x->H, rng));
    x->w3.push_back(RandomWeight(WeightFormat::kFP4Block32, x->I, x->H, rng));
    x->w2.push_back(RandomWeight(WeightFormat::kFP4Block32, x->H, x->I, rng));
  }
  x->s1 = RandomWeight(WeightFormat::kFP8Block, x->Is, x->H, rng);
  x->s3 = RandomWeight(WeightFormat::kFP8Block, x->Is, x->H, rng);
  x->s2 = RandomWeight(WeightFormat::kFP8Block, x->H, x->Is, rng);
  UploadSet(x->w1, &x->d1, &x->p1, &x->q1);
  UploadSet(x->w3, &x->d3, &x->p3, &x->q3);
  UploadSet(x->w2, &x->d2, &x->p2, &x->q2);
  x->ds1 = UploadOne(x->s1);
  x->ds3 = UploadOne(x->s3);
  x->ds2 = UploadOne(x->s2);
}

// h and contrib of T tokens (slots [T, k + 1]) from the two launches.
void RunExperts(const Experts& x, const std::vector<int32_t>& ids, int64_t T, int64_t k,
                const std::vector<float>& in, float limit, int64_t hs, std::vector<float>* h,
                std::vector<float>* c) {
  const cuda::SharedExpert sh = x.Shared();
  DeviceBuffer di = ids.empty() ? DeviceBuffer() : ToDevice(ids), dx = ToDevice(in);
  DeviceBuffer dh = ToDevice(std::vector<float>(T * (k + 1) * hs, -7.0f));
  DeviceBuffer dc = Zeros(T * (k + 1) * x.H);
  ASSERT_OK(cuda::ExpertsUpGate(x.Set(x.d1, x.p1, x.q1), x.Set(x.d3, x.p3, x.q3),
                                di.as<int32_t>(), T, k, dx.as<float>(), x.H, limit, &sh,
                                dh.as<float>(), hs));
  ASSERT_OK(cuda::ExpertsDown(x.Set(x.d2, x.p2, x.q2), di.as<int32_t>(), T, k, dh.as<float>(), hs,
                              &sh, dc.as<float>()));
  *h = ToHost(dh, T * (k + 1) * hs);
  *c = ToHost(dc, T * (k + 1) * x.H);
}

// Both launches against MatvecRef + SwigluClampRef for T = 1..32 with repeated experts and one
// id outside [0, E) (NaN rows); every slot has the bits of the same token run alone (T = 1).
// Routed FP4 and shared FP8 experts on either core.
class CudaExpertsPaths : public WeightCoreTest {};
INSTANTIATE_TEST_SUITE_P(Cores, CudaExpertsPaths, ::testing::ValuesIn(kWeightPaths), CoreName);

TEST_P(CudaExpertsPaths, UpGateAndDownMatchReferenceAndAreBatchIndependent) {
  if (cuda::DeviceCount() == 0) GTEST_SKIP() << "no CUDA device";
  std::mt19937 rng(61);
  Experts x;
  x.E = 5, x.I = 64, x.H = 96, x.Is = 80;
  MakeExperts(&x, rng);
  const int64_t k = 3, hs = 80, S = k + 1;
  const float limit = 2.0f;
  for (int64_t T : kTokenCounts) {
    std::uniform_int_distribution<int> pick(0, 4);
    std::vector<int32_t> ids(T * k);
    for (auto& e : ids) e = pick(rng);
    if (T > 1) ids[k + 1] = 9;  // token 1, slot 1: bad id
    const std::vector<float> in = RandomNormal(T * x.H, rng);
    std::vector<float> h, c;
    RunExperts(x, ids, T, k, in, limit, hs, &h, &c);
    for (int64_t t = 0; t < T; ++t) {
      const float* xt = in.data() + t * x.H;
      for (int64_t j = 0; j < S; ++j) {
        const int64_t s = t * S + j;
        const std::string what = "T " + std::to_string(T) + " slot " + std::to_string(s);
        const bool shared = j == k;
        const int32_t e = shared ? 0 : ids[t * k + j];
        std::vector<float> gh(h.begin() + s * hs, h.begin() + s * hs + (shared ? x.Is : x.I));
        std::vector<float> gc(c.begin() + s * x.H, c.begin() + (s + 1) * x.H);
        if (!shared && e >= x.E) {
          for (float v : gh) ASSERT_TRUE(std::isnan(v)) << what;
          for (float v : gc) ASSERT_TRUE(std::isnan(v)) << what;
          continue;
        }
        const std::vector<float> g = Ref(shared ? x.s1.w : x.w1[e].w, xt);
        const std::vector<float> u = Ref(shared ? x.s3.w : x.w3[e].w, xt);
        std::vector<float> want(g.size());
        SwigluClampRef(g.data(), u.data(), g.size(), limit, want.data());
        ExpectClose(gh, want, 1e-4, what + " h");
        ExpectClose(gc, Ref(shared ? x.s2.w : x.w2[e].w, gh.data()), 1e-4, what + " contrib");
      }
    }
    // The same tokens one at a time: the same bits (batch-composition independence).
    for (int64_t t = 0; t < T; ++t) {
      const std::vector<int32_t> id1(ids.begin() + t * k, ids.begin() + (t + 1) * k);
      const std::vector<float> in1(in.begin() + t * x.H, in.begin() + (t + 1) * x.H);
      std::vector<float> h1, c1;
      RunExperts(x, id1, 1, k, in1, limit, hs, &h1, &c1);
      for (int64_t i = 0; i < S * hs; ++i)
        ASSERT_TRUE(SameBits(h1[i], h[t * S * hs + i]) || (std::isnan(h1[i]) && std::isnan(h[t * S * hs + i])))
            << "T " << T << " t " << t << " h " << i;
      for (int64_t i = 0; i < S * x.H; ++i)
        ASSERT_TRUE(SameBits(c1[i], c[t * S * x.H + i]) || (std::isnan(c1[i]) && std::isnan(c[t * S * x.H + i])))
            << "T " << T << " t " << t << " contrib " << i;
    }
  }
}

// Eight tokens of one expert over wide rows (H = I = 1280): a pass of 8 slots whose x does not
// fit the tensor-core core's shared-memory stage (each lane splits its own x), against each
// token alone (staged): the same bits, in both launches.
TEST_P(CudaExpertsPaths, WideRowsOfManySlotsHaveTheirAloneBits) {
  if (cuda::DeviceCount() == 0) GTEST_SKIP() << "no CUDA device";
  std::mt19937 rng(67);
  Experts x;
  x.E = 1, x.I = 1280, x.H = 1280, x.Is = 128;
  MakeExperts(&x, rng);
  const int64_t T = 8, k = 1, S = k + 1, hs = x.I;
  const std::vector<int32_t> ids(T * k, 0);
  const std::vector<float> in = RandomNormal(T * x.H, rng);
  std::vector<float> h, c;
  RunExperts(x, ids, T, k, in, 2.0f, hs, &h, &c);
  for (int64_t t : {0, 5}) {
    const std::vector<float> in1(in.begin() + t * x.H, in.begin() + (t + 1) * x.H);
    std::vector<float> h1, c1;
    RunExperts(x, {0}, 1, k, in1, 2.0f, hs, &h1, &c1);
    for (int64_t j = 0; j < S; ++j) {  // the routed slot, then the shared one
      const int64_t rows = j < k ? x.I : x.Is;
      for (int64_t i = 0; i < rows; ++i)
        ASSERT_TRUE(SameBits(h1[j * hs + i], h[(t * S + j) * hs + i])) << "t " << t << " slot " << j << " h " << i;
      for (int64_t i = 0; i < x.H; ++i)
        ASSERT_TRUE(SameBits(c1[j * x.H + i], c[(t * S + j) * x.H + i])) << "t " << t << " slot " << j << " c " << i;
    }
  }
}

// A slot of ExpertsDown has the bits of Gemm with its expert's weight alone, at shapes where that
// Gemm takes one slice a row as the experts do (not at the real w2: ops.h).
TEST_P(CudaExpertsPaths, DownSlotEqualsGemmOfItsExpert) {
  if (cuda::DeviceCount() == 0) GTEST_SKIP() << "no CUDA device";
  std::mt19937 rng(3);
  Experts x;
  x.E = 3, x.I = 64, x.H = 96, x.Is = 64;
  MakeExperts(&x, rng);
  const int64_t T = 2, k = 2, hs = 64;
  const std::vector<int32_t> ids = {2, 0, 0, 1};
  const std::vector<float> hin = RandomNormal(T * (k + 1) * hs, rng);
  DeviceBuffer di = ToDevice(ids), dh = ToDevice(hin), dc = Zeros(T * (k + 1) * x.H), dy = Zeros(x.H);
  const cuda::SharedExpert sh = x.Shared();
  ASSERT_OK(cuda::ExpertsDown(x.Set(x.d2, x.p2, x.q2), di.as<int32_t>(), T, k, dh.as<float>(), hs,
                              &sh, dc.as<float>()));
  const std::vector<float> c = ToHost(dc, T * (k + 1) * x.H);
  for (int64_t s = 0; s < T * (k + 1); ++s) {
    const int64_t t = s / (k + 1), j = s % (k + 1);
    const QWeight w = j == k ? x.ds2.view() : x.d2[ids[t * k + j]].view();
    ASSERT_OK(cuda::Gemv(w, dh.as<float>() + s * hs, dy.as<float>()));
    const std::vector<float> y = ToHost(dy, x.H);
    for (int64_t r = 0; r < x.H; ++r) ASSERT_TRUE(SameBits(c[s * x.H + r], y[r])) << "slot " << s << " r " << r;
  }
}

// k = 0 with the shared expert (the EP path): only the shared slots; MoeCombine adds the shared
// row of [T, k + 1, H] contributions last.
TEST_P(CudaExpertsPaths, SharedOnlyAndCombineWithSharedRow) {
  if (cuda::DeviceCount() == 0) GTEST_SKIP() << "no CUDA device";
  std::mt19937 rng(17);
  Experts x;
  x.E = 2, x.I = 64, x.H = 96, x.Is = 80;
  MakeExperts(&x, rng);
  const int64_t T = 3, hs = 80;
  const std::vector<float> in = RandomNormal(T * x.H, rng);
  std::vector<float> h, c;
  RunExperts(x, {}, T, 0, in, std::numeric_limits<float>::infinity(), hs, &h, &c);
  for (int64_t t = 0; t < T; ++t) {
    const std::vector<float> g = Ref(x.s1.w, in.data() + t * x.H), u = Ref(x.s3.w, in.data() + t * x.H);
    std::vector<float> want(x.Is);
    SwigluClampRef(g.data(), u.data(), x.Is, 0.0, want.data());
    ExpectClose(std::vector<float>(h.begin() + t * hs, h.begin() + t * hs + x.Is), want, 1e-4, "shared h");
  }
  const int64_t k = 2, H = 16;
  const std::vector<float> contrib = RandomNormal(T * (k + 1) * H, rng), w = RandomNormal(T * k, rng);
  DeviceBuffer dc = ToDevice(contrib), dw = ToDevice(w), dy = Zeros(T * H);
  ASSERT_OK(cuda::MoeCombine(dc.as<float>(), dw.as<float>(), T, k, H, dy.as<float>(), true));
  const std::vector<float> y = ToHost(dy, T * H);
  for (int64_t t = 0; t < T; ++t)
    for (int64_t i = 0; i < H; ++i) {
      float want = 0.0f;
      for (int64_t j = 0; j < k; ++j) want += w[t * k + j] * contrib[(t * (k + 1) + j) * H + i];
      want += contrib[(t * (k + 1) + k) * H + i];
      EXPECT_NEAR(y[t * H + i], want, 1e-5f * (1.0f + std::fabs(want))) << t << " " << i;
    }
}

TEST(CudaArgs, ExpertsRejectBadArguments) {
  std::vector<uint8_t> bytes(4096);
  float* f = reinterpret_cast<float*>(bytes.data());
  const void* const* p = reinterpret_cast<const void* const*>(bytes.data());
  const uint8_t* const* q = reinterpret_cast<const uint8_t* const*>(bytes.data());
  const int32_t* ids = reinterpret_cast<const int32_t*>(bytes.data());
  const cuda::DevExperts w{WeightFormat::kFP4Block32, 64, 96, 4, p, q};
  cuda::DevExperts bad = w;
  bad.cols = 80;
  Status s = cuda::ExpertsUpGate(bad, bad, ids, 1, 2, f, 96, 1.0f, nullptr, f, 64);
  EXPECT_NE(s.message().find("ExpertsUpGate w1: FP4 block32 weight [64, 80]: cols must be a multiple of 32"),
            std::string::npos) << s.ToString();
  bad = w;
  bad.rows = 32;
  s = cuda::ExpertsUpGate(w, bad, ids, 1, 2, f, 96, 1.0f, nullptr, f, 64);
  EXPECT_NE(s.message().find("w3 differs from w1"), std::string::npos) << s.ToString();
  s = cuda::ExpertsUpGate(w, w, nullptr, 1, 2, f, 96, 1.0f, nullptr, f, 64);
  EXPECT_NE(s.message().find("ids must be a device pointer"), std::string::npos) << s.ToString();
  s = cuda::ExpertsUpGate(w, w, ids, 1, 2, f, 96, 0.0f, nullptr, f, 64);
  EXPECT_NE(s.message().find("limit must be > 0"), std::string::npos) << s.ToString();
  s = cuda::ExpertsUpGate(w, w, ids, 1, 2, f, 96, 1.0f, nullptr, f, 32);
  EXPECT_NE(s.message().find("output stride 32 < 64 rows"), std::string::npos) << s.ToString();
  s = cuda::ExpertsUpGate(w, w, ids, 1, 0, f, 96, 1.0f, nullptr, f, 64);
  EXPECT_NE(s.message().find("k 0 and no shared expert"), std::string::npos) << s.ToString();
  s = cuda::ExpertsDown(w, ids, 2, 2, f, 32, nullptr, f);
  EXPECT_NE(s.message().find("x rows of 32 floats for 96 columns"), std::string::npos) << s.ToString();
  const cuda::SharedExpert sh{{WeightFormat::kFP8Block, 64, 128, bytes.data(), bytes.data()},
                              {WeightFormat::kFP8Block, 64, 128, bytes.data(), bytes.data()},
                              {WeightFormat::kFP8Block, 96, 64, bytes.data(), bytes.data()}};
  s = cuda::ExpertsUpGate(w, w, ids, 1, 2, f, 96, 1.0f, &sh, f, 64);
  EXPECT_NE(s.message().find("shared expert cols 128 != routed cols 96"), std::string::npos) << s.ToString();
  s = cuda::ExpertsUpGate(w, w, ids, -1, 2, f, 96, 1.0f, nullptr, f, 64);
  EXPECT_NE(s.message().find("tokens -1"), std::string::npos) << s.ToString();
}

}  // namespace
}  // namespace fm
