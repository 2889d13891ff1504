#!/usr/bin/env bash
# Runs the CUDA tests against the real kernels/cuda/*.cu on the CPU, through the emulation in
# tests/gpu/emu/ (block.x threads per launch, blocks in turn), for machines without a GPU:
# test_cuda_kernels (each kernel vs its CPU twin) and test_cuda_shard (the device ShardModel vs
# the CPU one). Checks kernel indexing, quant layouts, reductions and the step's orchestration;
# not a substitute for tests/gpu/run.sh.
# Usage: tests/gpu/emulate.sh [gtest args, e.g. --gtest_filter=CudaRope.*]
set -euo pipefail
cd "$(dirname "$0")/../.."
OUT=$(mktemp -d)
trap 'rm -rf "$OUT"' EXIT
CXX="g++ -std=c++20 -O1 -Wno-unknown-pragmas -Itests/gpu/emu -I."
objs=()
for k in gemv experts elementwise router hc attention indexer step; do
  # kernel[<NT>]<<<grid, block[, shared, stream]>>>(args)  ->  EmuLaunch(kernel, EmuConfig{...}, args)
  perl -0777 -pe 's/(\w+(?:<\w+>)?)<<<(.*?)>>>\(/EmuLaunch($1, EmuConfig{$2}, /sg' "kernels/cuda/$k.cu" > "$OUT/$k.cpp"
  objs+=("$OUT/$k.cpp")
done
common=(common/status.cpp common/numfmt.cpp common/tensor.cpp common/log.cpp common/thread_pool.cpp)
$CXX -o "$OUT/test_cuda_kernels_emu" tests/gpu/test_cuda_kernels.cpp tests/gpu/test_cuda_gemm.cpp \
  tests/gpu/test_cuda_model_ops.cpp tests/gpu/test_cuda_step_ops.cpp "${objs[@]}" tests/gpu/emu/device_emu.cpp \
  kernels/cpu/matvec_ref.cpp kernels/cpu/router.cpp kernels/cpu/hc.cpp kernels/cpu/swiglu.cpp \
  kernels/cpu/attention_core.cpp kernels/cpu/indexer.cpp kernels/cpu/compressor_pool.cpp \
  "${common[@]}" -lgtest -lgtest_main -lboost_context -pthread
$CXX -march=native -o "$OUT/test_cuda_shard_emu" tests/gpu/test_cuda_shard.cpp \
  model/cuda/shard_model.cpp model/cuda/device_weights.cpp model/cuda/step_inputs.cpp model/*.cpp "${objs[@]}" tests/gpu/emu/device_emu.cpp \
  kernels/cpu/*.cpp "${common[@]}" -lgtest -lgtest_main -lpcre2-8 -lboost_context -pthread
"$OUT/test_cuda_kernels_emu" "$@"
"$OUT/test_cuda_shard_emu" "$@"
