#!/usr/bin/env bash
# The main job end to end on the embedded default (the tiny preset): make a checkpoint and inspect its
# footprint; the full-size V4.1 layout as a header-only skeleton, planned for the published 5090-epyc
# host; then this host: profile (quick), plan with the cost model, and run the plan on the runtime.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
. .venv/bin/activate
OUT=${DSV41_DEMO_DIR:-out/demo}
mkdir -p "$OUT"
dsv41-checkpoint make --preset tiny --out "$OUT/tiny" --seed 0
dsv41-checkpoint inspect "$OUT/tiny"
dsv41-checkpoint make --preset deepseek-v4.1-flash --skeleton --out "$OUT/v41-skeleton"
dsv41-checkpoint inspect "$OUT/v41-skeleton" --json > "$OUT/v41-footprint.json"
python - "$OUT/v41-footprint.json" <<'PY'
import json, sys
d = json.load(open(sys.argv[1]))
for k in ("expert_bytes", "routed_expert_bytes_total", "engram_bytes_total", "routed_bytes_per_decode_token",
          "engram_bytes_per_token", "encoder_pass_bytes", "full_pass_bytes", "kv_bytes_per_token", "n_routed_expert_tensors"):
    print(f"{k:32s} {d[k]:>18,.0f}")
PY
# where should each byte of the full V4.1 live on a published host, and how fast will it be?
dsv41-tune plan --profile profiles/5090-epyc.json --checkpoint "$OUT/v41-skeleton" --prompt-tokens 8192
# this host, on the tiny checkpoint: profile -> plan -> run
dsv41-tune profile --checkpoint "$OUT/tiny" --quick --out "$OUT/host-profile.json"
dsv41-tune plan --profile "$OUT/host-profile.json" --checkpoint "$OUT/tiny" --prompt-tokens 256 --max-tokens 32 \
  --trials 500 --storage "sqlite:///$OUT/studies.db" --json > "$OUT/plan.json"
dsv41-run --checkpoint "$OUT/tiny" --plan "$OUT/plan.json" --prompt-tokens 256 --max-tokens 32
