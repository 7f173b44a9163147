#!/usr/bin/env bash
# The main job end to end on the embedded default (the tiny preset):
#   make a checkpoint -> tune this host (quick profile, cost-model search, validation on the runtime)
#   -> serve the tuned plan over the OpenAI API -> a short load test -> a comparison report against
#   the published 5090-epyc host. Also: the full-size V4.1 layout as a header-only skeleton, planned
#   for that published host, and its plan exported as a llama.cpp launch line.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
. .venv/bin/activate
OUT=${DSV41_DEMO_DIR:-out/demo}
mkdir -p "$OUT"
dsv41-checkpoint make --preset tiny --out "$OUT/tiny" --seed 0
dsv41-checkpoint inspect "$OUT/tiny"
# where should each byte of the full V4.1 live on a published host, and how fast will it be?
dsv41-checkpoint make --preset deepseek-v4.1-flash --skeleton --out "$OUT/v41-skeleton"
dsv41-tune plan --profile profiles/5090-epyc.json --checkpoint "$OUT/v41-skeleton" --prompt-tokens 8192
dsv41-tune export --profile profiles/5090-epyc.json --to llama.cpp
# this host: profile -> search -> validate -> the tuned profile (it records the checkpoint it was made with)
dsv41-tune --checkpoint "$OUT/tiny" --quick --out "$OUT/host.json" --prompt-tokens 96 --max-tokens 16 \
  --storage "sqlite:///$OUT/studies.db"
# serve it, load-test it, compare hosts
PORT=$(python -c 'import socket; s = socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])')
dsv41-serve --profile "$OUT/host.json" --port "$PORT" 2> "$OUT/serve.log" &
SERVER=$!
trap 'kill $SERVER 2>/dev/null || true' EXIT
python - "$PORT" "$SERVER" <<'PY'
import sys, time, httpx, os
url = f"http://127.0.0.1:{sys.argv[1]}/health"
for _ in range(600):
    try:
        if httpx.get(url, timeout=1).status_code == 200:
            sys.exit(0)
    except httpx.HTTPError:
        pass
    try:
        os.kill(int(sys.argv[2]), 0)
    except OSError:
        sys.exit("dsv41-serve exited; see serve.log")
    time.sleep(0.5)
sys.exit("dsv41-serve did not come up")
PY
dsv41-bench --url "http://127.0.0.1:$PORT" --requests 8 --concurrency 2 --prompt-tokens 64 --output-tokens 16 \
  --warmup 2 --out "$OUT/bench.jsonl"
dsv41-report profiles/5090-epyc.json "$OUT/host.json" "$OUT/bench.jsonl" --out "$OUT/report"
echo "report: $OUT/report/report.html"
