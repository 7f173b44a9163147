"""Lab: the FP8 decode GEMV with 8 against 16 float lanes per step on an AVX2 host.

The package's `fp8_dot` takes `lanes` = LANES (8 on AVX2: one `vcvtph2ps` of 8 halves per step, the
widen / shift / mask on 128-bit vectors). With 16 the compiler keeps the integer decode on one
256-bit vector and emits two converts and two FMAs per step: half the integer ops per weight. Both
forms sum per block in another lane order, so they differ in the last bits: each is held against a
float64 reference here. Measured from DRAM: decode-width calls (T = 1) over copies of a 4096 x 4096
matrix until the rotation spans 8x the total LLC, both forms interleaved per round, median GB/s of
codes read.

  python -m kernels.lab.fp8_lanes [--rounds 7] [--threads N]
"""
from __future__ import annotations

import argparse

import numba
import numpy as np
import torch
from numba import njit, prange

from hostinfo import llc_bytes, usable_cores
from hostinfo.measure import measure
from kernels.cpu_moe import STAB
from kernels.formats import dequantize_fp8_block, quantize_fp8_block
from kernels.fp8_simd import fp8_dot


def _gemv(lanes):
    @njit(parallel=True, nogil=True)
    def gemv(q, s, bn, x, out):
        N, K = q.shape
        nb, sK = K // 32, s.shape[1]
        qf, sf, xf, of = q.reshape(-1), s.reshape(-1), x.reshape(-1), out.reshape(-1)
        for n in prange(N):
            fp8_dot(1, 1, lanes, qf, n * K, K, sf, (n // bn) * sK, 0, xf, 0, K, STAB, nb, 32, of, n, N, 1)
    return gemv


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument("--threads", type=int, default=usable_cores())
    args = ap.parse_args(argv)
    numba.set_num_threads(args.threads)
    N = K = 4096
    w = torch.randn(N, K) * 0.05
    q, s = quantize_fp8_block(w, (32, 32))
    q8, s8 = q.view(torch.uint8).numpy(), s.numpy()
    copies = max(2, -(-8 * llc_bytes() // q8.nbytes))
    mats = [(q8.copy(), s8.copy()) for _ in range(copies)]
    x = np.random.default_rng(0).standard_normal((1, K)).astype(np.float32)
    ref = (torch.from_numpy(x).double() @ dequantize_fp8_block(q, s, (32, 32), torch.float64).T).numpy()[0]
    forms = {lanes: _gemv(lanes) for lanes in (8, 16)}
    for lanes, f in forms.items():
        out = np.full((1, N), np.nan, np.float32)
        f(q8, s8, 32, x, out)
        err = float(np.abs(out[0] - ref).max() / np.abs(ref).max())
        print(f"lanes {lanes:2d}: max error {err:.2e} of max |ref|")
        assert err < 1e-5, lanes
    print(f"{copies} copies of {q8.nbytes / 2**20:.0f} MiB, LLC {llc_bytes() / 2**20:.0f} MiB, {args.threads} threads")
    gbs = {lanes: [] for lanes in forms}
    state = {"i": 0}
    out = np.empty((1, N), np.float32)

    def step(f):
        m, sc = mats[state["i"] % copies]
        state["i"] += 1
        f(m, sc, 32, x, out)
    for _ in range(args.rounds):
        for lanes, f in forms.items():
            m = measure(lambda f=f: step(f), repeats=copies, warmup=1)
            gbs[lanes].append(q8.nbytes / m.median / 1e9)
    for lanes, v in gbs.items():
        print(f"lanes {lanes:2d}: {np.median(v):5.1f} GB/s (rounds {min(v):.1f}-{max(v):.1f})")
    print("per round 16 / 8:", " ".join(f"{a / b:.2f}" for a, b in zip(gbs[16], gbs[8])))


if __name__ == "__main__":
    main()
