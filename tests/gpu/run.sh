#!/usr/bin/env bash
# GPU checks for a machine with an NVIDIA GPU (docs/gpu.md "Running the GPU checks"):
#   tests/gpu/run.sh [BUILD_DIR]      configure (CUDA on, the local GPU's architecture only) and
#                                     build here, then check (needs the Debian -dev packages;
#                                     default build dir build-gpu)
#   tests/gpu/run.sh --prebuilt       check what tests/gpu/pack.sh put in .devrun/ on a build
#                                     machine: no configure, no build (the GPU machine's way)
#   add --profile: ncu tables instead of the checks: per weight-kernel case of bench_cuda_gemv
#                  --once its throughput, occupancy, issue use and stall reasons (first), and
#                  time per kernel of eager decode steps
# The checks: each GPU test binary (kernels vs their CPU twins, the device shard vs the CPU
# shard, NCCL), bench_cuda_gemv (its parts fma, tc, ovl and fused, each a process of its own),
# `bench decode --device cuda:0`
# on the bench preset (CUDA graph and eager) and on `mkmodel --preset flash --layers 2` (the real
# shapes: per-layer time and the 43-layer prediction), each graph row again with
# `--weight-core tc` (the tensor-core core, ops.h SetWeightPath) and with `--launch-overlap`
# ("ovl": programmatic dependent launch, ops.h SetLaunchOverlap), bench cluster of pp2 / ep2 /
# tp2 cuda:0 workers against one cuda:0 worker, test_integration DeviceShard.*. Without a GPU
# each GPU step reports "skipped: no GPU" (--prebuilt still checks that every packed binary loads).
# Each row is printed as its step ends, and the table again last. Logs go to a fresh
# /tmp/fm-gpu.*; with $OUT set (the device tool), $OUT gets at most 4 files, the tool's limit
# being 8 with plain names: summary.txt, bench_cuda_gemv.log, profile-gemv.txt and logs.tgz (all
# logs), refreshed after every step, so a run cut short still returns what it did.
# The whole run keeps within FM_GPU_BUDGET_S seconds (default 540, under the tool's 600 s a
# command): each step's timeout is cut to what is left, and a step that no longer fits says
# "skipped: out of time". The steps go most wanted first (the speed figures of the untimed
# kernel work and the kernel tests, then the device shard's tests, the real shapes, the
# clusters, NCCL), then the --profile's ncu table of the weight kernels if 120 s are left.
# Set FM_GPU_BUDGET_S lower when the device tool has less than 600 s left (its limit_s).
# Checkpoints are written once to /tmp/fm-gpu-models (bench 2.3 GB, flash 2 layers 13 GB).
# Exit status 0 only if no step failed.
set -uo pipefail
cd "$(dirname "$0")/../.."
mode=build build=build-gpu profile=0
while [ $# -gt 0 ]; do
  case $1 in
    --prebuilt) mode=prebuilt ;;
    --profile) profile=1 ;;
    -h | --help) sed -n '2,31p' "$0"; exit 0 ;;
    -*) echo "run.sh: unknown option '$1' (see --help)" >&2; exit 2 ;;
    *) build=$1 ;;
  esac
  shift
done
logs=$(mktemp -d /tmp/fm-gpu.XXXXXX)
models=/tmp/fm-gpu-models
mkdir -p "$logs" "$models"
deadline=$((SECONDS + ${FM_GPU_BUDGET_S:-540}))

# $OUT (the device tool's return folder) gets the few files it can carry back.
publish() {
  [ -n "${OUT:-}" ] || return 0
  mkdir -p "$OUT"
  cp "$logs/summary.txt" "$OUT/summary.txt" 2>/dev/null
  for f in bench_cuda_gemv.log profile-gemv.txt; do [ -f "$logs/$f" ] && cp "$logs/$f" "$OUT/$f"; done
  tar -C "$logs" -czf "$OUT/logs.tgz" . 2>/dev/null
}

