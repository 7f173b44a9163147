"""The tuner's pick against a measured grid of plans on the mini checkpoint, with the noise floor.

  python benchmarks/tuner_regret.py [--checkpoint out/mini] [--plans 16] [--max-minutes 20] [--json]

A fractional grid (seeded sample of the full product) over the knobs that matter on this host:
CPU-MoE threads, prefill chunk and mode (bounded_replay included, so the tuner runs with
--allow-inexact-prefill), Engram placement / depth / row cache, DSpark on/length. Each plan is loaded
once and measured cold then warm (repeats); the noise floor comes from repeats of one plan; the tuner
(`dsv41-tune --quick`, same workload) then picks, and its pick is measured the same way. Regret =
(best grid decode tok/s - pick's) / best; the model's error = median |predicted - measured| / measured
over the tuner's validated plans. The grid stops early at --max-minutes (what was measured is used).
With --json the last line holds regret, median_abs_error, noise_floor and the rows.
"""
from __future__ import annotations

import argparse
import itertools
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from hostinfo import usable_cores  # noqa: E402
from runtime.checkpoint.reader import Checkpoint  # noqa: E402
from runtime.engine import Engine  # noqa: E402
from runtime.plan import Plan  # noqa: E402
from runtime.workload import Workload, make_prompt  # noqa: E402


def grid(n: int, seed: int, geometry_hash: str) -> list[Plan]:
    cores = usable_cores()
    axes = {"cpu_threads": sorted({1, cores}), "prefill_chunk": [128, 512], "prefill_mode": ["full", "bounded_replay"],
            "engram": [("host", 8, 0), ("nvme_direct", 1, 0), ("nvme_direct", 16, 0), ("nvme_direct", 16, 64)],
            "dspark": [(False, 2), (True, 2)]}
    full = list(itertools.product(*axes.values()))
    pick = np.random.default_rng(seed).choice(len(full), size=min(n, len(full)), replace=False)
    plans = []
    for i in pick:                                   # random order: a time cap cuts a random subset
        th, ch, mode, (pl, depth, cache), (ds, d) = full[i]
        plans.append(Plan(cpu_threads=th, prefill_chunk=ch, prefill_mode=mode, engram_placement=pl, engram_io_depth=depth,
                          engram_row_cache_mib=cache, dspark=ds, draft_length=d, max_context=2048, geometry_hash=geometry_hash))
    return plans


def measure(ck, plan, prompt, wl, repeats):
    e = Engine(ck, plan)
    try:
        cold = e.generate(prompt, wl.max_tokens)
        warm = [e.generate(prompt, wl.max_tokens) for _ in range(repeats)]
    finally:
        e.close()
    return {"plan": plan.to_dict(), "cold_decode_tok_s": cold.decode_tok_s, "cold_ttft_s": cold.ttft_s,
            "decode_samples": [w.decode_tok_s for w in warm], "ttft_samples": [w.ttft_s for w in warm],
            "decode_tok_s": statistics.median(w.decode_tok_s for w in warm), "ttft_s": statistics.median(w.ttft_s for w in warm)}


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--checkpoint", default="out/mini")
    ap.add_argument("--plans", type=int, default=16)
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--prompt-tokens", type=int, default=192)
    ap.add_argument("--max-tokens", type=int, default=12)
    ap.add_argument("--max-minutes", type=float, default=20)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args(argv)
    if not (Path(args.checkpoint) / "model.safetensors.index.json").exists():
        subprocess.run([sys.executable, "-m", "runtime.cli.checkpoint", "make", "--preset", "mini", "--out", args.checkpoint], check=True)
    ck = Checkpoint(args.checkpoint)
    wl = Workload(prompt_tokens=args.prompt_tokens, max_tokens=args.max_tokens)
    from tokenizers import Tokenizer
    prompt = make_prompt(Tokenizer.from_file(str(ck.root / "tokenizer.json")), wl.prompt_tokens, seed=7)
    t_end = time.time() + args.max_minutes * 60
    rows = []
    for plan in grid(args.plans, args.seed, ck.config.geometry_hash()):
        if time.time() > t_end:
            print(f"time cap reached after {len(rows)} plans")
            break
        r = measure(ck, plan, prompt, wl, args.repeats)
        rows.append(r)
        p = r["plan"]
        print(f"grid  threads {p['cpu_threads']} chunk {p['prefill_chunk']:4d} {p['prefill_mode']:14s} {p['engram_placement']:11s} "
              f"qd{p['engram_io_depth']:<2d} cache {p['engram_row_cache_mib']:3d} dspark {'d=' + str(p['draft_length']) if p['dspark'] else 'off':4s}"
              f" -> {r['decode_tok_s']:6.2f} tok/s, TTFT {r['ttft_s']:6.2f} s", flush=True)
    best = max(rows, key=lambda r: r["decode_tok_s"])
    again = measure(ck, Plan.from_dict(best["plan"]), prompt, wl, max(3, args.repeats))   # the noise floor: one plan, repeated
    s = best["decode_samples"] + again["decode_samples"]
    floor = (max(s) - min(s)) / 2 / statistics.median(s)
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "tuned.json"
        subprocess.run([sys.executable, "-m", "autotune.cli", "--checkpoint", str(ck.root), "--quick", "--allow-inexact-prefill",
                        "--prompt-tokens", str(wl.prompt_tokens), "--max-tokens", str(wl.max_tokens), "--out", str(out),
                        "--storage", f"sqlite:///{tmp}/s.db"], check=True)
        tuned = json.loads(out.read_text())
    pick_plan = Plan.from_dict(tuned["plan"])
    picked = measure(ck, pick_plan, prompt, wl, args.repeats)
    best_tok = max(best["decode_tok_s"], statistics.median(s))
    regret = max(0.0, (best_tok - picked["decode_tok_s"]) / best_tok)
    errs = [abs(r["predicted"]["decode_tok_s"] - r["measured"]["decode_tok_s"]) / r["measured"]["decode_tok_s"]
            for r in tuned["validation"]["rows"]]
    out = {"regret": regret, "median_abs_error": statistics.median(errs), "noise_floor": floor,
           "grid_best_tok_s": best_tok, "pick_tok_s": picked["decode_tok_s"], "pick": tuned["plan"], "rows": rows}
    print(f"grid best {best_tok:.2f} tok/s, tuner's pick {picked['decode_tok_s']:.2f} -> regret {100 * regret:.1f}% "
          f"(noise floor {100 * floor:.1f}%); median |predicted - measured| / measured {100 * out['median_abs_error']:.1f}%")
    if args.json:
        print(json.dumps(out))
    return out


if __name__ == "__main__":
    main()
