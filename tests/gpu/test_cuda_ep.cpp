// Expert parallelism on the device shard (model/cuda/ep_experts.h): cuda shards each holding a
// half of the routed experts on the device, exchanging over a loopback TCP group with the
// EpExpertExecutor (worker/), give the single device shard's manifold bit for bit for their own
// sequences, as one stage (pp1 x ep2) and as two stages of two (pp2 x ep2). The members' prefills
// differ in length, so they run different numbers of device steps (AgreeRounds pads the shorter),
// and in the last step one member has no rows (it serves the other's pairs only). No CPU expert
// kernel runs: each member's experts run on its device (DeviceExpertRunner). The same over an
// NCCL group (device buffers: rows and outputs go device to device, no host copy of them): in
// the emulation over tests/gpu/emu/nccl.h, on a GPU machine with one GPU a member.
#include <gtest/gtest.h>

#include <chrono>
#include <cstring>
#include <memory>
#include <random>
#include <string>
#include <thread>
#include <vector>

#include "kernels/cuda/device.h"
#include "model/checkpoint.h"
#include "model/cuda/shard_model.h"
#include "model/forward.h"
#include "model/kv_cache.h"
#include "model/mkmodel.h"
#include "model/moe.h"
#include "net/nccl_communicator.h"
#include "tests/gpu/nccl_test_group.h"
#include "tests/model_test_util.h"
#include "tests/unit/test_comm_group.h"
#include "worker/ep_expert_executor.h"

