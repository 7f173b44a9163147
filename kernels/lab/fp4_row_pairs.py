"""Lab: the rows a CPU-MoE GEMV call decodes and the order it loads rows and inputs in.

  python -m kernels.lab.fp4_row_pairs [--threads N] [--rounds 6] [--inputs 2 4 8] [--rows 1i 1 2 4]

At verify widths (a slot meets 2-8 inputs) the kernel is bound by its operations per product, not by
DRAM: per input and superblock it loads 8 input vectors for 8 `vpdpbusd` (kernels/fp4_i8.py), and a
Zen 4 core loads one 64-byte vector a cycle. With R adjacent rows a call (`fp4_i8_dot(R, T, ...)`, one
DRAM stream) and the rows decoded first, each input vector loaded serves R rows; decoded rows take 8
vector registers each. Variants: "R" in the package's order for R rows (`ROWS_FIRST`), "Rf" rows
first, "Ri" inputs first. Every output is the same `_dot` of its row and input in every variant: the
bits must not move (checked first). Rows in order, 5120-wide rows (V4.1 gate / up), T inputs, in L2
(384 rows, 1 MB, over and over) and from DRAM (fresh rows from a bank of 4608 x 300), all variants in
every round, the order reversed every other round, the stream read once per round. Prints weight GB/s,
GMAC/s and the per-round ratio to the first variant. In the package since: rows first where they fit
half the registers, rows in pairs on 64-byte paths (kernels/cpu_moe.py PAIRS; kernels/lab/README.md).
"""
from __future__ import annotations

import argparse

import numpy as np
from numba import njit, prange

from hostinfo import usable_cores
from kernels.cpu_moe import MODE, ROWS_PER_CHUNK, _prepare, random_bytes
from kernels import fp4_i8 as fi
from kernels.fp4_i8 import fp4_i8_dot
from kernels.lab.fp4_ceiling import ROW_BYTES, ROWS, STEPS, rate
from kernels.lab.weight_prefetch import H
from kernels.stream import dram_stream_read

L2_ROWS = 384                                 # 1 MB of rows: half an L2 of 1 MiB a core on 2 threads, 6 chunks


def gemv(R, T, mode=MODE, K=H, dot=fp4_i8_dot):
    """A fresh GEMV: rows row0..row0+n-1 of K weights, R adjacent rows a call against T inputs, through `dot`
    (the package's intrinsic, or a lab copy of it); out [T, n]."""
    @njit(parallel=True, nogil=True)
    def f(w, s, x, out, row0, n):
        xq, xc, xr = x
        for c in prange(n // ROWS_PER_CHUNK):
            for i in range(0, ROWS_PER_CHUNK, R):
                r = row0 + c * ROWS_PER_CHUNK + i
                dot(R, T, mode, w, r * (K // 2), K // 2, s, r * (K // 32), K // 32, xq, xc, xr, 0, K, out, r - row0, n, 1)
    return f


def compiled(variant, T, K, args):
    """variant "R" (R rows a call in the package's order for R, kernels/fp4_i8.py ROWS_FIRST), "Rf" (every
    row decoded first, then each input's vectors, used by all R rows) or "Ri" (every input's vectors
    first, then row by row) -> its GEMV, compiled by a call on `args`."""
    R, order = int(variant.rstrip("fi")), variant[-1]
    f = gemv(R, T, K=K)
    rows_first = {"f": R, "i": R - 1}.get(order, fi.ROWS_FIRST[MODE])
    with fi.emitting(fi.ROWS_FIRST, MODE, rows_first):
        f(*args)
    return f


def main(argv=None):
    ap = argparse.ArgumentParser()
    ap.add_argument("--threads", type=int, default=usable_cores())
    ap.add_argument("--rounds", type=int, default=6)
    ap.add_argument("--k", type=int, default=H, help="weights a row (5120: V4.1 gate / up; 2304: its down rows)")
    ap.add_argument("--inputs", type=int, nargs="+", default=[2, 4, 8])
    ap.add_argument("--rows", nargs="+", default=["1i", "1", "2", "4"],
                    help="R rows a call in the package's order, Rf every row decoded before the inputs' loads, "
                         "Ri the inputs' loads first; the first is the baseline")
    args = ap.parse_args(argv)
    if not MODE:
        raise SystemExit("scalar ISA: no SIMD kernel to compare")
    if any(not v.rstrip("fi").isdigit() or ROWS_PER_CHUNK % int(v.rstrip("fi")) for v in args.rows):
        raise SystemExit(f"--rows: each must be R, Rf or Ri with R dividing {ROWS_PER_CHUNK}, got {args.rows}")
    rng = np.random.default_rng(0)
    K = args.k
    if K % 32:
        raise SystemExit(f"--k: weights a row must be a multiple of 32, got {K}")
    w = random_bytes(rng, (STEPS * ROWS, K // 2)).reshape(-1)
    s = rng.integers(118, 130, (STEPS * ROWS, K // 32), dtype=np.uint8).reshape(-1)
    per = (K // 2 + K // 32) / ROW_BYTES                          # `rate` counts 5120-wide rows' bytes
    for T in args.inputs:
        x = tuple(a.reshape(-1) for a in _prepare(rng.standard_normal((T, K)).astype(np.float32), np.arange(T)))
        outs = {v: np.empty(T * ROWS, np.float32) for v in args.rows}
        fs = {v: compiled(v, T, K, (w, s, x, outs[v], 5 * ROWS, ROWS)) for v in args.rows}
        base = args.rows[0]
        same = all(np.array_equal(outs[v].view(np.uint32), outs[base].view(np.uint32)) for v in args.rows)
        print(f"{T} inputs, {K}-wide rows: every variant gives the same bits: {same}")
        got = {v: {"l2": [], "dram": []} for v in args.rows}
        streams = []
        for rnd in range(args.rounds):
            for v in (args.rows if rnd % 2 == 0 else args.rows[::-1]):
                got[v]["l2"].append(per * rate(fs[v], w, s, x, outs[v], args.threads, L2_ROWS, 400, 1))
                got[v]["dram"].append(per * rate(fs[v], w, s, x, outs[v], args.threads, ROWS, 60, STEPS))
            streams.append(dram_stream_read(args.threads, repeats=3).median)
        mac = K * T / (K // 2 + K // 32)                                  # GMAC/s per GB/s of weights
        print(f"  {args.threads} threads, {args.rounds} rounds; stream {np.median(streams):.1f} GB/s "
              f"({min(streams):.1f}-{max(streams):.1f})")
        print(f"  {'R':>3} {'L2 GB/s':>8} {'GMAC/s':>7} {'DRAM GB/s':>10} {'/stream':>8}   per-round ratio to the first: L2 / DRAM")
        for v, g in got.items():
            rs = {k: [a / b for a, b in zip(g[k], got[base][k])] for k in g}
            print(f"  {v:>3} {np.median(g['l2']):>8.1f} {np.median(g['l2']) * mac:>7.0f} {np.median(g['dram']):>10.1f} "
                  f"{np.median([a / b for a, b in zip(g['dram'], streams)]):>8.2f}   "
                  + " / ".join(f"{np.median(v):.3f} ({min(v):.2f}-{max(v):.2f})" for v in rs.values()), flush=True)


if __name__ == "__main__":
    main()
