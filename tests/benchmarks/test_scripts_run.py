"""The benchmark scripts run to the end (issue "speed on every ISA": on any host). Only the one that
takes any checkpoint runs here, on tiny and on one core, with a small probe budget: the figures are
not what this checks (benchmarks are scripts, not tests), that every line and JSON key is produced is."""
import json
import math
import os
import subprocess
import sys
from pathlib import Path

SCRIPTS = Path(__file__).resolve().parents[2] / "benchmarks"


def test_decode_roofline_runs_to_the_end_on_tiny_and_one_core(tiny_dir):
    env = {k: v for k, v in os.environ.items() if not k.startswith("DSV41_")}
    env.update(DSV41_CORES="1", DSV41_PROBE_MIB="128")
    p = subprocess.run([sys.executable, str(SCRIPTS / "decode_roofline.py"), "--checkpoint", str(tiny_dir), "--rounds", "2",
                        "--prompt-tokens", "16", "--max-tokens", "4", "--json"], env=env, capture_output=True, text=True, timeout=300)
    assert p.returncode == 0, p.stderr[-3000:]
    out = json.loads(p.stdout.strip().splitlines()[-1])
    assert out["threads"] == 1 and len(out["rounds"]) == 2
    for k in ("decode_tok_s", "decode_ratio", "decode_kernel_ratio", "moe_engine_vs_replay", "prefill_ratio", "stream_gbs",
              "cpu_moe_kernel_gbs", "dense_gemv_gbs", "matmul_peak_gflops"):
        assert math.isfinite(out[k]) and out[k] > 0, (k, out[k])
    assert "of their speed replayed alone" in p.stdout


def test_decode_roofline_refuses_a_run_with_no_decode_step(tiny_dir):
    p = subprocess.run([sys.executable, str(SCRIPTS / "decode_roofline.py"), "--checkpoint", str(tiny_dir), "--max-tokens", "1"],
                       capture_output=True, text=True, timeout=120)
    assert p.returncode == 2 and "--max-tokens 1: at least 2" in p.stderr, p.stderr[-2000:]
