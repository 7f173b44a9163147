#!/usr/bin/env bash
# The GPU check, for a lent CUDA machine (one command, a few minutes). It needs torch, triton, numba,
# tokenizers, safetensors, rich and psutil (no optuna, no fastapi, no network) and writes JSON and logs
# under $OUT (default out/gpu-check):
#   device.txt        torch / CUDA / device name
#   pytest.log        every CUDA-capable test: Triton kernels, the Triton slot cache, the runtime vs reference,
#                     the device's dense weights against the plan's count
#   runs.jsonl        dsv41-run with three plans on a tiny checkpoint (one with a 32 GiB vram_budget), a line each;
#   runs.err          their logs (8 files at most come back from a lent machine: these are the 8)
#   gpu_kernels.json  the Triton kernels against the device copy bandwidth
#   probes.json       the DRAM stream read probe
#   profile.json      dsv41-tune profile --quick: GPU memory read and bf16 matmul, PCIe copies, the expert
#                     gather with repeats (pinned bank bounded by the probe memory budget), the contended
#                     CPU-MoE + gather pair
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-out/gpu-check}
mkdir -p "$OUT"
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
CK=${CK:-/tmp/dsv41-gpu-tiny}
PY=${PYTHON:-python3}
"$PY" -c "import torch, numpy, numba; print(torch.__version__, torch.version.cuda, torch.cuda.is_available(), torch.cuda.get_device_name(0) if torch.cuda.is_available() else '-', 'numpy', numpy.__version__, 'numba', numba.__version__)" | tee "$OUT/device.txt"
"$PY" -c "import triton; print('triton', triton.__version__)" >> "$OUT/device.txt" 2>&1
"$PY" -m runtime.cli.checkpoint make --preset tiny --out "$CK" --seed 0 || exit 1
timeout 300 "$PY" -m pytest -q -p no:cacheprovider --durations=15 tests/kernels/test_triton_gpu.py tests/runtime/test_device_slots.py \
  tests/runtime/test_runtime.py tests/runtime/test_memory.py 2>&1 | tee "$OUT/pytest.log"
i=0                        # at most 8 files come back from a lent machine: the runs share two
: > "$OUT/runs.jsonl"; : > "$OUT/runs.err"
for plan in '{"moe_strategy": "cpu", "prefill_chunk": 16}' \
            '{"moe_strategy": "offload", "slot_cache_experts": 64, "prefill_chunk": 7}' \
            '{"moe_strategy": "hybrid", "slot_cache_experts": 32, "fetch_fraction": 0.5, "vram_budget_gib": 32}'; do
  i=$((i + 1))
  echo "$plan" > "/tmp/dsv41-plan-$i.json"
  echo "== run $i: $plan" >> "$OUT/runs.err"
  timeout 90 "$PY" -m runtime.cli.run --checkpoint "$CK" --plan "/tmp/dsv41-plan-$i.json" --prompt-tokens 200 --max-tokens 32 --json \
    >> "$OUT/runs.jsonl" 2>> "$OUT/runs.err" || echo "run $i failed (see runs.err)"
done
timeout 90 "$PY" benchmarks/gpu_kernels.py > "$OUT/gpu_kernels.json" 2>&1 || echo "gpu_kernels failed"
"$PY" -c "
import json; from kernels.stream import dram_stream_read; from hostinfo import usable_cores
m = dram_stream_read(usable_cores(), repeats=3)
print(json.dumps({'dram_stream_read_gbs': m.to_dict()}))" > "$OUT/probes.json" 2>&1 || echo "probes failed"
timeout 200 "$PY" -m autotune.cli profile --checkpoint "$CK" --quick --out "$OUT/profile.json" > "$OUT/profile.log" 2>&1 \
  || echo "profile failed (see profile.log)"
tail -3 "$OUT/pytest.log"
