"""Lab: AVX-VNNI's 256-bit `vpdpbusd` against AVX2's `vpmaddubsw` + `vpmaddwd` in the CPU-MoE GEMV.

  python -m kernels.lab.fp4_avx_vnni [--threads N] [--rounds 6] [--inputs 1 4 8]

In the package since: the avx2vnni path (kernels/fp4_i8.py mode 5), for CPUs with AVX-VNNI and no
AVX-512 (Intel client cores from Alder Lake on). Per pair of code vectors and input, AVX2 takes two
`vpmaddubsw` and an add into 16 bits, and per two pairs one `vpmaddwd` and an add into 32 bits;
`vpdpbusd` does each vector's products into the 32-bit lanes in one op. The same integer per lane, so
the same bits (checked first). Rows in order, `--inputs` inputs sharing each row decode, 5120-wide
rows (V4.1 gate / up) in L3 (2304 rows again and again) and from DRAM (4608 fresh rows a step), both
paths interleaved, order reversed every other round, the stream read once per round. On an AVX-512
CPU both run as EVEX on 256-bit vectors: a figure of the op count, not of a client core.
"""
from __future__ import annotations

import argparse

import numpy as np
from hostinfo import runnable_isas, usable_cores
from kernels.cpu_moe import _prepare, random_bytes
from kernels.fp4_i8 import superblock_bytes
from kernels.lab.fp4_ceiling import ROWS, STEPS, rate
from kernels.lab.weight_prefetch import H, gemv
from kernels.stream import dram_stream_read

PATHS = {"avx2 (mode 1)": 1, "avx2vnni (mode 5)": 5}


def main(argv=None):
    ap = argparse.ArgumentParser()
    ap.add_argument("--threads", type=int, default=usable_cores())
    ap.add_argument("--rounds", type=int, default=6)
    ap.add_argument("--inputs", type=int, nargs="+", default=[1, 4, 8], choices=range(1, 9))
    args = ap.parse_args(argv)
    if "avx2vnni" not in runnable_isas():
        raise SystemExit("this CPU has no AVX-VNNI (hostinfo.runnable_isas)")
    rng = np.random.default_rng(0)
    w = random_bytes(rng, (STEPS * ROWS, H // 2))
    s = rng.integers(118, 130, (STEPS * ROWS, H // 32), dtype=np.uint8)
    print(f"{args.threads} threads, {args.rounds} rounds; GB/s of weight bytes; ratio: per round, avx2vnni / avx2")
    for T in args.inputs:
        x = tuple(a.reshape(-1) for a in _prepare(rng.standard_normal((T, H)).astype(np.float32), np.arange(T), superblock_bytes(1)))
        fs = {n: gemv("fp4", m, T) for n, m in PATHS.items()}
        outs = {n: np.empty(T * ROWS, np.float32) for n in PATHS}
        for n in PATHS:
            fs[n](w, s, x, outs[n], 7 * ROWS, ROWS)
        same = np.array_equal(*(o.view(np.uint32) for o in outs.values()))
        got = {n: {"l3": [], "dram": []} for n in PATHS}
        streams = []
        names = list(PATHS)
        for r in range(args.rounds):
            for n in (names if r % 2 == 0 else names[::-1]):
                got[n]["l3"].append(rate(fs[n], w, s, x, outs[n], args.threads, 2304, 60, 1))
                got[n]["dram"].append(rate(fs[n], w, s, x, outs[n], args.threads, ROWS, 40, STEPS))
            streams.append(dram_stream_read(args.threads, repeats=2).median)
        a, b = got[names[0]], got[names[1]]
        line = [f"{T} inputs (same bits: {same}), stream {np.median(streams):.1f}:"]
        for k in ("l3", "dram"):
            rs = [y / z for y, z in zip(b[k], a[k])]
            line.append(f"{k} {np.median(a[k]):.1f} -> {np.median(b[k]):.1f} ({np.median(rs):.2f}, {min(rs):.2f}-{max(rs):.2f})")
        print("  ".join(line), flush=True)


if __name__ == "__main__":
    main()
