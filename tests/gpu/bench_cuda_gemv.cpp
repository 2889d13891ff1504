// GEMV bandwidth on the GPU for the model's decode shapes: bytes of weights + scales read per
// call / time per call, and that as a fraction of the device's read probe (MeasureReadBandwidth).
// Every weight case rotates over enough copies (>= 512 MiB) that L2 (50-60 MiB on H100/H200)
// cannot hold them, so the number is DRAM bandwidth, as in decode. Cases: Gemm of each shape at
// T = 1, 2, 4, 8, 32 tokens (bytes counted once: each weight is read once a call); GemmMany of
// the attention's products of x (one launch); the MoE step's ExpertsUpGate (W1 + W3 of k = 6 of
// 256 FP4 experts and the FP8 shared expert, I = 2048, H = 4096) and ExpertsDown, for 1 and 8
// tokens; HcPostPre at the real manifold; IndexerTopK at the real indexer's shapes; the decode
// attention at 1 and 8 rows. The FP8/FP4 cases run on both cores of ops.h SetWeightPath, "fma"
// and "tc" (tensor cores), in the same run; each Gemm shape's T = 1 also with launch overlap
// (SetLaunchOverlap), the "ovl" line.
// Every case is timed twice, on a stream of its own: calls launched one by one (the "us" column:
// what an eager step pays, host launch cost included when a call is shorter than its launch)
// and the same calls replayed from one CUDA graph (the "graph us" column: what a captured decode
// step pays).
// Usage: bench_cuda_gemv [--part P] [--once]  (one line per case; exit 1 on a CUDA error or a
//        failed case; 0 devices: skip). --part runs one part: fma (every weight case on the FMA
//        core), tc (the FP8/FP4 ones on the tensor cores), ovl (T = 1 with launch overlap) or
//        fused (HcPostPre, IndexerTopK, SinkAttention); without it all four, in that order.
//        tests/gpu/run.sh runs each part in a process of its own: a fault is sticky for a CUDA
//        context, so a kernel that faults costs only its own part's lines.
//        --once: every case launched once, untimed, one weight copy, no probe: "launch N: case"
//        names the N-th kernel launch, for ncu (tests/gpu/run.sh --profile).
#include <cuda_runtime.h>

#include <algorithm>
#include <cmath>
#include <cstddef>
#include <cstdio>
#include <functional>
#include <random>
#include <set>
#include <string>
#include <utility>
#include <vector>

#include "kernels/cuda/check.cuh"
#include "kernels/cuda/fused_ops.h"
#include "kernels/cuda/ops.h"

