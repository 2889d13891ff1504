#!/usr/bin/env bash
# The n choices of one HTTP request share their prompt's prefill (docs/architecture.md "Shared
# prompts"): times one /v1/completions request with n choices against n separate requests of
# the same prompt sent at once (choice i and request i seeded alike), twice, on one `serve`
# process, and checks that they gave the same tokens and logprobs (docs/performance.md "Shared prompts").
#   bench/shared_prompt.sh MODEL_DIR [PROMPT_TOKENS (default 512)] [N (default 8)] [PORT (default 18731)]
set -euo pipefail
if [ $# -lt 1 ]; then
  echo "usage: bench/shared_prompt.sh MODEL_DIR [PROMPT_TOKENS] [N] [PORT]" >&2
  exit 2
fi
model=$(realpath "$1")
prompt=${2:-512}
n=${3:-8}
port=${4:-18731}
cd "$(dirname "$0")/.."
bin=build/cli/flashmesh
work=$(mktemp -d)
trap 'kill $(jobs -p) 2>/dev/null || true; wait || true; rm -rf "$work"' EXIT
if python3 -c "import urllib.request; urllib.request.urlopen('http://127.0.0.1:$port/health', timeout=2)" 2>/dev/null; then
  echo "127.0.0.1:$port already answers: stop what runs there first" >&2
  exit 1
fi
"$bin" serve --model "$model" --http "127.0.0.1:$port" --listen 127.0.0.1:$((port + 1)) --log-level warn \
  > "$work/serve.log" 2>&1 &
for _ in $(seq 1 120); do
  python3 -c "import urllib.request; urllib.request.urlopen('http://127.0.0.1:$port/health', timeout=2)" 2>/dev/null && break
  sleep 0.5
done
python3 - "$port" "$prompt" "$n" <<'PY'
import json, sys, threading, time, urllib.request
port, P, n = (int(a) for a in sys.argv[1:4])
prompt = [10 + (k * 37) % 250 for k in range(P)]
def call(body):
    req = urllib.request.Request(f"http://127.0.0.1:{port}/v1/completions", json.dumps(body).encode(),
                                 {"Content-Type": "application/json"})
    return json.loads(urllib.request.urlopen(req, timeout=600).read())
base = {"prompt": prompt, "max_tokens": 4, "temperature": 1.0, "seed": 5, "ignore_eos": True, "logprobs": 0}
def tokens(choice):   # ids as text pieces and their logprobs: a text alone may be empty
    return choice["logprobs"]["tokens"], choice["logprobs"]["token_logprobs"]
call(dict(base, max_tokens=1))   # warm
for _ in range(2):
    t = time.time()
    alone = [None] * n
    def one(i): alone[i] = call(dict(base, seed=5 + i))
    threads = [threading.Thread(target=one, args=(i,)) for i in range(n)]
    for th in threads: th.start()
    for th in threads: th.join()
    separate = time.time() - t
    t = time.time()
    shared = call(dict(base, n=n))
    together = time.time() - t
    same = all(tokens(shared["choices"][i]) == tokens(alone[i]["choices"][0]) for i in range(n))
    print(f"prompt {P} tokens, n {n}: {n} separate requests {separate:.2f} s, one request of n = {n} "
          f"{together:.2f} s, ratio {separate / together:.2f}, same tokens and logprobs: {same}")
PY
