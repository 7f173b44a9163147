"""Lab: the package's expert FFN with lanes as rows against the superblock kernel, whole steps interleaved.

  python -m kernels.lab.lanes_ab [--widths 1 2 4 6 8] [--inputs 4] [--streams 1] [--rounds 4] [--steps 30]
                                [--l1-ahead A ...] [--prefetch D ...] [--l2-one always shared never] [--stream]

kernels/cpu_moe.py builds its banks in the lanes layout on the paths in LANES_MODES (kernels/fp4_lanes.py)
and keeps rows in order elsewhere. Here both are the package's own code: kernels/cpu_moe.py executed
twice as uncached modules of their own (kernels/lab/code_prefetch.py `ffn_copy`), one with the host's
path (or $DSV41_CPU_ISA's) in LANES_MODES, one with it empty (the superblock kernel), whatever the
package picks, so a path can be measured before it is put in the table. One bank's bytes serve both
(random bytes time alike in either layout). V4.1 geometry, the bank and each step's experts as the
profiler's probe has them (kernels/probe_bank.py: 4x the host's total LLC): batch 1 or a verify of W
tokens (top-6 of a pool of 10). Steps interleaved, the order reversed every round; prints GB/s of
distinct expert bytes and the lanes copy's per-round speed ratio to the superblock one; with --stream
also every copy's per-round ratio to the DRAM stream probe (kernels/stream.py, as the benchmarks take
it) read at the same threads at the start of the round: the issue's bar, beside the A/B.
"""
from __future__ import annotations

import argparse
import itertools
import time

import numpy as np

import kernels.cpu_moe as cm
from hostinfo import usable_cores
from kernels.fp4_i8 import MODES
from kernels import fp4_lanes as fl
from kernels import fp4_simd as simd
from kernels.lab.code_prefetch import H, I, TOP_K, ffn_copy, plans
from kernels.probe_bank import ProbeTooLarge, bank_size
from kernels.stream import dram_stream_read, stream_buffer
from kernels.threads import set_threads


def copies(l1_ahead, prefetch=None, l2_one=None):
    """{"rows": the superblock kernel on rows in order, "lanes" (or "lanes@A~D^S" per L1_AHEAD A,
    WEIGHT_PREFETCH D and S, this path's L2_ONE_INPUT rule): the lanes kernel}: uncached modules of
    kernels/cpu_moe.py, with the settings each lanes copy compiles under (None: the package's)."""
    if "LANES_MODES = (" not in open(cm.__file__).read():
        raise RuntimeError("kernels/cpu_moe.py no longer defines LANES_MODES: the copies cannot be told apart")
    rows = ffn_copy(-1, "rows")
    rows.LANES_MODES, rows.GROUP, rows.emit = (), 0, []   # LANES_MODES, GROUP: read by the copy's kernels as they compile
    mods = {"rows": rows}
    for a, d, f in itertools.product(l1_ahead or [None], prefetch or [None], l2_one or [None]):
        name = "lanes" + "".join("" if v is None else f"{c}{v}" for c, v in (("@", a), ("~", d), ("^", f)))
        m = ffn_copy(-1, name)
        m.LANES_MODES, m.GROUP = (cm.MODE,), fl.group_rows(cm.MODE)
        settings = ((fl, "L1_AHEAD", a), (simd, "WEIGHT_PREFETCH", d),
                    (fl, "L2_ONE_INPUT", None if f is None else {**fl.L2_ONE_INPUT, cm.MODE: f}))   # this path's entry
        m.emit = [(mod, k, v) for mod, k, v in settings if v is not None]
        mods[name] = m
    return mods


def compile_under(mod, call):
    """Run `call` (the copy's first, compiling call) with the module settings the copy is emitted under."""
    saved = [(m, k, getattr(m, k)) for m, k, _ in mod.emit]
    try:
        for m, k, v in mod.emit:
            setattr(m, k, v)
        call()
    finally:
        for m, k, v in saved:
            setattr(m, k, v)


