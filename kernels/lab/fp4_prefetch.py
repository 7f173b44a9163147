"""Lab: the int8 CPU-MoE kernel's software prefetch, distance x target cache, timed from DRAM.

  python -m kernels.lab.fp4_prefetch [--threads N] [--rounds 16]

One GEMV per step over fresh rows (5120-wide, the V4.1 gate/up geometry; rows in order, one input),
each (distance, locality) compiled into its own copy of the kernel (kernels/fp4_i8.py reads PREFETCH
and LOCALITY when it emits code), all interleaved in every round (order reversed every other round),
with the DRAM stream read once per round. Locality is llvm.prefetch's: 3 = prefetcht0 (into L1),
1 = prefetcht2 (into L2). Prints each one's median GB/s and its per-round ratio to the first.
"""
from __future__ import annotations

import argparse

import numpy as np
from numba import njit, prange

import kernels.fp4_i8 as K
from hostinfo import probe_budget_bytes, usable_cores
from hostinfo.measure import measure
from kernels.cpu_moe import MODE, ROWS_PER_CHUNK, _prepare, random_bytes
from kernels.fp4_i8 import fp4_i8_dot
from kernels.stream import dram_stream_read
from kernels.threads import set_threads

H = 5120
CONFIGS = [(2048, 3), (16384, 1), (32768, 1), (16384, 3)]     # (bytes ahead, locality); the first is the baseline


def compiled(distance, locality, args):
    """A GEMV over rows row0.. with the prefetch given, compiled now by a call on `args` (the kernel's
    code reads the two globals while it is emitted); the globals are put back after."""
    @njit(parallel=True, nogil=True)
    def gemv(cf, sf, xq, xc, xr, out, row0, nrows):
        for c in prange(nrows // ROWS_PER_CHUNK):
            for i in range(ROWS_PER_CHUNK):
                r = row0 + c * ROWS_PER_CHUNK + i
                fp4_i8_dot(1, 1, MODE, cf, r * (H // 2), 0, sf, r * (H // 32), 0, xq, xc, xr, 0, H, out, r - row0, 0, 0)
    before = K.PREFETCH, K.LOCALITY
    K.PREFETCH, K.LOCALITY = distance, locality
    try:
        gemv(*args)
    finally:
        K.PREFETCH, K.LOCALITY = before
    return gemv


def main(argv=None):
    ap = argparse.ArgumentParser()
    ap.add_argument("--threads", type=int, default=usable_cores())
    ap.add_argument("--rounds", type=int, default=16)
    args = ap.parse_args(argv)
    if not MODE:
        raise SystemExit("scalar ISA: the kernel has no software prefetch there")
    set_threads(args.threads)
    n = 4608                                                   # one expert's gate + up rows a step
    rows = min(60 * n, int(probe_budget_bytes() / (H * 17 / 32)) // n * n)
    rng = np.random.default_rng(0)
    codes = random_bytes(rng, (rows, H // 2))
    scales = (115 + rng.integers(-1, 2, (rows, H // 32))).astype(np.uint8)
    xq, xc, xr = (a.reshape(-1) for a in _prepare(rng.standard_normal((1, H)).astype(np.float32), np.zeros(1, np.int64)))
    cf, sf = codes.reshape(-1), scales.reshape(-1)
    fns, out, step = {}, np.empty(n, np.float32), {"i": 1}
    for cfg in CONFIGS:
        fns[cfg] = compiled(*cfg, (cf, sf, xq, xc, xr, out, 0, n))
    samples, streams = {c: [] for c in CONFIGS}, []
    for rnd in range(args.rounds):
        streams.append(dram_stream_read(args.threads, repeats=2).median)
        for cfg in (CONFIGS if rnd % 2 == 0 else CONFIGS[::-1]):
            def go(f=fns[cfg]):
                f(cf, sf, xq, xc, xr, out, (step["i"] * n) % (rows - n), n)
                step["i"] += 1
            samples[cfg].append(measure(go, repeats=3, warmup=1).map(lambda s: n * H * 17 / 32 / s / 1e9, "GB/s").median)
    print(f"bank {rows * H * 17 / 32 / 1e9:.2f} GB, stream {np.median(streams):.1f} GB/s [{min(streams):.1f}-{max(streams):.1f}]")
    base = np.array(samples[CONFIGS[0]])
    for cfg in CONFIGS:
        r = np.array(samples[cfg]) / base
        print(f"{cfg[0]:6d} B ahead, locality {cfg[1]}: {np.median(samples[cfg]):5.1f} GB/s; per-round ratio to the first "
              f"{np.median(r):.2f}, above 1 in {(r > 1).sum()} of {len(r)} rounds")


if __name__ == "__main__":
    main()
