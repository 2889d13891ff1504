// Cluster YAML parsing and validation (cluster_config.h). yaml-cpp gives every node a Mark
// (0-based line/column); each error is "file:line:col: key.path: what is wrong".
#include "config/cluster_config.h"

#include <yaml-cpp/yaml.h>

#include <arpa/inet.h>

#include <algorithm>
#include <cctype>
#include <cmath>
#include <filesystem>
#include <fstream>
#include <iomanip>
#include <limits>
#include <map>
#include <set>
#include <sstream>

#include "common/file.h"

namespace fm {

bool IsLoopback(const std::string& host) {
  if (host == "localhost" || host == "::1") return true;
  in_addr a{};
  return inet_pton(AF_INET, host.c_str(), &a) == 1 && (ntohl(a.s_addr) >> 24) == 127;
}

namespace {

namespace fs = std::filesystem;

class Parser {
 public:
  Parser(std::string origin, std::string base_dir)
      : origin_(std::move(origin)), base_dir_(std::move(base_dir)) {}

  std::string Where(const YAML::Node& n) const {
    const YAML::Mark m = n.Mark();
    if (m.is_null()) return origin_;
    return origin_ + ":" + std::to_string(m.line + 1) + ":" + std::to_string(m.column + 1);
  }
  int Line(const YAML::Node& n) const { return n.Mark().is_null() ? 0 : n.Mark().line + 1; }
  Status Error(const YAML::Node& at, const std::string& path, const std::string& msg) const {
    return InvalidArgument(Where(at) + ": " + path + ": " + msg);
  }

  // Checks that `map` is a mapping whose keys are all in `allowed`, none repeated.
  Status Keys(const YAML::Node& map, const std::string& path,
              const std::vector<std::string>& allowed) const {
    if (!map.IsMap()) return Error(map, path, "expected a mapping");
    std::set<std::string> seen;
    for (auto it = map.begin(); it != map.end(); ++it) {
      const YAML::Node key = it->first;   // a copy: it-> is a proxy that dies here
      if (!key.IsScalar()) return Error(key, path, "keys must be plain names");
      const std::string k = key.Scalar();
      const std::string kp = path.empty() ? k : path + "." + k;
      if (std::find(allowed.begin(), allowed.end(), k) == allowed.end()) {
        std::string list;
        for (const auto& a : allowed) list += (list.empty() ? "" : ", ") + a;
        return Error(key, kp, "unknown key (allowed: " + list + ")");
      }
      if (!seen.insert(k).second) return Error(key, kp, "duplicate key");
    }
    return Status::Ok();
  }

  // map[key], or an error at the map when it is missing.
  Result<YAML::Node> Required(const YAML::Node& map, const std::string& path,
                              const std::string& key) const {
    YAML::Node n = map[key];
    if (!n.IsDefined() || n.IsNull())
      return Error(map, Join(path, key), "missing required field");
    return n;
  }

  static std::string Join(const std::string& path, const std::string& key) {
    return path.empty() ? key : path + "." + key;
  }

  Result<std::string> String(const YAML::Node& n, const std::string& path) const {
    if (!n.IsScalar()) return Error(n, path, "expected a string");
    if (n.Scalar().empty()) return Error(n, path, "must not be empty");
    return n.Scalar();
  }

  Result<int64_t> Int(const YAML::Node& n, const std::string& path, int64_t min,
                      int64_t max = std::numeric_limits<int64_t>::max()) const {
    int64_t v = 0;
    if (!n.IsScalar() || !YAML::convert<int64_t>::decode(n, v))
      return Error(n, path, "expected an integer, got " + Show(n));
    if (v < min) return Error(n, path, std::to_string(v) + " is below the minimum " +
                                           std::to_string(min));
    if (v > max) return Error(n, path, std::to_string(v) + " is above the maximum " +
                                           std::to_string(max));
    return v;
  }

