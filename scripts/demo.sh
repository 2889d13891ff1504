#!/usr/bin/env bash
# The main job, from a fresh machine: install deps, build, generate a small test model,
# start a local 3-stage pipeline cluster (configs/local-pp3.yaml), run one generate call,
# print the cluster status table, and stop the cluster.
set -euo pipefail
cd "$(dirname "$0")/.."
JOBS=${JOBS:-$(nproc)}
bash scripts/install-deps.sh
cmake -S . -B build -G Ninja -DCMAKE_BUILD_TYPE=Release >/dev/null
cmake --build build -j "$JOBS" --target flashmesh
FM=build/cli/flashmesh
[ -f out/small/config.json ] || $FM mkmodel --preset small --seed 1 out/small
CONFIG=configs/local-pp3.yaml
SERVER=$(awk '/listen:/ {gsub(/[{},]/," "); for (i=1;i<=NF;i++) if ($i=="listen:") print $(i+1)}' "$CONFIG" | head -1)
$FM up --config "$CONFIG" &
UP_PID=$!
trap 'kill -INT $UP_PID 2>/dev/null; wait $UP_PID 2>/dev/null || true' EXIT
for _ in $(seq 1 120); do
  $FM health --server "$SERVER" >/dev/null 2>&1 && break
  kill -0 $UP_PID 2>/dev/null || { echo "demo: cluster exited early" >&2; exit 1; }
  sleep 0.5
done
$FM health --server "$SERVER"
echo "--- generate"
$FM generate --server "$SERVER" --prompt "The capital of France is" --max-tokens 24 --greedy
echo
echo "--- status"
$FM status --server "$SERVER"
