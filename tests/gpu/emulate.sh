#!/usr/bin/env bash
# Runs test_cuda_kernels against the real kernels/cuda/*.cu on the CPU, through
# the emulation in tests/gpu/emu/ (one thread per CUDA thread), for machines without a GPU.
# Checks kernel indexing, quant layouts and reductions; not a substitute for tests/gpu/run.sh.
# Takes about 2 minutes on 2 cores. Usage: tests/gpu/emulate.sh [gtest args, e.g. --gtest_filter=CudaRope.*]
set -euo pipefail
cd "$(dirname "$0")/../.."
OUT=$(mktemp -d)
trap 'rm -rf "$OUT"' EXIT
for k in gemv elementwise router hc attention indexer; do
  # kernel<<<grid, block>>>(args)  ->  EmuLaunch(kernel, grid, block, args)
  perl -0777 -pe 's/(\w+)<<<(.*?)>>>\(/EmuLaunch($1, $2, /sg' "kernels/cuda/$k.cu" > "$OUT/$k.cpp"
done
g++ -std=c++20 -O1 -Wno-unknown-pragmas -Itests/gpu/emu -I. -o "$OUT/test_cuda_kernels_emu" \
  tests/gpu/test_cuda_kernels.cpp tests/gpu/test_cuda_model_ops.cpp "$OUT/gemv.cpp" "$OUT/elementwise.cpp" "$OUT/router.cpp" "$OUT/hc.cpp" "$OUT/attention.cpp" "$OUT/indexer.cpp" tests/gpu/emu/device_emu.cpp \
  kernels/cpu/matvec_ref.cpp kernels/cpu/router.cpp kernels/cpu/hc.cpp kernels/cpu/swiglu.cpp kernels/cpu/attention_core.cpp kernels/cpu/indexer.cpp kernels/cpu/compressor_pool.cpp common/status.cpp common/numfmt.cpp common/tensor.cpp common/log.cpp \
  -lgtest -lgtest_main -pthread
"$OUT/test_cuda_kernels_emu" "$@"