def main(argv=None):
    ap = argparse.ArgumentParser()
    ap.add_argument("--widths", type=int, nargs="+", default=[1, 2, 4, 6, 8], help="1: batch 1; W: a verify of W tokens")
    ap.add_argument("--threads", type=int, default=usable_cores())
    ap.add_argument("--inputs", type=int, default=cm.DEFAULT_INPUTS, choices=cm.ROW_INPUTS)
    ap.add_argument("--streams", type=int, default=1, choices=cm.ROW_STREAMS)
    ap.add_argument("--rounds", type=int, default=4)
    ap.add_argument("--steps", type=int, default=30, help="steps per copy per round")
    ap.add_argument("--l1-ahead", type=int, nargs="+", default=None,
                    help="a lanes copy per value of kernels/fp4_lanes.py L1_AHEAD (bytes; < 1 none); default the package's")
    ap.add_argument("--prefetch", type=int, nargs="+", default=None,
                    help="... and per kernels/fp4_simd.py WEIGHT_PREFETCH (bytes ahead into L2; < 0 none); default the package's")
    ap.add_argument("--l2-one", nargs="+", default=None, choices=fl.L2_RULES,
                    help="... and per kernels/fp4_lanes.py L2_ONE_INPUT (this path's: when a call of one input prefetches into L2)")
    ap.add_argument("--fetch", default=cm.DEFAULT_FETCH, choices=fl.FETCHES, help="the lanes copies' fetching (Plan.cpu_moe_fetch)")
    ap.add_argument("--stream", action="store_true", help="also each copy's per-round ratio to the DRAM stream probe")
    args = ap.parse_args(argv)
    if not cm.MODE:
        raise SystemExit("the scalar path has no lanes kernel: nothing to compare")
    try:
        E, note = bank_size(H, I, TOP_K)
    except ProbeTooLarge as e:
        raise SystemExit(str(e))
    bank = cm.Fp4Bank.random(E, H, I)
    set_threads(args.threads)
    mods = copies(args.l1_ahead, args.prefetch, args.l2_one)
    names = list(mods)
    buf = stream_buffer() if args.stream else None
    w = (bank.w13_codes, bank.w13_scales, bank.w2_codes, bank.w2_scales, args.streams, args.inputs, cm.l1_input_bytes(), args.threads,
         args.fetch == "near")
    print(f"path {MODES[cm.MODE]}, {args.threads} threads, streams {args.streams}, up to {args.inputs} inputs a call, "
          f"bank {E} experts ({E * bank.expert_bytes / 1e9:.1f} GB{'; ' + note if note else ''})", flush=True)
    for W in args.widths:
        rng = np.random.default_rng(W)
        x = rng.standard_normal((W, H)).astype(np.float32)
        wts = np.full((W, TOP_K), 1 / TOP_K, np.float32)
        plan = plans(W, E, rng)
        nbytes = np.mean([len(np.unique(p)) for p in plan]) * bank.expert_bytes
        for mod in mods.values():                                  # compile, each lanes copy under its settings
            compile_under(mod, lambda: mod._ffn(x, plan[0], wts, *w, np.zeros((W, H), np.float32), *cm.ffn_scratch(plan[0], I, H)))
        ts = {n: [] for n in mods}
        streams = []
        i = 0
        for r in range(args.rounds):
            if buf is not None:
                streams.append(dram_stream_read(args.threads, repeats=2, buf=buf[0], note=buf[1]).median)
            for _ in range(args.steps):
                for n in (names if r % 2 == 0 else names[::-1]):
                    y, scratch = np.zeros((W, H), np.float32), cm.ffn_scratch(plan[i % len(plan)], I, H)
                    t0 = time.perf_counter()
                    mods[n]._ffn(x, plan[i % len(plan)], wts, *w, y, *scratch)
                    ts[n].append(time.perf_counter() - t0)
                i += 1
        def rounds(n):                                             # per round: the copy's median step time
            return [np.median(ts[n][k * args.steps:(k + 1) * args.steps]) for k in range(args.rounds)]
        print(f"{'batch 1' if W == 1 else f'verify {W}'}: rows {nbytes / np.median(ts['rows']) / 1e9:5.1f} GB/s", flush=True)
        for n in names[1:]:
            per = [a / b for a, b in zip(rounds("rows"), rounds(n))]
            print(f"  {n:9s} {nbytes / np.median(ts[n]) / 1e9:5.1f} GB/s; / rows per round " + " ".join(f"{v:.3f}" for v in per)
                  + f" (median {np.median(per):.3f})", flush=True)
        if streams:
            print(f"  stream {' '.join(f'{v:.1f}' for v in streams)} GB/s; each copy / stream per round:", flush=True)
            for n in names:
                per = [nbytes / t / 1e9 / s for t, s in zip(rounds(n), streams)]
                print(f"    {n:9s} " + " ".join(f"{v:.2f}" for v in per) + f" (median {np.median(per):.2f})", flush=True)


if __name__ == "__main__":
    main()
