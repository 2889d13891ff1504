#!/usr/bin/env bash
# How long a running stream stalls while a burst of long prompts prefills, for several
# limits.max_step_tokens (chunked prefill, docs/operations.md "Limits and tuning"), in one run.
# A streamed completion of 4000 tokens starts, then four 8000-token prompts arrive; the largest
# gaps between the stream's events are printed per setting. 40000 lets all four prompts into
# one step, as before chunked prefill.
#   bench/chunked_prefill_stall.sh [MODEL_DIR (default out/small)] [SETTINGS... (default 2048 8192 40000)]
set -euo pipefail
cd "$(dirname "$0")/.."
model=${1:-out/small}
shift || true
settings=("$@")
[ ${#settings[@]} -gt 0 ] || settings=(2048 8192 40000)
bin=build/cli/flashmesh
work=$(mktemp -d)
trap 'kill $(jobs -p) 2>/dev/null || true; rm -rf "$work"' EXIT
python3 -c "import json;print(json.dumps({'prompt':[10+(i%4000) for i in range(8000)],'max_tokens':2,'ignore_eos':True}))" \
  > "$work/p8k.json"
cat > "$work/gaps.py" <<'EOF'
import http.client, json, sys, time
c = http.client.HTTPConnection("127.0.0.1", int(sys.argv[1]), timeout=600)
c.request("POST", "/v1/completions", headers={"Content-Type": "application/json"},
          body=json.dumps({"prompt": "hi", "max_tokens": 4000, "ignore_eos": True, "stream": True}))
r = c.getresponse(); last = t0 = time.time(); gaps = []
for line in r:
    if line.startswith(b"data:"):
        now = time.time(); gaps.append(now - last); last = now
        if b"[DONE]" in line: break
top = sorted(gaps)[-3:][::-1]
print(f"{len(gaps)} events in {time.time() - t0:.1f} s, largest gaps {', '.join(f'{g:.2f}' for g in top)} s")
EOF
port=$((27000 + RANDOM % 2000))
for m in "${settings[@]}"; do
  port=$((port + 2))
  "$bin" serve --model "$model" --listen 127.0.0.1:$port --http 127.0.0.1:$((port + 1)) --threads 2 \
    --max-step-tokens "$m" > "$work/serve_$m.log" 2>&1 &
  serve=$!
  for _ in $(seq 1 120); do curl -sf 127.0.0.1:$((port + 1))/health > /dev/null && break; sleep 0.5; done
  python3 "$work/gaps.py" $((port + 1)) > "$work/gaps_$m.txt" &
  stream=$!
  sleep 1
  burst=()
  for _ in 1 2 3 4; do
    curl -s -o /dev/null 127.0.0.1:$((port + 1))/v1/completions -H 'Content-Type: application/json' \
      --data-binary @"$work/p8k.json" & burst+=($!)
  done
  wait "${burst[@]}" "$stream"
  echo "max_step_tokens $m: $(cat "$work/gaps_$m.txt")"
  kill "$serve"; wait "$serve" 2>/dev/null || true
done
