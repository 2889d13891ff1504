#include "coordinator/cluster.h"

#include <grpcpp/grpcpp.h>

#include <random>

#include "common/log.h"
#include "rpc/control_auth.h"
#include "rpc/grpc_status.h"

namespace fm {
namespace {

using flashmesh::v1::NodeState;
constexpr auto kLoadTimeout = std::chrono::minutes(10);
// After a failed LoadShard the next waits 0.5 s, doubling per failure, at most 8 s.
constexpr auto kLoadBackoff = std::chrono::milliseconds(500);
constexpr auto kMaxLoadBackoff = std::chrono::milliseconds(8000);

// The same shard, apart from the per-load NCCL ids.
bool SameShard(flashmesh::v1::ShardSpec a, flashmesh::v1::ShardSpec b) {
  for (auto* s : {&a, &b}) {
    s->clear_nccl_unique_id();
    s->clear_next_nccl_id();
    s->clear_prev_nccl_id();
  }
  return CanonicalBytes(a) == CanonicalBytes(b);
}

uint64_t UnixMillis() {
  return static_cast<uint64_t>(std::chrono::duration_cast<std::chrono::milliseconds>(
                                   std::chrono::system_clock::now().time_since_epoch())
                                   .count());
}

uint64_t RandomEpoch() {
  std::random_device rd;
  return (static_cast<uint64_t>(rd()) << 32) | rd() | 1;
}

}  // namespace

NodeHandle::NodeHandle(const WorkerPlan& plan, std::string control, std::string data,
                       flashmesh::v1::ShardSpec spec, const ClusterOptions& options,
                       uint64_t term)
    : plan_(plan), control_(std::move(control)), data_(std::move(data)), spec_(std::move(spec)) {
  // Reconnects quickly after a worker restarts under the same address.
  stub_ = flashmesh::v1::Worker::NewStub(NewWorkerChannel(
      control_, plan_.node, WorkerChannelArgs(), options.cluster_secret, term,
      options.worker_credentials));
}

NodeState NodeHandle::state() const {
  std::lock_guard<std::mutex> lock(mu_);
  return state_;
}

std::string NodeHandle::error() const {
  std::lock_guard<std::mutex> lock(mu_);
  return error_;
}

double NodeHandle::heartbeat_age_s() const {
  std::lock_guard<std::mutex> lock(mu_);
  if (!ever_ok_) return -1;
  return std::chrono::duration<double>(std::chrono::steady_clock::now() - last_ok_).count();
}

Cluster::Cluster(const Plan& plan, const std::vector<std::pair<std::string, std::string>>& addresses,
                 const ClusterOptions& options)
    : options_(options),
      checkpoint_(options.model_dir),
      num_stages_(plan.pipeline_stages),
      expert_parallel_(plan.expert_parallel),
      stage_group_(plan.group()),
      tensor_parallel_(plan.tensor_parallel),
      epoch_(RandomEpoch()),
      term_(options.term ? options.term : UnixMillis()) {
  for (size_t i = 0; i < plan.workers.size(); ++i) {
    const WorkerPlan& w = plan.workers[i];
    flashmesh::v1::ShardSpec spec;
    spec.set_model_dir(options.model_dir);
    spec.set_stage(w.stage);
    spec.set_num_stages(plan.pipeline_stages);
    spec.set_layer_begin(static_cast<int32_t>(w.layer_begin));
    spec.set_layer_end(static_cast<int32_t>(w.layer_end));
    spec.set_embed(w.embed);
    spec.set_head(w.head);
    const size_t k = static_cast<size_t>(plan.group());
    if (k > 1)
      for (int64_t e = w.expert_begin; e < w.expert_end; ++e) spec.add_experts(static_cast<int32_t>(e));
    // The data plane: member r of stage s hands its manifolds to member r of stage s+1 (with
    // tensor parallelism every member holds every row, so each hop carries them all).
    if (i + k < plan.workers.size()) {
      spec.set_next_node(plan.workers[i + k].node);
      spec.set_next_data(addresses[i + k].second);
    }
    if (i >= k) spec.set_prev_node(plan.workers[i - k].node);
    const bool tp = plan.tensor_parallel > 1;
    const int member = tp ? w.tp_rank : w.ep_rank;
    if (k > 1) {
      // The stage's EP (or TP) group, in rank order, and every member's expert range.
      const size_t first = i - static_cast<size_t>(member);
      spec.set_ep_rank(member);
      if (tp) spec.set_tensor_parallel(plan.tensor_parallel);
      for (size_t m = first; m < first + k; ++m) {
        spec.add_ep_nodes(plan.workers[m].node);
        spec.add_ep_data(addresses[m].second);
        spec.add_ep_expert_begin(plan.workers[m].expert_begin);
      }
      spec.add_ep_expert_begin(plan.workers[first + k - 1].expert_end);
      if (options.nccl) spec.set_ep_transport(flashmesh::v1::TRANSPORT_NCCL);
    }
    if (options.nccl && plan.pipeline_stages > 1)
      spec.set_stage_transport(flashmesh::v1::TRANSPORT_NCCL);
    // NCCL needs every node on a GPU (the YAML is checked for it).
    const int device = i < options.cuda_devices.size() ? options.cuda_devices[i] : -1;
    if (device >= 0) spec.set_cuda_device(device);
    spec.set_activation_dtype(options.activation_dtype == "bf16"
                                  ? flashmesh::v1::ACTIVATION_DTYPE_BF16
                                  : flashmesh::v1::ACTIVATION_DTYPE_F32);
    spec.set_max_context(static_cast<int32_t>(options.max_context));
    spec.set_max_step_rows(options.max_step_rows);
    spec.set_kv_cache_bytes(options.kv_cache_bytes);
    spec.set_epoch(epoch_);
    nodes_.push_back(std::make_unique<NodeHandle>(w, addresses[i].first, addresses[i].second, spec,
                                                  options, term_));
    nodes_.back()->index_ = static_cast<int>(i);
    // The scheduler sees a TP group as one member (every worker gets every item) whose rank 0
    // samples; each EP member samples its own sequences.
    infos_.push_back({w.node, addresses[i].first, tp ? 0 : w.ep_rank, w.head && (!tp || member == 0)});
  }
  // transport nccl: the EP groups and the stage hops are NCCL communicators, which cannot take
  // a restarted member back. Without hops each stage's EP group loads on its own; with hops
  // they chain every worker together, so the whole cluster is one group loaded together.
  const size_t k = static_cast<size_t>(plan.group());
  const bool hops = plan.pipeline_stages > 1;
  if (options.nccl && (k > 1 || hops)) {
    const size_t size = hops ? nodes_.size() : k;
    for (size_t first = 0; first + size <= nodes_.size(); first += size) {
      auto g = std::make_unique<NcclGroup>();
      for (size_t m = first; m < first + size; ++m) g->members.push_back(nodes_[m].get());
      nccl_groups_.push_back(std::move(g));
    }
  }
}

Cluster::~Cluster() {
  {
    std::lock_guard<std::mutex> lock(stop_mu_);
    stop_ = true;
  }
  stop_cv_.notify_all();
  for (auto& n : nodes_) {
    std::lock_guard<std::mutex> lock(n->mu_);
    if (n->loading_) n->loading_->TryCancel();
  }
  for (auto& t : threads_) t.join();
}

void Cluster::Start() {
  for (auto& n : nodes_) threads_.emplace_back([this, node = n.get()] { Heartbeat(node); });
}

NodeHandle* Cluster::Find(const std::string& name) const {
  for (const auto& n : nodes_)
    if (n->name() == name) return n.get();
  return nullptr;
}

namespace {

Status NotReady(const NodeHandle& n, NodeState s) {
  std::string what = s == flashmesh::v1::NODE_STATE_DOWN       ? "is down"
                     : s == flashmesh::v1::NODE_STATE_LOADING  ? "is loading its shard"
                     : s == flashmesh::v1::NODE_STATE_DRAINING ? "is draining"
                                                               : "has not answered yet";
  std::string err = n.error();
  return Unavailable("node " + n.name() + " (" + n.control() + ") " + what +
                     (err.empty() ? "" : ": " + err));
}

}  // namespace

Status Cluster::SteppedDown() const {
  if (!stepped_down_) return Status::Ok();
  std::lock_guard<std::mutex> lock(step_down_mu_);
  return Unavailable("this coordinator (term " + std::to_string(term_) + ") stepped down: " +
                     step_down_reason_);
}

Status Cluster::Ready() const {
  FM_RETURN_IF_ERROR(SteppedDown());
  for (const auto& n : nodes_)
    if (NodeState s = n->state(); s != flashmesh::v1::NODE_STATE_UP) return NotReady(*n, s);
  return Status::Ok();
}

Status Cluster::Running() const {
  // The workers follow the newer coordinator: steps of this one would only be refused (and
  // read as nodes that do not answer).
  FM_RETURN_IF_ERROR(SteppedDown());
  for (const auto& n : nodes_)
    if (NodeState s = n->state(); s != flashmesh::v1::NODE_STATE_UP && s != flashmesh::v1::NODE_STATE_DRAINING)
      return NotReady(*n, s);
  return Status::Ok();
}

bool Cluster::serving(int worker) const {
  const auto state = nodes_[worker]->state();
  return state == flashmesh::v1::NODE_STATE_UP || state == flashmesh::v1::NODE_STATE_DRAINING;
}

void Cluster::MarkDown(int worker, const std::string& why) {
  if (stepped_down_) return;  // a refusal of the newer term is no fault of the node (worker_set.h)
  NodeHandle* node = nodes_[worker].get();
  if (node->state() == flashmesh::v1::NODE_STATE_DOWN) return;   // keep the first cause
  // A failed RPC's message names the node already (cluster_rpc.cpp), and NotReady names it
  // before the cause: once is enough ("node w1 (ADDR) is down: did not answer in time").
  std::string cause = why;
  const std::string named = "node " + node->name() + " (" + node->control() + ") ";
  if (size_t at = cause.find(named); at != std::string::npos) {
    cause.erase(at, named.size());
    if (cause.compare(at, 16, "is unavailable: ") == 0) cause.erase(at, 16);
  }
  SetState(node, flashmesh::v1::NODE_STATE_DOWN, cause);
}

void Cluster::SetState(NodeHandle* node, NodeState state, const std::string& error) {
  NodeState before;
  {
    std::lock_guard<std::mutex> lock(node->mu_);
    if (stepped_down_) return;   // StepDown left it unknown; a late heartbeat or load changes nothing
    before = node->state_;
    node->state_ = state;
    node->error_ = error;
  }
  if (before == state) return;
  if (state == flashmesh::v1::NODE_STATE_DOWN) {
    FM_LOG(kWarn, "coordinator") << "node " << node->name() << " down: " << error;
  } else if (state == flashmesh::v1::NODE_STATE_UP) {
    FM_LOG(kInfo, "coordinator") << "node " << node->name() << " up (stage " << node->plan().stage
                                 << ", layers [" << node->plan().layer_begin << ", "
                                 << node->plan().layer_end << "))";
  } else if (state == flashmesh::v1::NODE_STATE_DRAINING) {
    FM_LOG(kInfo, "coordinator") << "node " << node->name() << " draining: it takes no new sequence";
  }
  if (listener_) listener_();
}

void Cluster::StepDown(const std::string& why) {
  {
    std::lock_guard<std::mutex> lock(step_down_mu_);
    if (stepped_down_) return;
    step_down_reason_ = why;
    stepped_down_ = true;
  }
  FM_LOG(kError, "coordinator") << "stepping down (term " << term_ << "): " << why
                                << "; this coordinator no longer loads or steps any worker";
  // Its heartbeats end here, so what it saw of each node only ages: its status, `health
  // --node` and node_up say "unknown" rather than vouch for a node it no longer watches.
  // stepped_down_ is set first: SetState (under the node's lock) changes nothing after it.
  for (const auto& n : nodes_) {
    std::lock_guard<std::mutex> lock(n->mu_);
    n->state_ = flashmesh::v1::NODE_STATE_UNSPECIFIED;
    n->error_ = "not watched: this coordinator (term " + std::to_string(term_) + ") stepped down";
  }
  if (listener_) listener_();
}

void Cluster::LoadNode(NodeHandle* node, const flashmesh::v1::ShardSpec& spec) {
  SetState(node, flashmesh::v1::NODE_STATE_LOADING, "");
  flashmesh::v1::LoadShardRequest lreq;
  *lreq.mutable_shard() = spec;
  for (const FileFingerprint& f : checkpoint_.Expected(node->name())) {
    flashmesh::v1::FileFingerprint* e = lreq.add_expect_files();
    e->set_name(f.name);
    e->set_size(f.size);
    e->set_crc32c(f.crc32c);
    e->set_source(f.source);
    e->set_path(f.path);
    e->set_holder(f.holder);
  }
  flashmesh::v1::LoadShardResponse lresp;
  grpc::ClientContext lctx;
  lctx.set_deadline(std::chrono::system_clock::now() + kLoadTimeout);
  {
    std::lock_guard<std::mutex> lock(node->mu_);
    if (stop_) return;
    node->loading_ = &lctx;   // the destructor cancels it: a stop never waits for a load
    node->accepted_ = false;
  }
  grpc::Status ls = node->stub()->LoadShard(&lctx, lreq, &lresp);
  {
    std::lock_guard<std::mutex> lock(node->mu_);
    node->loading_ = nullptr;
  }
  if (ls.ok()) {
    std::vector<FileFingerprint> files;
    for (const auto& f : lresp.files()) files.push_back({f.name(), f.size(), f.crc32c(), "", "", ""});
    if (Status same = checkpoint_.Admit(node->name(), lresp.model_dir(), std::move(files)); !same.ok()) {
      FailLoad(node, "LoadShard refused", same.message());
      return;
    }
    vocab_size_ = lresp.vocab_size();
    {
      std::lock_guard<std::mutex> lock(node->mu_);
      node->load_failures_ = 0;
      node->accepted_ = true;
    }
    // A drained worker stays drained through the load: nothing is admitted for it meanwhile.
    SetState(node, lresp.draining() ? flashmesh::v1::NODE_STATE_DRAINING : flashmesh::v1::NODE_STATE_UP, "");
  } else if (ls.error_code() == grpc::StatusCode::FAILED_PRECONDITION) {
    StepDown("node " + node->name() + " refused LoadShard: " + ls.error_message());
  } else {
    checkpoint_.Forget(node->name());   // it holds no admitted load now (checkpoint_refs.h)
    FailLoad(node, "LoadShard failed", ls.error_message());
  }
}

std::chrono::milliseconds Cluster::FailLoad(NodeHandle* node, const std::string& what,
                                           const std::string& why) {
  std::chrono::milliseconds backoff;
  int failures = 0;
  {
    std::lock_guard<std::mutex> lock(node->mu_);
    backoff = std::min<std::chrono::milliseconds>(
        kLoadBackoff * (1 << std::min(node->load_failures_, 5)), kMaxLoadBackoff);
    failures = ++node->load_failures_;
    node->next_load_ = std::chrono::steady_clock::now() + backoff;
  }
  // The node is named before its error already ("node w1 (ADDR) is down: ..."): not again in
  // the worker's own wording of it ("node w1: ...", "node w1 loading its shard: ...").
  std::string cause = why;
  for (const std::string& named : {"node " + node->name() + ": ", "node " + node->name() + " "})
    if (cause.rfind(named, 0) == 0) {
      cause.erase(0, named.size());
      break;
    }
  SetState(node, flashmesh::v1::NODE_STATE_DOWN,
           what + " (" + std::to_string(failures) + " in a row, next in " +
               std::to_string(backoff.count()) + " ms): " + cause);
  return backoff;
}

Cluster::NcclGroup* Cluster::GroupOf(const NodeHandle* node) const {
  for (const auto& g : nccl_groups_)
    for (const NodeHandle* m : g->members)
      if (m == node) return g.get();
  return nullptr;
}

Result<std::string> Cluster::NewNcclId(NodeHandle* root, const std::string& what) {
  flashmesh::v1::NewNcclIdRequest ireq;
  flashmesh::v1::NewNcclIdResponse iresp;
  grpc::ClientContext ictx;
  ictx.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(10));
  grpc::Status is = root->stub()->NewNcclId(&ictx, ireq, &iresp);
  if (!is.ok())
    return Unavailable("NewNcclId on " + root->name() + " (" + what + "): " + is.error_message());
  return iresp.unique_id();
}