namespace fm {
namespace {

struct Shape {
  const char* name;
  WeightFormat format;
  int64_t rows, cols;
};

const Shape kShapes[] = {
    {"attn.wq_b      FP8", WeightFormat::kFP8Block, 32768, 1024},
    {"attn.wo_b      FP8", WeightFormat::kFP8Block, 4096, 8192},
    {"shared w1      FP8", WeightFormat::kFP8Block, 2048, 4096},
    {"expert w1      FP4", WeightFormat::kFP4Block32, 2048, 4096},
    {"expert w2      FP4", WeightFormat::kFP4Block32, 4096, 2048},
    {"head          BF16", WeightFormat::kBF16, 129280, 4096},
    {"hc_attn_fn     F32", WeightFormat::kF32, 24, 16384},
};

// The attention's products of the normed x at DeepSeek-V4-Flash's shapes (a ratio-4 layer:
// wq_a, wkv, the compressor's and the indexer compressor's wkv/wgate, the indexer's head
// weights), in the checkpoint's formats (model/tensor_schema.cpp: the compressors are BF16).
const Shape kAttnX[] = {
    {"wq_a", WeightFormat::kFP8Block, 1024, 4096},  {"wkv", WeightFormat::kFP8Block, 512, 4096},
    {"c.wkv", WeightFormat::kBF16, 1024, 4096},     {"c.wgate", WeightFormat::kBF16, 1024, 4096},
    {"ic.wkv", WeightFormat::kBF16, 256, 4096},     {"ic.wgate", WeightFormat::kBF16, 256, 4096},
    {"i.proj", WeightFormat::kBF16, 64, 4096},
};

double g_probe = 0;  // GB/s
const cuda::Stream* g_stream = nullptr;  // every case's stream (main)
bool g_once = false;  // --once
int g_launches = 0;   // cases launched under --once
int g_graph_failures = 0;  // cases whose graph column failed (their eager line stands)

// Each FP8/FP4 case on the FMA core, then on the tensor-core one; the core names the line.
const cuda::WeightPath kCores[] = {cuda::WeightPath::kFma, cuda::WeightPath::kTensorCore};
std::string CoreTag(cuda::WeightPath p) { return p == cuda::WeightPath::kFma ? "fma " : "tc  "; }

// Host bytes of a weight of small codes (no NaN/inf patterns), scales near 1.
struct HostBytes {
  std::vector<uint8_t> data, scale;
  QWeight w;
};
HostBytes MakeHost(const Shape& s) {
  HostBytes h;
  h.w = QWeight{s.format, s.rows, s.cols, nullptr, nullptr};
  const size_t n = static_cast<size_t>(s.rows * s.cols);
  const size_t bytes = s.format == WeightFormat::kF32 ? 4 * n : s.format == WeightFormat::kBF16 ? 2 * n
                       : s.format == WeightFormat::kFP8Block ? n : n / 2;
  h.data.resize(bytes);
  std::mt19937 rng(1);
  for (auto& b : h.data) b = static_cast<uint8_t>(rng() & 0x37);
  if (s.format == WeightFormat::kFP8Block)
    h.scale.assign(static_cast<size_t>((s.rows + 127) / 128 * ((s.cols + 127) / 128)), 127);
  if (s.format == WeightFormat::kFP4Block32) h.scale.assign(n / 32, 127);
  h.w.data = h.data.data();
  h.w.scale = h.scale.empty() ? nullptr : h.scale.data();
  return h;
}

Result<std::vector<cuda::DeviceWeight>> Copies(const HostBytes& h, int copies) {
  std::vector<cuda::DeviceWeight> v;
  for (int i = 0; i < copies; ++i) {
    FM_ASSIGN_OR_RETURN(cuda::DeviceWeight w, cuda::UploadWeight(h.w));
    v.push_back(std::move(w));
  }
  return v;
}

int CopiesFor(size_t bytes) {
  return g_once ? 1 : static_cast<int>(std::max<size_t>(2, (512ull << 20) / bytes + 1));
}

Result<cuda::DeviceBuffer> Floats(size_t n, float v) {
  std::vector<float> h(n, v);
  return cuda::Upload(h.data(), n * 4);
}

// Event-timed ms of `body` on the current stream.
Result<float> TimeMs(const std::function<Status()>& body) {
  cudaEvent_t start, stop;
  FM_CUDA_RETURN_IF_ERROR(cudaEventCreate(&start));
  FM_CUDA_RETURN_IF_ERROR(cudaEventCreate(&stop));
  Status st = cuda::CudaStatus(cudaEventRecord(start, cuda::CurrentStream()), "cudaEventRecord");
  if (st.ok()) st = body();
  if (st.ok()) st = cuda::CudaStatus(cudaEventRecord(stop, cuda::CurrentStream()), "cudaEventRecord");
  if (st.ok()) st = cuda::Synchronize();
  float ms = 0;
  if (st.ok()) st = cuda::CudaStatus(cudaEventElapsedTime(&ms, start, stop), "cudaEventElapsedTime");
  cudaEventDestroy(start);
  cudaEventDestroy(stop);
  FM_RETURN_IF_ERROR(st);
  return ms;
}

// The mean over `iters` calls of call(i) after a warm-up round of `warm` calls, launched one by
// one and then replayed from a graph of the same calls, timed with events; prints one line.
// Under --once: call(0) alone, its line naming the launch.
Status Time(const std::string& name, size_t bytes, int warm, const std::function<Status(int)>& call) {
  if (g_once) {  // one launch, named for the profiler's table
    std::printf("launch %d: %s\n", g_launches++, name.c_str());
    return call(0);
  }
  for (int i = 0; i < warm; ++i) FM_RETURN_IF_ERROR(call(i));
  const int iters = std::max(20, 4 * warm);
  auto all = [&]() -> Status {
    for (int i = 0; i < iters; ++i) FM_RETURN_IF_ERROR(call(i));
    return Status::Ok();
  };
  FM_ASSIGN_OR_RETURN(const float ms, TimeMs(all));
  const double us = 1000.0 * ms / iters, gbs = bytes / (us * 1e3);
  // The eager figure is out before the capture is tried: a capture that fails costs only its
  // own column (counted as a failure at the end), not the line.
  std::printf("%-42s %8.2f MiB %9.2f us %8.1f GB/s  %.2f of probe | ", name.c_str(),
              bytes / double(1 << 20), us, gbs, gbs / g_probe);
  std::fflush(stdout);
  Result<float> graph_ms = [&]() -> Result<float> {
    FM_ASSIGN_OR_RETURN(const cuda::Graph graph, cuda::Graph::Capture(*g_stream, all));
    FM_RETURN_IF_ERROR(graph.Launch(*g_stream));  // the replay's warm-up
    return TimeMs([&] { return graph.Launch(*g_stream); });
  }();
  if (!graph_ms.ok()) {
    ++g_graph_failures;
    std::printf("graph FAILED: %s\n", graph_ms.status().ToString().c_str());
    return Status::Ok();
  }
  const double gus = 1000.0 * *graph_ms / iters, ggbs = bytes / (gus * 1e3);
  std::printf("graph %9.2f us  %.2f of probe\n", gus, ggbs / g_probe);
  return Status::Ok();
}

// A Gemm shape on `core` at T = 1..32, or (overlap) T = 1 on the FMA core with launch overlap.
Status BenchShape(const Shape& s, cuda::WeightPath core, bool overlap) {
  const HostBytes h = MakeHost(s);
  const size_t bytes = h.w.bytes();
  const int copies = CopiesFor(bytes);
  FM_ASSIGN_OR_RETURN(auto weights, Copies(h, copies));
  if (overlap) {
    // T = 1 with launch overlap (ops.h SetLaunchOverlap): each call's L2 prefetch of its rows
    // runs while the call before it finishes, as a decode step's products would.
    FM_ASSIGN_OR_RETURN(cuda::DeviceBuffer x, Floats(s.cols, 0.5f));
    FM_ASSIGN_OR_RETURN(cuda::DeviceBuffer y, Floats(s.rows, 0.0f));
    cuda::SetLaunchOverlap(true);
    const Status st = Time(std::string("ovl ") + s.name + " T=1", bytes, copies, [&](int i) {
      return cuda::Gemm(weights[i % copies].view(), x.as<float>(), s.cols, y.as<float>(), s.rows, 1);
    });
    cuda::SetLaunchOverlap(false);
    return st;
  }
  cuda::SetWeightPath(core);
  for (int64_t T : {1, 2, 4, 8, 32}) {
    FM_ASSIGN_OR_RETURN(cuda::DeviceBuffer x, Floats(T * s.cols, 0.5f));
    FM_ASSIGN_OR_RETURN(cuda::DeviceBuffer y, Floats(T * s.rows, 0.0f));
    char name[80];
    std::snprintf(name, sizeof name, "%s%s T=%-2lld [%lld, %lld]", CoreTag(core).c_str(), s.name,
                  static_cast<long long>(T), static_cast<long long>(s.rows),
                  static_cast<long long>(s.cols));
    FM_RETURN_IF_ERROR(Time(name, bytes, copies, [&](int i) {
      return cuda::Gemm(weights[i % copies].view(), x.as<float>(), s.cols, y.as<float>(), s.rows, T);
    }));
  }
  return Status::Ok();
}

Status BenchAttnX(cuda::WeightPath core) {
  const int n = static_cast<int>(std::size(kAttnX));
  size_t bytes = 0;
  std::vector<HostBytes> hosts;
  for (const Shape& s : kAttnX) {
    hosts.push_back(MakeHost(s));
    bytes += hosts.back().w.bytes();
  }
  const int copies = CopiesFor(bytes);
  std::vector<std::vector<cuda::DeviceWeight>> w;
  int64_t out = 0;
  for (const HostBytes& h : hosts) {
    FM_ASSIGN_OR_RETURN(auto c, Copies(h, copies));
    w.push_back(std::move(c));
    out += h.w.rows;
  }
  cuda::SetWeightPath(core);
  for (const int64_t T : {1, 4}) {
    FM_ASSIGN_OR_RETURN(cuda::DeviceBuffer x, Floats(T * 4096, 0.5f));
    FM_ASSIGN_OR_RETURN(cuda::DeviceBuffer y, Floats(T * out, 0.0f));
    FM_ASSIGN_OR_RETURN(cuda::DeviceBuffer g, Floats(4096, 1.0f));
    const std::string name = CoreTag(core) + "GemmMany attn x (7) T=" + std::to_string(T);
    FM_RETURN_IF_ERROR(Time(name, bytes, copies, [&](int i) {
      std::vector<cuda::GemvTask> tasks;
      int64_t off = 0;
      for (int j = 0; j < n; ++j) {
        const QWeight v = w[j][i % copies].view();
        tasks.push_back({v, x.as<float>(), 4096, y.as<float>() + off * T, v.rows});
        off += v.rows;
      }
      return cuda::GemmMany(tasks.data(), tasks.size(), T, g.as<float>(), 1e-6f);
    }));
  }
  return Status::Ok();
}

// k = 6 of 256 FP4 experts (I = 2048, H = 4096) plus the FP8 shared expert, on `core`; the
// chosen experts change every call, and the shared expert rotates over 16 copies (24 MiB each),
// so that all their weights come from DRAM.
Status BenchExperts(cuda::WeightPath core) {
  const int64_t E = 256, k = 6, I = 2048, H = 4096;
  const int shared_copies = g_once ? 1 : 16;
  const HostBytes up = MakeHost({"", WeightFormat::kFP4Block32, I, H});
  const HostBytes down = MakeHost({"", WeightFormat::kFP4Block32, H, I});
  const HostBytes s_up = MakeHost({"", WeightFormat::kFP8Block, I, H});
  const HostBytes s_down = MakeHost({"", WeightFormat::kFP8Block, H, I});
  FM_ASSIGN_OR_RETURN(auto w1, Copies(up, E));
  FM_ASSIGN_OR_RETURN(auto w3, Copies(up, E));
  FM_ASSIGN_OR_RETURN(auto w2, Copies(down, E));
  FM_ASSIGN_OR_RETURN(auto s1, Copies(s_up, shared_copies));
  FM_ASSIGN_OR_RETURN(auto s3, Copies(s_up, shared_copies));
  FM_ASSIGN_OR_RETURN(auto s2, Copies(s_down, shared_copies));
  auto table = [&](const std::vector<cuda::DeviceWeight>& w, bool scale) {
    std::vector<const void*> p;
    for (const auto& d : w) p.push_back(scale ? d.scale.data() : d.data.data());
    return cuda::Upload(p.data(), p.size() * sizeof(void*));
  };
  FM_ASSIGN_OR_RETURN(cuda::DeviceBuffer p1, table(w1, false));
  FM_ASSIGN_OR_RETURN(cuda::DeviceBuffer q1, table(w1, true));
  FM_ASSIGN_OR_RETURN(cuda::DeviceBuffer p3, table(w3, false));
  FM_ASSIGN_OR_RETURN(cuda::DeviceBuffer q3, table(w3, true));
  FM_ASSIGN_OR_RETURN(cuda::DeviceBuffer p2, table(w2, false));
  FM_ASSIGN_OR_RETURN(cuda::DeviceBuffer q2, table(w2, true));
  auto set = [&](const cuda::DeviceBuffer& p, const cuda::DeviceBuffer& q, int64_t rows, int64_t cols) {
    return cuda::DevExperts{WeightFormat::kFP4Block32, rows, cols, E, p.as<const void* const>(),
                            q.as<const uint8_t* const>()};
  };
  std::vector<cuda::SharedExpert> shared;
  for (int c = 0; c < shared_copies; ++c) shared.push_back({s1[c].view(), s3[c].view(), s2[c].view()});
  // 64 id sets of T tokens x 6 distinct experts each, rotated: 384 expert picks or more > 256,
  // beyond L2. T = 8: a decode step of 8 streams (48 picks, mostly distinct experts).
  const int sets = 64;
  cuda::SetWeightPath(core);
  for (const int64_t T : {1, 8}) {
    std::mt19937 rng(5);
    std::vector<int32_t> ids(sets * T * k);
    for (int i = 0; i < sets * T; ++i) {
      std::vector<int32_t> all(E);
      for (int e = 0; e < E; ++e) all[e] = e;
      std::shuffle(all.begin(), all.end(), rng);
      std::copy(all.begin(), all.begin() + k, ids.begin() + i * k);
    }
    FM_ASSIGN_OR_RETURN(cuda::DeviceBuffer dids, cuda::Upload(ids.data(), ids.size() * 4));
    FM_ASSIGN_OR_RETURN(cuda::DeviceBuffer x, Floats(T * H, 0.5f));
    FM_ASSIGN_OR_RETURN(cuda::DeviceBuffer h, Floats(T * (k + 1) * I, 0.5f));
    FM_ASSIGN_OR_RETURN(cuda::DeviceBuffer c, Floats(T * (k + 1) * H, 0.0f));
    // Bytes: the distinct experts of a set (the mean over the sets; T = 8: about 44) + the
    // shared expert, once.
    double distinct = 0;
    for (int i = 0; i < sets; ++i)
      distinct += std::set<int32_t>(ids.begin() + i * T * k, ids.begin() + (i + 1) * T * k).size();
    distinct /= sets;
    const size_t up_bytes = static_cast<size_t>(2 * (distinct * up.w.bytes() + s_up.w.bytes()));
    const size_t down_bytes = static_cast<size_t>(distinct * down.w.bytes() + s_down.w.bytes());
    const std::string t = " T=" + std::to_string(T);
    FM_RETURN_IF_ERROR(Time(CoreTag(core) + "ExpertsUpGate k=6+shared" + t, up_bytes, sets, [&](int i) {
      return cuda::ExpertsUpGate(set(p1, q1, I, H), set(p3, q3, I, H),
                                 dids.as<int32_t>() + (i % sets) * T * k, T, k, x.as<float>(), H,
                                 10.0f, &shared[i % shared_copies], h.as<float>(), I);
    }));
    FM_RETURN_IF_ERROR(Time(CoreTag(core) + "ExpertsDown   k=6+shared" + t, down_bytes, sets, [&](int i) {
      return cuda::ExpertsDown(set(p2, q2, H, I), dids.as<int32_t>() + (i % sets) * T * k, T, k,
                               h.as<float>(), I, &shared[i % shared_copies], c.as<float>());
    }));
  }
  return Status::Ok();
}

// HcPostPre at the real manifold (hc 4 x H 4096, a [24, 16384] F32 mix weight) for T = 1 and
// 8 rows, with the model's 20 Sinkhorn iterations and with 1 (the difference is the Sinkhorn's
// share), and with the FFN's output taken from the 6 + 1 expert slots (the decode layer's way:
// "slots", against a dense output); bytes: the mix weight and X read once.
Status BenchHcPostPre() {
  const int64_t n = 4, H = 4096, M = (2 + n) * n;
  for (const int64_t T : {1, 8}) {
    FM_ASSIGN_OR_RETURN(cuda::DeviceBuffer x, Floats(T * n * H, 0.01f));
    FM_ASSIGN_OR_RETURN(cuda::DeviceBuffer out, Floats(T * H, 0.01f));
    FM_ASSIGN_OR_RETURN(cuda::DeviceBuffer xn, Floats(T * n * H, 0.0f));
    FM_ASSIGN_OR_RETURN(cuda::DeviceBuffer fn, Floats(M * n * H, 0.001f));
    FM_ASSIGN_OR_RETURN(cuda::DeviceBuffer base, Floats(M, 0.1f));
    FM_ASSIGN_OR_RETURN(cuda::DeviceBuffer scale, Floats(3, 1.0f));
    FM_ASSIGN_OR_RETURN(cuda::DeviceBuffer norm, Floats(H, 1.0f));
    FM_ASSIGN_OR_RETURN(cuda::DeviceBuffer post, Floats(T * n, 1.0f));
    FM_ASSIGN_OR_RETURN(cuda::DeviceBuffer comb, Floats(T * n * n, 0.25f));
    FM_ASSIGN_OR_RETURN(cuda::DeviceBuffer y, Floats(T * H, 0.0f));
    FM_ASSIGN_OR_RETURN(cuda::DeviceBuffer part, Floats(cuda::HcFusedPartials(T, n, H), 0.0f));
    std::vector<int32_t> zero(T, 0);
    FM_ASSIGN_OR_RETURN(cuda::DeviceBuffer counter, cuda::Upload(zero.data(), zero.size() * 4));
    const int64_t k = 6;
    FM_ASSIGN_OR_RETURN(cuda::DeviceBuffer slots, Floats(T * (k + 1) * H, 0.01f));
    FM_ASSIGN_OR_RETURN(cuda::DeviceBuffer rw, Floats(T * k, 0.2f));
    const size_t bytes = (M + 2 * T) * n * H * 4;
    struct Case { int64_t iters; bool slots; };
    for (const Case c : {Case{20, false}, Case{1, false}, Case{20, true}}) {
      const cuda::HcPostInput in =
          c.slots ? cuda::HcPostInput::Slots(slots.as<float>(), rw.as<float>(), k)
                  : cuda::HcPostInput(out.as<float>());
      const std::string name = "HcPostPre T=" + std::to_string(T) + " sinkhorn " +
                               std::to_string(c.iters) + (c.slots ? " slots" : "");
      FM_RETURN_IF_ERROR(Time(name, bytes, 8, [&](int) {
        return cuda::HcPostPre(x.as<float>(), in, xn.as<float>(), fn.as<float>(),
                               base.as<float>(), scale.as<float>(), norm.as<float>(), T, n, H,
                               c.iters, 1e-6f, 1e-6f, post.as<float>(), comb.as<float>(),
                               y.as<float>(), part.as<float>(), counter.as<int32_t>());
      }));
    }
  }
  return Status::Ok();
}

// The Lightning indexer of one decode row at DeepSeek-V4-Flash's shapes (64 heads x 128, top
// 512) over n compressed entries (a ratio-4 layer at 4n positions: 16K, 64K, 256K): scores and
// the top-k in one launch. Compute bound (64 x 128 multiply-adds an entry): bytes = the keys.
Status BenchIndexer() {
  const int64_t nh = 64, di = 128, k = 512;
  for (const int64_t n : {4096, 16384, 65536}) {
    std::vector<float> host(n * di);
    std::mt19937 rng(7);
    std::normal_distribution<float> dist(0.0f, 1.0f);
    for (float& v : host) v = dist(rng);
    FM_ASSIGN_OR_RETURN(cuda::DeviceBuffer keys, cuda::Upload(host.data(), host.size() * 4));
    FM_ASSIGN_OR_RETURN(cuda::DeviceBuffer score, Floats(n, 0.0f));
    FM_ASSIGN_OR_RETURN(cuda::DeviceBuffer q, Floats(nh * di, 0.05f));
    FM_ASSIGN_OR_RETURN(cuda::DeviceBuffer w, Floats(nh, 0.1f));
    const cuda::RowCache rc{nullptr, keys.as<float>(), score.as<float>(), nullptr, nullptr,
                            nullptr, nullptr, static_cast<int32_t>(n), 0};
    FM_ASSIGN_OR_RETURN(cuda::DeviceBuffer table, cuda::Upload(&rc, sizeof rc));
    const int32_t visible = static_cast<int32_t>(n);
    FM_ASSIGN_OR_RETURN(cuda::DeviceBuffer vis, cuda::Upload(&visible, 4));
    std::vector<int32_t> zero(1, 0);
    FM_ASSIGN_OR_RETURN(cuda::DeviceBuffer counter, cuda::Upload(zero.data(), 4));
    FM_ASSIGN_OR_RETURN(cuda::DeviceBuffer picks, cuda::Upload(std::vector<int32_t>(k).data(), k * 4));
    cuda::RowSteps steps{};
    steps.visible = vis.as<int32_t>();
    FM_RETURN_IF_ERROR(Time("IndexerTopK 64x128 top512 n=" + std::to_string(n), n * di * 4, 2,
                            [&](int) {
      return cuda::IndexerTopK(table.as<cuda::RowCache>(), 0, 1, q.as<float>(), w.as<float>(), nh,
                               di, 1.0f / std::sqrt(128.0f), steps, n, k, picks.as<int32_t>(),
                               counter.as<int32_t>());
    }));
  }
  return Status::Ok();
}

// The decode attention at DeepSeek-V4-Flash's shapes (64 heads of 512, one kv head) over a
// ratio-4 layer's 640 keys (128 window rows + 512 picked entries) for 1 row (the batched
// one-row kernel) and 8 rows (the one-key kernel); bytes = each row's keys, read once.
Status BenchAttention() {
  const int64_t nh = 64, d = 512, W = 128, topk = 512, max_entries = 4096, rd = 64;
  struct Row { int32_t ring_row, win_start, nwin, visible, entries, keys; };
  for (const int64_t T : {1, 8}) {
    FM_ASSIGN_OR_RETURN(cuda::DeviceBuffer keys, Floats((W + max_entries) * d, 0.01f));
    FM_ASSIGN_OR_RETURN(cuda::DeviceBuffer q, Floats(T * nh * d, 0.02f));
    FM_ASSIGN_OR_RETURN(cuda::DeviceBuffer o, Floats(T * nh * d, 0.0f));
    FM_ASSIGN_OR_RETURN(cuda::DeviceBuffer sink, Floats(nh, 0.0f));
    FM_ASSIGN_OR_RETURN(cuda::DeviceBuffer freqs, Floats(rd / 2, 0.001f));
    std::vector<int32_t> picks(T * topk), pos(T, 5000);
    for (int64_t i = 0; i < T * topk; ++i) picks[i] = static_cast<int32_t>((i % topk) * 7 % max_entries);
    FM_ASSIGN_OR_RETURN(cuda::DeviceBuffer dpicks, cuda::Upload(picks.data(), picks.size() * 4));
    FM_ASSIGN_OR_RETURN(cuda::DeviceBuffer dpos, cuda::Upload(pos.data(), pos.size() * 4));
    std::vector<cuda::RowCache> table(T);
    for (auto& rc : table) rc.keys = keys.as<float>(), rc.max_entries = max_entries;
    FM_ASSIGN_OR_RETURN(cuda::DeviceBuffer dtable, cuda::Upload(table.data(), table.size() * sizeof(table[0])));
    std::vector<Row> rows(T, Row{0, 0, static_cast<int32_t>(W), static_cast<int32_t>(max_entries),
                                 static_cast<int32_t>(topk), static_cast<int32_t>(W + topk)});
    FM_ASSIGN_OR_RETURN(cuda::DeviceBuffer drows, cuda::Upload(rows.data(), rows.size() * sizeof(Row)));
    const char* b = drows.as<const char>();
    auto at = [b](size_t off) { return reinterpret_cast<const int32_t*>(b + off); };
    const cuda::RowSteps steps{at(offsetof(Row, ring_row)), at(offsetof(Row, win_start)),
                               at(offsetof(Row, visible)), at(offsetof(Row, entries)),
                               at(offsetof(Row, keys)), nullptr, sizeof(Row)};
    const cuda::AttentionArgs a{q.as<float>(), nh, d, dtable.as<cuda::RowCache>(), W, true, topk,
                                dpicks.as<int32_t>(), steps, sink.as<float>(),
                                1.0f / std::sqrt(static_cast<float>(d)), dpos.as<int32_t>(),
                                freqs.as<float>(), rd, o.as<float>()};
    FM_RETURN_IF_ERROR(Time("SinkAttention 64x512 keys=640 rows=" + std::to_string(T),
                            T * (W + topk) * d * 4, 2,
                            [&](int) { return cuda::SinkAttentionRows(a, 0, T); }));
  }
  return Status::Ok();
}

}  // namespace
}  // namespace fm

