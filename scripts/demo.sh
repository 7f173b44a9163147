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
dsv41-checkpoint inspect "$OUT/v41-skeleton" --json | python -m json.tool | head -40
# where should each byte of the full V4.1 live on a published host, and how fast will it be?
dsv41-tune plan --profile profiles/5090-epyc.json --checkpoint "$OUT/v41-skeleton" --prompt-tokens 8192