rows=() failed=0
row() {  # step result seconds detail: printed at once, appended to summary.txt, published
  rows+=("$(printf '%-26s %-22s %5s  %s' "$1" "$2" "$3" "$4")")
  printf '%s\n' "${rows[-1]}" | tee -a "$logs/summary.txt"
  case $2 in FAILED*) failed=1 ;; esac
  publish || true
}
# limit WANTED: a step's timeout, cut to the time left (10 s kept for the table).
limit() { local left=$((deadline - SECONDS - 10)); left=$((left < 1 ? 1 : left)); echo $(($1 < left ? $1 : left)); }
# out_of_time NAME: true (and the row written) when under 30 s are left.
out_of_time() {
  [ $((deadline - SECONDS)) -ge 30 ] && return 1
  row "$1" "skipped: out of time" 0 "FM_GPU_BUDGET_S=${FM_GPU_BUDGET_S:-540}"
  return 0
}
# A file name for a step's label ("decode bench graph" -> decode_bench_graph).
file() { echo "${1// /_}"; }
# why RC LOG: a failed step's detail: its time limit when timeout ended it, else the log's last line.
why() { if [ "$1" -eq 124 ] || [ "$1" -eq 137 ]; then echo "timed out (budget or step limit)"; else tail -1 "$2"; fi; }

gpu=$(nvidia-smi --query-gpu=name,memory.total,compute_cap --format=csv,noheader 2>/dev/null | head -1)
# Without nvidia-smi, the driver's device nodes still say a GPU is there (the steps then find
# out whether CUDA can use it: "CUDA sees no device" fails them).
[ -z "$gpu" ] && [ -e /dev/nvidia0 ] && gpu="a GPU at /dev/nvidia0 (no nvidia-smi)"
echo "run.sh: $mode mode, GPU: ${gpu:-none}, logs in $logs"

