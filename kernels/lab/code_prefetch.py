"""Lab: the CPU-MoE kernel's codes prefetched into L1 a few superblocks ahead, timed in whole expert FFN steps.

  python -m kernels.lab.code_prefetch [--ahead -1 -1 2 1] [--widths 1 2 4 6 8] [--rounds 4] [--steps 40]

kernels/fp4_i8.py CODE_L1_AHEAD: each row's codes prefetched into L1 (prefetcht0) that many superblocks
ahead, beside the stream's far prefetch into L2. Each setting (for the host's path; < 1: none) compiles
its own copy of the expert FFN: kernels/cpu_moe.py executed again as a module of its own, uncached (a
cached copy would load the package's machine code), while the setting holds, since the intrinsic reads
it when its code is emitted. The first setting is the baseline; a setting given twice is an identical
copy, the A/A that says how far two copies of one code differ in this process. V4.1 geometry, rows in
order, up to 8 inputs a row decode; the bank and each step's experts as the profiler's probe has them
(kernels/probe_bank.py: 4x the host's total LLC, at least 20 experts, within the probe memory budget):
batch 1 (6 consecutive experts) or a verify of W tokens (each token's top-6 of a pool of 10, the pool
moving every step, as benchmarks/cpu_moe.py plans it); every copy's step
interleaved with the others', the order reversed every round. Checks first that every copy gives the
same bits; prints GB/s of distinct expert bytes and each copy's per-round speed ratio to the baseline.
"""
from __future__ import annotations

import argparse
import sys
import time
import types
from pathlib import Path

import numpy as np

import kernels.cpu_moe as cm
from hostinfo import usable_cores
from kernels import fp4_i8 as fi
from kernels.probe_bank import ProbeTooLarge, bank_size, step_ids
from kernels.threads import set_threads

H, I, TOP_K, POOL = 5120, 2304, 6, 10


def ffn_copy(ahead: int, tag: str):
    """kernels/cpu_moe.py as a fresh, uncached module whose kernels emit CODE_L1_AHEAD = `ahead` for the
    host's path; compiled by the first call (`compile_copy`)."""
    src = Path(cm.__file__).read_text()
    if "cache=CACHE" not in src:
        raise RuntimeError(f"{cm.__file__} no longer says cache=CACHE: a copy could load the package's cached code")
    src = src.replace("cache=CACHE", "cache=False")
    mod = types.ModuleType(f"kernels.lab._cpu_moe_{tag}")
    mod.__file__ = cm.__file__
    sys.modules[mod.__name__] = mod                   # dataclasses look their annotations' module up there
    exec(compile(src, cm.__file__, "exec"), mod.__dict__)
    mod.ahead = ahead
    return mod


def compile_copy(mod, *args):
    """Run the copy's `_ffn` on `args` with its setting in force (its code is emitted at the first call), then
    restore the package's setting."""
    with fi.emitting(fi.CODE_L1_AHEAD, cm.MODE, mod.ahead):
        mod._ffn(*args)


def plans(W: int, E: int, rng, n=64):
    """Expert ids per step: batch 1 (6 consecutive fresh experts) or W tokens' top-6 of a pool of 10."""
    return [step_ids(i, W, TOP_K, E, POOL, rng) for i in range(n)]


def main(argv=None):
    ap = argparse.ArgumentParser()
    ap.add_argument("--ahead", type=int, nargs="+", default=[-1, -1, 2, 1],
                    help="superblocks ahead per copy (< 1: no L1 prefetch); the first is the baseline")
    ap.add_argument("--widths", type=int, nargs="+", default=[1, 2, 4, 6, 8], help="1: batch 1; W: a verify of W tokens")
    ap.add_argument("--threads", type=int, default=usable_cores())
    ap.add_argument("--rounds", type=int, default=4)
    ap.add_argument("--steps", type=int, default=40, help="steps per copy per round")
    args = ap.parse_args(argv)
    if not cm.MODE:
        raise SystemExit("scalar ISA: no SIMD kernel to compare")
    try:                                                           # at least 2 * TOP_K + 8 = 2 * POOL experts
        E, note = bank_size(H, I, TOP_K)
    except ProbeTooLarge as e:
        raise SystemExit(str(e))
    bank = cm.Fp4Bank.random(E, H, I)
    set_threads(args.threads)
    names = [f"{a}" + "'" * args.ahead[:i].count(a) for i, a in enumerate(args.ahead)]
    copies = {n: ffn_copy(a, f"{i}") for i, (n, a) in enumerate(zip(names, args.ahead))}
    w = (bank.w13_codes, bank.w13_scales, bank.w2_codes, bank.w2_scales, 1, 8, cm.l1_input_bytes(), args.threads)
    print(f"path {fi.MODES[cm.MODE]}, {args.threads} threads, "
          f"bank {E} experts ({E * bank.expert_bytes / 1e9:.1f} GB{'; ' + note if note else ''}); copies (superblocks ahead): {', '.join(names)}", flush=True)
    for W in args.widths:
        rng = np.random.default_rng(W)
        x = rng.standard_normal((W, H)).astype(np.float32)
        wts = np.full((W, TOP_K), 1 / TOP_K, np.float32)
        plan = plans(W, E, rng)
        nbytes = np.mean([len(np.unique(p)) for p in plan]) * bank.expert_bytes
        outs = {}
        for n, mod in copies.items():
            outs[n] = np.zeros((W, H), np.float32)
            compile_copy(mod, x, plan[0], wts, *w, outs[n], *cm.ffn_scratch(plan[0], I, H))
        same = all(np.array_equal(o.view(np.uint32), outs[names[0]].view(np.uint32)) for o in outs.values())
        ts = {n: [] for n in copies}
        i = 0
        for r in range(args.rounds):
            for _ in range(args.steps):
                for n in (names if r % 2 == 0 else names[::-1]):
                    y, scratch = np.zeros((W, H), np.float32), cm.ffn_scratch(plan[i % len(plan)], I, H)
                    t0 = time.perf_counter()
                    copies[n]._ffn(x, plan[i % len(plan)], wts, *w, y, *scratch)
                    ts[n].append(time.perf_counter() - t0)
                i += 1
        what = "batch 1" if W == 1 else f"verify {W}"
        print(f"{what}: every copy gives the same bits: {same}")
        base = names[0]
        for n in names:
            per = [np.median(ts[base][k * args.steps:(k + 1) * args.steps]) / np.median(ts[n][k * args.steps:(k + 1) * args.steps])
                   for k in range(args.rounds)]
            print(f"  {n:>4}: {nbytes / np.median(ts[n]) / 1e9:6.1f} GB/s   speed / baseline per round: "
                  + " ".join(f"{v:.3f}" for v in per) + f"   (median {np.median(per):.3f})", flush=True)


if __name__ == "__main__":
    main()