int main(int argc, char** argv) {
  std::string part;
  for (int i = 1; i < argc; ++i) {
    const std::string a = argv[i];
    if (a == "--once") {
      fm::g_once = true;
    } else if (a == "--part" && i + 1 < argc &&
               std::set<std::string>{"fma", "tc", "ovl", "fused"}.count(argv[i + 1])) {
      part = argv[++i];
    } else {
      std::fprintf(stderr, "usage: bench_cuda_gemv [--part fma|tc|ovl|fused] [--once]\n");
      return 2;
    }
  }
  if (fm::cuda::DeviceCount() == 0) {
    std::printf("bench_cuda_gemv: no CUDA device, skipped\n");
    return 0;
  }
  std::printf("bench_cuda_gemv on %s%s\n", fm::cuda::DeviceDescription(0).c_str(),
              part.empty() ? "" : (", part " + part).c_str());
  if (!fm::g_once) {
    auto probe = fm::cuda::MeasureReadBandwidth(1ull << 30, 10);
    if (!probe.ok()) {
      std::fprintf(stderr, "bench_cuda_gemv: read probe: %s\n", probe.status().ToString().c_str());
      return 1;
    }
    fm::g_probe = *probe;
    std::printf("device read probe: %.1f GB/s\n", fm::g_probe);
  }
  auto stream = fm::cuda::Stream::Create();  // graphs capture a stream of ours, not the default one
  if (!stream.ok()) {
    std::fprintf(stderr, "bench_cuda_gemv: %s\n", stream.status().ToString().c_str());
    return 1;
  }
  const fm::cuda::StreamScope on_stream(*stream);
  fm::g_stream = &*stream;
  // Every group runs even when one before it failed (a case that never ran on a GPU must not
  // cost the lines after it), each from the default core without launch overlap.
  int failed = 0;
  auto run = [&](const std::string& what, const std::function<fm::Status()>& bench) {
    const fm::Status st = bench();
    fm::cuda::SetWeightPath(fm::cuda::WeightPath::kFma);
    fm::cuda::SetLaunchOverlap(false);
    if (st.ok()) return;
    ++failed;
    std::printf("FAILED %s: %s\n", what.c_str(), st.ToString().c_str());
  };
  auto want = [&](const char* p) { return part.empty() || part == p; };
  for (const fm::cuda::WeightPath core : fm::kCores) {
    const std::string tag = fm::CoreTag(core);
    if (!want(core == fm::cuda::WeightPath::kFma ? "fma" : "tc")) continue;
    for (const auto& s : fm::kShapes) {
      // The tensor-core core serves the block-scaled formats only.
      const bool quantized = s.format == fm::WeightFormat::kFP8Block || s.format == fm::WeightFormat::kFP4Block32;
      if (core == fm::cuda::WeightPath::kFma || quantized)
        run(tag + s.name, [&] { return fm::BenchShape(s, core, false); });
    }
    run(tag + "attention GemmMany", [&] { return fm::BenchAttnX(core); });
    run(tag + "experts", [&] { return fm::BenchExperts(core); });
  }
  if (want("ovl"))
    for (const auto& s : fm::kShapes)
      run(std::string("ovl ") + s.name, [&] { return fm::BenchShape(s, fm::kCores[0], true); });
  if (want("fused")) {
    run("HcPostPre", fm::BenchHcPostPre);
    run("IndexerTopK", fm::BenchIndexer);
    run("SinkAttention", fm::BenchAttention);
  }
  if (fm::g_graph_failures > 0) std::printf("FAILED %d graph columns\n", fm::g_graph_failures);
  return failed > 0 || fm::g_graph_failures > 0 ? 1 : 0;
}
