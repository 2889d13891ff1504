// Cluster YAML: a full valid file, defaults, and every class of error with its file:line and
// the key it names. Also every committed configs/*.yaml parses.
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <string>

#include <gtest/gtest.h>
#include <unistd.h>

#include "config/cluster_config.h"

namespace fm {
namespace {

// Line numbers below refer to this text (line 1 is "model: ...").
const char* kGood =
    "model: ../out/small\n"                                                   // 1
    "coordinator: { listen: 127.0.0.1:7070 }\n"                               // 2
    "parallel: { pipeline_stages: 2, expert_parallel: 1 }\n"                  // 3
    "transport: tcp\n"                                                        // 4
    "nodes:\n"                                                                // 5
    "  - { name: a, control: 127.0.0.1:7101, data: 127.0.0.1:7201, device: cpu, memory_gib: 20 }\n"
    "  - name: b\n"                                                           // 7
    "    control: 127.0.0.1:7102\n"                                           // 8
    "    data: 127.0.0.1:7202\n"                                              // 9
    "    device: cpu\n"                                                       // 10
    "    memory_gib: 20.5\n"                                                  // 11
    "limits: { max_batch: 8, max_context: 4096, kv_cache_gib: 2, max_queue: 10, max_tokens: 512 }\n"
    "security:\n"                                                             // 13
    "  token_file: tokens.txt\n"                                              // 14
    "  cluster_secret_file: /etc/fm/secret\n"                                 // 15
    "  tls: { cert: c.pem, key: k.pem, ca: ca.pem }\n"                        // 16
    "heartbeat: { interval_ms: 500, timeout_ms: 3000 }\n";                    // 17

Result<ClusterConfig> Parse(const std::string& text) {
  return ParseClusterConfig(text, "t.yaml", "/cfg/dir");
}

// Replaces the first occurrence of `from` in kGood.
std::string Edit(const std::string& from, const std::string& to) {
  std::string s = kGood;
  const size_t at = s.find(from);
  EXPECT_NE(at, std::string::npos) << from;
  return s.replace(at, from.size(), to);
}

// Expects an InvalidArgument that starts with "t.yaml:<line>:" and contains `needle`.
void ExpectError(const std::string& text, int line, const std::string& needle) {
  auto r = Parse(text);
  ASSERT_FALSE(r.ok()) << "accepted; expected an error about " << needle;
  const std::string& m = r.status().message();
  EXPECT_EQ(m.rfind("t.yaml:" + std::to_string(line) + ":", 0), 0u) << m;
  EXPECT_NE(m.find(needle), std::string::npos) << m;
}

TEST(ClusterConfig, FullFileParses) {
  auto r = Parse(kGood);
  ASSERT_TRUE(r.ok()) << r.status().ToString();
  const ClusterConfig& c = *r;
  EXPECT_EQ(c.model, "/cfg/out/small");  // relative to the YAML's directory
  // A YAML given by a relative path: the model path is still absolute (the coordinator sends it
  // to workers, which may run in another directory).
  auto rel = ParseClusterConfig(kGood, "cfgdir/t.yaml", "cfgdir");
  ASSERT_TRUE(rel.ok()) << rel.status().ToString();
  EXPECT_EQ(rel->model, (std::filesystem::current_path() / "out/small").string());   // cfgdir/../out
  EXPECT_EQ(c.coordinator.listen.ToString(), "127.0.0.1:7070");
  EXPECT_FALSE(c.parallel.automatic);
  EXPECT_EQ(c.parallel.pipeline_stages, 2);
  EXPECT_EQ(c.parallel.expert_parallel, 1);
  EXPECT_EQ(c.transport, TransportKind::kTcp);
  EXPECT_EQ(c.activation_dtype, "f32");
  ASSERT_EQ(c.nodes.size(), 2u);
  EXPECT_EQ(c.nodes[0].name, "a");
  EXPECT_EQ(c.nodes[0].data.port, 7201);
  EXPECT_EQ(c.nodes[0].cuda_device, -1);
  EXPECT_EQ(c.nodes[1].line, 7);
  EXPECT_DOUBLE_EQ(c.nodes[1].memory_gib, 20.5);
  EXPECT_EQ(c.limits.max_batch, 8);
  EXPECT_EQ(c.limits.max_context, 4096);
  EXPECT_DOUBLE_EQ(c.limits.kv_cache_gib, 2.0);
  EXPECT_EQ(c.limits.max_queue, 10);
  EXPECT_EQ(c.limits.max_tokens, 512);
  EXPECT_EQ(c.security.token_file, "/cfg/dir/tokens.txt");
  EXPECT_EQ(c.security.cluster_secret_file, "/etc/fm/secret");
  EXPECT_TRUE(c.security.tls.enabled());
  EXPECT_EQ(c.security.tls.ca, "/cfg/dir/ca.pem");
  EXPECT_EQ(c.heartbeat.timeout_ms, 3000);
  ASSERT_NE(c.FindNode("b"), nullptr);
  EXPECT_EQ(c.FindNode("zz"), nullptr);
}

TEST(ClusterConfig, DefaultsForOptionalSections) {
  auto r = Parse(
      "model: /m\n"
      "coordinator: { listen: 0.0.0.0:7070 }\n"
      "transport: nccl\n"
      "nodes: [ { name: g, control: 10.0.0.1:7101, data: 10.0.0.1:7201, device: cuda:0, "
      "memory_gib: 121 } ]\n"
      "security: { insecure: true }\n");
  ASSERT_TRUE(r.ok()) << r.status().ToString();
  EXPECT_TRUE(r->security.insecure);
  EXPECT_TRUE(r->parallel.automatic);
  EXPECT_EQ(r->transport, TransportKind::kNccl);
  EXPECT_EQ(r->nodes[0].cuda_device, 0);
  EXPECT_EQ(r->limits.max_queue, 64);
  EXPECT_EQ(r->limits.max_batch, 16);
  EXPECT_DOUBLE_EQ(r->limits.kv_cache_gib, 0.0);
  EXPECT_DOUBLE_EQ(r->limits.write_stall_timeout_s, 60.0);
  EXPECT_EQ(r->limits.max_step_tokens, 2048);
  EXPECT_TRUE(r->security.cluster_secret_file.empty());
  EXPECT_FALSE(r->security.tls.enabled());
  EXPECT_EQ(r->heartbeat.interval_ms, 1000);
}

TEST(ClusterConfig, WithoutASecretEveryListenerMustBeLoopbackUnlessInsecure) {
  const std::string open =
      "model: /m\n"
      "coordinator: { listen: 127.0.0.1:7070, http: 127.0.0.1:8080 }\n"
      "nodes: [ { name: g, control: 127.0.0.1:7101, data: 127.0.0.1:7201, device: cpu, "
      "memory_gib: 1 } ]\n";
  auto loopback = Parse(open);
  ASSERT_TRUE(loopback.ok()) << loopback.status().ToString();
  EXPECT_FALSE(loopback->security.insecure);
  auto exposed = [&](const std::string& from, const std::string& to) {
    std::string t = open;
    t.replace(t.find(from), from.size(), to);
    return t;
  };
  const std::string hint = " is not a loopback address, and without security.cluster_secret_file";
  ExpectError(exposed("listen: 127.0.0.1", "listen: 0.0.0.0"), 2, "coordinator.listen: 0.0.0.0:7070" + hint);
  ExpectError(exposed("http: 127.0.0.1", "http: 10.1.1.1"), 2, "coordinator.http: 10.1.1.1:8080" + hint);
  ExpectError(exposed("control: 127.0.0.1", "control: 10.1.1.1"), 3, "nodes[0].control: 10.1.1.1:7101" + hint);
  ExpectError(exposed("data: 127.0.0.1", "data: spark-a"), 3, "nodes[0].data: spark-a:7201" + hint);
  // A name is not an address: 127.example.com may resolve anywhere.
  ExpectError(exposed("control: 127.0.0.1", "control: 127.example.com"), 3,
              "nodes[0].control: 127.example.com:7101" + hint);
  EXPECT_TRUE(Parse(exposed("control: 127.0.0.1", "control: 127.3.4.5")).ok());
  EXPECT_TRUE(Parse(exposed("data: 127.0.0.1", "data: 10.1.1.1") + "security: { insecure: true }\n").ok());
  EXPECT_TRUE(Parse(exposed("data: 127.0.0.1", "data: 10.1.1.1") +
                    "security: { cluster_secret_file: s }\n").ok());
  ExpectError(open + "security: { insecure: yes }\n", 4, "security.insecure: 'yes': want true or false");
  ExpectError(open + "security: { encrypt_data_plane: true }\n", 4,
              "security.encrypt_data_plane: needs security.cluster_secret_file");
  auto encrypted = Parse(open + "security: { cluster_secret_file: s, encrypt_data_plane: true }\n");
  ASSERT_TRUE(encrypted.ok()) << encrypted.status().ToString();
  EXPECT_TRUE(encrypted->security.encrypt_data_plane);
}

TEST(ClusterConfig, WriteStallTimeout) {
  auto r = Parse(Edit("max_queue: 10", "max_queue: 10, write_stall_timeout_s: 2.5"));
  ASSERT_TRUE(r.ok()) << r.status().ToString();
  EXPECT_DOUBLE_EQ(r->limits.write_stall_timeout_s, 2.5);
  ExpectError(Edit("max_queue: 10", "max_queue: 10, write_stall_timeout_s: 0"), 12,
              "limits.write_stall_timeout_s");
}

TEST(ClusterConfig, MaxStepTokens) {
  auto r = Parse(Edit("max_queue: 10", "max_queue: 10, max_step_tokens: 512"));
  ASSERT_TRUE(r.ok()) << r.status().ToString();
  EXPECT_EQ(r->limits.max_step_tokens, 512);
  ExpectError(Edit("max_queue: 10", "max_queue: 10, max_step_tokens: 0"), 12, "limits.max_step_tokens");
}

TEST(ClusterConfig, UnknownKeysAtEveryLevel) {
  ExpectError(std::string(kGood) + "extra: 1\n", 18, "extra: unknown key");
  ExpectError(Edit("{ listen: 127.0.0.1:7070 }", "{ listen: 127.0.0.1:7070, port: 1 }"), 2,
              "coordinator.port: unknown key");
  ExpectError(Edit("expert_parallel: 1", "expert_paralel: 1"), 3,
              "parallel.expert_paralel: unknown key");
  ExpectError(Edit("    device: cpu\n", "    device: cpu\n    gpu: 1\n"), 11,
              "nodes[1].gpu: unknown key");
  ExpectError(Edit("max_queue: 10", "max_queue: 10, qps: 3"), 12, "limits.qps: unknown key");
  ExpectError(Edit("ca: ca.pem", "ca: ca.pem, crl: x"), 16, "security.tls.crl: unknown key");
  ExpectError(Edit("timeout_ms: 3000", "timeout_ms: 3000, every: 1"), 17,
              "heartbeat.every: unknown key");
}

TEST(ClusterConfig, MissingRequiredFields) {
  ExpectError(Edit("model: ../out/small\n", ""), 1, "model: missing required field");
  ExpectError(Edit("    memory_gib: 20.5\n", ""), 7, "nodes[1].memory_gib: missing required field");
  ExpectError(Edit("name: a, ", ""), 6, "nodes[0].name: missing required field");
  ExpectError(Edit("{ listen: 127.0.0.1:7070 }", "{ }"), 2, "coordinator.listen: missing");
  ExpectError(Edit("{ cert: c.pem, key: k.pem, ca: ca.pem }", "{ cert: c.pem, key: k.pem }"), 16,
              "security.tls.ca: missing required field");
}

TEST(ClusterConfig, WrongTypes) {
  ExpectError(Edit("memory_gib: 20.5", "memory_gib: lots"), 11,
              "nodes[1].memory_gib: expected a number, got 'lots'");
  ExpectError(Edit("max_batch: 8", "max_batch: 8.5"), 12, "limits.max_batch: expected an integer");
  ExpectError(Edit("max_batch: 8", "max_batch: [8]"), 12, "limits.max_batch: expected an integer");
  ExpectError(Edit("max_batch: 8", "max_batch: 0"), 12, "limits.max_batch: 0 is below");
  ExpectError(Edit("memory_gib: 20.5", "memory_gib: -1"), 11, "nodes[1].memory_gib: must be > 0");
  ExpectError("model: /m\ncoordinator: { listen: 127.0.0.1:1 }\nnodes: 3\n", 3,
              "nodes: expected a non-empty list");
  ExpectError("model: /m\ncoordinator: { listen: 127.0.0.1:1 }\nnodes: []\n", 3,
              "nodes: expected a non-empty list");
  ExpectError(Edit("coordinator: { listen: 127.0.0.1:7070 }", "coordinator: 7070"), 2,
              "coordinator: expected a mapping");
  ExpectError(Edit("pipeline_stages: 2", "pipeline_stages: two"), 3,
              "parallel.pipeline_stages: expected an integer");
  // The value written, not a clamped one; a bound that allows 0 says so.
  ExpectError(Edit("pipeline_stages: 2", "pipeline_stages: 1000000000000"), 3,
              "parallel.pipeline_stages: 1000000000000 is above the maximum 1048576");
  ExpectError(Edit("kv_cache_gib: 2", "kv_cache_gib: -1"), 12, "limits.kv_cache_gib: must be >= 0");
  // A second document would be ignored: refused.
  auto two = Parse(std::string(kGood) + "---\nmodel: /other\n");
  ASSERT_FALSE(two.ok());
  EXPECT_NE(two.status().message().find("a second YAML document"), std::string::npos)
      << two.status().message();
  // A trailing separator (generators write one) is an empty document: fine.
  EXPECT_TRUE(Parse(std::string(kGood) + "---\n").ok());
}

TEST(ClusterConfig, DuplicateNamesAndAddresses) {
  ExpectError(Edit("  - name: b\n", "  - name: a\n"), 7,
              "nodes[1].name: duplicate node name 'a' (also at line 6)");
  ExpectError(Edit("data: 127.0.0.1:7202", "data: 127.0.0.1:7201"), 9,
              "nodes[1].data: address 127.0.0.1:7201 is already used by nodes[0].data");
  ExpectError(Edit("control: 127.0.0.1:7101", "control: 127.0.0.1:7070"), 6,
              "nodes[0].control: address 127.0.0.1:7070 is already used by coordinator.listen");
  ExpectError(Edit("transport: tcp\n", "transport: tcp\ntransport: nccl\n"), 5,
              "transport: duplicate key");
  ExpectError(Edit("{ listen: 127.0.0.1:7070 }", "{ listen: 127.0.0.1:7070, http: 127.0.0.1:7070 }"), 2,
              "coordinator.http: address 127.0.0.1:7070 is already used by coordinator.listen");
  // Other spellings of one socket on this machine: the second worker could not bind.
  ExpectError(Edit("data: 127.0.0.1:7202", "data: LOCALHOST:7201"), 9,
              "nodes[1].data: address LOCALHOST:7201 is already used by nodes[0].data (127.0.0.1:7201)");
  ExpectError(Edit("control: 127.0.0.1:7102", "control: 0.0.0.0:7101"), 8,
              "nodes[1].control: address 0.0.0.0:7101 is already used by nodes[0].control");
  ExpectError(Edit("{ listen: 127.0.0.1:7070 }", "{ listen: '[::]:7201' }"), 6,
              "nodes[0].data: address 127.0.0.1:7201 is already used by coordinator.listen ([::]:7201)");
  // Other machines may use the same port, also beside a wildcard listener here.
  std::string two_hosts = Edit("data: 127.0.0.1:7202", "data: 10.0.0.2:7201");
  two_hosts.replace(two_hosts.find("data: 127.0.0.1:7201"), 20, "data: 10.0.0.1:7201");
  EXPECT_TRUE(Parse(two_hosts).ok()) << Parse(two_hosts).status().ToString();
  const std::string wildcard_and_remote = Edit("control: 127.0.0.1:7102", "control: 10.0.0.2:7101");
  std::string w = wildcard_and_remote;
  w.replace(w.find("control: 127.0.0.1:7101"), 23, "control: 0.0.0.0:7101");
  EXPECT_TRUE(Parse(w).ok()) << Parse(w).status().ToString();
}

TEST(ClusterConfig, CoordinatorHttpIsOptional) {
  auto none = Parse(kGood);
  ASSERT_TRUE(none.ok()) << none.status().ToString();
  EXPECT_FALSE(none->coordinator.http.has_value());
  auto http = Parse(Edit("{ listen: 127.0.0.1:7070 }", "{ listen: 127.0.0.1:7070, http: 0.0.0.0:8080 }"));
  ASSERT_TRUE(http.ok()) << http.status().ToString();
  ASSERT_TRUE(http->coordinator.http.has_value());
  EXPECT_EQ(http->coordinator.http->ToString(), "0.0.0.0:8080");
  ExpectError(Edit("{ listen: 127.0.0.1:7070 }", "{ listen: 127.0.0.1:7070, http: 8080 }"), 2, "coordinator.http");
}

TEST(ClusterConfig, BadValues) {
  ExpectError(Edit("data: 127.0.0.1:7202", "data: 127.0.0.1"), 9, "nodes[1].data: '127.0.0.1'");
  ExpectError(Edit("data: 127.0.0.1:7202", "data: 127.0.0.1:70000"), 9, "not in 1..65535");
  ExpectError(Edit("data: 127.0.0.1:7202", "data: 127.0.0.1:0"), 9, "not in 1..65535");
  ExpectError(Edit("data: 127.0.0.1:7202", "data: a b:1"), 9, "bad character");
  ExpectError(Edit("transport: tcp", "transport: rdma"), 4, "transport: 'rdma': want tcp or nccl");
  ExpectError(Edit("transport: tcp\n", "transport: tcp\nactivation_dtype: fp16\n"), 5,
              "activation_dtype: 'fp16': want f32 or bf16");
  ExpectError(Edit("    device: cpu", "    device: gpu0"), 10,
              "nodes[1].device: 'gpu0': want cpu or cuda:N");
  ExpectError(Edit("    device: cpu", "    device: cuda:x"), 10, "'cuda:x': want cpu or cuda:N");
  ExpectError(Edit("transport: tcp", "transport: nccl"), 6,
              "nodes[0].device: transport nccl needs cuda devices");
  ExpectError(Edit("parallel: { pipeline_stages: 2, expert_parallel: 1 }", "parallel: manual"), 3,
              "parallel: 'manual': want auto");
  ExpectError(Edit("pipeline_stages: 2", "pipeline_stages: 3"), 3,
              "3 x expert_parallel 1 = 3 workers, but nodes lists 2");
  ExpectError(Edit("expert_parallel: 1", "tensor_parallel: 2"), 3,
              "2 x tensor_parallel 2 = 4 workers, but nodes lists 2");
  ExpectError(Edit("expert_parallel: 1", "expert_parallel: 2, tensor_parallel: 2"), 3,
              "parallel.tensor_parallel: expert_parallel and tensor_parallel cannot both be above 1");
  ExpectError(Edit("max_tokens: 512", "max_tokens: 5000"), 12,
              "limits.max_tokens: 5000 exceeds limits.max_context 4096");
  ExpectError(Edit("timeout_ms: 3000", "timeout_ms: 500"), 17, "heartbeat.timeout_ms: 500 must");
  // A step's rows and the plan's memory sums stay in range; max_context travels as int32.
  ExpectError(Edit("max_context: 4096", "max_context: 2147483648"), 12,
              "limits.max_context: 2147483648 is above the maximum 2147483647");
  ExpectError(Edit("max_batch: 8", "max_batch: 4611686018427387904"), 12,
              "limits.max_batch: 4611686018427387904 is above the maximum 4096");
  // Sizes and durations that would overflow their byte or nanosecond counts: refused.
  ExpectError(Edit("max_queue: 10", "max_queue: 10, write_stall_timeout_s: 1e10"), 12,
              "limits.write_stall_timeout_s: 1e10 is above the maximum 86400");
  ExpectError(Edit("timeout_ms: 3000", "timeout_ms: 9300000000000"), 17,
              "heartbeat.timeout_ms: 9300000000000 is above the maximum 86400000");
  ExpectError(Edit("kv_cache_gib: 2", "kv_cache_gib: 2e10"), 12,
              "limits.kv_cache_gib: 2e10 is above the maximum 1048576");
  ExpectError(Edit("memory_gib: 20.5", "memory_gib: 1e13"), 11,
              "nodes[1].memory_gib: 1e13 is above the maximum 1048576");
  // Heartbeats in a busy loop: refused.
  ExpectError(Edit("interval_ms: 500, timeout_ms: 3000", "interval_ms: 1, timeout_ms: 3"), 17,
              "heartbeat.interval_ms: 1 is below the minimum 10");
  ExpectError(Edit("  - name: b", "  - name: b c"), 7, "nodes[1].name: 'b c'");
}

TEST(ClusterConfig, SyntaxErrorsHaveALine) {
  auto r = Parse("model: /m\nnodes: [ {name: a\n");
  ASSERT_FALSE(r.ok());
  EXPECT_EQ(r.status().message().rfind("t.yaml:", 0), 0u);
  EXPECT_NE(r.status().message().find("YAML syntax"), std::string::npos);
  EXPECT_FALSE(Parse("- 1\n- 2\n").ok());
}

TEST(ClusterConfig, HostPortForms) {
  auto v6 = ParseHostPort("[::1]:7070");
  ASSERT_TRUE(v6.ok()) << v6.status().ToString();
  EXPECT_EQ(v6->host, "::1");
  EXPECT_EQ(v6->ToString(), "[::1]:7070");
  EXPECT_TRUE(ParseHostPort("spark-a.local:1").ok());
  EXPECT_TRUE(ParseHostPort("127.0.0.1:0", /*allow_zero=*/true).ok());
  EXPECT_FALSE(ParseHostPort(":7070").ok());
  EXPECT_FALSE(ParseHostPort("[::1]7070").ok());
}

TEST(ClusterConfig, ClusterSecretFile) {
  // Per process: a sanitizer build's unit tests may run beside this one.
  const auto dir = std::filesystem::temp_directory_path() /
                   ("fm_test_cluster_secret_" + std::to_string(getpid()));
  std::filesystem::create_directories(dir);
  ClusterConfig c;
  auto none = ReadClusterSecret(c);
  ASSERT_TRUE(none.ok());
  EXPECT_EQ(*none, "");
  c.security.cluster_secret_file = (dir / "secret").string();
  std::ofstream(c.security.cluster_secret_file) << "hunter2\n";
  auto s = ReadClusterSecret(c);
  ASSERT_TRUE(s.ok());
  EXPECT_EQ(*s, "hunter2");
  std::ofstream(c.security.cluster_secret_file) << "\n";
  EXPECT_FALSE(ReadClusterSecret(c).ok());
  c.security.cluster_secret_file = (dir / "missing").string();
  auto m = ReadClusterSecret(c);
  ASSERT_FALSE(m.ok());
  EXPECT_NE(m.status().message().find("cluster_secret_file"), std::string::npos);
  std::filesystem::remove_all(dir);
}

TEST(ClusterConfig, HardwareProfiles) {
  // Default by device: cpu (bandwidth left for the probe); cuda:N gets gb10.
  auto def = Parse(kGood);
  ASSERT_TRUE(def.ok()) << def.status().ToString();
  EXPECT_EQ(def->nodes[0].profile.name, "cpu");
  EXPECT_EQ(def->nodes[0].profile.mem_bw_gbps, 0);
  EXPECT_EQ(def->nodes[0].profile.decode_efficiency, 0.6);
  auto cuda = Parse(Edit("    device: cpu", "    device: cuda:1"));
  ASSERT_TRUE(cuda.ok()) << cuda.status().ToString();
  EXPECT_EQ(cuda->nodes[1].profile.name, "gb10");
  EXPECT_EQ(cuda->nodes[1].profile.mem_bw_gbps, 270);
  EXPECT_EQ(cuda->nodes[1].profile.link_gbps, 200);
  // A name, or a built-in with fields overridden.
  auto h200 = Parse(Edit("memory_gib: 20 }", "memory_gib: 20, profile: h200 }"));
  ASSERT_TRUE(h200.ok()) << h200.status().ToString();
  EXPECT_EQ(h200->nodes[0].profile.mem_bw_gbps, 4430);
  auto over = Parse(Edit("    memory_gib: 20.5\n",
                         "    memory_gib: 20.5\n    profile: { name: gb10, mem_bw_gbps: 250, "
                         "decode_efficiency: 0.5, link_latency_us: 0 }\n"));
  ASSERT_TRUE(over.ok()) << over.status().ToString();
  const HardwareProfile& p = over->nodes[1].profile;
  EXPECT_EQ(p.name, "gb10");
  EXPECT_EQ(p.mem_bw_gbps, 250);
  EXPECT_EQ(p.decode_efficiency, 0.5);
  EXPECT_EQ(p.link_latency_us, 0);
  EXPECT_EQ(p.link_gbps, 200);   // not overridden: the built-in's
  // Errors name the line and the field.
  ExpectError(Edit("memory_gib: 20 }", "memory_gib: 20, profile: tpu }"), 6,
              "nodes[0].profile: hardware profile 'tpu': unknown (built-in: gb10, h200, cpu)");
  ExpectError(Edit("    memory_gib: 20.5\n", "    memory_gib: 20.5\n    profile: { mem_bw_gbps: 9 }\n"),
              12, "nodes[1].profile.name: missing required field");
  ExpectError(Edit("    memory_gib: 20.5\n",
                   "    memory_gib: 20.5\n    profile: { name: cpu, decode_efficiency: 1.5 }\n"),
              12, "nodes[1].profile.decode_efficiency: must be in (0, 1], got 1.5");
  ExpectError(Edit("    memory_gib: 20.5\n",
                   "    memory_gib: 20.5\n    profile: { name: cpu, link_gbps: fast }\n"),
              12, "nodes[1].profile.link_gbps: expected a number, got 'fast'");
  ExpectError(Edit("    memory_gib: 20.5\n",
                   "    memory_gib: 20.5\n    profile: { name: cpu, mem_bw_gbps: 0 }\n"),
              12, "nodes[1].profile.mem_bw_gbps: must be > 0");
  ExpectError(Edit("    memory_gib: 20.5\n",
                   "    memory_gib: 20.5\n    profile: { name: cpu, flops: 1 }\n"),
              12, "nodes[1].profile.flops: unknown key");
}

TEST(ClusterConfig, CommittedConfigsParse) {
  const std::filesystem::path dir = std::filesystem::path(FM_SOURCE_DIR) / "configs";
  int n = 0;
  for (const char* name : {"local-1.yaml", "local-pp3.yaml", "local-pp2-ep2.yaml", "gb10x2.yaml",
                           "gb10x4.yaml", "local-tp2.yaml", "local-pp2-tp2.yaml"}) {
    auto r = LoadClusterConfig((dir / name).string());
    EXPECT_TRUE(r.ok()) << name << ": " << r.status().ToString();
    n += r.ok();
  }
  EXPECT_EQ(n, 7);
  auto tp = LoadClusterConfig((dir / "local-pp2-tp2.yaml").string());
  ASSERT_TRUE(tp.ok());
  EXPECT_FALSE(tp->parallel.automatic);
  EXPECT_EQ(tp->parallel.pipeline_stages, 2);
  EXPECT_EQ(tp->parallel.tensor_parallel, 2);
  EXPECT_EQ(tp->parallel.expert_parallel, 1);
  auto missing = LoadClusterConfig((dir / "nope.yaml").string());
  EXPECT_EQ(missing.status().code(), Code::kNotFound);
}

// The cluster YAML inside deploy/k8s/configmap.yaml (the block under "cluster.yaml: |") is
// what every pod loads: it must pass the same checks, non-loopback pod addresses included.
TEST(ClusterConfig, KubernetesConfigMapParses) {
  std::ifstream in(std::filesystem::path(FM_SOURCE_DIR) / "deploy/k8s/configmap.yaml");
  ASSERT_TRUE(in);
  std::string line, yaml;
  bool inside = false;
  while (std::getline(in, line)) {
    if (inside && line.rfind("    ", 0) != 0) break;
    if (inside) yaml += line.substr(4) + "\n";
    if (line == "  cluster.yaml: |") inside = true;
  }
  ASSERT_FALSE(yaml.empty());
  auto r = ParseClusterConfig(yaml, "configmap.yaml", "/");
  ASSERT_TRUE(r.ok()) << r.status().ToString();
  EXPECT_EQ(r->nodes.size(), 2u);
  EXPECT_EQ(r->security.cluster_secret_file, "/etc/flashmesh-secret/cluster.secret");
}

}  // namespace
}  // namespace fm
