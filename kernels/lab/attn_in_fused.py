"""Lab: a decode layer's attention inputs as one compiled call against the separate calls, warm and cold.

  python -m kernels.lab.attn_in_fused [--evict-mib 128] [--rounds 40]

The piece (mini's shapes, one token): a = rmsnorm(h), ql = a wq_a^T, q = rope(ql wq_b^T),
cw = rmsnorm(a wkv^T), k = rope(cw). "apart" is how the runtime runs it: each kernel through its own
Python entry point with torch tensors around it (kernels/norms.py, kernels/fp8_dense.py fp8_linear);
"fused" is one njit function calling the same compiled kernels (the same bits: checked). "cold" times
each call after a 2-thread read of --evict-mib MiB (a layer's MoE read on mini is ~113 MB), "warm"
right after another call. Rounds alternate the order; medians with the 10th-90th percentiles.
"""
from __future__ import annotations

import argparse
import time

import numpy as np
import torch
from numba import njit, prange

from kernels.cpu_moe import STAB
from kernels.fp8_dense import LANES, Fp8Weight, _gemv_simd, fp8_linear
from kernels.norms import _rope, _rows, rmsnorm, rope
from kernels.threads import set_threads

H, Q, C, HEADS = 5120, 128, 128, 2


@njit(nogil=True)
def fused(h, an, kn, qa, sa, qb, sb, qk, sk, cos, sin, stab, a, ql, qraw, q, craw, cw, k):
    _rows(h, an, 1e-6, np.empty(1, np.float32), a)
    _gemv_simd(qa, sa, 32, 32, a, ql, stab)
    _gemv_simd(qb, sb, 32, 32, ql, qraw, stab)
    _rope(qraw.reshape(1, HEADS, C), cos, sin, q)
    _gemv_simd(qk, sk, 32, 32, a, craw, stab)
    _rows(craw, kn, 1e-6, np.empty(1, np.float32), cw)
    _rope(cw.reshape(1, 1, C), cos, sin, k)


@njit(parallel=True, nogil=True)
def touch(buf, n):
    """One load per 64-byte line of buf's first n lines, over every thread: the caches evicted."""
    s = 0.0
    for i in prange(n):
        s += buf[i * 8]
    return s


def main(argv=None):
    ap = argparse.ArgumentParser()
    ap.add_argument("--evict-mib", type=int, default=128)
    ap.add_argument("--rounds", type=int, default=40)
    ap.add_argument("--threads", type=int, default=2)
    args = ap.parse_args(argv)
    if not LANES:
        raise SystemExit("scalar ISA: no SIMD GEMV to fuse")
    set_threads(args.threads)
    torch.set_num_threads(1)                                  # as a decode forward runs torch's ops
    rng = np.random.default_rng(0)

    def fp8(N, K):
        return Fp8Weight(rng.integers(0, 120, (N, K), dtype=np.uint8), rng.integers(118, 124, (-(-N // 32), K // 32), dtype=np.uint8), (32, 32))
    h = torch.randn(1, H)
    an, kn = torch.rand(H) + 0.5, torch.rand(C) + 0.5
    wq_a, wq_b, wkv = fp8(Q, H), fp8(HEADS * C, Q), fp8(C, H)
    ang = torch.rand(1, C // 2, dtype=torch.float64) * 6
    cos, sin = ang.cos().float(), ang.sin().float()

    def apart():                                              # the runtime's form: a call per kernel
        a = torch.empty(1, H)
        rmsnorm(h.numpy(), an.numpy(), 1e-6, a.numpy())
        ql = fp8_linear(a, wq_a)
        qr = fp8_linear(ql, wq_b).view(1, HEADS, C)
        q = torch.empty_like(qr)
        rope(qr.numpy(), cos.numpy(), sin.numpy(), q.numpy())
        c0 = fp8_linear(a, wkv)
        cw = torch.empty_like(c0)
        rmsnorm(c0.numpy(), kn.numpy(), 1e-6, cw.numpy())
        k = torch.empty_like(cw)
        rope(cw[:, None].numpy(), cos.numpy(), sin.numpy(), k[:, None].numpy())
        return a, ql, q, cw, k
    bufs = dict(a=np.empty((1, H), np.float32), ql=np.empty((1, Q), np.float32), qraw=np.empty((1, HEADS * C), np.float32),
                q=np.empty((1, HEADS, C), np.float32), craw=np.empty((1, C), np.float32), cw=np.empty((1, C), np.float32),
                k=np.empty((1, 1, C), np.float32))

    def one():
        fused(h.numpy(), an.numpy(), kn.numpy(), wq_a.q, wq_a.scale, wq_b.q, wq_b.scale, wkv.q, wkv.scale, cos.numpy(),
              sin.numpy(), STAB, **bufs)
    ref = apart()
    one()
    same = all(np.array_equal(r.numpy().reshape(-1), bufs[n].reshape(-1)) for r, n in zip(ref, ("a", "ql", "q", "cw", "k")))
    print(f"same bits as the separate calls: {same}")
    junk = np.ones((args.evict_mib << 20) // 8)
    lines = len(junk) // 8
    touch(junk, 8)
    res = {n: {"warm": [], "cold": []} for n in ("apart", "fused")}
    for rnd in range(args.rounds):
        for name, f in (("apart", apart), ("fused", one)) if rnd % 2 == 0 else (("fused", one), ("apart", apart)):
            for mode in ("warm", "cold"):
                touch(junk, lines) if mode == "cold" else f()
                t0 = time.perf_counter()
                f()
                res[name][mode].append(time.perf_counter() - t0)
    for name, d in res.items():
        print(f"{name:6s} " + "  ".join(f"{m} {1e6 * np.median(v):6.1f} us [{1e6 * np.percentile(v, 10):.0f}-"
                                         f"{1e6 * np.percentile(v, 90):.0f}]" for m, v in d.items()))


if __name__ == "__main__":
    main()
