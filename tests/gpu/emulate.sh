#!/usr/bin/env bash
# Runs the CUDA tests against the real kernels/cuda/*.cu on the CPU, through the emulation in
# tests/gpu/emu/ (block.x threads per launch, blocks in turn, in orders that vary so that a
# missing barrier shows), for machines without a GPU: test_cuda_kernels (each kernel vs its CPU
# twin, and test_emu_schedule: the emulation's own schedule) and test_cuda_shard (the device
# ShardModel vs the CPU one; test_emu_device_faults: a device a fault ended, a graph capture
# that fails), and test_nccl_emu (net/nccl_communicator.cpp over emu/nccl.h, its ranks as
# threads). Checks kernel indexing, quant layouts, reductions, barriers and the step's
# orchestration; not a substitute for tests/gpu/run.sh.
# Each source compiles on its own, JOBS at a time (through ccache when installed), into
# $EMU_BUILD (default build-emu/), so a rerun after an edit recompiles only what changed.
# Usage: tests/gpu/emulate.sh [gtest args, e.g. --gtest_filter=CudaRope.*]
set -euo pipefail
cd "$(dirname "$0")/../.."
OUT=${EMU_BUILD:-build-emu}
JOBS=${JOBS:-$(nproc)}
mkdir -p "$OUT/src" "$OUT/inc/kernels/cuda"
# The rewritten headers ($OUT/inc) come before the real ones (.); emu/ (the runtime, check.cuh)
# before both. For this CPU, as the Release build's CPU kernels are; no FMA contraction, as in
# the CMake build: tests that compare two code paths bit for bit must not depend on where the
# compiler fused a multiply-add.
CXX="g++ -std=c++20 -O1 -march=native -ffp-contract=off -Wno-unknown-pragmas -Wno-psabi -Itests/gpu/emu -I$OUT/inc -I."
command -v ccache >/dev/null && CXX="ccache $CXX"