  Result<double> Number(const YAML::Node& n, const std::string& path, bool allow_zero,
                        double max = std::numeric_limits<double>::max()) const {
    double v = 0;
    if (!n.IsScalar() || !YAML::convert<double>::decode(n, v) || !std::isfinite(v))
      return Error(n, path, "expected a number, got " + Show(n));
    if (v < 0 || (!allow_zero && v == 0)) return Error(n, path, allow_zero ? "must be >= 0" : "must be > 0");
    if (v > max) {
      std::ostringstream m;
      m << std::setprecision(15) << max;
      return Error(n, path, n.Scalar() + " is above the maximum " + m.str());
    }
    return v;
  }

  Result<HostPort> Address(const YAML::Node& n, const std::string& path) const {
    FM_ASSIGN_OR_RETURN(std::string s, String(n, path));
    Result<HostPort> hp = ParseHostPort(s);
    if (!hp.ok()) return Error(n, path, hp.status().message());
    return hp;
  }

  // A path relative to the YAML's directory, made absolute: the coordinator sends the model
  // path to workers, which may run in another directory.
  Result<std::string> Path(const YAML::Node& n, const std::string& path) const {
    FM_ASSIGN_OR_RETURN(std::string s, String(n, path));
    fs::path p(s);
    if (p.is_relative()) p = fs::path(base_dir_) / p;
    std::error_code ec;
    const fs::path abs = fs::absolute(p, ec);
    return (ec ? p : abs).lexically_normal().string();
  }

  static std::string Show(const YAML::Node& n) {
    if (n.IsScalar()) return "'" + n.Scalar() + "'";
    if (n.IsSequence()) return "a list";
    if (n.IsMap()) return "a mapping";
    return "nothing";
  }