# Where each binary is: the build tree, or .devrun/bin with the packed libraries.
if [ $mode = prebuilt ]; then
  # pack.sh ships bin/ and lib/ as one archive (the tool carries at most 64 MiB); it is unpacked
  # outside the repo, so a run here never leaves .devrun too large to carry.
  pk=.devrun
  if [ -f .devrun/pack.tgz ]; then
    pk=$(mktemp -d /tmp/fm-pack.XXXXXX)
    tar -xzf .devrun/pack.tgz -C "$pk" || exit 1
  fi
  chmod +x "$pk"/bin/* 2>/dev/null
  [ -x "$pk/bin/flashmesh" ] || { echo "run.sh: no .devrun/pack.tgz: run tests/gpu/pack.sh on the build machine first" >&2; exit 1; }
  nccl=$(find /usr /opt -name 'libnccl.so.2*' 2>/dev/null | head -1)
  # Only the packed binaries see the packed libraries (not python3, ncu or nvidia-smi).
  [ "$pk" = .devrun ] && pk=$PWD/.devrun
  FM_LD=$pk/lib${nccl:+:$(dirname "$nccl")}:/usr/local/cuda/lib64:${LD_LIBRARY_PATH:-}
  echo "run.sh: binaries of $(cat .devrun/commit), built for $(cat .devrun/march 2>/dev/null), NCCL ${nccl:-not found}"
  bin() { echo "$pk/bin/$1"; }
  # A -march=native pack needs the build machine's vector extensions here.
  if [ -f .devrun/cpuflags ]; then
    lacking=$(comm -23 <(tr ' ' '\n' <.devrun/cpuflags | sort -u) <(grep -o 'avx[0-9a-z_]*' /proc/cpuinfo | sort -u) | tr '\n' ' ')
    if [ -n "$lacking" ]; then
      row "cpu extensions" "FAILED" 0 "this CPU lacks $lacking(the pack is -march=native: pack with tests/gpu/pack.sh, no argument)"
      exit 1
    fi
  fi
  # Every library resolves, from the packed lib/ or from the set pack.sh leaves to the GPU machine.
  t0=$SECONDS missing=""
  for b in "$pk"/bin/*; do
    while read -r name arrow path _; do
      [ "$arrow" = "=>" ] || continue
      case $path in
        "$pk/lib/"*) continue ;;
        not) missing+=" $(basename "$b"):$name(not found)"; continue ;;
      esac
      case $name in
        libc.so*|libm.so*|libpthread.so*|libdl.so*|librt.so*|ld-linux*|libgcc_s.so*|libstdc++.so*) ;;
        libcuda.so*|libnccl.so*) ;;
        *) missing+=" $(basename "$b"):$name(from $path)" ;;
      esac
    done < <(LD_LIBRARY_PATH=$FM_LD ldd "$b")
  done
  if [ -n "$missing" ]; then row "packed libraries" "FAILED" $((SECONDS - t0)) "not packed:$missing"
  elif ! LD_LIBRARY_PATH=$FM_LD "$pk/bin/flashmesh" --help >"$logs/flashmesh-help.log" 2>&1; then row "packed libraries" "FAILED" $((SECONDS - t0)) "flashmesh --help: $(tail -1 "$logs/flashmesh-help.log")"
  else row "packed libraries" "ok" $((SECONDS - t0)) "$(ls "$pk/bin" | wc -l) binaries resolve all libraries"
  fi
else
  FM_LD=${LD_LIBRARY_PATH:-}
  arch=$(nvidia-smi --query-gpu=compute_cap --format=csv,noheader 2>/dev/null | head -1 | tr -d '. ')
  arch=${arch:-90}  # compute_cap 9.0 -> 90 (H100/H200), 12.1 -> 121 (GB10)
  t0=$SECONDS
  if cmake -S . -B "$build" -G Ninja -DCMAKE_BUILD_TYPE=Release -DFLASHMESH_CUDA=ON \
       -DCMAKE_CUDA_ARCHITECTURES="$arch" >"$logs/configure.log" 2>&1 &&
     cmake --build "$build" -j "$(nproc)" --target flashmesh test_cuda_kernels test_cuda_shard \
       bench_cuda_gemv test_integration $(grep -o 'test_nccl_[a-z]*:' "$build/build.ninja" | sort -u | tr -d :) \
       >"$logs/build.log" 2>&1; then
    row "configure + build" "ok" $((SECONDS - t0)) "sm_$arch, $build"
  else
    row "configure + build" "FAILED" $((SECONDS - t0)) "see $logs/configure.log, build.log"
    printf '%s\n' "${rows[@]}"
    exit 1
  fi
  bin() { find "$build/cli" "$build/tests/gpu" "$build/tests/integration" -maxdepth 1 -name "$1" -type f 2>/dev/null | head -1; }
fi

E=(env "LD_LIBRARY_PATH=$FM_LD")   # runs a built or packed binary with its libraries

# missing NAME: true (and the row written) when the binary is absent: a failure in a pack.
missing() {
  local exe
  exe=$(bin "$1")
  [ -n "$exe" ] && [ -x "$exe" ] && return 1
  if [ $mode = prebuilt ]; then row "$1" "FAILED" 0 "not in the pack"; else row "$1" "skipped: not built" 0 ""; fi
  return 0
}
# A GPU that nvidia-smi sees but CUDA cannot use makes every test skip "no CUDA device": a failure.
no_cuda() { [ -n "$gpu" ] && grep -q 'no CUDA device' "$1"; }

# gtest_step NAME TIMEOUT [FILTER]: one test binary, its counts (and first failures) from the log.
gtest_step() {
  local name=$1 filter=${3:-*} t0=$SECONDS rc log="$logs/$1.log"
  missing "$name" && return
  [ -n "$gpu" ] || { row "$name" "skipped: no GPU" 0 ""; return; }
  out_of_time "$name" && return
  timeout -k 10 "$(limit "$2")" "${E[@]}" "$(bin "$name")" --gtest_filter="$filter" >"$log" 2>&1
  rc=$?
  local counts failures
  counts="$(grep -c '^\[       OK \] .* ms)$' "$log") passed, $(grep -c '^\[  SKIPPED \] .* ms)$' "$log") skipped, $(grep -c '^\[  FAILED  \] .* ms)$' "$log") failed"
  failures=$(grep '^\[  FAILED  \] .* ms)$' "$log" | sed 's/.*\] //;s/ (.*//' | head -5 | tr '\n' ' ')
  if no_cuda "$log"; then row "$name" "FAILED" $((SECONDS - t0)) "CUDA sees no device that nvidia-smi shows; $counts"
  elif [ $rc -eq 0 ]; then row "$name" "ok" $((SECONDS - t0)) "$counts"
  else row "$name" "FAILED (rc $rc)" $((SECONDS - t0)) "$counts${failures:+: $failures}"; fi
}

