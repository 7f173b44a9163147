"""Lab: ds_fp4 GEMV variants, each checked against the reference and timed from DRAM.

  python -m kernels.lab.fp4_gemv_variants [--threads N]

One matrix-vector product per step over fresh rows of a bank >= 4x LLC (5120-wide rows, the V4.1
gate/up geometry). Variants:
  v0  plain numba loops, 16-entry LUT per nibble, scalar scale per group
  v1  SIMD intrinsic, 1 row per x load, rows in order
  v2  SIMD intrinsic, 4 consecutive rows per x load
  v3  SIMD intrinsic, 4 rows a quarter-chunk apart per x load (4 DRAM streams per thread)
  v4  v3's row layout on int8 inputs: nibble -> byte shuffle, integer dot products (VNNI `vpdpbusd`, or
      `vpmaddubsw` + `vpmaddwd`), a convert and two FP ops per 4 code bytes (kernels/lab/fp4_i8_lanes.py)
  v5  v4's arithmetic, 1 row at a time (rows in order: one DRAM stream per thread)
  v6  v4's arithmetic, 4 consecutive rows per input load
  v7  superblocks (kernels/fp4_i8.py): 4 vectors transposed so an integer lane sums a whole block; a
      convert and two FP ops per block, one scale vector per 16 blocks; 1 row at a time -> package
  v8  v7, 4 rows a quarter-chunk apart
  v9  v7, 4 adjacent rows per call (one stream per thread, 4 independent chains, inputs loaded once)
  v10 v7 on the AVX2 instruction path (32-byte vectors, `vpmaddubsw` + `vpmaddwd`) where the CPU has
      AVX-512: do 256-bit loads stream better (as the DRAM probe's 32-byte loads do on Zen 4)?
With --in-cache every step makes 16 passes over the same 256 rows per thread (700 KB a core: its L2
holds them; the compute ceiling); else fresh rows from DRAM, one expert's gate+up (4608 rows) a step. Variants run interleaved over --rounds rounds.
The package (kernels/cpu_moe.py) imports only the winner. Results and notes: kernels/lab/README.md.
"""
from __future__ import annotations

import argparse

import numpy as np
import torch
from numba import njit, prange

from hostinfo import llc_bytes, probe_budget_bytes, usable_cores
from hostinfo.measure import measure
from kernels.cpu_moe import E2M1_F32, LANES, MODE, STAB, _prepare, random_bytes
from kernels.fp4_i8 import fp4_i8_dot, superblock_bytes
from kernels.lab.fp4_i8_lanes import fp4_i8_dot_lanes
from kernels.formats import dequantize_mxfp4
from kernels.lab.fp4_float_dot import fp4_dot
from kernels.stream import dram_stream_read
from kernels.threads import set_threads

H = 5120
CHUNK = 64


@njit(parallel=True, nogil=True)
def v0(codes, scales, x, out, row0, nrows, stab):
    ng = H // 32
    for r in prange(row0, row0 + nrows):
        acc = np.float32(0.0)
        for g in range(ng):
            s = stab[scales[r, g]]
            p = np.float32(0.0)
            for j in range(16):
                c = codes[r, g * 16 + j]
                p += E2M1_F32[c & 15] * x[g * 32 + 2 * j] + E2M1_F32[c >> 4] * x[g * 32 + 2 * j + 1]
            acc += p * s
        out[r - row0] = acc


