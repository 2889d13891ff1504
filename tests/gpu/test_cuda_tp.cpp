// Tensor parallelism on the device shard (model/cuda/tp_step.h): two cuda shards, each uploaded
// with member r's rows of the split weights and its half of the routed experts, gathering over an
// in-process group, give the single device shard's manifold bit for bit on both members, through
// a prefill longer than the sliding window (compressed and indexed layers run; several device
// steps) and decode steps; the shard refuses to step without its group or with another member's.
#include <gtest/gtest.h>

#include <algorithm>
#include <chrono>
#include <condition_variable>
#include <cstring>
#include <functional>
#include <map>
#include <memory>
#include <mutex>
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
#include "model/tp.h"
#include "net/nccl_communicator.h"
#include "tests/gpu/nccl_test_group.h"
#include "tests/model_test_util.h"
#include "worker/tp_group.h"

namespace fm {
namespace {

// The all-gathers of t threads in one process: the i-th gather of every member meets the i-th
// of the others.
class LocalGroup {
 public:
  LocalGroup(int t, std::vector<int64_t> expert_begin) : t_(t), begin_(std::move(expert_begin)) {
    for (int r = 0; r < t; ++r) members_.push_back(std::make_unique<Member>(this, r));
  }
  TpGroup* member(int r) { return members_[r].get(); }
  int64_t gathers() const { return gathers_; }

 private:
  struct Round {
    std::vector<std::vector<float>> pieces;
    int arrived = 0, left = 0;
  };
  class Member : public TpGroup {
   public:
    Member(LocalGroup* g, int r) : g_(g), r_(r) {}
    int rank() const override { return r_; }
    int size() const override { return g_->t_; }
    int ExpertOwner(int32_t e) const override {
      auto it = std::upper_bound(g_->begin_.begin(), g_->begin_.end(), e);
      return std::clamp(static_cast<int>(it - g_->begin_.begin()) - 1, 0, size() - 1);
    }
    Result<std::vector<std::vector<float>>> AllGather(std::span<const float> mine) override {
      return g_->Gather(next_++, r_, mine);
    }

   private:
    LocalGroup* g_;
    int r_;
    uint64_t next_ = 0;
  };

  Result<std::vector<std::vector<float>>> Gather(uint64_t i, int r, std::span<const float> mine) {
    std::unique_lock<std::mutex> lock(mu_);
    Round& round = rounds_[i];
    if (round.pieces.empty()) round.pieces.resize(t_);
    round.pieces[r].assign(mine.begin(), mine.end());
    if (++round.arrived == t_) {
      ++gathers_;
      cv_.notify_all();
    }
    if (!cv_.wait_for(lock, std::chrono::seconds(120), [&] { return round.arrived == t_; }))
      return DeadlineExceeded("gather " + std::to_string(i) + ": member " + std::to_string(r) +
                              " waited for the others");
    std::vector<std::vector<float>> out = round.pieces;
    if (++round.left == t_) rounds_.erase(i);
    return out;
  }