# mkmodel_step NAME ARGS...: writes $models/NAME once (config.json is written last).
mkmodel_step() {
  local name=$1 t0=$SECONDS
  shift
  [ -n "$gpu" ] || { row "mkmodel $name" "skipped: no GPU" 0 "only the device benches use it"; return 1; }
  if [ -f "$models/$name/config.json" ]; then row "mkmodel $name" "ok" 0 "already in $models"; return 0; fi
  out_of_time "mkmodel $name" && return 1
  rm -rf "${models:?}/$name"
  timeout -k 10 "$(limit 300)" "${E[@]}" "$(bin flashmesh)" mkmodel "$@" "$models/$name" >"$logs/mkmodel-$name.log" 2>&1
  local rc=$?
  if [ $rc -eq 0 ]; then
    row "mkmodel $name" "ok" $((SECONDS - t0)) "$(du -sh "$models/$name" | cut -f1)"
  else
    row "mkmodel $name" "FAILED" $((SECONDS - t0)) "$(why $rc "$logs/mkmodel-$name.log")"
    rm -rf "${models:?}/$name"
    return 1
  fi
}

# bench_step LABEL MODEL ARGS...: bench decode on cuda:0, the JSON's main figures in the table.
bench_step() {
  local label=$1 model=$2 t0=$SECONDS out f
  f=$(file "$1")
  shift 2
  [ -n "$gpu" ] || { row "$label" "skipped: no GPU" 0 ""; return; }
  [ -f "$models/$model/config.json" ] || { row "$label" "skipped: no checkpoint" 0 ""; return; }
  out_of_time "$label" && return
  local rc=0
  out=$(timeout -k 10 "$(limit 300)" "${E[@]}" "$(bin flashmesh)" bench decode --model "$models/$model" --device cuda:0 --json "$@" 2>"$logs/$f.err") || rc=$?
  if [ $rc -eq 0 ]; then
    echo "$out" >"$logs/$f.json"
    row "$label" "ok" $((SECONDS - t0)) "$(python3 -c '
import json, sys
j = json.loads(sys.argv[1])
print("%.0f tok/s, bw_eff %.3f, layer %.3f ms, head %.3f ms (rich pick %.3f), %d-layer model %.2f ms/tok (floor %.2f); %d streams %.2fx; h2d %.0f B/tok, d2h %.0f B/tok" % (
    j["tok_per_s"], j["bw_efficiency"], j["layer_ms"], j["head_ms"], j["head_rich_ms"], j["full_model_layers"],
    j["full_model_ms_per_token"], j["full_model_floor_ms"], j["streams"], j["streams_speedup"],
    j["h2d_bytes_per_token"], j["d2h_bytes_per_token"]))' "$out")"
  else
    row "$label" "FAILED" $((SECONDS - t0)) "$(why $rc "$logs/$f.err")"
  fi
}

# cuda_yaml NAME PARALLEL WORKERS INDEX: a loopback cluster of WORKERS cuda:0 workers (TCP
# between them) serving the bench checkpoint, parallel as given, on ports of its own (INDEX: a
# daemon of the step before that still shuts down holds none of them); prints the file's path.
cuda_yaml() {
  local f="$logs/$1.yaml" i p=$((7070 + 300 * $4))
  {
    echo "model: $models/bench"
    echo "coordinator: { listen: 127.0.0.1:$p }"
    echo "parallel: { $2 }"
    echo "transport: tcp"
    echo "nodes:"
    for ((i = 0; i < $3; i++)); do
      echo "  - { name: w$i, control: 127.0.0.1:$((p + 31 + i)), data: 127.0.0.1:$((p + 131 + i)), device: cuda:0, memory_gib: 30 }"
    done
    echo "limits: { max_batch: 8, max_context: 2048, max_queue: 64, max_tokens: 512 }"
  } >"$f"
  echo "$f"
}

