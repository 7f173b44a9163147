"""Planned vs measured memory per tier on mini: one `dsv41-run --json` process per plan (peak RSS never
resets inside a process), for each placement and strategy a CPU host runs.

  python benchmarks/memory.py [--checkpoint out/mini] [--prompt-tokens 1024] [--max-tokens 8] [--only NAME] [--json]

Planned: runtime/budget.py (anonymous host RAM; the checkpoint bytes read through the mapping).
Measured: the anonymous RSS the load and the requests added (sampled peak above the start, after the
kernels were warmed) and the checkpoint mapping's resident pages (/proc/self/smaps). The mini
checkpoint is made (about 2-3 minutes) if absent.
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from runtime.plan import Plan  # noqa: E402


def plans(ctx: int) -> dict:
    return {
        "cpu, all in RAM, chunk 64": Plan(max_context=ctx, prefill_chunk=64),
        "cpu, chunk 512": Plan(max_context=ctx, prefill_chunk=512),
        "NVMe tier + Engram O_DIRECT": Plan(max_context=ctx, prefill_chunk=64, host_expert_budget_gib=0.5,
                                            expert_nvme_path="nvme_direct", engram_placement="nvme_direct"),
        "NVMe tier + Engram page cache": Plan(max_context=ctx, prefill_chunk=64, host_expert_budget_gib=0.5,
                                              expert_nvme_path="nvme_mmap", engram_placement="nvme_mmap"),
        "DSpark draft 3": Plan(max_context=ctx, prefill_chunk=64, dspark=True, draft_length=3),
    }


def run(ck: str, plan: Plan, prompt: int, gen: int) -> dict:
    with tempfile.NamedTemporaryFile("w", suffix=".json", delete=False) as f:
        json.dump(plan.to_dict(), f)
    out = subprocess.run([sys.executable, "-m", "runtime.cli.run", "--checkpoint", ck, "--plan", f.name,
                          "--prompt-tokens", str(prompt), "--max-tokens", str(gen), "--json"], capture_output=True, text=True)
    os.unlink(f.name)
    if out.returncode:
        raise SystemExit(out.stderr[-3000:])
    return json.loads(out.stdout)["memory"]


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--checkpoint", default="out/mini")
    ap.add_argument("--prompt-tokens", type=int, default=1024)
    ap.add_argument("--max-tokens", type=int, default=8)
    ap.add_argument("--only", default="", help="run the plans whose name contains this")
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args(argv)
    if not (Path(args.checkpoint) / "model.safetensors.index.json").exists():
        subprocess.run([sys.executable, "-m", "runtime.cli.checkpoint", "make", "--preset", "mini", "--out", args.checkpoint], check=True)
    rows = {}
    print(f"{'plan':32s} {'anon planned':>13s} {'measured':>9s} {'ratio':>6s} {'mapped planned':>15s} {'measured':>9s} {'ratio':>6s}")
    for name, plan in plans(args.prompt_tokens + args.max_tokens + 64).items():
        if args.only not in name:
            continue
        m = run(args.checkpoint, plan, args.prompt_tokens, args.max_tokens)
        p, q = m["planned"], m["measured"]
        rows[name] = m
        print(f"{name:32s} {p['anon'] / 2**20:10.1f} MiB {q['anon_added'] / 2**20:9.1f} {q['anon_added'] / p['anon']:6.3f}"
              f" {p['file'] / 2**20:12.1f} MiB {q['checkpoint_mapped'] / 2**20:9.1f} {q['checkpoint_mapped'] / p['file']:6.3f}")
    if args.json:
        print(json.dumps(rows))
    return rows


if __name__ == "__main__":
    main()
