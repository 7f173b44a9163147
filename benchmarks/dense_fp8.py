"""Decode on mini with the dense linears in FP8 as stored (the runtime) vs float32 copies (the old
path), interleaved on one checkpoint in one run.

  python benchmarks/dense_fp8.py [--checkpoint out/mini] [--prompt-tokens 64] [--max-tokens 16] [--rounds 5] [--json]

Two engines with the same plan (cpu, all usable threads); the second's fp8 linears are replaced by
their float32 dequantization (load_dense keep_fp8=False). Rounds alternate A, B, A, B...; each
reports decode tok/s, the dense/attention phase per token, and the dense bytes each engine holds.
Greedy tokens are checked equal. The mini checkpoint is made (about 2-3 minutes) if absent.
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import kernels  # noqa: E402,F401  (before torch: it sets the process up for it, kernels/__init__.py)
import torch

from hostinfo import usable_cores  # noqa: E402
from runtime.engine import Engine  # noqa: E402
from runtime.model.weights import load_dense  # noqa: E402
from runtime.plan import Plan  # noqa: E402
from runtime.workload import make_prompt  # noqa: E402


def held(w: dict) -> int:
    return sum(t.nbytes for t in w.values())


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--checkpoint", default="out/mini")
    ap.add_argument("--prompt-tokens", type=int, default=64)
    ap.add_argument("--max-tokens", type=int, default=16)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args(argv)
    if not (Path(args.checkpoint) / "model.safetensors.index.json").exists():
        subprocess.run([sys.executable, "-m", "runtime.cli.checkpoint", "make", "--preset", "mini", "--out", args.checkpoint], check=True)
    plan = Plan(cpu_threads=usable_cores(), prefill_chunk=args.prompt_tokens,
                max_context=args.prompt_tokens + args.max_tokens + 8)
    fp8 = Engine(args.checkpoint, plan)
    f32 = Engine(args.checkpoint, plan)
    f32.model.w = load_dense(f32.ck, torch.float32, "cpu", keep_fp8=False)
    from tokenizers import Tokenizer
    prompt = make_prompt(Tokenizer.from_file(str(Path(args.checkpoint) / "tokenizer.json")), args.prompt_tokens, seed=0)
    rows = {"fp8": {"decode": [], "dense_s": []}, "fp32": {"decode": [], "dense_s": []}}
    toks = {}
    for e in (fp8, f32):
        e.generate(prompt, 4)                                      # warm-up: compile, page in
    for _ in range(args.rounds):
        for name, e in (("fp8", fp8), ("fp32", f32)):
            r = e.generate(prompt, args.max_tokens)
            toks[name] = r.tokens
            rows[name]["decode"].append(r.decode_tok_s)
            rows[name]["dense_s"].append((r.phases.get("attention", 0.0) + r.phases.get("dense", 0.0)) / max(1, len(r.tokens) - 1))
    out = {"threads": plan.cpu_threads, "same_tokens": toks["fp8"] == toks["fp32"]}
    for name, e in (("fp8", fp8), ("fp32", f32)):
        d = rows[name]
        out[name] = {"decode_tok_s": float(np.median(d["decode"])), "decode_min": min(d["decode"]), "decode_max": max(d["decode"]),
                     "dense_phase_s_per_token": float(np.median(d["dense_s"])), "dense_bytes_held": held(e.model.w),
                     "samples": d["decode"]}
        print(f"{name:5s} decode {out[name]['decode_tok_s']:6.2f} tok/s [{out[name]['decode_min']:.2f}-{out[name]['decode_max']:.2f}]"
              f"  dense/attention {1e3 * out[name]['dense_phase_s_per_token']:6.1f} ms/token"
              f"  dense held {out[name]['dense_bytes_held'] / 2**20:8.1f} MiB")
    out["speedup"] = out["fp8"]["decode_tok_s"] / out["fp32"]["decode_tok_s"]
    print(f"fp8 / fp32 decode: x{out['speedup']:.2f}; greedy tokens equal: {out['same_tokens']}")
    fp8.close(), f32.close()
    if args.json:
        print(json.dumps(out))
    return out


if __name__ == "__main__":
    main()