 private:
  std::string origin_;
  std::string base_dir_;
};

// nodes[].profile: a built-in name, or { name: NAME, field: value, ... } overriding its fields.
Result<HardwareProfile> ParseProfile(const Parser& p, const YAML::Node& n, const std::string& path,
                                     const char* default_name) {
  auto builtin = [&](const YAML::Node& at, const std::string& name) -> Result<HardwareProfile> {
    Result<HardwareProfile> b = BuiltinHardwareProfile(name);
    if (!b.ok()) return p.Error(at, path, b.status().message());
    return b;
  };
  if (!n.IsDefined() || n.IsNull()) return builtin(n, default_name);
  if (n.IsScalar()) {
    FM_ASSIGN_OR_RETURN(std::string name, p.String(n, path));
    return builtin(n, name);
  }
  FM_RETURN_IF_ERROR(p.Keys(n, path, {"name", "mem_bw_gbps", "decode_efficiency", "memory_gb",
                                      "compute_tflops", "link_gbps", "link_latency_us"}));
  FM_ASSIGN_OR_RETURN(const YAML::Node name_node, p.Required(n, path, "name"));
  FM_ASSIGN_OR_RETURN(std::string name, p.String(name_node, path + ".name"));
  FM_ASSIGN_OR_RETURN(HardwareProfile prof, builtin(name_node, name));
  struct {
    const char* key;
    double* value;
    bool allow_zero;   // a latency may be 0; bandwidths, memory, compute may not
    double max;        // the efficiency is a share
  } fields[] = {{"mem_bw_gbps", &prof.mem_bw_gbps, false, 0},
                {"decode_efficiency", &prof.decode_efficiency, false, 1},
                {"memory_gb", &prof.memory_gb, false, 0},
                {"compute_tflops", &prof.compute_tflops, false, 0},
                {"link_gbps", &prof.link_gbps, false, 0},
                {"link_latency_us", &prof.link_latency_us, true, 0}};
  for (const auto& f : fields) {
    const YAML::Node v = n[f.key];
    if (!v.IsDefined()) continue;
    const std::string fp = path + "." + f.key;
    FM_ASSIGN_OR_RETURN(*f.value, p.Number(v, fp, f.allow_zero));
    if (f.max > 0 && *f.value > f.max)
      return p.Error(v, fp, "must be in (0, 1], got " + v.Scalar());
  }
  return prof;
}

Status ParseNodes(const Parser& p, const YAML::Node& list, ClusterConfig* cfg) {
  if (!list.IsSequence() || list.size() == 0)
    return p.Error(list, "nodes", "expected a non-empty list of nodes");
  std::map<std::string, int> names;  // name -> line
  for (size_t i = 0; i < list.size(); ++i) {
    const YAML::Node n = list[i];
    const std::string path = "nodes[" + std::to_string(i) + "]";
    FM_RETURN_IF_ERROR(
        p.Keys(n, path, {"name", "control", "data", "device", "memory_gib", "profile"}));
    NodeConfig node;
    node.line = p.Line(n);
    FM_ASSIGN_OR_RETURN(const YAML::Node name, p.Required(n, path, "name"));
    FM_ASSIGN_OR_RETURN(node.name, p.String(name, path + ".name"));
    for (char c : node.name)
      if (!(std::isalnum(static_cast<unsigned char>(c)) || c == '-' || c == '_' || c == '.'))
        return p.Error(name, path + ".name",
                       "'" + node.name + "': use letters, digits, '-', '_', '.'");
    if (node.name.size() > 63) return p.Error(name, path + ".name", "longer than 63 characters");
    if (auto [it, fresh] = names.emplace(node.name, node.line); !fresh)
      return p.Error(name, path + ".name",
                     "duplicate node name '" + node.name + "' (also at line " +
                         std::to_string(it->second) + ")");
    FM_ASSIGN_OR_RETURN(const YAML::Node control, p.Required(n, path, "control"));
    FM_ASSIGN_OR_RETURN(node.control, p.Address(control, path + ".control"));
    FM_ASSIGN_OR_RETURN(const YAML::Node data, p.Required(n, path, "data"));
    FM_ASSIGN_OR_RETURN(node.data, p.Address(data, path + ".data"));
    FM_ASSIGN_OR_RETURN(const YAML::Node device, p.Required(n, path, "device"));
    FM_ASSIGN_OR_RETURN(node.device, p.String(device, path + ".device"));
    Result<int> cuda = ParseDevice(node.device);
    if (!cuda.ok()) return p.Error(device, path + ".device", cuda.status().message());
    node.cuda_device = *cuda;
    FM_ASSIGN_OR_RETURN(const YAML::Node mem, p.Required(n, path, "memory_gib"));
    FM_ASSIGN_OR_RETURN(node.memory_gib, p.Number(mem, path + ".memory_gib", false, kMaxMemoryGib));
    FM_ASSIGN_OR_RETURN(node.profile, ParseProfile(p, n["profile"], path + ".profile",
                                                   DefaultProfileName(node.cuda_device)));
    cfg->nodes.push_back(std::move(node));
  }
  return Status::Ok();
}

// Two listeners clash on one port when they name the same address (localhost is 127.0.0.1),
// or when one is a wildcard (0.0.0.0, ::) and the other is on this machine too (loopback or a
// wildcard): the second to start could not bind. Other hosts are compared as written.
bool SameSocket(HostPort a, HostPort b) {
  if (a.port != b.port) return false;
  for (HostPort* hp : {&a, &b}) {
    std::transform(hp->host.begin(), hp->host.end(), hp->host.begin(), ::tolower);
    if (hp->host == "localhost") hp->host = "127.0.0.1";
  }
  auto wildcard = [](const std::string& h) { return h == "0.0.0.0" || h == "::"; };
  auto local = [&](const std::string& h) { return wildcard(h) || IsLoopback(h); };
  return a.host == b.host || (wildcard(a.host) && local(b.host)) || (wildcard(b.host) && local(a.host));
}

// No two listeners (coordinator, every node's control and data) share a socket.
Status CheckAddresses(const Parser& p, const YAML::Node& root, const ClusterConfig& cfg) {
  std::vector<std::pair<HostPort, std::string>> used;  // address, who
  auto claim = [&](const HostPort& hp, const std::string& who, const YAML::Node& at) -> Status {
    for (const auto& [other, owner] : used)
      if (SameSocket(hp, other))
        return p.Error(at, who, "address " + hp.ToString() + " is already used by " + owner +
                                    (other.host == hp.host ? "" : " (" + other.ToString() + ")"));
    used.emplace_back(hp, who);
    return Status::Ok();
  };
  FM_RETURN_IF_ERROR(claim(cfg.coordinator.listen, "coordinator.listen", root["coordinator"]["listen"]));
  if (cfg.coordinator.http)
    FM_RETURN_IF_ERROR(claim(*cfg.coordinator.http, "coordinator.http", root["coordinator"]["http"]));
  for (size_t i = 0; i < cfg.nodes.size(); ++i) {
    const std::string path = "nodes[" + std::to_string(i) + "]";
    const YAML::Node n = root["nodes"][i];
    FM_RETURN_IF_ERROR(claim(cfg.nodes[i].control, path + ".control", n["control"]));
    FM_RETURN_IF_ERROR(claim(cfg.nodes[i].data, path + ".data", n["data"]));
  }
  return Status::Ok();
}

// Without a cluster secret nothing authenticates the workers' callers and peers: every
// listener must then be on loopback, unless security.insecure says the network is trusted.
Status CheckExposure(const Parser& p, const YAML::Node& root, const ClusterConfig& cfg) {
  if (!cfg.security.cluster_secret_file.empty() || cfg.security.insecure) return Status::Ok();
  const std::string why = " is not a loopback address, and without "
                          "security.cluster_secret_file anyone who reaches it controls the "
                          "cluster (set the secret, or security.insecure: true on a trusted network)";
  auto check = [&](const HostPort& hp, const std::string& who, const YAML::Node& at) {
    return IsLoopback(hp.host) ? Status::Ok() : p.Error(at, who, hp.ToString() + why);
  };
  FM_RETURN_IF_ERROR(check(cfg.coordinator.listen, "coordinator.listen", root["coordinator"]["listen"]));
  if (cfg.coordinator.http)
    FM_RETURN_IF_ERROR(check(*cfg.coordinator.http, "coordinator.http", root["coordinator"]["http"]));
  for (size_t i = 0; i < cfg.nodes.size(); ++i) {
    const std::string path = "nodes[" + std::to_string(i) + "]";
    const YAML::Node n = root["nodes"][i];
    FM_RETURN_IF_ERROR(check(cfg.nodes[i].control, path + ".control", n["control"]));
    FM_RETURN_IF_ERROR(check(cfg.nodes[i].data, path + ".data", n["data"]));
  }
  return Status::Ok();
}

Status ParseRoot(const Parser& p, const YAML::Node& root, ClusterConfig* cfg) {
  FM_RETURN_IF_ERROR(p.Keys(root, "", {"model", "coordinator", "parallel", "transport",
                                       "activation_dtype", "nodes", "limits", "security",
                                       "heartbeat"}));
  FM_ASSIGN_OR_RETURN(const YAML::Node model, p.Required(root, "", "model"));
  FM_ASSIGN_OR_RETURN(cfg->model, p.Path(model, "model"));
  cfg->model_where = p.Where(model);

  FM_ASSIGN_OR_RETURN(const YAML::Node coord, p.Required(root, "", "coordinator"));
  FM_RETURN_IF_ERROR(p.Keys(coord, "coordinator", {"listen", "http"}));
  FM_ASSIGN_OR_RETURN(const YAML::Node listen, p.Required(coord, "coordinator", "listen"));
  FM_ASSIGN_OR_RETURN(cfg->coordinator.listen, p.Address(listen, "coordinator.listen"));
  if (const YAML::Node http = coord["http"]; http.IsDefined() && !http.IsNull()) {
    FM_ASSIGN_OR_RETURN(cfg->coordinator.http, p.Address(http, "coordinator.http"));
  }

  if (const YAML::Node par = root["parallel"]; par.IsDefined() && !par.IsNull()) {
    if (par.IsScalar()) {
      if (par.Scalar() != "auto")
        return p.Error(par, "parallel", "'" + par.Scalar() +
                                            "': want auto or {pipeline_stages, expert_parallel | tensor_parallel}");
    } else {
      FM_RETURN_IF_ERROR(
          p.Keys(par, "parallel", {"pipeline_stages", "expert_parallel", "tensor_parallel"}));
      cfg->parallel.automatic = false;
      FM_ASSIGN_OR_RETURN(const YAML::Node s, p.Required(par, "parallel", "pipeline_stages"));
      // More stages than nodes is refused with the plan; the bound keeps the number an int.
      FM_ASSIGN_OR_RETURN(int64_t stages, p.Int(s, "parallel.pipeline_stages", 1, 1 << 20));
      cfg->parallel.pipeline_stages = static_cast<int>(stages);
      if (const YAML::Node k = par["expert_parallel"]; k.IsDefined()) {
        FM_ASSIGN_OR_RETURN(int64_t ep, p.Int(k, "parallel.expert_parallel", 1));
        cfg->parallel.expert_parallel = static_cast<int>(std::min<int64_t>(ep, 1 << 20));
      }
      if (const YAML::Node t = par["tensor_parallel"]; t.IsDefined()) {
        FM_ASSIGN_OR_RETURN(int64_t tp, p.Int(t, "parallel.tensor_parallel", 1));
        cfg->parallel.tensor_parallel = static_cast<int>(std::min<int64_t>(tp, 1 << 20));
        if (tp > 1 && cfg->parallel.expert_parallel > 1)
          return p.Error(t, "parallel.tensor_parallel",
                         "expert_parallel and tensor_parallel cannot both be above 1 (a "
                         "tensor-parallel group also splits the experts)");
      }
    }
  }

  if (const YAML::Node t = root["transport"]; t.IsDefined()) {
    FM_ASSIGN_OR_RETURN(std::string name, p.String(t, "transport"));
    if (name == "tcp") cfg->transport = TransportKind::kTcp;
    else if (name == "nccl") cfg->transport = TransportKind::kNccl;
    else return p.Error(t, "transport", "'" + name + "': want tcp or nccl");
  }

  if (const YAML::Node d = root["activation_dtype"]; d.IsDefined()) {
    FM_ASSIGN_OR_RETURN(cfg->activation_dtype, p.String(d, "activation_dtype"));
    if (cfg->activation_dtype != "f32" && cfg->activation_dtype != "bf16")
      return p.Error(d, "activation_dtype", "'" + cfg->activation_dtype + "': want f32 or bf16");
  }

  FM_ASSIGN_OR_RETURN(const YAML::Node nodes, p.Required(root, "", "nodes"));
  FM_RETURN_IF_ERROR(ParseNodes(p, nodes, cfg));
  FM_RETURN_IF_ERROR(CheckAddresses(p, root, *cfg));
  if (cfg->transport == TransportKind::kNccl)
    for (size_t i = 0; i < cfg->nodes.size(); ++i)
      if (cfg->nodes[i].cuda_device < 0)
        return p.Error(nodes[i]["device"], "nodes[" + std::to_string(i) + "].device",
                       "transport nccl needs cuda devices, got cpu");
  if (!cfg->parallel.automatic) {
    const int64_t workers = int64_t{cfg->parallel.pipeline_stages} *
                            cfg->parallel.expert_parallel * cfg->parallel.tensor_parallel;
    const bool tp = cfg->parallel.tensor_parallel > 1;
    if (workers != static_cast<int64_t>(cfg->nodes.size()))
      return p.Error(root["parallel"], "parallel",
                     "pipeline_stages " + std::to_string(cfg->parallel.pipeline_stages) +
                         (tp ? " x tensor_parallel " + std::to_string(cfg->parallel.tensor_parallel)
                             : " x expert_parallel " + std::to_string(cfg->parallel.expert_parallel)) +
                         " = " + std::to_string(workers) + " workers, but nodes lists " +
                         std::to_string(cfg->nodes.size()));
  }

  if (const YAML::Node l = root["limits"]; l.IsDefined() && !l.IsNull()) {
    FM_RETURN_IF_ERROR(p.Keys(l, "limits", {"max_batch", "max_context", "kv_cache_gib",
                                            "max_queue", "max_tokens", "max_streams_per_client",
                                            "write_stall_timeout_s", "max_step_tokens"}));
    LimitsConfig& lim = cfg->limits;
    if (l["max_batch"]) { FM_ASSIGN_OR_RETURN(lim.max_batch, p.Int(l["max_batch"], "limits.max_batch", 1, kMaxBatchLimit)); }
    if (l["max_context"]) {
      FM_ASSIGN_OR_RETURN(lim.max_context, p.Int(l["max_context"], "limits.max_context", 1, kMaxContextLimit));
    }
    if (l["kv_cache_gib"]) { FM_ASSIGN_OR_RETURN(lim.kv_cache_gib, p.Number(l["kv_cache_gib"], "limits.kv_cache_gib", true, kMaxMemoryGib)); }
    if (l["max_queue"]) { FM_ASSIGN_OR_RETURN(lim.max_queue, p.Int(l["max_queue"], "limits.max_queue", 1)); }
    if (l["max_tokens"]) { FM_ASSIGN_OR_RETURN(lim.max_tokens, p.Int(l["max_tokens"], "limits.max_tokens", 1)); }
    if (l["max_step_tokens"]) {
      FM_ASSIGN_OR_RETURN(lim.max_step_tokens,
                          p.Int(l["max_step_tokens"], "limits.max_step_tokens", 1, kMaxContextLimit));
    }
    if (l["max_streams_per_client"]) {
      FM_ASSIGN_OR_RETURN(lim.max_streams_per_client,
                          p.Int(l["max_streams_per_client"], "limits.max_streams_per_client", 1));
    }
    if (l["write_stall_timeout_s"]) {
      FM_ASSIGN_OR_RETURN(lim.write_stall_timeout_s,
                          p.Number(l["write_stall_timeout_s"], "limits.write_stall_timeout_s", false,
                                   kMaxWriteStallTimeoutS));
    }
    if (!l["max_tokens"]) lim.max_tokens = std::min(lim.max_tokens, lim.max_context);
    if (lim.max_tokens > lim.max_context)
      return p.Error(l["max_tokens"], "limits.max_tokens",
                     std::to_string(lim.max_tokens) + " exceeds limits.max_context " +
                         std::to_string(lim.max_context));
  }

  if (const YAML::Node s = root["security"]; s.IsDefined() && !s.IsNull()) {
    FM_RETURN_IF_ERROR(p.Keys(s, "security", {"token_file", "cluster_secret_file", "tls", "insecure",
                                              "encrypt_data_plane"}));
    for (auto [key, out] : {std::pair{"insecure", &cfg->security.insecure},
                            std::pair{"encrypt_data_plane", &cfg->security.encrypt_data_plane}}) {
      const YAML::Node n = s[key];
      if (!n.IsDefined()) continue;
      const std::string path = std::string("security.") + key;
      FM_ASSIGN_OR_RETURN(const std::string v, p.String(n, path));
      if (v != "true" && v != "false") return p.Error(n, path, "'" + v + "': want true or false");
      *out = v == "true";
    }
    if (s["token_file"]) { FM_ASSIGN_OR_RETURN(cfg->security.token_file, p.Path(s["token_file"], "security.token_file")); }
    if (s["cluster_secret_file"]) {
      FM_ASSIGN_OR_RETURN(cfg->security.cluster_secret_file,
                          p.Path(s["cluster_secret_file"], "security.cluster_secret_file"));
    }
    if (const YAML::Node tls = s["tls"]; tls.IsDefined()) {
      FM_RETURN_IF_ERROR(p.Keys(tls, "security.tls", {"cert", "key", "ca"}));
      TlsConfig& t = cfg->security.tls;
      FM_ASSIGN_OR_RETURN(const YAML::Node cert, p.Required(tls, "security.tls", "cert"));
      FM_ASSIGN_OR_RETURN(t.cert, p.Path(cert, "security.tls.cert"));
      FM_ASSIGN_OR_RETURN(const YAML::Node key, p.Required(tls, "security.tls", "key"));
      FM_ASSIGN_OR_RETURN(t.key, p.Path(key, "security.tls.key"));
      FM_ASSIGN_OR_RETURN(const YAML::Node ca, p.Required(tls, "security.tls", "ca"));
      FM_ASSIGN_OR_RETURN(t.ca, p.Path(ca, "security.tls.ca"));
    }
    if (cfg->security.encrypt_data_plane && cfg->security.cluster_secret_file.empty())
      return p.Error(s["encrypt_data_plane"], "security.encrypt_data_plane",
                     "needs security.cluster_secret_file (the session keys come from it)");
  }

  FM_RETURN_IF_ERROR(CheckExposure(p, root, *cfg));

  if (const YAML::Node h = root["heartbeat"]; h.IsDefined() && !h.IsNull()) {
    FM_RETURN_IF_ERROR(p.Keys(h, "heartbeat", {"interval_ms", "timeout_ms"}));
    HeartbeatConfig& hb = cfg->heartbeat;
    // Below 10 ms a heartbeat loop is a busy loop, and nodes flap on any scheduling hiccup.
    if (h["interval_ms"]) { FM_ASSIGN_OR_RETURN(hb.interval_ms, p.Int(h["interval_ms"], "heartbeat.interval_ms", 10, kMaxHeartbeatMs)); }
    if (h["timeout_ms"]) { FM_ASSIGN_OR_RETURN(hb.timeout_ms, p.Int(h["timeout_ms"], "heartbeat.timeout_ms", 40, kMaxHeartbeatMs)); }
    if (hb.timeout_ms <= hb.interval_ms)
      return p.Error(h["timeout_ms"] ? h["timeout_ms"] : h, "heartbeat.timeout_ms",
                     std::to_string(hb.timeout_ms) + " must exceed interval_ms " +
                         std::to_string(hb.interval_ms));
  }
  return Status::Ok();
}

}  // namespace

std::string HostPort::ToString() const {
  const bool v6 = host.find(':') != std::string::npos;
  return (v6 ? "[" + host + "]" : host) + ":" + std::to_string(port);
}

Result<int> ParseDevice(const std::string& device) {
  if (device == "cpu") return -1;
  const std::string idx = device.rfind("cuda:", 0) == 0 ? device.substr(5) : "";
  if (idx.empty() || idx.size() > 3 || idx.find_first_not_of("0123456789") != std::string::npos)
    return InvalidArgument("'" + device + "': want cpu or cuda:N");
  return std::stoi(idx);
}

Result<HostPort> ParseHostPort(const std::string& s, bool allow_zero) {
  HostPort hp;
  std::string port;
  if (!s.empty() && s[0] == '[') {
    const size_t close = s.find(']');
    if (close == std::string::npos || close + 1 >= s.size() || s[close + 1] != ':')
      return InvalidArgument("'" + s + "': expected [ipv6]:port");
    hp.host = s.substr(1, close - 1);
    port = s.substr(close + 2);
    if (hp.host.empty() || hp.host.find_first_not_of("0123456789abcdefABCDEF:.") != std::string::npos)
      return InvalidArgument("'" + s + "': bad IPv6 address");
  } else {
    const size_t colon = s.rfind(':');
    if (colon == std::string::npos) return InvalidArgument("'" + s + "': expected host:port");
    hp.host = s.substr(0, colon);
    port = s.substr(colon + 1);
    if (hp.host.empty()) return InvalidArgument("'" + s + "': empty host");
    for (char c : hp.host)
      if (!(std::isalnum(static_cast<unsigned char>(c)) || c == '.' || c == '-' || c == '_'))
        return InvalidArgument("'" + s + "': bad character '" + std::string(1, c) + "' in host");
  }
  if (port.empty() || port.size() > 5 || port.find_first_not_of("0123456789") != std::string::npos)
    return InvalidArgument("'" + s + "': bad port '" + port + "'");
  const int v = std::stoi(port);
  if (v > 65535 || (v == 0 && !allow_zero))
    return InvalidArgument("'" + s + "': port " + port + " not in 1..65535");
  hp.port = static_cast<uint16_t>(v);
  return hp;
}

const char* TransportKindName(TransportKind t) { return t == TransportKind::kNccl ? "nccl" : "tcp"; }

const NodeConfig* ClusterConfig::FindNode(const std::string& name) const {
  for (const auto& n : nodes)
    if (n.name == name) return &n;
  return nullptr;
}

namespace {

// The line of a `---` that separates content from more content (a second document); 0 if none.
// A leading `---` (a document start) and a trailing one (generators write it) start nothing.
int SecondDocumentLine(const std::string& text) {
  bool content_before = false;
  int separator = 0, line = 0;
  for (size_t at = 0; at <= text.size();) {
    size_t end = text.find('\n', at);
    if (end == std::string::npos) end = text.size();
    const std::string_view l(text.data() + at, end - at);
    ++line;
    at = end + 1;
    if (l.substr(0, 3) == "---" && (l.size() == 3 || std::isspace(static_cast<unsigned char>(l[3])))) {
      if (content_before && separator == 0) separator = line;
      continue;
    }
    const size_t first = l.find_first_not_of(" \t\r");
    if (first == std::string_view::npos || l[first] == '#') continue;
    if (separator > 0) return separator;
    content_before = true;
  }
  return 0;
}

}  // namespace

Result<ClusterConfig> ParseClusterConfig(const std::string& yaml_text, const std::string& origin,
                                         const std::string& base_dir) {
  // One document: YAML::Load reads the first and ignores the rest silently, unlike an unknown
  // key. (YAML::LoadAll would see them, but loops forever on some malformed input: the fuzzer.)
  if (const int line = SecondDocumentLine(yaml_text); line > 0)
    return InvalidArgument(origin + ":" + std::to_string(line) +
                           ": a second YAML document; a cluster config is one document");
  YAML::Node root;
  try {
    root = YAML::Load(yaml_text);
  } catch (const YAML::Exception& e) {
    return InvalidArgument(origin + ":" + std::to_string(e.mark.line + 1) + ":" +
                           std::to_string(e.mark.column + 1) + ": YAML syntax: " + e.msg);
  }
  Parser p(origin, base_dir);
  if (!root.IsMap()) return InvalidArgument(origin + ": expected a mapping at the top level");
  ClusterConfig cfg;
  cfg.path = origin;
  try {
    FM_RETURN_IF_ERROR(ParseRoot(p, root, &cfg));
  } catch (const YAML::Exception& e) {  // yaml-cpp throws on some malformed node accesses
    return InvalidArgument(origin + ":" + std::to_string(e.mark.line + 1) + ": " + e.msg);
  }
  return cfg;
}

Result<ClusterConfig> LoadClusterConfig(const std::string& path) {
  Result<std::string> text = ReadSmallFile(path, 16u << 20);
  if (!text.ok()) return text.status().Wrap("cluster config");
  const std::string dir = fs::path(path).parent_path().string();
  return ParseClusterConfig(*text, path, dir.empty() ? "." : dir);
}

Result<std::string> ReadClusterSecret(const ClusterConfig& cfg) {
  const std::string& file = cfg.security.cluster_secret_file;
  if (file.empty()) return std::string();
  Result<std::string> read = ReadSmallFile(file, 1u << 20);
  if (!read.ok()) return read.status().Wrap("security.cluster_secret_file");
  std::string secret = *read;
  while (!secret.empty() && std::isspace(static_cast<unsigned char>(secret.back())))
    secret.pop_back();
  if (secret.empty())
    return InvalidArgument("security.cluster_secret_file " + file + ": empty secret");
  return secret;
}

}  // namespace fm
