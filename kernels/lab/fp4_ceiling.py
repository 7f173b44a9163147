"""Lab: the CPU-MoE GEMV's own compute rate (weights in L2 / L3) beside its rate from DRAM and the stream.

  python -m kernels.lab.fp4_ceiling [--threads 1 2] [--rounds 2]

One input, rows in order (the package's `fp4_i8_dot` through kernels/lab/weight_prefetch.py's GEMV),
5120-wide rows (V4.1 gate/up): 128 rows (348 KB: L2) and 2304 rows (6.3 MB: L3) passed over again
and again, and 4608 fresh rows a step from a bank of 300 steps (3.8 GB) for DRAM; the DRAM stream
read after each. When the in-cache rate is near the stream, batch 1 cannot read at the stream
unless compute and memory overlap completely: where this host's products, not its DRAM, bound it.
"""
from __future__ import annotations

import argparse
import time

import numpy as np

from hostinfo import usable_cores
from kernels.cpu_moe import _prepare, random_bytes
from kernels.lab.weight_prefetch import H, gemv
from kernels.stream import dram_stream_read
from kernels.threads import set_threads

ROWS, STEPS = 4608, 300
ROW_BYTES = H // 2 + H // 32          # codes + scale bytes


def rate(f, w, s, x, out, threads, rows, calls, span):
    """GB/s (median) of `calls` GEMVs over `rows` rows, stepping through `span` row ranges."""
    set_threads(threads)
    ts = []
    for i in range(calls):
        t0 = time.perf_counter()
        f(w, s, x, out, (i % span) * rows, rows)
        ts.append(time.perf_counter() - t0)
    return rows * ROW_BYTES / np.median(ts[2:]) / 1e9


def main(argv=None):
    ap = argparse.ArgumentParser()
    ap.add_argument("--threads", type=int, nargs="+", default=list(range(1, usable_cores() + 1)))
    ap.add_argument("--rounds", type=int, default=2)
    args = ap.parse_args(argv)
    rng = np.random.default_rng(0)
    f = gemv("fp4")
    w = random_bytes(rng, (STEPS * ROWS, H // 2))
    s = rng.integers(118, 130, (STEPS * ROWS, H // 32), dtype=np.uint8)
    x = _prepare(rng.standard_normal((1, H)).astype(np.float32), np.zeros(1, np.int64))
    out = np.empty(ROWS, np.float32)
    print(f"{'threads':>7} {'L2 GB/s':>8} {'L3 GB/s':>8} {'DRAM GB/s':>10} {'stream':>7} {'DRAM/stream':>12} {'DRAM/L3':>8}")
    for _ in range(args.rounds):
        for t in args.threads:
            l2 = rate(f, w, s, x, out, t, 128, 400, 1)
            l3 = rate(f, w, s, x, out, t, 2304, 100, 1)
            dram = rate(f, w, s, x, out, t, ROWS, 60, STEPS)
            stream = dram_stream_read(t, repeats=3).median
            print(f"{t:>7} {l2:>8.1f} {l3:>8.1f} {dram:>10.1f} {stream:>7.1f} {dram / stream:>12.2f} {dram / l3:>8.2f}")


if __name__ == "__main__":
    main()