@njit(parallel=True, nogil=True)
def v1(cf, sf, xd, out, row0, nrows, stab):
    for r in prange(row0, row0 + nrows):
        fp4_dot(1, 1, LANES, cf, r * (H // 2), H // 2, sf, r * (H // 32), H // 32, xd, 0, H, stab, H // 32, out, r - row0, 0, 1)


@njit(parallel=True, nogil=True)
def v2(cf, sf, xd, out, row0, nrows, stab):
    for b in prange(nrows // 4):
        r = row0 + 4 * b
        fp4_dot(4, 1, LANES, cf, r * (H // 2), H // 2, sf, r * (H // 32), H // 32, xd, 0, H, stab, H // 32, out, r - row0, 0, 1)


@njit(parallel=True, nogil=True)
def v3(cf, sf, xd, out, row0, nrows, stab):
    q = CHUNK // 4
    for c in prange(nrows // CHUNK):
        for i in range(q):
            r = row0 + c * CHUNK + i
            fp4_dot(4, 1, LANES, cf, r * (H // 2), q * (H // 2), sf, r * (H // 32), q * (H // 32), xd, 0, H,
                    stab, H // 32, out, r - row0, 0, q)


@njit(parallel=True, nogil=True)
def v4(cf, sf, xp, out, row0, nrows, stab):
    q = CHUNK // 4
    xq, xc, xr = xp
    for c in prange(nrows // CHUNK):
        for i in range(q):
            r = row0 + c * CHUNK + i
            fp4_i8_dot_lanes(4, 1, MODE, cf, r * (H // 2), q * (H // 2), sf, r * (H // 32), q * (H // 32), xq.reshape(-1),
                             xc.reshape(-1), xr.reshape(-1), 0, H, out, r - row0, 0, q)


@njit(parallel=True, nogil=True)
def v6(cf, sf, xp, out, row0, nrows, stab):
    xq, xc, xr = xp
    for c in prange(nrows // CHUNK):
        for i in range(0, CHUNK, 4):
            r = row0 + c * CHUNK + i
            fp4_i8_dot_lanes(4, 1, MODE, cf, r * (H // 2), H // 2, sf, r * (H // 32), H // 32, xq.reshape(-1),
                             xc.reshape(-1), xr.reshape(-1), 0, H, out, r - row0, 0, 1)


def one_row(dot, mode):
    """v5 / v7 / v10: rows in order, one at a time (one DRAM stream per thread), through the intrinsic
    `dot` on instruction path `mode` (constants of the compiled function, as the intrinsics need)."""
    @njit(parallel=True, nogil=True)
    def gemv(cf, sf, xp, out, row0, nrows, stab):
        xq, xc, xr = xp
        for c in prange(nrows // CHUNK):
            for i in range(CHUNK):
                r = row0 + c * CHUNK + i
                dot(1, 1, mode, cf, r * (H // 2), 0, sf, r * (H // 32), 0, xq.reshape(-1),
                    xc.reshape(-1), xr.reshape(-1), 0, H, out, r - row0, 0, 0)
    return gemv


v5 = one_row(fp4_i8_dot_lanes, MODE)
v7 = one_row(fp4_i8_dot, MODE)
v10 = one_row(fp4_i8_dot, 1)                                   # the AVX2 path's 32-byte vectors


@njit(parallel=True, nogil=True)
def v8(cf, sf, xp, out, row0, nrows, stab):
    q = CHUNK // 4
    xq, xc, xr = xp
    for c in prange(nrows // CHUNK):
        for i in range(q):
            r = row0 + c * CHUNK + i
            fp4_i8_dot(4, 1, MODE, cf, r * (H // 2), q * (H // 2), sf, r * (H // 32), q * (H // 32), xq.reshape(-1),
                       xc.reshape(-1), xr.reshape(-1), 0, H, out, r - row0, 0, q)


@njit(parallel=True, nogil=True)
def v9(cf, sf, xp, out, row0, nrows, stab):
    xq, xc, xr = xp
    for c in prange(nrows // CHUNK):
        for i in range(0, CHUNK, 4):
            r = row0 + c * CHUNK + i
            fp4_i8_dot(4, 1, MODE, cf, r * (H // 2), H // 2, sf, r * (H // 32), H // 32, xq.reshape(-1),
                       xc.reshape(-1), xr.reshape(-1), 0, H, out, r - row0, 0, 1)


def main(argv=None):
    ap = argparse.ArgumentParser()
    ap.add_argument("--threads", type=int, default=usable_cores())
    ap.add_argument("--steps", type=int, default=16, help="timed steps per variant, spread over the rounds")
    ap.add_argument("--rounds", type=int, default=4)
    ap.add_argument("--in-cache", action="store_true", help="the same rows every step (compute ceiling)")
    ap.add_argument("--only", nargs="+", help="variant names to run (e.g. v5 v7)")
    args = ap.parse_args(argv)
    set_threads(args.threads)
    row_bytes, n = H * 17 / 32, (256 * args.threads if args.in_cache else 4608)   # rows per pass
    # >= 4.2x the total LLC and >= 8 steps of fresh rows, within the probe memory budget
    rows = max(int(4.2 * llc_bytes() / row_bytes), 8 * n)
    rows = n if args.in_cache else max(2 * n, min(rows, int(probe_budget_bytes() / row_bytes))) // n * n
    rng = np.random.default_rng(0)
    codes = random_bytes(rng, (rows, H // 2))                 # numpy's allocation: huge pages, as the runtime's banks
    scales = (115 + rng.integers(-1, 2, (rows, H // 32))).astype(np.uint8)
    x = rng.standard_normal(H).astype(np.float32)
    xd = np.concatenate([x[0::2], x[1::2]])
    ref = (dequantize_mxfp4(torch.from_numpy(codes[:n]), torch.from_numpy(scales[:n]), torch.float64) @ torch.from_numpy(x).double()).numpy()
    stream = dram_stream_read(args.threads)
    where = "the same rows every step (in cache)" if args.in_cache else "fresh rows (DRAM)"
    print(f"bank {rows * H * 17 / 32 / 1e9:.2f} GB, {where}, stream {stream.median:.2f} GB/s ({args.threads} threads, ISA lanes {LANES})")
    one = np.zeros(1, np.int64)
    variants = [("v0 plain loops", v0, (codes, scales, x))]
    if LANES:                                                  # the SIMD variants need avx2 / avx512
        lanes, sup = _prepare(x[None], one, 0), _prepare(x[None], one)
        cs = (codes.reshape(-1), scales.reshape(-1))
        variants += [("v1 simd 1 row", v1, cs + (xd,)), ("v2 simd 4 rows", v2, cs + (xd,)),
                     ("v3 simd 4 spaced rows", v3, cs + (xd,)), ("v4 int8 4 spaced rows", v4, cs + (lanes,)),
                     ("v5 int8 1 row", v5, cs + (lanes,)), ("v6 int8 4 adjacent rows", v6, cs + (lanes,)),
                     ("v7 superblocks 1 row", v7, cs + (sup,)), ("v8 superblocks 4 spaced", v8, cs + (sup,)),
                     ("v9 superblocks 4 adjacent", v9, cs + (sup,))]
        if MODE > 1:                                           # the 32-byte path beside the 64-byte one
            variants.append(("v10 superblocks 32-byte", v10, cs + (_prepare(x[None], one, superblock_bytes(1)),)))
    else:
        print("scalar ISA: only v0 (the SIMD variants need avx2 or avx512)")
    if args.only:
        variants = [v for v in variants if v[0].split()[0] in args.only]
    samples, errs, passes = {}, {}, (16 if args.in_cache else 1)
    for name, f, a in variants:
        out = np.full(n, np.nan, np.float32)
        f(*a, out, 0, n, STAB)
        errs[name] = np.linalg.norm(out - ref) / np.linalg.norm(ref)
        samples[name] = []
    for _ in range(args.rounds):                               # interleaved: every variant in every round
        for name, f, a in variants:
            out = np.empty(n, np.float32)
            state = {"i": 1}

            def step():
                for _ in range(passes):
                    f(*a, out, 0 if args.in_cache else (state["i"] * n) % (rows - n), n, STAB)
                state["i"] += 1
            reps = 1 if name[1] == "0" else max(1, args.steps // args.rounds)
            samples[name] += measure(step, repeats=reps, warmup=1).map(lambda s: passes * n * H * 17 / 32 / s / 1e9, "GB/s").samples
    for name, _, _ in variants:
        m = np.array(samples[name])
        print(f"{name:26s} {np.median(m):6.2f} GB/s [{m.min():.2f}-{m.max():.2f}]  ratio {np.median(m) / stream.median:.2f}  "
              f"rel.err {errs[name]:.1e}")


if __name__ == "__main__":
    main()
