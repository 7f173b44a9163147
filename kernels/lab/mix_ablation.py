"""Lab: what each part of the CPU-MoE kernel's superblock loop costs, by timing it with that part removed.

  python -m kernels.lab.mix_ablation [--calls 2x4 2x8] [--k 2304] [--threads 1] [--dram] [--rounds 7]

A wide call's loop (kernels/fp4_i8.py `fp4_i8_dot`, R rows x T inputs) is a mix: per row and superblock
the codes' loads, a transpose and the nibbles' decode; per row and input 8 products (`vpdpbusd`) and a
float step (convert, scale product, multiply-add). A model of the pipes (kernels/lab/port_pressure.py)
did not predict which change would pay on the Zen 4 VM; this times the package's loop beside copies
that each leave one part out (the same rows, inputs and call, all interleaved, the order reversed every
round), so the gain each removal gives bounds what making that part free could give. The copies compute
other numbers: a timing tool only, never a kernel. Parts (`ABLATIONS`): `no_transpose` (codes used as
loaded), `no_decode` (code bytes used as weights), `no_float` (the int sums added as bits, no convert,
no scale product), `no_mul` (the input's scale alone), `one_input_load` (every input's products use the
first input's vectors, so one input's loads serve all and fewer registers are live). Each copy is
kernels/fp4_i8.py's text with one edit, executed as a module of its own; an edit that no longer finds its
text stops the lab (the test holds them to the package's source). Rows in order, T inputs, 5120- or
2304-wide rows, in L2 (a few hundred rows over and over; one thread keeps them in its own L2) or with
--dram from a bank of fresh rows (4x the total LLC, at least 1 GB, within the probe memory budget); GMAC/s and each copy's per-round ratio to the package's loop.
"""
from __future__ import annotations

import argparse
import time
import types
from pathlib import Path

import numpy as np

from hostinfo import llc_bytes, probe_budget_bytes
from kernels import fp4_i8 as fi
from kernels.cpu_moe import MODE, ROWS_PER_CHUNK, _prepare, random_bytes
from kernels.lab.fp4_row_pairs import gemv
from kernels.threads import set_threads

_FMA = "builder.store(builder.call(st.fma, [f, builder.fmul(ws, xs), builder.load(accs[r][j])]), accs[r][j])\n\n"
ABLATIONS = {                        # part -> (text in kernels/fp4_i8.py, its replacement), first occurrence each
    "no_transpose": [("vs = st.transpose([st.load(cbase, builder.add(cp, c64(k * step)), st.vb) for k in range(SUPER)])",
                      "vs = [st.load(cbase, builder.add(cp, c64(k * step)), st.vb) for k in range(SUPER)]")],
    "no_decode": [("return [st.decode(v) for v in vs], st.scale", "return [(v, v) for v in vs], st.scale")],
    "no_float": [("f = builder.sitofp(st.dot(st.load(cxbase, k, st.vi, 4), lohi, qs), st.vf)",
                  "f = builder.bitcast(st.dot(st.load(cxbase, k, st.vi, 4), lohi, qs), st.vf)"),
                 (_FMA, "builder.store(builder.fadd(f, builder.load(accs[r][j])), accs[r][j])\n\n")],
    "no_mul": [(_FMA, "builder.store(builder.call(st.fma, [f, xs, builder.load(accs[r][j])]), accs[r][j])\n\n")],
    "one_input_load": [("qs = inputs(j)\n", "qs = inputs(0)\n"),                      # rows first
                       ("qs = [inputs(j) for j in range(T)]", "qs = [inputs(0) for j in range(T)]")],   # inputs first
}


def source(part: str | None) -> str:
    """kernels/fp4_i8.py's text with `part` left out (None: as it is)."""
    src = Path(fi.__file__).read_text()
    for old, new in ABLATIONS.get(part, []):
        if old not in src:
            raise RuntimeError(f"{part}: kernels/fp4_i8.py no longer holds {old.strip()[:70]!r}; update ABLATIONS")
        src = src.replace(old, new, 1)
    return src


