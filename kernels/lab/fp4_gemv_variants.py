"""Lab: ds_fp4 GEMV variants, each checked against the reference and timed from DRAM.

  python -m kernels.lab.fp4_gemv_variants [--threads N]

One matrix-vector product per step over fresh rows of a bank >= 4x LLC (5120-wide rows, the V4.1
gate/up geometry). Variants:
  v0  plain numba loops, 16-entry LUT per nibble, scalar scale per group
  v1  SIMD intrinsic, 1 row per x load, rows in order
  v2  SIMD intrinsic, 4 consecutive rows per x load
  v3  SIMD intrinsic, 4 rows a quarter-chunk apart per x load (4 DRAM streams per thread)
  v4  v3's row layout on int8 inputs: nibble -> byte shuffle, integer dot products (VNNI `vpdpbusd`, or
      `vpmaddubsw` + `vpmaddwd`), one convert and two FP ops per 64 code bytes -> package
The package (kernels/cpu_moe.py) imports only the winner. Results and notes: kernels/lab/README.md.
"""
from __future__ import annotations

import argparse

import numpy as np
import torch
from numba import njit, prange

from hostinfo import llc_bytes, probe_budget_bytes, usable_cores
from hostinfo.measure import measure
from kernels.cpu_moe import E2M1_F32, LANES, MODE, STAB, _prepare
from kernels.fp4_i8 import fp4_i8_dot
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
            fp4_i8_dot(4, 1, MODE, cf, r * (H // 2), q * (H // 2), sf, r * (H // 32), q * (H // 32), xq.reshape(-1),
                       xc.reshape(-1), xr.reshape(-1), 0, H, out, r - row0, 0, q)


@njit(parallel=True, nogil=True)
def v5(cf, sf, xp, out, row0, nrows, stab):
    xq, xc, xr = xp
    for c in prange(nrows // CHUNK):
        for i in range(CHUNK):
            r = row0 + c * CHUNK + i
            fp4_i8_dot(1, 1, MODE, cf, r * (H // 2), 0, sf, r * (H // 32), 0, xq.reshape(-1),
                       xc.reshape(-1), xr.reshape(-1), 0, H, out, r - row0, 0, 0)


@njit(parallel=True, nogil=True)
def v6(cf, sf, xp, out, row0, nrows, stab):
    xq, xc, xr = xp
    for c in prange(nrows // CHUNK):
        for i in range(0, CHUNK, 4):
            r = row0 + c * CHUNK + i
            fp4_i8_dot(4, 1, MODE, cf, r * (H // 2), H // 2, sf, r * (H // 32), H // 32, xq.reshape(-1),
                       xc.reshape(-1), xr.reshape(-1), 0, H, out, r - row0, 0, 1)


def main(argv=None):
    ap = argparse.ArgumentParser()
    ap.add_argument("--threads", type=int, default=usable_cores())
    ap.add_argument("--steps", type=int, default=16)
    args = ap.parse_args(argv)
    set_threads(args.threads)
    row_bytes, n = H * 17 / 32, 4608                           # one expert's gate+up rows per step
    # >= 4.2x the total LLC and >= 8 steps of fresh rows, within the probe memory budget
    rows = max(int(4.2 * llc_bytes() / row_bytes), 8 * n)
    rows = max(2 * n, min(rows, int(probe_budget_bytes() / row_bytes))) // n * n
    rng = np.random.default_rng(0)
    codes = np.frombuffer(bytearray(rng.bytes(rows * H // 2)), np.uint8).reshape(rows, H // 2)
    scales = (115 + rng.integers(-1, 2, (rows, H // 32))).astype(np.uint8)
    x = rng.standard_normal(H).astype(np.float32)
    xd = np.concatenate([x[0::2], x[1::2]])
    ref = (dequantize_mxfp4(torch.from_numpy(codes[:n]), torch.from_numpy(scales[:n]), torch.float64) @ torch.from_numpy(x).double()).numpy()
    stream = dram_stream_read(args.threads)
    print(f"bank {rows * H * 17 / 32 / 1e9:.2f} GB, stream {stream.median:.2f} GB/s ({args.threads} threads, ISA lanes {LANES})")
    variants = [("v0 plain loops", v0, (codes, scales, x))]
    if LANES:                                                  # the SIMD variants need avx2 / avx512
        variants += [("v1 simd 1 row", v1, (codes.reshape(-1), scales.reshape(-1), xd)),
                     ("v2 simd 4 rows", v2, (codes.reshape(-1), scales.reshape(-1), xd)),
                     ("v3 simd 4 spaced rows", v3, (codes.reshape(-1), scales.reshape(-1), xd)),
                     ("v4 int8 4 spaced rows", v4, (codes.reshape(-1), scales.reshape(-1), _prepare(x[None], np.zeros(1, np.int64)))),
                     ("v5 int8 1 row", v5, (codes.reshape(-1), scales.reshape(-1), _prepare(x[None], np.zeros(1, np.int64)))),
                     ("v6 int8 4 adjacent rows", v6, (codes.reshape(-1), scales.reshape(-1), _prepare(x[None], np.zeros(1, np.int64))))]
    else:
        print("scalar ISA: only v0 (the SIMD variants need avx2 or avx512)")
    for name, f, a in variants:
        out = np.full(n, np.nan, np.float32)
        f(*a, out, 0, n, STAB)
        err = np.linalg.norm(out - ref) / np.linalg.norm(ref)
        state = {"i": 1}

        def step():
            f(*a, out, (state["i"] * n) % (rows - n), n, STAB)
            state["i"] += 1
        m = measure(step, repeats=args.steps if name[1] != "0" else 3, warmup=1).map(lambda s: n * H * 17 / 32 / s / 1e9, "GB/s")
        print(f"{name:24s} {m.median:6.2f} GB/s [{m.min:.2f}-{m.max:.2f}]  ratio {m.median / stream.median:.2f}  rel.err {err:.1e}")


if __name__ == "__main__":
    main()