# emu_source IN OUT: the CUDA source as the emulation compiles it. Two rewrites:
# - kernel<<<grid, block[, shared, stream]>>>(args)  ->  EmuLaunch(kernel, EmuConfig{...}, args)
#   (kernel may name a template instance: Kernel<4><<<...>>>);
# - after each `__shared__ T a[..], b;` declaration, EmuPoisonShared(&a, sizeof a); ... for each
#   name, so every block starts its shared memory as 0xFF bytes (emu/cuda_runtime.h).
# OUT keeps its old timestamp when nothing changed.
emu_source() {
  perl -0777 -pe '
    s/(\w+(?:<[^<>;()]*>)?)<<<(.*?)>>>\(/EmuLaunch($1, EmuConfig{$2}, /sg;
    s{__shared__\s+([^;]*);}{
      my $decl = $1;
      my $poison = join(" ", map { my $d = $_; $d =~ s/\[.*//s; $d =~ /(\w+)\s*$/;
                                   "EmuPoisonShared(&$1, sizeof $1);" } split(/,/, $decl));
      "__shared__ $decl; $poison"
    }ge' "$1" >"$2.new"
  if cmp -s "$2.new" "$2"; then rm "$2.new"; else mv "$2.new" "$2"; fi
}
for h in kernels/cuda/*.cuh; do
  # check.cuh: emu/kernels/cuda/check.cuh stands in.
  [ "$(basename "$h")" = check.cuh ] || emu_source "$h" "$OUT/inc/$h"
done
kernels=()
for cu in kernels/cuda/*.cu; do
  k=$(basename "$cu" .cu)
  # device.cu is the CUDA runtime glue (emu/device_emu.cpp stands in); membw times a real device.
  case "$k" in device|membw) continue ;; esac
  emu_source "$cu" "$OUT/src/$k.cpp"
  kernels+=("$OUT/src/$k.cpp")
done
common=(common/status.cpp common/file.cpp common/device_transfers.cpp common/numfmt.cpp common/tensor.cpp common/log.cpp common/thread_pool.cpp)
kernel_test=(tests/gpu/test_cuda_*.cpp)
kernel_test=("${kernel_test[@]/tests\/gpu\/test_cuda_shard*.cpp}")
kernel_test=("${kernel_test[@]/tests\/gpu\/test_cuda_tp.cpp}")
kernel_test=("${kernel_test[@]/tests\/gpu\/test_cuda_ep.cpp}")
# The NCCL communicator over emu/nccl.h: the emulation's own tests and the real-GPU ones (those
# needing two devices skip).
nccl_srcs=(tests/gpu/test_nccl_emu.cpp tests/gpu/test_nccl_communicator.cpp net/nccl_communicator.cpp
           net/frame.cpp common/crc32c.cpp tests/gpu/emu/device_emu.cpp "${common[@]}")
kernel_srcs=("${kernel_test[@]}" tests/gpu/test_emu_schedule.cpp model/sampler.cpp model/embed.cpp
             model/cuda/logit_edits.cpp "${kernels[@]}" tests/gpu/emu/device_emu.cpp
             kernels/cpu/matvec_ref.cpp kernels/cpu/router.cpp kernels/cpu/hc.cpp
             kernels/cpu/swiglu.cpp kernels/cpu/attention_core.cpp kernels/cpu/indexer.cpp
             kernels/cpu/compressor_pool.cpp kernels/cpu/rmsnorm.cpp kernels/cpu/rope.cpp
             kernels/cpu/hc_ref.cpp "${common[@]}")
# The EP and tp tests (test_cuda_ep, test_cuda_tp) run the worker's EP executor and tp group over
# the TCP communicator and over the NCCL one (emu/nccl.h).
ep_srcs=(worker/ep_expert_executor.cpp net/communicator.cpp net/tcp_transport.cpp net/tcp_transport_conns.cpp net/tcp_conn.cpp
         net/handshake.cpp net/frame_auth.cpp net/frame.cpp common/crc32c.cpp net/nccl_communicator.cpp
         worker/tp_group.cpp)
shard_srcs=(tests/gpu/test_cuda_shard*.cpp tests/gpu/test_cuda_tp.cpp tests/gpu/test_cuda_ep.cpp
            tests/gpu/test_emu_device_faults.cpp worker/shard_runtime.cpp worker/stage_executor.cpp
            model/cuda/shard_model.cpp model/cuda/shard_head.cpp model/cuda/device_weights.cpp
            model/cuda/step_inputs.cpp model/cuda/logit_edits.cpp
            model/cuda/device_activations.cpp model/cuda/tp_step.cpp model/cuda/ep_experts.cpp
            model/*.cpp "${kernels[@]}" tests/gpu/emu/device_emu.cpp kernels/cpu/*.cpp
            "${ep_srcs[@]}" "${common[@]}")

# Each source -> one object under $OUT/obj/, JOBS compiles at a time; the three test binaries
# share the objects of the sources they have in common (the kernels, the emulated runtime,
# common/).
compile() {
  mkdir -p "$OUT/obj"
  $CXX -c "$1" -o "$OUT/obj/${1//\//_}.o"
}
export -f compile
export OUT CXX
objs_of() {  # srcs... -> the object paths, in order
  for s in "$@"; do [ -n "$s" ] && echo "$OUT/obj/${s//\//_}.o"; done
}
for s in "${kernel_srcs[@]}" "${nccl_srcs[@]}" "${shard_srcs[@]}"; do [ -n "$s" ] && echo "$s"; done |
  sort -u | xargs -P "$JOBS" -I{} bash -c 'compile "{}"'
mapfile -t kobjs < <(objs_of "${kernel_srcs[@]}")
mapfile -t sobjs < <(objs_of "${shard_srcs[@]}")
mapfile -t nobjs < <(objs_of "${nccl_srcs[@]}")
g++ -o "$OUT/test_cuda_kernels_emu" "${kobjs[@]}" -lgtest -lgtest_main -lboost_context -pthread
g++ -o "$OUT/test_cuda_shard_emu" "${sobjs[@]}" -lgtest -lgtest_main -lpcre2-8 -lboost_context \
  -lcrypto -pthread
g++ -o "$OUT/test_nccl_emu" "${nobjs[@]}" -lgtest -lgtest_main -lboost_context -pthread
# run_sharded BIN ARGS...: the test binary as JOBS gtest shards at once (the emulation runs one
# kernel at a time per process), each shard's output printed whole when all have ended.
run_sharded() {
  local bin=$1 rc=0 pids=(); shift
  for ((i = 0; i < JOBS; i++)); do
    GTEST_TOTAL_SHARDS=$JOBS GTEST_SHARD_INDEX=$i "$bin" "$@" >"$bin.shard$i.log" 2>&1 & pids+=($!)
  done
  for ((i = 0; i < JOBS; i++)); do wait "${pids[$i]}" || rc=1; done
  for ((i = 0; i < JOBS; i++)); do echo "--- $(basename "$bin") shard $i of $JOBS"; cat "$bin.shard$i.log"; done
  return $rc
}
run_sharded "$OUT/test_cuda_kernels_emu" "$@"
run_sharded "$OUT/test_cuda_shard_emu" "$@"
"$OUT/test_nccl_emu" "$@"
