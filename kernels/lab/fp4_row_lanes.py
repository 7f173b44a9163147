"""Lab: lanes as rows, as a numba intrinsic, beside the package's kernel in one process.

  python -m kernels.lab.fp4_row_lanes [--threads 1 N] [--inputs 1 4 8] [--rounds 5] [--dram]

kernels/lab/fp4_row_lanes.c measured the arithmetic in C. Here it is emitted as the package emits its
kernel (LLVM IR through a numba intrinsic), on a bank repacked 16 rows at a time, and timed against
the package's GEMV (kernels/fp4_i8.py through kernels/lab/fp4_row_pairs.py `gemv`) over the same rows
and inputs, interleaved, the order reversed every round.

Layout (`repack`): a code byte keeps its pair of weights (2p in its low nibble, 2p+1 in its high one).
Per 16 rows, dword d of the 16 rows sits together (64 bytes: row l's code bytes 4d..4d+3 in lanes
l), so one 64-byte vector decodes (byte permute, AVX-512 VBMI) into the 16 rows' even weights 8d, 8d+2,
.., 8d+6 (low nibbles) and their odd ones (high nibbles); the 16 rows' scale bytes of each block
follow the same way ([blocks, 16]). An input's even and odd int8 (the package's own split, kernels/
cpu_moe.py `_prepare` without superblocks: xq = the K/2 even q then the K/2 odd ones, in order) give
the 4 bytes a product broadcasts to every lane: one 4-byte load per `vpdpbusd`, shared by G groups.
Per block and input: `vpdpbusd` from the offset's share (xc: -12 x the block's q sum), then per group a
convert, a scale product and an FMA: the package's integer per block, its float sums in another order
(so other bits; checked here against the package's outputs to float32 rounding). The codes are
prefetched into L2 as the package's are (kernels/fp4_simd.py `prefetch_weights`).

Zen 4 VM (AVX-512 VNNI + VBMI, 2 cores), 2304-wide rows, 3 rounds, against the package in one process
(kernels/lab/README.md, "a seventh time"): one group of 16 rows a call, in L2 1.19-1.45x the package at
1-8 inputs on 1 and 2 threads (2 threads: 124 / 182 / 242 / 258 / 286 GMAC/s at 1 / 2 / 4 / 6 / 8), from
DRAM on 2 threads 1.14 / 1.23 / 1.51 at 1 / 4 / 8 inputs (62 / 240 / 262 GMAC/s). Two groups a call
(an input's load for 32 rows) spill at 8 inputs (16 float accumulators beside 16 decoded vectors):
0.97-1.05 on 2 threads in L2; four 0.75-0.84.
"""
from __future__ import annotations

import argparse
import time

import numpy as np
from llvmlite import ir
from numba import njit, prange, types
from numba.core import cgutils
from numba.extending import intrinsic

from hostinfo import llc_bytes, probe_budget_bytes, usable_cores
from kernels.cpu_moe import MODE, ROWS_PER_CHUNK, _prepare, random_bytes
from kernels.fp4_i8 import LUT16
from kernels.fp4_simd import _data_ptrs, _literal, prefetch_weights
from kernels.lab.fp4_row_pairs import gemv
from kernels.threads import set_threads

i8, i16, i32, i64, f32 = ir.IntType(8), ir.IntType(16), ir.IntType(32), ir.IntType(64), ir.FloatType()
V8, V16, VI, VF = ir.VectorType(i8, 64), ir.VectorType(i16, 32), ir.VectorType(i32, 16), ir.VectorType(f32, 16)


