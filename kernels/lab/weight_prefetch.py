"""Lab: the weight streams' software prefetch (distance x target cache), timed from DRAM.

  python -m kernels.lab.weight_prefetch [--kernel fp4 fp8 bf16] [--threads N] [--rounds 16]
                                        [--configs=2048:3,16384:1,-1:1 ...]

One GEMV per step over fresh 5120-wide rows (rows in order, one input): ds_fp4 through the int8
CPU-MoE kernel (one expert's gate + up, 4608 rows), FP8 and BF16 through the dense kernels (16384
rows). Each (distance, locality) is compiled into its own copy of the kernel (kernels/fp4_simd.py
WEIGHT_PREFETCH, WEIGHT_LOCALITY: read when a kernel's code is emitted); all run interleaved in every
round (the order reversed every other round), the DRAM stream read once per round; a negative
distance compiles the kernel with no prefetch instruction. Locality is
llvm.prefetch's: 3 = prefetcht0 (into L1), 1 = prefetcht2 (into L2). Prints each one's median GB/s
and its per-round ratio to the first configuration. The bank spans 4x the host's total LLC (at least
60 steps of fp4 rows), within the probe's memory budget.
"""
from __future__ import annotations

import argparse

import numpy as np
from numba import njit, prange

import kernels.fp4_simd as simd
from hostinfo import llc_bytes, probe_budget_bytes, usable_cores
from hostinfo.measure import measure
from kernels.bf16_dense import UNROLL, bf16_dot
from kernels.cpu_moe import LANES, MODE, ROWS_PER_CHUNK, STAB, _prepare, random_bytes
from kernels.fp4_i8 import fp4_i8_dot
from kernels.fp8_simd import fp8_dot
from kernels.stream import dram_stream_read
from kernels.threads import set_threads

H = 5120
CONFIGS = [(2048, 3), (16384, 1), (32768, 1), (16384, 3)]     # (bytes ahead, locality); the first is the baseline