namespace fm {
namespace {

using namespace std::chrono_literals;

// One EP member: its checkpoint selection on cuda:0, its executor and its one sequence.
struct Member {
  std::unique_ptr<Checkpoint> ckpt;
  std::unique_ptr<ShardModel> model;
  std::unique_ptr<EpExpertExecutor> ep;
  std::unique_ptr<SequenceCache> seq;
};

// An EP group's communicators: TCP on loopback, or NCCL (one device a member when the machine
// has several; the emulation's one device otherwise).
struct Group {
  std::unique_ptr<CommGroup> tcp;
  std::vector<std::unique_ptr<net::NcclCommunicator>> nccl;
  int device(int r) const { return nccl.empty() ? 0 : r % cuda::DeviceCount(); }
  net::Communicator* comm(int r) const {
    return nccl.empty() ? tcp->comms[r].get() : static_cast<net::Communicator*>(nccl[r].get());
  }
};

std::unique_ptr<Group> MakeGroup(int n, bool nccl) {
  auto g = std::make_unique<Group>();
  if (!nccl) {
    g->tcp = std::make_unique<CommGroup>(n);
    return g;
  }
  g->nccl = NcclGroupInProcess(n, "m");
  if (g->nccl.empty()) return nullptr;
  return g;
}

// The members of stage [begin, end) of an ep-member group over `comms`.
std::vector<Member> OpenStage(const std::string& dir, int64_t begin, int64_t end, bool last,
                              const Group& comms, const std::vector<int64_t>& expert_begin) {
  std::vector<Member> ms(expert_begin.size() - 1);
  for (size_t r = 0; r < ms.size(); ++r) {
    ShardSelection sel;
    sel.layer_begin = begin;
    sel.layer_end = end;
    sel.embed = begin == 0;
    sel.head = last;
    for (int64_t e = expert_begin[r]; e < expert_begin[r + 1]; ++e) sel.experts.push_back(e);
    auto c = Checkpoint::Open(dir, sel);
    EXPECT_TRUE(c.ok()) << c.status().ToString();
    if (!c.ok()) return {};
    ms[r].ckpt = std::move(c).value();
    auto m = CreateCudaShardModel(*ms[r].ckpt, comms.device(static_cast<int>(r)));
    EXPECT_TRUE(m.ok()) << m.status().ToString();
    if (!m.ok()) return {};
    ms[r].model = std::move(m).value();
    ExpertRunner* runner = ms[r].model->LocalExperts();
    EXPECT_NE(runner, nullptr);
    ms[r].ep = std::make_unique<EpExpertExecutor>(ms[r].ckpt->config(), runner,
                                                  comms.comm(static_cast<int>(r)), expert_begin,
                                                  20000ms, 64);
    ms[r].model->SetExpertExecutor(ms[r].ep.get());
    ms[r].seq = ms[r].model->NewSequence(256).value();
  }
  return ms;
}

// One step of a stage: member r runs tokens[r] (none: it only serves the others' pairs, as the
// worker does) on x[r], all members at once.
void StepStage(std::vector<Member>& ms, uint64_t step,
               const std::vector<std::vector<int32_t>>& tokens, std::vector<std::vector<float>>* x) {
  std::vector<Status> status(ms.size());
  std::vector<std::thread> threads;
  for (size_t r = 0; r < ms.size(); ++r)
    threads.emplace_back([&, r] {
      Member& m = ms[r];
      m.ep->SetStep(step);
      if (tokens[r].empty()) {
        Result<int64_t> rounds = m.ep->AgreeRounds(0);
        status[r] = rounds.ok() ? RunEmptyRounds(m.ep.get(), 0, *rounds, m.model->layer_begin(),
                                                 m.model->layer_end())
                                : rounds.status();
        return;
      }
      const BatchItem item{m.seq.get(), tokens[r]};
      status[r] = modeltest::OnShard(*m.model, &(*x)[r], [&](float* dx) {
        return m.model->ForwardLayers({&item, 1}, dx);
      });
    });
  for (auto& t : threads) t.join();
  for (size_t r = 0; r < ms.size(); ++r)
    ASSERT_TRUE(status[r].ok()) << "member " << r << " step " << step << ": " << status[r].ToString();
}

// stages: the layer boundaries ({0, L}: one stage; {0, 3, L}: two).
void ExpectEpEqualsSingleDevice(const std::vector<int64_t>& bounds, bool nccl = false) {
  if (cuda::DeviceCount() == 0) GTEST_SKIP() << "no CUDA device";
  const bool emulated = cuda::DeviceDescription(0) == "CPU emulation";
  if (nccl && !emulated && cuda::DeviceCount() < 2)
    GTEST_SKIP() << "needs 2 CUDA devices (NCCL: one rank per GPU)";
  const std::string& dir = modeltest::PresetDir("tiny");
  auto ck = Checkpoint::Open(dir, {});
  ASSERT_TRUE(ck.ok());
  auto single = CreateCudaShardModel(**ck, 0);
  ASSERT_TRUE(single.ok()) << single.status().ToString();
  const ModelConfig& cfg = (*single)->config();
  const int64_t row = cfg.hc_mult * cfg.hidden_size, E = cfg.n_routed_experts;
  const std::vector<int64_t> expert_begin = {0, E / 2, E};
  const size_t S = bounds.size() - 1;
  std::vector<std::unique_ptr<Group>> groups;
  std::vector<std::vector<Member>> stages;
  for (size_t s = 0; s < S; ++s) {
    groups.push_back(MakeGroup(2, nccl));
    ASSERT_TRUE(groups.back());
    stages.push_back(OpenStage(dir, bounds[s], bounds[s + 1], s + 1 == S, *groups.back(),
                               expert_begin));
    ASSERT_EQ(stages.back().size(), 2u);
  }
  std::unique_ptr<SequenceCache> want_seq[2] = {(*single)->NewSequence(256).value(),
                                                (*single)->NewSequence(256).value()};
  std::mt19937 rng(9);
  std::uniform_int_distribution<int32_t> tok(0, static_cast<int32_t>(cfg.vocab_size - 1));
  const int64_t cpu_runs = CpuExpertGroupRuns();
  // Step 1: prefills of 40 rows (two device steps) and 5 (one); steps 2-3 decode a token each;
  // step 4 decodes member 0's sequence only.
  for (uint64_t step = 1; step <= 4; ++step) {
    std::vector<std::vector<int32_t>> tokens(2);
    const int64_t lens[2] = {step == 1 ? 40 : 1, step == 1 ? 5 : step == 4 ? 0 : 1};
    for (int r = 0; r < 2; ++r)
      for (int64_t j = 0; j < lens[r]; ++j) tokens[r].push_back(tok(rng));
    std::vector<std::vector<float>> want(2), x(2);
    for (int r = 0; r < 2; ++r) {
      if (tokens[r].empty()) continue;
      want[r].resize(tokens[r].size() * row);
      ASSERT_TRUE(modeltest::OnShard(**single, &want[r], [&](float* dx) {
                    return (*single)->Embed(tokens[r], dx);
                  }).ok());
      x[r] = want[r];
      const BatchItem item{want_seq[r].get(), tokens[r]};
      ASSERT_TRUE(modeltest::OnShard(**single, &want[r], [&](float* dx) {
                    return (*single)->ForwardLayers({&item, 1}, dx);
                  }).ok());
    }
    for (size_t s = 0; s < S; ++s) ASSERT_NO_FATAL_FAILURE(StepStage(stages[s], step, tokens, &x));
    for (int r = 0; r < 2; ++r)
      EXPECT_TRUE(tokens[r].empty() ||
                  std::memcmp(want[r].data(), x[r].data(), want[r].size() * sizeof(float)) == 0)
          << "member " << r << " step " << step << ": differs from the single device shard";
  }
  EXPECT_EQ(CpuExpertGroupRuns(), cpu_runs) << "a CPU expert kernel ran";
  for (auto& st : stages)
    for (auto& m : st) EXPECT_GT(m.ep->stats().dispatch_bytes, 0u);
}

TEST(CudaExpertParallel, OneStageOfTwoMembersEqualsTheSingleDeviceShardBitForBit) {
  ExpectEpEqualsSingleDevice({0, 6});
}

TEST(CudaExpertParallel, TwoStagesOfTwoMembersEqualTheSingleDeviceShardBitForBit) {
  ExpectEpEqualsSingleDevice({0, 3, 6});
}

TEST(CudaExpertParallel, OverNcclRowsGoDeviceToDeviceAndEqualTheSingleDeviceShard) {
  ExpectEpEqualsSingleDevice({0, 6}, /*nccl=*/true);
}

}  // namespace
}  // namespace fm
