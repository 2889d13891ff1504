#!/usr/bin/env bash
# Time to first token of a short prompt that arrives behind a long one on a pipeline, and of the
# long one (docs/performance.md "Chunked prefill on a pipeline"). Starts the YAML's cluster with
# `up` (1 kernel thread a worker), sends a LONG-token prompt, 150 ms later a 4-token one, each
# with max_tokens 1, three times, and prints both wall times. Set limits.max_step_tokens in the
# YAML below LONG so that the long prompt goes in chunks.
#   bench/short_behind_long.sh CONFIG API_ADDR (the YAML's coordinator.listen) [LONG (default 1536)]
set -euo pipefail
if [ $# -lt 2 ]; then
  echo "usage: bench/short_behind_long.sh CONFIG API_ADDR [LONG (default 1536)]" >&2
  exit 2
fi
config=$(realpath "$1")
api=$2
long=${3:-1536}
cd "$(dirname "$0")/.."
bin=build/cli/flashmesh
work=$(mktemp -d)
# up stops its workers on SIGTERM; waiting for it frees the YAML's ports for the next run.
trap 'kill $(jobs -p) 2>/dev/null || true; wait || true; rm -rf "$work"' EXIT
# Something already answering there would be timed instead of this cluster.
if "$bin" health --server "$api" > /dev/null 2>&1; then
  echo "$api already answers: stop what runs there first" >&2
  exit 1
fi
"$bin" up --config "$config" --threads 1 --log-level warn > "$work/up.log" 2>&1 &
up_pid=$!
for _ in $(seq 1 120); do
  kill -0 "$up_pid" 2> /dev/null || { cat "$work/up.log"; exit 1; }
  "$bin" health --server "$api" > /dev/null 2>&1 && break
  sleep 0.5
done
"$bin" health --server "$api" > /dev/null || { cat "$work/up.log"; exit 1; }
ids=$(python3 -c "print(','.join(str(3 + (i * 31) % 200) for i in range($long)))")
now_ms() { date +%s%3N; }
for try in 1 2 3; do
  "$bin" generate --server "$api" --tokens "$ids" --max-tokens 1 --format ids --log-level warn > /dev/null &
  long_pid=$!
  sleep 0.15
  start=$(now_ms)
  "$bin" generate --server "$api" --tokens 5,6,7,8 --max-tokens 1 --format ids --log-level warn > /dev/null
  short_end=$(now_ms)
  wait "$long_pid"
  long_end=$(now_ms)
  echo "try $try: short prompt $((short_end - start)) ms; the $long-token one done $((long_end - start)) ms after the short one started"
done