  int t_;
  std::vector<int64_t> begin_;
  std::vector<std::unique_ptr<Member>> members_;
  std::mutex mu_;
  std::condition_variable cv_;
  std::map<uint64_t, Round> rounds_;
  int64_t gathers_ = 0;
};

struct Shard {
  std::unique_ptr<Checkpoint> ckpt;
  std::unique_ptr<ShardModel> model;
  std::vector<std::unique_ptr<SequenceCache>> seqs;
};

Shard Open(const std::string& dir, const ShardSelection& sel, int nseq, int device = 0) {
  Shard s;
  auto c = Checkpoint::Open(dir, sel);
  EXPECT_TRUE(c.ok()) << c.status().ToString();
  if (!c.ok()) return s;
  s.ckpt = std::move(c).value();
  auto m = CreateCudaShardModel(*s.ckpt, device);
  EXPECT_TRUE(m.ok()) << m.status().ToString();
  if (!m.ok()) return s;
  s.model = std::move(m).value();
  for (int i = 0; i < nseq; ++i) s.seqs.push_back(s.model->NewSequence(256).value());
  return s;
}

std::vector<BatchItem> Items(Shard& s, const std::vector<std::vector<int32_t>>& tokens) {
  std::vector<BatchItem> items;
  for (size_t i = 0; i < tokens.size(); ++i) items.push_back({s.seqs[i].get(), tokens[i]});
  return items;
}

// Step 1 prefills three prompts (two longer than the window: 81 rows, device steps of 32, 32
// and 17), steps 2-4 decode one token of each, on the single shard and on every member at once
// (set_step(step) first): every member's manifold equals the single shard's bit for bit.
void ExpectMembersEqualSingle(Shard& single, std::vector<Shard>& members,
                              const std::function<void(uint64_t)>& set_step) {
  const ModelConfig& cfg = single.model->config();
  const int64_t row = cfg.hc_mult * cfg.hidden_size;
  const int t = static_cast<int>(members.size());
  std::mt19937 rng(5);
  std::uniform_int_distribution<int32_t> tok(0, static_cast<int32_t>(cfg.vocab_size - 1));
  const int64_t W = cfg.sliding_window;
  for (int step = 1; step <= 4; ++step) {
    set_step(step);
    std::vector<std::vector<int32_t>> tokens(3);
    const std::vector<int64_t> lens =
        step == 1 ? std::vector<int64_t>{W + 9, 2 * W + 5 + 16, 3} : std::vector<int64_t>{1, 1, 1};
    std::vector<int32_t> all;
    for (int i = 0; i < 3; ++i) {
      for (int64_t j = 0; j < lens[i]; ++j) tokens[i].push_back(tok(rng));
      all.insert(all.end(), tokens[i].begin(), tokens[i].end());
    }
    std::vector<float> want(all.size() * row);
    ASSERT_TRUE(modeltest::OnShard(*single.model, &want, [&](float* dx) {
                  return single.model->Embed(all, dx);
                }).ok());
    std::vector<std::vector<float>> got(t, want);
    auto items = Items(single, tokens);
    ASSERT_TRUE(modeltest::OnShard(*single.model, &want, [&](float* dx) {
                  return single.model->ForwardLayers(items, dx);
                }).ok());
    std::vector<std::thread> threads;
    std::vector<Status> status(t);
    for (int r = 0; r < t; ++r)
      threads.emplace_back([&, r] {
        auto mine = Items(members[r], tokens);
        status[r] = modeltest::OnShard(*members[r].model, &got[r], [&](float* dx) {
          return members[r].model->ForwardLayers(mine, dx);
        });
      });
    for (auto& th : threads) th.join();
    for (int r = 0; r < t; ++r) {
      ASSERT_TRUE(status[r].ok()) << "member " << r << ": " << status[r].ToString();
      EXPECT_EQ(std::memcmp(want.data(), got[r].data(), want.size() * sizeof(float)), 0)
          << "member " << r << " step " << step << ": differs from the single device shard";
    }
  }
}

TEST(CudaTensorParallel, TwoMembersEqualTheSingleDeviceShardBitForBit) {
  if (cuda::DeviceCount() == 0) GTEST_SKIP() << "no CUDA device";
  const std::string& dir = modeltest::PresetDir("tiny");
  constexpr int t = 2;
  Shard single = Open(dir, {}, 3);
  ASSERT_TRUE(single.model);
  const ModelConfig& cfg = single.model->config();
  ASSERT_TRUE(CheckTensorParallel(cfg, t).ok());
  const int64_t E = cfg.n_routed_experts, row = cfg.hc_mult * cfg.hidden_size;
  std::vector<int64_t> begin;
  for (int r = 0; r <= t; ++r) begin.push_back(E * r / t);
  LocalGroup group(t, begin);
  std::vector<Shard> members;
  for (int r = 0; r < t; ++r) {
    ShardSelection sel;
    for (int64_t e = begin[r]; e < begin[r + 1]; ++e) sel.experts.push_back(e);
    sel.tp_rank = r;
    sel.tp_size = t;
    members.push_back(Open(dir, sel, 3));
    ASSERT_TRUE(members[r].model);
  }
  // Without its group a member's shard does not step; with another member's it is refused.
  {
    std::vector<float> x(row);
    const std::vector<int32_t> one = {1};
    const BatchItem item{members[0].seqs[0].get(), one};
    const Status st = modeltest::OnShard(*members[0].model, &x, [&](float* dx) {
      return members[0].model->ForwardLayers({&item, 1}, dx);
    });
    EXPECT_EQ(st.code(), Code::kFailedPrecondition) << st.ToString();
    EXPECT_EQ(members[0].seqs[0]->next_pos(), 0);
    const Status wrong = members[0].model->SetTensorParallel(group.member(1));
    EXPECT_NE(wrong.ToString().find("member 1 of 2 for a cuda shard uploaded for member 0 of 2"),
              std::string::npos)
        << wrong.ToString();
  }
  for (int r = 0; r < t; ++r)
    ASSERT_TRUE(members[r].model->SetTensorParallel(group.member(r)).ok());

  ExpectMembersEqualSingle(single, members, [](uint64_t) {});
  // Every layer of every device step (3 prefill, 3 decode) gathered 4 times: the o_lora outputs,
  // wo_b's rows, the shared expert's mid, then its output rows with the routed outputs.
  EXPECT_EQ(group.gathers(), (3 + 3) * cfg.num_hidden_layers * 4);
}

// The same over NCCL (CommTpGroup, the worker's): every gather's pieces go device to device
// (AllGatherInPlace, joined by CopyRowPieces), in the emulation over tests/gpu/emu/nccl.h and
// on a GPU machine with one GPU a member.
TEST(CudaTensorParallel, OverNcclPiecesGoDeviceToDeviceAndEqualTheSingleDeviceShard) {
  if (cuda::DeviceCount() == 0) GTEST_SKIP() << "no CUDA device";
  if (cuda::DeviceDescription(0) != "CPU emulation" && cuda::DeviceCount() < 2)
    GTEST_SKIP() << "needs 2 CUDA devices (NCCL: one rank per GPU)";
  const std::string& dir = modeltest::PresetDir("tiny");
  constexpr int t = 2;
  Shard single = Open(dir, {}, 3);
  ASSERT_TRUE(single.model);
  const ModelConfig& cfg = single.model->config();
  const int64_t E = cfg.n_routed_experts;
  std::vector<int64_t> begin;
  for (int r = 0; r <= t; ++r) begin.push_back(E * r / t);
  std::vector<std::unique_ptr<net::NcclCommunicator>> comms = NcclGroupInProcess(t, "m");
  ASSERT_EQ(comms.size(), static_cast<size_t>(t));
  std::vector<std::unique_ptr<CommTpGroup>> groups;
  std::vector<Shard> members;
  for (int r = 0; r < t; ++r) {
    const int device = r % cuda::DeviceCount();
    groups.push_back(std::make_unique<CommTpGroup>(comms[r].get(), begin, std::chrono::seconds(60)));
    ASSERT_TRUE(groups[r]->device_buffers());
    ShardSelection sel;
    for (int64_t e = begin[r]; e < begin[r + 1]; ++e) sel.experts.push_back(e);
    sel.tp_rank = r;
    sel.tp_size = t;
    members.push_back(Open(dir, sel, 3, device));
    ASSERT_TRUE(members[r].model);
    ASSERT_TRUE(members[r].model->SetTensorParallel(groups[r].get()).ok());
  }
  ExpectMembersEqualSingle(single, members, [&](uint64_t step) {
    for (auto& g : groups) g->SetStep(step);
  });
  for (auto& g : groups) EXPECT_GT(g->bytes_sent(), 0u);
}

}  // namespace
}  // namespace fm