def repack(codes: np.ndarray, scales: np.ndarray):
    """codes [N, K/2], scales [N, K/32] (rows in the bank's order, N a multiple of 16) -> the lanes layout:
    codes [N/16, K/8, 16, 4] (dword d of 16 rows together), scales [N/16, K/32, 16]."""
    N, h = codes.shape
    c = codes.reshape(N // 16, 16, h // 4, 4).transpose(0, 2, 1, 3)
    s = scales.reshape(N // 16, 16, -1).transpose(0, 2, 1)
    return np.ascontiguousarray(c).reshape(-1), np.ascontiguousarray(s).reshape(-1)


@intrinsic
def lanes_dot(typingctx, G_t, T_t, codes, c_off, scales, s_off, xq, xc, xr, K, out, o_off, o_stride):
    """G groups of 16 rows (codes from c_off, K/2 bytes a row, scales from s_off) against inputs 0..T-1
    (xq [T, K], xc, xr [T, K/8]: `_prepare(x, rows, 0)`'s layout; entries 4g..4g+3 are block g's):
    out[o_off + j o_stride + 16 g + l] = row 16 g + l . input j."""
    G, T = _literal(G_t), _literal(T_t)
    if G is None or T is None:
        return None
    sig = types.void(G_t, T_t, codes, c_off, scales, s_off, xq, xc, xr, K, out, o_off, o_stride)

    def codegen(context, builder, signature, args):
        _, _, _, c_off_v, _, s_off_v, _, _, _, K_v, _, o_off_v, o_stride_v = args
        cb, sb, qb, cxb, rb, ob = _data_ptrs(context, builder, signature.args, args, (2, 4, 6, 7, 8, 10))
        c64 = lambda v: ir.Constant(i64, v)  # noqa: E731
        fn = lambda name, ret, a: cgutils.get_or_insert_function(builder.module, ir.FunctionType(ret, a), name)  # noqa: E731
        permb = fn("llvm.x86.avx512.permvar.qi.512", V8, [V8, V8])
        dpbusd = fn("llvm.x86.avx512.vpdpbusd.512", VI, [VI, VI, VI])
        fma = fn("llvm.fma.v16f32", VF, [VF, VF, VF])
        prefetch = fn("llvm.prefetch.p0i8", ir.VoidType(), [i8.as_pointer(), i32, i32, i32])
        add4 = fn("llvm.vector.reduce.add.v4i32", i32, [ir.VectorType(i32, 4)])
        lut = ir.Constant(V8, LUT16 * 4)
        half, nb = builder.udiv(K_v, c64(2)), builder.udiv(K_v, c64(32))
        zero = ir.Constant(VF, [0.0] * 16)
        accs = [[cgutils.alloca_once_value(builder, zero) for _ in range(T)] for _ in range(G)]

        def load(base, at, t, align=1):
            return builder.load(builder.bitcast(builder.gep(base, [at]), t.as_pointer()), align=align)

        def splat(v, t):
            vec = builder.insert_element(ir.Constant(t, ir.Undefined), v, ir.Constant(i32, 0))
            return builder.shuffle_vector(vec, ir.Constant(t, ir.Undefined), ir.Constant(VI, [0] * 16))

        with cgutils.for_range(builder, nb) as loop:
            b = loop.index
            ws, w = [], []
            for g in range(G):
                gc = builder.add(c_off_v, builder.add(builder.mul(c64(g * 16), half), builder.mul(b, c64(256))))
                rows = []
                for v in range(4):                                      # dwords 4b + v: 16 rows x 4 code bytes
                    prefetch_weights(builder, prefetch, builder.gep(cb, [builder.add(gc, c64(64 * v))]))
                    c = load(cb, builder.add(gc, c64(64 * v)), V8)
                    hi = builder.bitcast(builder.lshr(builder.bitcast(c, V16), ir.Constant(V16, [4] * 32)), V8)
                    rows.append((builder.call(permb, [lut, c]), builder.call(permb, [lut, hi])))
                w.append(rows)
                s8 = load(sb, builder.add(s_off_v, builder.add(builder.mul(c64(g * 16), nb), builder.mul(b, c64(16)))), ir.VectorType(i8, 16))
                bits = builder.shl(builder.zext(s8, VI), ir.Constant(VI, [23] * 16))
                ws.append(builder.bitcast(bits, VF))
            for j in range(T):
                qe = builder.add(builder.mul(c64(j), K_v), builder.mul(b, c64(16)))   # even q of block b
                e = builder.add(builder.mul(c64(j), builder.udiv(K_v, c64(8))), builder.mul(b, c64(4)))
                c4 = load(cxb, e, ir.VectorType(i32, 4), 4)          # the block's 4 entries' offset shares
                init = splat(builder.call(add4, [c4]), VI)
                xs = splat(load(rb, e, f32, 4), VF)
                for g in range(G):
                    acc = init
                    for v in range(4):
                        lo, hi = w[g][v]
                        de = splat(load(qb, builder.add(qe, c64(4 * v)), i32), VI)
                        do = splat(load(qb, builder.add(builder.add(qe, half), c64(4 * v)), i32), VI)
                        acc = builder.call(dpbusd, [acc, builder.bitcast(lo, VI), de])
                        acc = builder.call(dpbusd, [acc, builder.bitcast(hi, VI), do])
                    f = builder.sitofp(acc, VF)
                    builder.store(builder.call(fma, [f, builder.fmul(ws[g], xs), builder.load(accs[g][j])]), accs[g][j])
        for g in range(G):
            for j in range(T):
                o = builder.add(o_off_v, builder.add(builder.mul(o_stride_v, c64(j)), c64(16 * g)))
                builder.store(builder.load(accs[g][j]), builder.bitcast(builder.gep(ob, [o]), VF.as_pointer()), align=4)
        return context.get_dummy_value()
    return sig, codegen


def lanes_gemv(G, T):
    """A GEMV over rows row0..row0+n-1 of a repacked bank, G groups of 16 rows a call; out [T, n]."""
    @njit(parallel=True, nogil=True)
    def f(w, s, x, out, row0, n, K):
        xq, xc, xr = x
        for c in prange(n // ROWS_PER_CHUNK):
            for i in range(0, ROWS_PER_CHUNK, 16 * G):
                r = row0 + c * ROWS_PER_CHUNK + i
                lanes_dot(G, T, w, r * (K // 2), s, r * (K // 32), xq, xc, xr, K, out, r - row0, n)
    return f


def main(argv=None):
    ap = argparse.ArgumentParser()
    ap.add_argument("--threads", type=int, nargs="+", default=sorted({1, usable_cores()}))
    ap.add_argument("--inputs", type=int, nargs="+", default=[1, 4, 8])
    ap.add_argument("--groups", type=int, default=1, help="groups of 16 rows a call (an input's load serves all)")
    ap.add_argument("--k", type=int, default=2304)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--dram", action="store_true", help="fresh rows from a bank (4x the LLC, >= 1 GB) instead of rows in L2")
    args = ap.parse_args(argv)
    if MODE != 4:
        raise SystemExit("needs the AVX-512 VNNI + VBMI path (the byte permute decode)")
    K, G = args.k, args.groups
    rng = np.random.default_rng(0)
    rows = 4608 if args.dram else 768
    span = max(1, min(max(4 * llc_bytes(), 10**9), probe_budget_bytes()) // (rows * K * 17 // 32)) if args.dram else 1
    w = random_bytes(rng, (span * rows, K // 2))
    s = rng.integers(118, 130, (span * rows, K // 32), dtype=np.uint8)
    wl, sl = repack(w, s)
    w, s = w.reshape(-1), s.reshape(-1)
    print(f"{K}-wide rows, {'fresh rows from ' + format(span * rows * K * 17 / 32 / 1e9, '.1f') + ' GB' if args.dram else str(rows) + ' rows over and over'}; "
          f"lanes as rows: {G} groups of 16 rows a call; the package: pairs of rows")
    for T in args.inputs:
        x = rng.standard_normal((T, K)).astype(np.float32)
        xp = tuple(a.reshape(-1) for a in _prepare(x, np.arange(T)))
        xl = tuple(a.reshape(-1) for a in _prepare(x, np.arange(T), 0))
        pk, ln = gemv(2 if T > 1 else 1, T, K=K), lanes_gemv(G, T)
        op, ol = np.empty(T * rows, np.float32), np.empty(T * rows, np.float32)
        pk(w, s, xp, op, 0, rows)
        ln(wl, sl, xl, ol, 0, rows, K)
        err = float(np.abs(op - ol).max() / np.abs(op).max())
        for t in args.threads:
            set_threads(t)
            got = {"package": [], "lanes": []}
            for rnd in range(args.rounds):
                for name in (("package", "lanes") if rnd % 2 == 0 else ("lanes", "package")):
                    ts = []
                    for i in range(40):
                        t0 = time.perf_counter()
                        if name == "package":
                            pk(w, s, xp, op, (i % span) * rows, rows)
                        else:
                            ln(wl, sl, xl, ol, (i % span) * rows, rows, K)
                        ts.append(time.perf_counter() - t0)
                    got[name].append(rows * K * T / np.median(ts[3:]) / 1e9)
            r = [a / b for a, b in zip(got["lanes"], got["package"])]
            print(f"  {T} inputs, {t} thread(s): package {np.median(got['package']):6.1f} GMAC/s, lanes as rows "
                  f"{np.median(got['lanes']):6.1f}: x{np.median(r):.2f} ({min(r):.2f}-{max(r):.2f}); "
                  f"largest difference {err:.1e} of the largest output", flush=True)


if __name__ == "__main__":
    main()
