#!/usr/bin/env bash
# The main job end to end on the embedded default (the tiny preset): make a checkpoint and inspect
# its footprint, then the full-size V4.1 layout as a header-only skeleton.
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