void Cluster::LoadNcclGroup(NcclGroup* group, uint64_t seen) {
  std::lock_guard<std::mutex> lock(group->mu);
  if (group->generation != seen) return;   // loaded again meanwhile; the next beat looks anew
  // Odd from here to the end: a member's health answer asked before the load ended must not
  // mark it UP while it loads (Heartbeat compares the generation it saw).
  ++group->generation;
  struct End {
    std::atomic<uint64_t>* generation;
    ~End() { ++*generation; }
  } end{&group->generation};
  // A member that cannot give an id is the one at fault; every member waits out its backoff
  // (each one's heartbeat would start the group's load again).
  auto no_id = [&](NodeHandle* root, const Status& why) {
    const auto backoff = FailLoad(root, "no NCCL id for its group's load", why.message());
    for (NodeHandle* m : group->members) {
      std::lock_guard<std::mutex> l(m->mu_);
      m->next_load_ = std::max(m->next_load_, std::chrono::steady_clock::now() + backoff);
    }
  };
  // A fresh id for every communicator among the members: each stage's EP group (from its
  // rank 0) and each hop (from its sending worker, into its next_nccl_id and the receiver's
  // prev_nccl_id). Members are stage-major, so the hop from member i goes to member i + k.
  const size_t n = group->members.size(), k = static_cast<size_t>(stage_group_);
  std::vector<flashmesh::v1::ShardSpec> specs;
  for (NodeHandle* m : group->members) specs.push_back(m->spec());
  for (size_t i = 0; i < n; ++i) {
    if (k > 1 && i % k == 0) {
      Result<std::string> id = NewNcclId(group->members[i], "its EP group's rank 0");
      if (!id.ok()) return no_id(group->members[i], id.status());
      for (size_t m = i; m < i + k; ++m) specs[m].set_nccl_unique_id(*id);
    }
    if (specs[i].stage_transport() == flashmesh::v1::TRANSPORT_NCCL && i + k < n) {
      Result<std::string> id = NewNcclId(group->members[i], "the hop to the next stage");
      if (!id.ok()) return no_id(group->members[i], id.status());
      specs[i].set_next_nccl_id(*id);
      specs[i + k].set_prev_nccl_id(*id);
    }
  }
  FM_LOG(kInfo, "coordinator") << "loading the NCCL group of " << n << " workers (from "
                               << group->members.front()->name() << ") with fresh ids";
  // Together: the members meet in the communicators' first exchanges.
  std::vector<std::thread> loads;
  for (size_t i = 0; i < n; ++i)
    loads.emplace_back([this, m = group->members[i], spec = specs[i]] { LoadNode(m, spec); });
  for (auto& t : loads) t.join();
}