# cluster_step LABEL YAML: bench cluster of cuda:0 workers against one cuda:0 worker (`serve
# --device cuda:0`), batch 1 then 8 streams; the ratio and the bytes a token in the table.
cluster_step() {
  local label=$1 yaml=$2 t0=$SECONDS out f
  f=$(file "$1")
  [ -n "$gpu" ] || { row "$label" "skipped: no GPU" 0 ""; return; }
  [ -f "$models/bench/config.json" ] || { row "$label" "skipped: no checkpoint" 0 ""; return; }
  out_of_time "$label" && return
  local rc=0
  out=$(timeout -k 10 "$(limit 240)" "${E[@]}" "$(bin flashmesh)" bench cluster --config "$yaml" --model "$models/bench" \
          --tokens 32 --json 2>"$logs/$f.err") || rc=$?
  if [ $rc -eq 0 ]; then
    echo "$out" >"$logs/$f.json"
    row "$label" "ok" $((SECONDS - t0)) "$(python3 -c '
import json, sys
j = json.loads(sys.argv[1]); c = j["cluster"]
print("%.0f tok/s = %.2f of one cuda worker (%.0f), same tokens %s; h2d %.0f B/tok, d2h %.0f B/tok, wire %.0f B/tok" % (
    c["decode_tok_s"], j["decode_ratio"], j["single"]["decode_tok_s"], j["tokens_match"],
    c["h2d_bytes_per_token"], c["d2h_bytes_per_token"], c["wire_bytes_per_token"]))' "$out")"
  else
    row "$label" "FAILED" $((SECONDS - t0)) "$(why $rc "$logs/$f.err")"
  fi
}

