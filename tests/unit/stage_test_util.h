// Helpers of the worker tests that run ShardRuntimes and StageExecutors as the stages of one
// pipeline on loopback (test_data_plane.cpp, test_prompt_scores.cpp).
#pragma once
#include <gtest/gtest.h>

#include <cstdint>
#include <memory>
#include <string>

#include "net/tcp_transport.h"
#include "worker/shard_runtime.h"

namespace fm::testing_stage {

// Stage `stage` of `num_stages` holding layers [begin, end) (-1: to the last) of the checkpoint
// in `model_dir`; the first stage embeds, the last holds the head.
inline ShardPlacement StagePlacement(const std::string& model_dir, int stage, int num_stages, int64_t begin,
                                     int64_t end) {
  ShardPlacement p;
  p.model_dir = model_dir;
  p.stage = stage;
  p.num_stages = num_stages;
  p.layer_begin = begin;
  p.layer_end = end;
  p.embed = stage == 0;
  p.head = stage == num_stages - 1;
  return p;
}

// A data-plane transport named `name`, listening on a fresh loopback port.
inline std::unique_ptr<net::Transport> LoopbackTransport(const std::string& name) {
  auto t = net::MakeTcpTransport({.self_name = name, .secret = "unit-secret"});
  EXPECT_TRUE(t.ok());
  EXPECT_TRUE((*t)->Listen("127.0.0.1:0").ok());
  return std::move(t).value();
}

}  // namespace fm::testing_stage
