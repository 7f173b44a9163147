"""Lab: where the CPU-MoE kernel's cycles go, by LLVM's model of a CPU's pipes (llvm-mca).

  python -m kernels.lab.port_pressure [--calls 1x1 2x4 2x8] [--k 5120] [--mcpu znver4] [--mca llvm-mca-19]

Compiles `fp4_i8_dot(R, T)` on this host's instruction path in the package's order (as
kernels/lab/fp4_row_pairs.py does), takes from numba's assembly the loop holding the most product
instructions (the superblock loop: `vpdpbusd`, or `vpmaddubsw` without VNNI), and runs llvm-mca on it
for `--mcpu` (default: the CPU LLVM names this host). Prints, per loop iteration (one superblock of R
rows against T inputs), the model's cycles on each pipe, the busiest pipes and the instructions that
load them, so a change to the kernel's mix can be judged before it is timed.

A model, not a measurement: LLVM 19's Zen 4 model counts a 512-bit `vpdpbusd` as 2 cycles on each of FP0
and FP1, while the products' peak measured on the Zen 4 VM (kernels/int8_peak.py, ~180 GMAC/s a core)
needs about one 512-bit `vpdpbusd` a cycle; and two replacements it places on other pipes (`vscalefps`
for the scale multiply, `vpmultishiftqb` for the nibble shift) timed no faster there (kernels/lab/README.md).
Needs llvm-mca from LLVM 17 or later for Zen 4 (Debian: `apt-get install llvm-19`).
"""
from __future__ import annotations

import argparse
import re
import shutil
import subprocess
from collections import defaultdict

import numpy as np
from llvmlite import binding as llvm

from kernels.cpu_moe import MODE, _prepare, random_bytes
from kernels.fp4_i8 import VNNI_MODES
from kernels.lab.fp4_row_pairs import compiled

MCA = ("llvm-mca-19", "llvm-mca-18", "llvm-mca-17", "llvm-mca")


def mnemonic(tokens: list[str]) -> str:
    """An instruction's mnemonic without an encoding prefix (AVX-VNNI's `{vex} vpdpbusd`)."""
    return next(t for t in tokens if not t.startswith("{"))


def hot_loop(asm: str, product: str) -> list[str]:
    """The instructions of the loop (label .. its backward branch) holding the most `product` instructions."""
    lines = asm.splitlines()
    labels = {ln[:-1]: i for i, ln in enumerate(lines) if re.match(r"^\.LBB\S+:$", ln)}
    best = (0, [])
    for i, ln in enumerate(lines):
        m = re.match(r"^\s+j\w+\s+(\.LBB\S+)", ln)
        if m and labels.get(m.group(1), i) < i:
            body = [b for b in lines[labels[m.group(1)] + 1:i + 1] if b.strip() and not b.strip().startswith((".", "#"))]
            n = sum(mnemonic(b.split()) == product for b in body)
            best = max(best, (n, body), key=lambda t: t[0])
    if not best[0]:
        raise SystemExit(f"no loop with {product} in the compiled kernel")
    return best[1]


def pressure(report: str) -> tuple[dict[str, float], dict[str, dict[str, float]], float]:
    """llvm-mca's text -> (cycles per iteration on each resource kind, per mnemonic the same, the block's
    throughput). A kind with several units (Zen 4's two FP45, three loads) gets the cycles of one unit:
    its pressure over its units, as llvm-mca spreads it."""
    names = dict(re.findall(r"^\[(\d+(?:\.\d+)?)\]\s+-\s+(\S+)", report, re.M))
    units = defaultdict(int)
    for kind in names.values():
        units[kind] += 1
    head, per_iter = re.search(r"Resource pressure per iteration:\n(.*)\n(.*)\n", report).groups()
    cols = re.findall(r"\[(\d+(?:\.\d+)?)\]", head)
    total: dict[str, float] = defaultdict(float)
    for c, v in zip(cols, per_iter.split()):
        total[names[c]] += (float(v) if v != "-" else 0.0) / units[names[c]]
    by_ins: dict[str, dict[str, float]] = defaultdict(lambda: defaultdict(float))
    for ln in report.split("Resource pressure by instruction:")[1].splitlines()[2:]:
        parts = ln.split()
        if len(parts) <= len(cols):
            break
        for c, v in zip(cols, parts[:len(cols)]):
            if v != "-":
                by_ins[mnemonic(parts[len(cols):])][names[c]] += float(v) / units[names[c]]
    rt = float(re.search(r"Block RThroughput:\s+([\d.]+)", report).group(1))
    return dict(total), by_ins, rt


def main(argv=None):
    ap = argparse.ArgumentParser()
    ap.add_argument("--calls", nargs="+", default=["1x1", "2x4", "2x8"], help="R x T: rows and inputs a call")
    ap.add_argument("--k", type=int, default=5120, help="weights a row")
    ap.add_argument("--mcpu", default=llvm.get_host_cpu_name(), help="the CPU model llvm-mca uses (default: this host's)")
    ap.add_argument("--mca", default=next((m for m in MCA if shutil.which(m)), None), help="the llvm-mca binary")
    ap.add_argument("--top", type=int, default=8, help="instructions shown on the busiest pipes")
    args = ap.parse_args(argv)
    if not MODE:
        raise SystemExit("scalar ISA: no SIMD kernel to look at")
    if not args.mca:
        raise SystemExit("llvm-mca not found (Debian: apt-get install llvm-19), or give --mca")
    product = "vpdpbusd" if MODE in VNNI_MODES else "vpmaddubsw"
    rng = np.random.default_rng(0)
    K, n = args.k, 128
    w = random_bytes(rng, (n * K // 2,))
    s = np.full(n * K // 32, 120, np.uint8)
    for call in args.calls:
        R, T = (int(v) for v in call.split("x"))
        x = _prepare(rng.standard_normal((T, K)).astype(np.float32), np.arange(T))
        f = compiled(str(R), T, K, (w, s, x, np.empty(T * n, np.float32), 0, n))
        body = hot_loop(next(iter(f.inspect_asm().values())), product)
        run = subprocess.run([args.mca, f"-mcpu={args.mcpu}", "-iterations=100"], input="\n".join(body) + "\n",
                             capture_output=True, text=True)
        if run.returncode:
            raise SystemExit(f"{args.mca} failed: {run.stderr.strip()[:400]}")
        total, by_ins, rt = pressure(run.stdout)
        count = defaultdict(int)
        for b in body:
            count[mnemonic(b.split())] += 1
        busy = sorted(total, key=total.get, reverse=True)[:4]
        print(f"{R} rows x {T} inputs, {K}-wide rows, -mcpu={args.mcpu}: {len(body)} instructions, "
              f"{count[product]} {product} an iteration; block throughput {rt:.1f} cycles "
              f"({rt / max(count[product], 1):.2f} a {product})")
        print("  busiest: " + ", ".join(f"{r} {total[r]:.1f}" for r in busy))
        for r in busy[:2]:
            top = sorted(by_ins, key=lambda i: by_ins[i].get(r, 0.0), reverse=True)[:args.top]
            print(f"  on {r}: " + ", ".join(f"{i} x{count[i]} {by_ins[i][r]:.1f}" for i in top if by_ins[i].get(r)))


if __name__ == "__main__":
    main()
