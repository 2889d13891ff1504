#!/usr/bin/env bash
# GPU check for a machine with an NVIDIA GPU: configures with CUDA on for the local GPU's
# architecture only (one nvcc pass per .cu), builds the gpu tests and `flashmesh`, runs
# `ctest -L gpu` (kernels vs CPU twins, the device shard vs the CPU shard, NCCL), the GEMV
# bandwidth bench and the device decode bench on the bench preset, prints nvidia-smi.
# Usage: tests/gpu/run.sh [build-dir]  (default build-gpu).
# Exit status 0 only if every step passed. Takes about 3-5 minutes on an H200 host (16 cores).
set -uo pipefail
cd "$(dirname "$0")/../.."
BUILD=${1:-build-gpu}
JOBS=${JOBS:-$(nproc)}
failed=()
step() {
  echo "== $*"
  local t0=$SECONDS
  if "$@"; then echo "== ok ($((SECONDS - t0)) s)"; else echo "== FAILED ($((SECONDS - t0)) s): $*"; failed+=("$1 ${2:-}"); return 1; fi
}

# compute_cap "9.0" -> 90 (H100/H200), "12.1" -> 121 (GB10).
ARCH=$(nvidia-smi --query-gpu=compute_cap --format=csv,noheader 2>/dev/null | head -1 | tr -d '. ')
ARCH=${ARCH:-90}
echo "run.sh: CUDA architecture $ARCH, $JOBS jobs, build dir $BUILD"

step cmake -S . -B "$BUILD" -G Ninja -DCMAKE_BUILD_TYPE=Release -DFLASHMESH_CUDA=ON \
  -DCMAKE_CUDA_ARCHITECTURES="$ARCH" || exit 1
targets=(test_cuda_kernels test_cuda_shard bench_cuda_gemv)
grep -q "test_nccl_smoke" "$BUILD/build.ninja" && targets+=(test_nccl_smoke test_nccl_communicator)
if step cmake --build "$BUILD" -j "$JOBS" --target "${targets[@]}"; then
  step ctest --test-dir "$BUILD" -L gpu --output-on-failure --timeout 300
  step "$BUILD/tests/gpu/bench_cuda_gemv"
fi
if step cmake --build "$BUILD" -j "$JOBS" --target flashmesh; then
  # Device decode: tok/s and weight traffic / device read bandwidth (bw_efficiency).
  [ -f "$BUILD/bench-model/config.json" ] ||
    step "$BUILD/cli/flashmesh" mkmodel --preset bench "$BUILD/bench-model"
  # The same with every kernel launched per step: the CUDA graph's gain, measured in one run.
  for mode in "" --eager; do
    step "$BUILD/cli/flashmesh" bench decode --model "$BUILD/bench-model" --device cuda:0 \
      --context 64 --tokens 64 $mode
  done
fi
nvidia-smi

if [ ${#failed[@]} -ne 0 ]; then
  echo "run.sh: FAILED steps: ${failed[*]}"
  exit 1
fi
echo "run.sh: all steps passed"