def kernel(part: str | None):
    """The dot intrinsic of a fresh copy of kernels/fp4_i8.py with `part` left out."""
    mod = types.ModuleType(f"kernels.lab._fp4_i8_{part or 'package'}")
    mod.__file__ = fi.__file__
    exec(compile(source(part), fi.__file__, "exec"), mod.__dict__)
    return mod.fp4_i8_dot


def main(argv=None):
    ap = argparse.ArgumentParser()
    ap.add_argument("--calls", nargs="+", default=["2x4", "2x8"], help="R x T: rows and inputs a call")
    ap.add_argument("--k", type=int, default=2304, help="weights a row (2304: V4.1's down rows, 8 inputs fit L1)")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--dram", action="store_true", help="fresh rows from a bank (~1 GB) instead of rows in L2")
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument("--calls-per-round", type=int, default=60)
    args = ap.parse_args(argv)
    if not MODE:
        raise SystemExit("scalar ISA: no SIMD kernel to take apart")
    K = args.k
    if K % 32:
        raise SystemExit(f"--k: weights a row must be a multiple of 32, got {K}")
    rng = np.random.default_rng(0)
    rows = 4608 if args.dram else max(ROWS_PER_CHUNK, (768 * 2304 // K) // ROWS_PER_CHUNK * ROWS_PER_CHUNK)
    span = 1
    if args.dram:                                   # 4x the total LLC, at least 1 GB, within the probe memory budget
        want, budget = max(4 * llc_bytes(), 10**9), probe_budget_bytes()
        span = max(1, min(want, budget) // (rows * K * 17 // 32))
        if budget < 4 * llc_bytes():
            print(f"note: the probe memory budget ({budget / 2**20:.0f} MiB) keeps the bank under 4x the last-level cache")
    w = random_bytes(rng, (span * rows * K // 2,))
    s = rng.integers(118, 130, span * rows * K // 32, dtype=np.uint8)
    set_threads(args.threads)
    parts = [None, *ABLATIONS]
    print(f"{fi.MODES[MODE]}, {args.threads} thread(s), {K}-wide rows, {'fresh rows from ' + format(span * rows * K * 17 / 32 / 1e9, '.1f') + ' GB' if args.dram else str(rows) + ' rows over and over'}")
    for call in args.calls:
        R, T = (int(v) for v in call.split("x"))
        if ROWS_PER_CHUNK % R:
            raise SystemExit(f"--calls: R must divide {ROWS_PER_CHUNK}, got {call}")
        x = tuple(a.reshape(-1) for a in _prepare(rng.standard_normal((T, K)).astype(np.float32), np.arange(T)))
        out = np.empty(T * rows, np.float32)
        fs = {}
        for p in parts:
            fs[p] = gemv(R, T, K=K, dot=kernel(p))
            fs[p](w, s, x, out, 0, rows)                            # compile
        got = {p: [] for p in parts}
        for rnd in range(args.rounds):
            for p in (parts if rnd % 2 == 0 else parts[::-1]):
                ts = []
                for i in range(args.calls_per_round):
                    t0 = time.perf_counter()
                    fs[p](w, s, x, out, (i % span) * rows, rows)
                    ts.append(time.perf_counter() - t0)
                got[p].append(rows * K * T / np.median(ts[3:]) / 1e9)
        print(f"{R} rows x {T} inputs: GMAC/s (median over {args.rounds} rounds), per-round ratio to the package's loop")
        for p in parts:
            r = [a / b for a, b in zip(got[p], got[None])]
            print(f"  {p or 'package':15s} {np.median(got[p]):7.1f}  x{np.median(r):.3f} ({min(r):.2f}-{max(r):.2f})", flush=True)


if __name__ == "__main__":
    main()