void Cluster::Heartbeat(NodeHandle* node) {
  const auto rpc_timeout = std::min<std::chrono::milliseconds>(options_.down_after / 2,
                                                               std::chrono::milliseconds(1000));
  NcclGroup* group = GroupOf(node);
  while (!stop_ && !stepped_down_) {
    const uint64_t seen = group ? group->generation.load() : 0;
    bool accepted = false;   // read before Health: a load that ends meanwhile shows next beat
    {
      std::lock_guard<std::mutex> lock(node->mu_);
      accepted = node->accepted_;
    }
    flashmesh::v1::HealthRequest req;
    flashmesh::v1::HealthResponse resp;
    grpc::ClientContext ctx;
    const auto asked = std::chrono::steady_clock::now();
    ctx.set_deadline(std::chrono::system_clock::now() + rpc_timeout);
    grpc::Status s = node->stub()->Health(&ctx, req, &resp);
    auto now = std::chrono::steady_clock::now();
    // A group load ran when this was asked, or began since: the answer predates its end.
    auto predates_group_load = [&] { return group && (seen % 2 == 1 || group->generation != seen); };
    if (s.ok()) {
      {
        std::lock_guard<std::mutex> lock(node->mu_);
        node->ever_ok_ = true;
        node->last_ok_ = now;
      }
      if (resp.term() > term_) {
        StepDown("node " + node->name() + " follows the newer term " + std::to_string(resp.term()));
      } else if (resp.node() != node->name()) {
        SetState(node, flashmesh::v1::NODE_STATE_DOWN,
                 "the worker at " + node->control() + " says it is node '" + resp.node() + "'");
      } else if (!resp.loaded() || resp.epoch() != epoch_ || !SameShard(resp.shard(), node->spec()) ||
                 !accepted) {
        // Not ours (restarted, another coordinator's, loaded out of band with another shard, or
        // refused for its checkpoint): load ours, no sooner than the backoff after a failed load.
        // Whatever it loaded before is no reference for the other nodes' loads meanwhile (unless
        // the answer predates the end of a group load, which may have admitted it since).
        if ((!resp.loaded() || resp.epoch() != epoch_) && !predates_group_load())
          checkpoint_.Forget(node->name());
        if (resp.loaded() && resp.epoch() == epoch_ && accepted) {
          FM_LOG(kWarn, "coordinator") << "node " << node->name() << " holds another shard than the plan's: reloading";
        }
        bool due = false;
        {
          std::lock_guard<std::mutex> lock(node->mu_);
          due = now >= node->next_load_;
        }
        if (due) {
          if (group) {
            LoadNcclGroup(group, seen);
          } else {
            LoadNode(node, node->spec());
          }
        }
      } else if (predates_group_load()) {
        // Not marked UP on an answer older than the group's load.
      } else {
        SetState(node, resp.draining() ? flashmesh::v1::NODE_STATE_DRAINING : flashmesh::v1::NODE_STATE_UP, "");
        if (held_listener_)
          held_listener_(node->index_, std::vector<uint64_t>(resp.seq_ids().begin(), resp.seq_ids().end()), asked);
      }
    } else if (s.error_code() == grpc::StatusCode::DEADLINE_EXCEEDED &&
               stall_watch_.StalledAround(asked + rpc_timeout).count() > 0) {
      // It ran out of time while this coordinator was not running (paused, starved), which says
      // nothing of the node; its next beat does.
      FM_LOG(kWarn, "coordinator") << "the heartbeat of node " << node->name()
                                   << " ran out of time while this coordinator did not run; not counted";
    } else if (s.error_code() == grpc::StatusCode::UNAUTHENTICATED) {
      // It answers but not to us: another cluster secret (or not a worker of this cluster).
      SetState(node, flashmesh::v1::NODE_STATE_DOWN, "refuses this coordinator's calls: " + s.error_message());
    } else {
      bool ever_ok;
      std::chrono::steady_clock::time_point last_ok;
      {
        std::lock_guard<std::mutex> lock(node->mu_);
        ever_ok = node->ever_ok_;
        last_ok = node->last_ok_;
      }
      if (!ever_ok) {
        std::lock_guard<std::mutex> lock(node->mu_);
        if (!stepped_down_) node->error_ = s.error_message();   // as SetState: StepDown's stays
      } else if (now - last_ok >= options_.down_after) {
        SetState(node, flashmesh::v1::NODE_STATE_DOWN,
                 "no heartbeat for " +
                     std::to_string(std::chrono::duration_cast<std::chrono::milliseconds>(now - last_ok).count()) +
                     " ms: " + s.error_message());
      }
    }
    std::unique_lock<std::mutex> lock(stop_mu_);
    stop_cv_.wait_for(lock, options_.heartbeat_interval, [&] { return stop_.load(); });
  }
}

}  // namespace fm
