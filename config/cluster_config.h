// The cluster YAML (docs/operations.md "The cluster YAML"; examples in configs/): parsed with
// yaml-cpp and validated completely before anything starts. Every error carries
// "file:line:col" of the offending node and names the key, e.g.
// "gb10x2.yaml:7:5: nodes[1].memory_gib: expected a number, got 'lots'".
//
//   model: DIR                       required; relative paths resolve against the YAML's dir
//   coordinator: { listen: H:P, http: H:P }   listen required; http (OpenAI API) optional
//   parallel: auto | { pipeline_stages: S, expert_parallel: K | tensor_parallel: T }  default auto
//   transport: tcp | nccl            default tcp
//   activation_dtype: f32 | bf16     stage-to-stage frames; default f32 (bit-exact)
//   nodes: [ { name, control: H:P, data: H:P, device: cpu | cuda:N, memory_gib,
//              profile: gb10 | h200 | cpu | { name: NAME, FIELD: value, ... } }, ... ]  required;
//          profile (hardware_profile.h) defaults to cpu for device cpu, gb10 for cuda:N
//   limits: { max_batch: 16, max_context: 8192, kv_cache_gib: 0, max_queue: 64, max_tokens: 4096,
//             max_streams_per_client: 64, write_stall_timeout_s: 60 }
//   security: { token_file, cluster_secret_file, tls: { cert, key, ca }, insecure,
//               encrypt_data_plane }                                         all optional
//   heartbeat: { interval_ms: 1000, timeout_ms: 5000 }                       optional
#pragma once
#include <algorithm>
#include <chrono>
#include <cstdint>
#include <optional>
#include <string>
#include <vector>

#include "common/status.h"
#include "config/hardware_profile.h"

namespace fm {

struct HostPort {
  std::string host;  // name, IPv4, or IPv6 without brackets
  uint16_t port = 0;
  std::string ToString() const;  // "host:port" ("[v6]:port" for IPv6)
};
// "host:port" / "[v6]:port"; port 1..65535 (0 only when allow_zero). Errors say what is wrong.
Result<HostPort> ParseHostPort(const std::string& s, bool allow_zero = false);
// localhost, ::1, or an IPv4 address in 127.0.0.0/8 (not a name that merely starts "127.").
bool IsLoopback(const std::string& host);
// "cpu" -> -1, "cuda:N" -> N (N of at most 3 digits); anything else an error that quotes it.
Result<int> ParseDevice(const std::string& device);

enum class TransportKind { kTcp, kNccl };
const char* TransportKindName(TransportKind t);  // "tcp" / "nccl"

struct NodeConfig {
  std::string name;
  HostPort control;       // worker control gRPC
  HostPort data;          // data plane listen address
  std::string device;     // "cpu" or "cuda:N" as written
  int cuda_device = -1;   // N of cuda:N; -1 for cpu
  double memory_gib = 0;  // memory the worker may use for weights + KV (GiB)
  HardwareProfile profile = *BuiltinHardwareProfile("cpu");  // for the cost model
  int line = 0;           // 1-based line of this node in the YAML (for later error messages)
};

struct ParallelConfig {
  bool automatic = true;       // "auto": the planner chooses (see planner.h)
  int pipeline_stages = 0;     // when !automatic: >= 1
  int expert_parallel = 1;     // when !automatic: >= 1
  int tensor_parallel = 1;     // when !automatic: >= 1; not with expert_parallel > 1
};

// The largest limits accepted (YAML and `serve` flags alike): max_context travels as int32
// (worker.proto); max_batch x max_context bounds a step's rows and the plan's KV sums.
constexpr int64_t kMaxBatchLimit = 4096;
constexpr int64_t kMaxContextLimit = 2147483647;
// Sizes and durations past these are typos (and would overflow their byte or nanosecond
// counts): memory in GiB (1 PiB), the write-stall timeout in s and heartbeat times in ms
// (a day).
constexpr double kMaxMemoryGib = 1 << 20;
constexpr int64_t kMaxWriteStallTimeoutS = 86400;
constexpr int64_t kMaxHeartbeatMs = 86400 * 1000;

struct LimitsConfig {
  int64_t max_batch = 16;      // sequences decoded together (whole cluster)
  int64_t max_context = 8192;  // tokens per sequence (prompt + generated)
  double kv_cache_gib = 0;     // KV budget per worker; 0: none (the planner reserves what
                               // max_batch sequences at max_context take, and max_batch bounds it)
  int64_t max_queue = 64;      // waiting requests before new ones are refused
  int64_t max_tokens = 4096;   // max new tokens per request (<= max_context)
  int64_t max_step_tokens = 2048;   // rows of one micro-batch; longer prompts go in chunks of it
  int64_t max_streams_per_client = 64;   // concurrent generations of one API client
  double write_stall_timeout_s = 60;     // a gRPC stream whose client reads nothing this long ends
};

struct TlsConfig {
  std::string cert, key, ca;   // resolved paths; all three set or none
  bool enabled() const { return !cert.empty(); }
};

struct SecurityConfig {
  std::string token_file;           // API bearer tokens; "" = no API auth
  std::string cluster_secret_file;  // signs control RPCs + data plane; "" = loopback only
  TlsConfig tls;                    // gRPC TLS; disabled when absent
  // Without a cluster secret every listener must be on loopback unless this is true (a
  // trusted network; the daemons warn at start).
  bool insecure = false;
  // AES-256-GCM on every data-plane frame (needs the secret); without it frames carry an
  // HMAC tag only (authenticated, readable on the wire).
  bool encrypt_data_plane = false;
};

struct HeartbeatConfig {
  int64_t interval_ms = 1000;
  int64_t timeout_ms = 5000;   // a worker silent this long is marked dead (> interval_ms)

  // How often the coordinator polls each worker: the interval, but at least four polls within
  // the timeout so one lost poll does not mark a worker dead.
  std::chrono::milliseconds period() const {
    return std::min(std::chrono::milliseconds(interval_ms), std::chrono::milliseconds(timeout_ms) / 4);
  }
};

struct CoordinatorConfig {
  HostPort listen;                 // gRPC API
  std::optional<HostPort> http;    // HTTP API (OpenAI-compatible, /health, /metrics); none when unset
};

struct ClusterConfig {
  std::string path;            // the YAML file as given
  std::string model;           // checkpoint directory, resolved
  std::string model_where;     // "file:line:col" of `model:` (for errors about the directory)
  CoordinatorConfig coordinator;
  ParallelConfig parallel;
  TransportKind transport = TransportKind::kTcp;
  std::string activation_dtype = "f32";  // f32: distributed == single process, bit for bit
  std::vector<NodeConfig> nodes;
  LimitsConfig limits;
  SecurityConfig security;
  HeartbeatConfig heartbeat;

  const NodeConfig* FindNode(const std::string& name) const;  // nullptr if absent
};

// Reads and validates the YAML file.
Result<ClusterConfig> LoadClusterConfig(const std::string& path);
// Same from text; `origin` names the file in messages, relative paths resolve against base_dir.
Result<ClusterConfig> ParseClusterConfig(const std::string& yaml_text, const std::string& origin,
                                         const std::string& base_dir);
// The data-plane secret from security.cluster_secret_file (trailing whitespace/newline
// stripped); "" when no file is configured. An empty or unreadable file is an error.
Result<std::string> ReadClusterSecret(const ClusterConfig& cfg);

}  // namespace fm