# Nsight Compute, for --profile.
ncu=$(command -v ncu || ls /opt/nvidia/nsight-compute/*/ncu /usr/local/cuda/bin/ncu 2>/dev/null | head -1)

# Per-kernel device time of eager decode steps: ncu's gpu__time_duration of COUNT kernels after
# the first SKIP (the prefill and warm-up steps; well inside the 16 decode steps), clocks left
# alone; a table by kernel. profile MODEL SKIP COUNT (the checkpoint written by mkmodel_step).
profile() {
  local model=$1 skip=$2 count=$3 t0=$SECONDS
  [ -n "$gpu" ] || { row "ncu profile $model" "skipped: no GPU" 0 ""; return; }
  [ -n "$ncu" ] || { row "ncu profile $model" "FAILED" 0 "no ncu on this machine"; return; }
  [ -f "$models/$model/config.json" ] || { row "ncu profile $model" "skipped: no checkpoint" 0 ""; return; }
  out_of_time "ncu profile $model" && return
  timeout -k 10 "$(limit 400)" "$ncu" --clock-control none --print-units base --metrics gpu__time_duration.sum --csv \
    --launch-skip "$skip" --launch-count "$count" "${E[@]}" "$(bin flashmesh)" bench decode --model "$models/$model" \
    --device cuda:0 --context 8 --tokens 16 --eager >"$logs/ncu-$model.csv" 2>"$logs/ncu-$model.err" ||
    { row "ncu profile $model" "FAILED" $((SECONDS - t0)) "$(tail -1 "$logs/ncu-$model.err")"; return; }
  python3 - "$logs/ncu-$model.csv" >"$logs/profile-$model.txt" <<'PY'
import collections, csv, sys
rows = [r for r in csv.reader(open(sys.argv[1])) if len(r) > 10]
head, rows = rows[0], rows[1:]
k, v, u = head.index("Kernel Name"), head.index("Metric Value"), head.index("Metric Unit")
to_us = {"nsecond": 1e-3, "ns": 1e-3, "usecond": 1.0, "us": 1.0, "msecond": 1e3, "ms": 1e3}
total, calls = collections.defaultdict(float), collections.Counter()
for r in rows:
    name = r[k].split("(")[0][:60]
    total[name] += float(r[v].replace(",", "")) * to_us[r[u]]
    calls[name] += 1
all_us = sum(total.values())
print(f"{sum(calls.values())} kernels, {all_us:.1f} us")
for name, us in sorted(total.items(), key=lambda x: -x[1]):
    print(f"{us:10.1f} us {100 * us / all_us:5.1f}%  n={calls[name]:4d}  avg {us / calls[name]:7.2f} us  {name}")
PY
  row "ncu profile $model" "ok" $((SECONDS - t0)) "$(head -1 "$logs/profile-$model.txt"), table in $logs/profile-$model.txt"
  echo "== $model"
  head -20 "$logs/profile-$model.txt"
}

# Why each weight kernel runs at the speed it does: ncu over `bench_cuda_gemv --once` (every case
# launched once), one line per case: time, DRAM throughput, occupancy, issue-slot use,
# instructions, registers, and the main stall reasons (warps stalled per issued instruction:
# long scoreboard = waiting on memory, lg/math throttle = pipes full, wait = fixed latency), the
# pipes' use (% of peak: FMA, ALU, XU = conversions and special functions, LSU, tensor cores) and
# the DRAM bytes read (ncu flushes the caches first: compare with the case's weight bytes).
# Metrics this ncu does not know are left out (--query-metrics), not fatal.
# profile_gemv PART [tail]: one part of bench_cuda_gemv (fma, tc, ovl, fused); its table is
# appended to profile-gemv.txt. "tail": the checks' last step, on the time left: cut short, it
# says so without failing the run.
profile_gemv() {
  local part=$1 tail=${2:-} t0=$SECONDS want metrics="" m avail rc name="ncu bench_cuda_gemv $1"
  [ -n "$gpu" ] || { row "$name" "skipped: no GPU" 0 ""; return; }
  # The checks' tail is a bonus: no ncu, or ncu refused the counters, is not a failed run.
  local failed_row="FAILED"
  [ -n "$tail" ] && failed_row="skipped: ncu failed"
  [ -n "$ncu" ] || { row "$name" "$failed_row" 0 "no ncu on this machine"; return; }
  want="gpu__time_duration.sum dram__throughput.avg.pct_of_peak_sustained_elapsed
        sm__warps_active.avg.pct_of_peak_sustained_active
        smsp__issue_active.avg.pct_of_peak_sustained_active smsp__inst_executed.sum
        launch__registers_per_thread
        smsp__average_warps_issue_stalled_long_scoreboard_per_issue_active.ratio
        smsp__average_warps_issue_stalled_lg_throttle_per_issue_active.ratio
        smsp__average_warps_issue_stalled_math_pipe_throttle_per_issue_active.ratio
        smsp__average_warps_issue_stalled_wait_per_issue_active.ratio
        smsp__average_warps_issue_stalled_barrier_per_issue_active.ratio
        smsp__average_warps_issue_stalled_short_scoreboard_per_issue_active.ratio
        sm__inst_executed_pipe_fma.avg.pct_of_peak_sustained_active
        sm__inst_executed_pipe_alu.avg.pct_of_peak_sustained_active
        sm__inst_executed_pipe_xu.avg.pct_of_peak_sustained_active
        sm__inst_executed_pipe_lsu.avg.pct_of_peak_sustained_active
        sm__pipe_tensor_op_hmma_cycles_active.avg.pct_of_peak_sustained_active
        dram__bytes_read.sum"
  avail=$(timeout 60 "$ncu" --query-metrics 2>/dev/null | awk '{print $1}')
  for m in $want; do
    case $m in gpu__time_duration*|launch__*) metrics+="$m," ;;
      *) grep -qx "${m%%.*}" <<<"$avail" && metrics+="$m," ;; esac
  done
  out_of_time "$name" && return
  timeout -k 10 "$(limit 400)" "$ncu" --clock-control none --print-units base --metrics "${metrics%,}" --csv --log-file "$logs/ncu-gemv-$part.csv" \
    "${E[@]}" "$(bin bench_cuda_gemv)" --once --part "$part" >"$logs/gemv-once-$part.txt" 2>"$logs/ncu-gemv-$part.err"
  rc=$?
  if [ $rc -ne 0 ]; then
    if [ -n "$tail" ] && { [ $rc -eq 124 ] || [ $rc -eq 137 ]; }; then
      row "$name" "cut: out of time" $((SECONDS - t0)) "the checks' leftover time did not cover it"
    else
      row "$name" "$failed_row" $((SECONDS - t0)) "$(why $rc "$logs/ncu-gemv-$part.err")"
    fi
    return
  fi
  python3 - "$logs/ncu-gemv-$part.csv" "$logs/gemv-once-$part.txt" "$part" >>"$logs/profile-gemv.txt" <<'PY'
import collections, csv, re, sys
lines = open(sys.argv[1]).read().splitlines()
rows = [r for r in csv.reader(lines[next(i for i, l in enumerate(lines) if l.startswith('"ID"')):])]
head, rows = rows[0], rows[1:]
i_id, i_m, i_u, i_v = (head.index(h) for h in ("ID", "Metric Name", "Metric Unit", "Metric Value"))
labels = dict(re.findall(r"^launch (\d+): (.*)$", open(sys.argv[2]).read(), re.M))
# Times in us whatever unit ncu picked; counts in millions; the rest as given (%, ratios).
scale = {"nsecond": 1e-3, "ns": 1e-3, "usecond": 1.0, "us": 1.0, "msecond": 1e3, "ms": 1e3}
mb = {"byte": 1e-6, "Kbyte": 1e-3, "KB": 1e-3, "Mbyte": 1.0, "MB": 1.0, "Gbyte": 1e3, "GB": 1e3}
vals = collections.defaultdict(dict)
for r in rows:
    v = float(r[i_v].replace(",", "")) if r[i_v].replace(",", "").replace(".", "").isdigit() else None
    if v is not None and r[i_m].startswith("gpu__time_duration"): v *= scale.get(r[i_u], float("nan"))
    if v is not None and r[i_m] == "smsp__inst_executed.sum": v *= 1e-6
    if v is not None and r[i_m] == "dram__bytes_read.sum": v *= mb.get(r[i_u], float("nan"))
    vals[r[i_id]][r[i_m]] = v
cols = [("us", "gpu__time_duration.sum"), ("dram%", "dram__throughput"),
        ("occ%", "sm__warps_active"), ("issue%", "smsp__issue_active"),
        ("Minst", "smsp__inst_executed.sum"), ("regs", "launch__registers_per_thread"),
        ("longsb", "long_scoreboard"), ("lgthr", "lg_throttle"), ("math", "math_pipe"),
        ("wait", "stalled_wait"), ("barr", "barrier"), ("shortsb", "short_scoreboard"),
        ("fma%", "pipe_fma."), ("alu%", "pipe_alu."), ("xu%", "pipe_xu."), ("lsu%", "pipe_lsu."),
        ("tc%", "tensor_op_hmma"), ("MBread", "dram__bytes_read")]
print("== part " + sys.argv[3])
print("%-44s" % "case" + "".join("%8s" % c[0] for c in cols))
for k in sorted(vals, key=int):
    out = []
    for _, key in cols:
        v = next((x for name, x in vals[k].items() if key in name), None)
        out.append("%8s" % "-" if v is None else "%8.2f" % v)
    print("%-44s" % labels.get(k, "launch " + k)[:44] + "".join(out))
PY
  row "$name" "ok" $((SECONDS - t0)) "$(grep -c '^launch ' "$logs/gemv-once-$part.txt") cases, table in $logs/profile-gemv.txt"
  echo "== bench_cuda_gemv --once --part $part"
  sed -n "/^== part $part\$/,\$p" "$logs/profile-gemv.txt"
}

# gemv_step PART LIMIT: one part of bench_cuda_gemv in a process of its own (a CUDA fault is
# sticky for its context: it costs only that part's lines), appended to bench_cuda_gemv.log.
gemv_step() {
  local part=$1 name="bench_cuda_gemv $1" t0=$SECONDS rc log="$logs/bench_cuda_gemv-$1.log"
  missing bench_cuda_gemv && return
  [ -n "$gpu" ] || { row "$name" "skipped: no GPU" 0 ""; return; }
  out_of_time "$name" && return
  timeout -k 10 "$(limit "$2")" "${E[@]}" "$(bin bench_cuda_gemv)" --part "$part" >"$log" 2>&1
  rc=$?
  cat "$log" >>"$logs/bench_cuda_gemv.log"
  if no_cuda "$log"; then row "$name" "FAILED" $((SECONDS - t0)) "CUDA sees no device"
  elif [ $rc -eq 0 ]; then row "$name" "ok" $((SECONDS - t0)) "$(grep -c ' of probe' "$log") cases (bench_cuda_gemv.log)"
  elif [ $rc -eq 124 ] || [ $rc -eq 137 ]; then row "$name" "FAILED (rc $rc)" $((SECONDS - t0)) "$(why $rc /dev/null) after $(grep -c ' of probe' "$log") cases"
  else row "$name" "FAILED (rc $rc)" $((SECONDS - t0)) "$(grep -m3 FAILED "$log" | tr '\n' ' ')"; fi
}

if [ $profile = 1 ]; then
  # The weight kernels' stall reasons first (the measurement docs/performance.md asks for
  # next), then the per-kernel time of decode steps. Launches of a step: ~12 a layer + the
  # head; bench preset 8 layers, flash2 2.
  profile_gemv fma
  profile_gemv tc
  mkmodel_step bench --preset bench && profile bench 400 600
  mkmodel_step flash2 --preset flash --layers 2 && profile flash2 120 330
else
  # Most wanted first: the kernel tests (the new kernels' race checks), the weight kernels' and
  # the decode's speed, the device shard's tests, the real shapes, the clusters, NCCL; then,
  # on the time left, ncu's view of the weight kernels.
  gtest_step test_cuda_kernels 240
  gemv_step fma 90
  gemv_step tc 90
  gemv_step ovl 45
  gemv_step fused 60
  mkmodel_step bench --preset bench
  bench_step "decode bench graph" bench --context 64 --tokens 64 --streams 8
  bench_step "decode bench graph tc" bench --context 64 --tokens 64 --streams 8 --weight-core tc
  bench_step "decode bench graph ovl" bench --context 64 --tokens 64 --streams 8 --launch-overlap
  gtest_step test_cuda_shard 240
  mkmodel_step flash2 --preset flash --layers 2
  bench_step "decode flash2 graph" flash2 --context 256 --tokens 32 --streams 8
  bench_step "decode flash2 graph tc" flash2 --context 256 --tokens 32 --streams 8 --weight-core tc
  bench_step "decode flash2 graph ovl" flash2 --context 256 --tokens 32 --streams 8 --launch-overlap
  bench_step "decode flash2 graph tc ovl" flash2 --context 256 --tokens 32 --streams 8 \
    --weight-core tc --launch-overlap
  bench_step "decode bench eager" bench --context 64 --tokens 64 --eager
  cluster_step "cluster pp2 cuda" "$(cuda_yaml pp2 'pipeline_stages: 2, expert_parallel: 1' 2 0)"
  cluster_step "cluster ep2 cuda" "$(cuda_yaml ep2 'pipeline_stages: 1, expert_parallel: 2' 2 1)"
  cluster_step "cluster tp2 cuda" "$(cuda_yaml tp2 'pipeline_stages: 1, tensor_parallel: 2' 2 2)"
  gtest_step test_nccl_smoke 60
  gtest_step test_nccl_communicator 90
  gtest_step test_integration 240 'DeviceShard.*:ExpertParallel.Nccl*'
  for part in fma tc; do
    if [ $((deadline - SECONDS)) -ge 120 ]; then profile_gemv $part tail
    else row "ncu bench_cuda_gemv $part" "skipped: out of time" 0 "needs 120 s; run.sh --prebuilt --profile does it first"; fi
  done
fi
[ -n "$gpu" ] && nvidia-smi >"$logs/nvidia-smi.txt" 2>&1

{
  echo "==== GPU checks: ${gpu:-no GPU}, $mode, $((SECONDS))s, logs $logs"
  printf '%-26s %-22s %5s  %s\n' step result s detail
  printf '%s\n' "${rows[@]}"
} | tee "$logs/summary.txt"
# The bench_cuda_gemv lines docs/performance.md asks for, last, so that they are in the reply's
# tail (the full log comes back in $OUT): T=1 and T=8 of each shape and core, ovl, the fused
# kernels, every part's probe and failures; runs of spaces squeezed.
if [ -s "$logs/bench_cuda_gemv.log" ]; then
  echo "==== bench_cuda_gemv digest"
  grep -E '^device read probe| T=1 | T=8 |^ovl|GemmMany|Experts|HcPostPre|IndexerTopK|SinkAttention|^FAILED' \
    "$logs/bench_cuda_gemv.log" | sed -E 's/ {2,}/ /g' | head -n 90
fi
publish || true
exit $failed
