"""Lab: the CPU-MoE GEMV's nibble decode through one byte permute (`vpermb`, AVX-512 VBMI) per half.

  python -m kernels.lab.fp4_vpermb [--threads N] [--rounds 8]

In the package since: the avx512vbmi path (kernels/fp4_i8.py mode 4). The avx512vnni path (mode 3)
decodes 64 code bytes in 4 ops: low nibbles `vpandq` + `vpshufb`, high nibbles `vgf2p8affineqb` (LLVM's
shift-and-mask on GFNI hosts) + `vpshufb` (`vpshufb` reads bit 7, so a nibble must be masked first).
`vpermb` reads only an index's low 6 bits: with the 16-entry table repeated 4 times the byte itself
indexes its low nibble, and the byte shifted right by 4 within its 16-bit word its high nibble. 3 ops,
the same bytes: the outputs must be mode 3's bits (checked first). A third variant adds what a bank
stored in the kernel's order would save (kernels/lab/fp4_layout.py: no transpose, no scale select; its
outputs are not the dot products). Rows in order, one input, 5120-wide rows (V4.1 gate / up) in L2, in
L3 and from DRAM (kernels/lab/fp4_ceiling.py's sizes), interleaved, order reversed every other round,
the stream read once per round.
"""
from __future__ import annotations

import argparse

import numpy as np

from hostinfo import isa, usable_cores
from kernels.cpu_moe import _prepare, random_bytes
from kernels.lab.fp4_ceiling import ROWS, STEPS, rate
from kernels.lab.fp4_layout import _plain_scale, with_swaps
from kernels.lab.weight_prefetch import H, gemv
from kernels.stream import dram_stream_read

VARIANTS = {"vpshufb (mode 3)": (3, {}), "vpermb (mode 4)": (4, {}),
            "vpermb + kernel order": (4, {"transpose": lambda self, vs: vs, "scale": _plain_scale})}


def compiled(name, args):
    """A fresh copy of the GEMV on `name`'s mode, its methods swapped in while it compiles."""
    mode, swaps = VARIANTS[name]
    return with_swaps(gemv("fp4", mode), swaps, args)


def main(argv=None):
    ap = argparse.ArgumentParser()
    ap.add_argument("--threads", type=int, default=usable_cores())
    ap.add_argument("--rounds", type=int, default=8)
    args = ap.parse_args(argv)
    if isa() != "avx512vbmi":
        raise SystemExit(f"this CPU's widest path is {isa()}: no AVX-512 VBMI to compare")
    rng = np.random.default_rng(0)
    w = random_bytes(rng, (STEPS * ROWS, H // 2))
    s = rng.integers(118, 130, (STEPS * ROWS, H // 32), dtype=np.uint8)
    x = _prepare(rng.standard_normal((1, H)).astype(np.float32), np.zeros(1, np.int64))
    outs = {n: np.empty(ROWS, np.float32) for n in VARIANTS}
    fs = {n: compiled(n, (w, s, x, outs[n], 0, ROWS)) for n in VARIANTS}
    names = list(VARIANTS)
    for n in names[:2]:
        fs[n](w, s, x, outs[n], 7 * ROWS, ROWS)
    print(f"the vpermb decode's outputs are mode 3's bits: {np.array_equal(*(outs[n].view(np.uint32) for n in names[:2]))}")
    got = {n: {"l2": [], "l3": [], "dram": []} for n in VARIANTS}
    streams = []
    for r in range(args.rounds):
        for n in (names if r % 2 == 0 else names[::-1]):
            got[n]["l2"].append(rate(fs[n], w, s, x, outs[n], args.threads, 128, 400, 1))
            got[n]["l3"].append(rate(fs[n], w, s, x, outs[n], args.threads, 2304, 100, 1))
            got[n]["dram"].append(rate(fs[n], w, s, x, outs[n], args.threads, ROWS, 60, STEPS))
        streams.append(dram_stream_read(args.threads, repeats=3).median)
    base = got[names[0]]
    print(f"{args.threads} threads, {args.rounds} rounds; stream {np.median(streams):.1f} GB/s ({min(streams):.1f}-{max(streams):.1f})")
    print(f"{'variant':<22} {'L2 GB/s':>8} {'L3 GB/s':>8} {'DRAM GB/s':>10} {'DRAM/stream':>12}   per-round ratio to mode 3: L2 / L3 / DRAM")
    for n, g in got.items():
        rs = {k: [a / b for a, b in zip(g[k], base[k])] for k in g}
        print(f"{n:<22} {np.median(g['l2']):>8.1f} {np.median(g['l3']):>8.1f} {np.median(g['dram']):>10.1f} "
              f"{np.median([a / b for a, b in zip(g['dram'], streams)]):>12.2f}   "
              + " / ".join(f"{np.median(v):.3f} ({min(v):.2f}-{max(v):.2f})" for v in rs.values()))


if __name__ == "__main__":
    main()
