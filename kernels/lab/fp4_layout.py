"""Lab: what a bank stored in the kernel's order would buy the CPU-MoE GEMV (batch 1), before building it.

  python -m kernels.lab.fp4_layout [--threads N] [--rounds 6]

The package's AVX2 / AVX-512 kernel (kernels/fp4_i8.py) transposes every superblock's 4 code vectors
(8 unpacks a row and superblock, ~14% of its ~56 vector ops on AVX2) and permutes the block scales into
lane order; a bank written in that order when it is built would skip both. The variants here are the
same kernel compiled with the transpose (and then also the scale's NaN select) left out, over the same
bytes: their outputs are not the dot products (the bytes are not in that order), their rates are what
such a layout would run at. Rows in order, one input, 5120-wide rows (V4.1 gate / up): in L3 (2304
rows passed over again and again) and from DRAM (4608 fresh rows a step); variants interleaved, the
order reversed every other round, the stream read once per round.
"""
from __future__ import annotations

import argparse

import numpy as np

import kernels.fp4_i8 as fi
from hostinfo import usable_cores
from kernels.cpu_moe import _prepare, random_bytes
from kernels.lab.fp4_ceiling import ROWS, STEPS, rate
from kernels.lab.weight_prefetch import H, gemv
from kernels.stream import dram_stream_read


def _plain_scale(self, sbase, s_at, order):
    """The scale bytes in lane order already, no NaN select: one zero-extending load and a shift."""
    b = self.b
    s = b.zext(self.load(sbase, s_at, fi._vec(fi.i8, self.n)), self.vi)
    return b.bitcast(b.shl(s, fi.ir.Constant(self.vi, [23] * self.n)), self.vf)


VARIANTS = {"package": {}, "no transpose": {"transpose": lambda self, vs: vs},
            "no transpose, plain scales": {"transpose": lambda self, vs: vs, "scale": _plain_scale}}


def with_swaps(f, swaps, args):
    """Compile `f` by a call on `args` with `swaps` ({method: function}) put into fp4_i8._Step meanwhile
    (the emitted code is the variant's; the methods are put back after). -> f."""
    saved = {k: getattr(fi._Step, k) for k in swaps}
    for k, v in swaps.items():
        setattr(fi._Step, k, v)
    try:
        f(*args)
    finally:
        for k, v in saved.items():
            setattr(fi._Step, k, v)
    return f


def compiled(name, args):
    """A fresh copy of the GEMV with `name`'s methods swapped in while it compiles."""
    return with_swaps(gemv("fp4"), VARIANTS[name], args)


def main(argv=None):
    ap = argparse.ArgumentParser()
    ap.add_argument("--threads", type=int, default=usable_cores())
    ap.add_argument("--rounds", type=int, default=6)
    args = ap.parse_args(argv)
    rng = np.random.default_rng(0)
    w = random_bytes(rng, (STEPS * ROWS, H // 2))
    s = rng.integers(118, 130, (STEPS * ROWS, H // 32), dtype=np.uint8)
    x = _prepare(rng.standard_normal((1, H)).astype(np.float32), np.zeros(1, np.int64))
    out = np.empty(ROWS, np.float32)
    fs = {n: compiled(n, (w, s, x, out, 0, ROWS)) for n in VARIANTS}
    got = {n: {"l3": [], "dram": []} for n in VARIANTS}
    streams = []
    for r in range(args.rounds):
        for n in (list(VARIANTS) if r % 2 == 0 else list(VARIANTS)[::-1]):
            got[n]["l3"].append(rate(fs[n], w, s, x, out, args.threads, 2304, 100, 1))
            got[n]["dram"].append(rate(fs[n], w, s, x, out, args.threads, ROWS, 60, STEPS))
        streams.append(dram_stream_read(args.threads, repeats=3).median)
    base = got["package"]
    print(f"{args.threads} threads, {args.rounds} rounds; stream {np.median(streams):.1f} GB/s ({min(streams):.1f}-{max(streams):.1f})")
    print(f"{'variant':<28} {'L3 GB/s':>8} {'DRAM GB/s':>10} {'DRAM/stream':>12} {'DRAM vs package (per round)':>30}")
    for n, g in got.items():
        rs = [a / b for a, b in zip(g["dram"], base["dram"])]
        print(f"{n:<28} {np.median(g['l3']):>8.1f} {np.median(g['dram']):>10.1f} "
              f"{np.median([a / b for a, b in zip(g['dram'], streams)]):>12.2f} "
              f"{np.median(rs):>8.3f} ({min(rs):.3f}-{max(rs):.3f})")


if __name__ == "__main__":
    main()