def gemv(kernel, mode=MODE, inputs=1):
    """A fresh njit GEMV over rows row0..row0+n-1 through `kernel`'s intrinsic (each copy emits its own code;
    fp4 on instruction path `mode`, the host's by default, against `inputs` inputs sharing each row
    decode: out [inputs, n])."""
    if kernel == "fp4":
        @njit(parallel=True, nogil=True)
        def f(w, s, x, out, row0, n):
            xq, xc, xr = x
            for c in prange(n // ROWS_PER_CHUNK):
                for i in range(ROWS_PER_CHUNK):
                    r = row0 + c * ROWS_PER_CHUNK + i
                    fp4_i8_dot(1, inputs, mode, w, r * (H // 2), 0, s, r * (H // 32), 0, xq, xc, xr, 0, H, out, r - row0, n, 0)
    elif kernel == "fp8":
        @njit(parallel=True, nogil=True)
        def f(w, s, x, out, row0, n):
            for i in prange(n):
                r = row0 + i
                fp8_dot(1, 1, LANES, w, r * H, H, s, (r // 32) * (H // 32), 0, x, 0, H, STAB, H // 32, 32, out, i, n, 1)
    else:
        @njit(parallel=True, nogil=True)
        def f(w, s, x, out, row0, n):
            for i in prange(n):
                bf16_dot(1, LANES, w, (row0 + i) * H, H // (UNROLL * LANES), x, 0, H, out, i, n)
    return f


def weights(kernel, rng):
    """-> (rows a step, bytes a row, (w, s, x)) over a bank within the probe budget (>= 4 steps)."""
    n, row_bytes = (4608, H * 17 / 32) if kernel == "fp4" else (16384, H * (1 if kernel == "fp8" else 2))
    span = max(60 * 4608 * H * 17 // 32, 4 * llc_bytes())
    rows = max(4 * n, min(span, probe_budget_bytes()) // int(row_bytes) // n * n)
    x = rng.standard_normal(H).astype(np.float32)
    if kernel == "fp4":
        w, s = random_bytes(rng, (rows, H // 2)), (115 + rng.integers(-1, 2, (rows, H // 32))).astype(np.uint8)
        return n, row_bytes, (w.reshape(-1), s.reshape(-1), tuple(a.reshape(-1) for a in _prepare(x[None], np.zeros(1, np.int64))))
    if kernel == "fp8":                                        # E4M3 codes below NaN, E8M0 scales near 1
        w = rng.integers(0, 126, rows * H, dtype=np.uint8)
        return n, row_bytes, (w, (120 + rng.integers(0, 4, rows // 32 * (H // 32))).astype(np.uint8), x)
    w = (rng.integers(0, 1 << 15, rows * H, dtype=np.uint16) & 0x3FFF) | 0x3C00   # finite BF16 values
    return n, row_bytes, (w, np.zeros(1, np.uint8), x)


def compiled(kernel, distance, locality, args):
    """`kernel`'s GEMV with the prefetch given, compiled now by a call on `args`; the globals put back after."""
    f, before = gemv(kernel), (simd.WEIGHT_PREFETCH, simd.WEIGHT_LOCALITY)
    simd.WEIGHT_PREFETCH, simd.WEIGHT_LOCALITY = distance, locality
    try:
        f(*args)
    finally:
        simd.WEIGHT_PREFETCH, simd.WEIGHT_LOCALITY = before
    return f


def run(kernel, threads, rounds, configs=CONFIGS):
    n, row_bytes, (w, s, x) = weights(kernel, np.random.default_rng(0))
    rows = len(w) * (2 if kernel == "fp4" else 1) // H
    out = np.empty(n, np.float32)
    fns = {c: compiled(kernel, *c, (w, s, x, out, 0, n)) for c in configs}
    samples, streams, step = {c: [] for c in configs}, [], {"i": 1}
    for rnd in range(rounds):
        streams.append(dram_stream_read(threads, repeats=2).median)
        for cfg in (configs if rnd % 2 == 0 else configs[::-1]):
            def go(f=fns[cfg]):
                f(w, s, x, out, (step["i"] * n) % (rows - n + 1) // n * n, n)
                step["i"] += 1
            samples[cfg].append(measure(go, repeats=3, warmup=1).map(lambda t: n * row_bytes / t / 1e9, "GB/s").median)
    print(f"{kernel}: bank {rows * row_bytes / 1e9:.2f} GB, stream {np.median(streams):.1f} GB/s [{min(streams):.1f}-{max(streams):.1f}]")
    base = np.array(samples[configs[0]])
    for cfg in configs:
        r = np.array(samples[cfg]) / base
        print(f"  {cfg[0]:6d} B ahead, locality {cfg[1]}: {np.median(samples[cfg]):5.1f} GB/s; per-round ratio to the first "
              f"{np.median(r):.2f}, above 1 in {(r > 1).sum()} of {len(r)} rounds", flush=True)


def main(argv=None):
    ap = argparse.ArgumentParser()
    ap.add_argument("--kernel", nargs="+", default=["fp4", "fp8", "bf16"], choices=["fp4", "fp8", "bf16"])
    ap.add_argument("--threads", type=int, default=usable_cores())
    ap.add_argument("--rounds", type=int, default=16)
    ap.add_argument("--configs", nargs="+", metavar="BYTES:LOCALITY", help="the first is the baseline "
                    f"(default {','.join(f'{d}:{k}' for d, k in CONFIGS)})")
    args = ap.parse_args(argv)
    try:
        configs = [tuple(int(v) for v in c.split(":")) for a in args.configs for c in a.split(",")] if args.configs else CONFIGS
    except ValueError:
        configs = []
    if not configs or any(len(c) != 2 or c[1] not in (0, 1, 2, 3) for c in configs):
        raise SystemExit(f"--configs: expected BYTES:LOCALITY pairs (locality 0-3), got {args.configs}")
    if not MODE:
        raise SystemExit("scalar ISA: these kernels have no software prefetch there")
    set_threads(args.threads)
    for kernel in args.kernel:
        run(kernel, args.threads, args.rounds, configs)


if __name__ == "__main__":
    main()
