"""ds_fp4 x int8 with lanes as rows: a vector holds R rows x 4 code bytes, an input's 4 int8 broadcast.

The superblock kernel (kernels/fp4_i8.py) loads a 64-byte input vector for every 2 products it makes; a
row's decode is shared by at most 8 inputs. Here the bank is repacked R rows at a time (R = 16 on
AVX-512, 8 on AVX2: a vector's 32-bit lanes), so one vector of code bytes is dword d of R rows, and one
product takes a 4-byte load broadcast to every lane (a memory operand of `vpdpbusd`): the products
per load go from 2 to R. kernels/lab/fp4_row_lanes.py measured it beside the package's kernel in one
process on the Zen 4 VM (2 threads, 2304-wide rows): 1.19-1.35x in L2 at 1-8 inputs, 1.14 / 1.23 / 1.51x
from DRAM at 1 / 4 / 8 (kernels/lab/README.md).

Layout (`group` R; `to_lanes` / `to_rows` below): per R rows, codes [K/8, R, 4] (dword d of the R rows
together; a code byte keeps weight 2p in its low nibble and 2p+1 in its high one) and scales [K/32, R].
The same bytes as rows in order, moved: the bank's memory is the same.

Inputs: `_prepare(x, rows, BLOCK_ENTRIES)` (kernels/cpu_moe.py): xq = the K/2 even q then the K/2 odd
ones, in order, so dword v of block b (code bytes 16b + 4v ..) meets even q 16b + 4v .. and odd q
half + 16b + 4v ..; xc[b] = -12 x block b's q sum (the +12 offset's share), xr[b] = its scale / 2
(xc, xr [inputs, K/32]). One entry a block, not the 4 a block of the superblock kernel's tails:
summing 4 shares in the kernel took ~4 of the ~19 vector ops each input and block cost at 4 inputs
a call.

Per block b and input: the offset share broadcast as the integer chain's start, 8 products (4 dwords x
low / high nibbles: `vpdpbusd`, or `vpmaddubsw` + `vpmaddwd` without VNNI: the same integer), then per
lane one convert and an FMA with (weight scale x input scale): out lane l = row l's FMA chain over the
blocks in order. The integer per block is the superblock kernel's; the float sum runs over the blocks in
order with no horizontal sum, so the bits differ from that kernel's, and are the same whatever the
inputs beside it, the groups in the call, the thread count or the row's chunk.
"""
from __future__ import annotations

import numpy as np
from llvmlite import ir
from numba import types
from numba.core import cgutils
from numba.extending import intrinsic

from kernels.fp4_i8 import STEP, _fn, _Step, mode_error
from kernels.fp4_simd import _data_ptrs, _literal, prefetch_weights

i8, i32, i64, f32 = ir.IntType(8), ir.IntType(32), ir.IntType(64), ir.FloatType()
BLOCK_ENTRIES = -1          # `_prepare`'s sbb for this kernel's inputs: in order, one xc / xr entry per 32-block
# A group's codes also prefetched into L1 this many bytes ahead (< 1: none; read when the kernel is emitted;
# kernels/lab/lanes_ab.py --l1-ahead). Zen 4 VM, V4.1 geometry, 2 threads, lanes / rows kernel: batch 1
# 0.97 -> 1.02, verify 8 1.70 -> 1.75 at 2048 (VBMI path: 8 blocks of 16 rows); AVX2 (8 rows) 1.01 -> 1.02-1.05.
# One thread (where its own misses in flight are the limit), without the L2 prefetch at one input: 4096
# read 0.81-0.88 of the stream probe's thread against 0.78-0.85 at 2048 (kernels/lab/README.md, "a tenth time").
L1_AHEAD = 4096
# The weight stream's prefetch into L2 (kernels/fp4_simd.py `prefetch_weights`, 16 KiB ahead) is emitted in every
# call of two inputs or more, and in a call of one input per path: "always", "shared" (only beside other threads:
# not by a thread working alone) or "never" (read when the kernel is emitted; kernels/lab/lanes_ab.py --l2-one).
# Zen 4 VM, lanes_ab per-round ratios (kernels/lab/README.md, "a tenth time" and "an eleventh time"): one thread
# on the AVX-512 paths, whose products outrun DRAM, lost 5-25% of its reach to it at one input (in C too:
# kernels/lab/lanes_reach.c); two threads gain from it there (batch 1 0.92 against 0.88 of the 2-thread stream,
# 0.69-0.84 against 0.63-0.73 in the fast phase; verify 2 1.14 / 1.06 over the superblock kernel), and from two
# inputs a call every thread count and path does (up to 1.5x). On the AVX2 path (half the products a cycle) one
# thread gains at one input too (1.25 against 1.04-1.10 without).
L2_ONE_INPUT = {1: "always", 2: "shared", 3: "shared", 4: "shared"}
L2_RULES = ("always", "shared", "never")
# How a call fetches its weights, per host (`Plan.cpu_moe_fetch`, measured by the profiler: the faster here):
#   "far"   the codes into L1 L1_AHEAD bytes ahead, into L2 16 KiB ahead by the rules above (the Zen 4 VM's best);
#   "near"  a call of one input: the codes into L1 NEAR_L1_AHEAD bytes ahead, none into L2 (calls of more: "far").
# AMX Xeon VM, kernels/lab/lanes_reach.c (one input, one / two threads, per-round ratios to a 64-byte stream):
# L1 alone 1-2 KiB ahead 0.94-0.98 against the "far" fetching's 0.87-0.89 (and 0.75 / 0.88 at 8 / 4 KiB); the
# package, `benchmarks/cpu_moe.py --quick` A B A B at 2 threads: batch 1 0.74 / 0.72 of the stream against 0.66 /
# 0.69, batch widths 0.72-0.78 against 0.69-0.71, verify widths alike (kernels/lab/README.md).
FETCHES = ("far", "near")
NEAR_L1_AHEAD = 2048
FAR, FAR_ALONE, NEAR = 0, 1, 2        # `fp4_lanes_dot`'s literal `fetch`: "far" beside other threads / alone, "near"


def group_rows(mode: int) -> int:
    """Rows a lanes vector holds on instruction path `mode`: its 32-bit lanes (0: the scalar path)."""
    return STEP[mode] // 4 if mode else 0


def to_lanes(codes: np.ndarray, scales: np.ndarray, group: int, out=None):
    """codes [..., N, K/2], scales [..., N, K/32] in rows' order -> the lanes layout (same shapes, bytes
    moved; written into `out` = (codes, scales) where given)."""
    co, so = out if out is not None else (np.empty_like(codes), np.empty_like(scales))
    if not (co.flags.c_contiguous and so.flags.c_contiguous):
        raise ValueError("to_lanes: the arrays written must be C-contiguous (reshaped in place)")
    *lead, N, h = codes.shape
    co.reshape(*lead, N // group, h // 4, group, 4)[...] = codes.reshape(*lead, N // group, group, h // 4, 4).swapaxes(-3, -2)
    so.reshape(*lead, N // group, -1, group)[...] = scales.reshape(*lead, N // group, group, -1).swapaxes(-2, -1)
    return co, so


def to_rows(codes: np.ndarray, scales: np.ndarray, group: int):
    """The inverse of `to_lanes`: a bank's arrays in lanes layout -> rows in order (copies)."""
    *lead, N, h = codes.shape
    c = codes.reshape(*lead, N // group, h // 4, group, 4).swapaxes(-3, -2).reshape(codes.shape)
    s = scales.reshape(*lead, N // group, -1, group).swapaxes(-2, -1).reshape(scales.shape)
    return np.ascontiguousarray(c), np.ascontiguousarray(s)


@intrinsic
def fp4_lanes_dot(typingctx, G_t, T_t, mode_t, fetch_t, codes, c_off, g_stride, scales, s_off, gs_stride,
                  xq, xc, xr, a0, K, out, o_off, o_stride, og_stride):
    """G groups of R rows (group g's codes at c_off + g g_stride, its scales at s_off + g gs_stride) against
    inputs a0 .. a0+T-1: out[o_off + j o_stride + g og_stride + l] = row l of group g . input a0 + j.
    fetch (literal FAR / FAR_ALONE / NEAR): how the weights are fetched (`FETCHES`; FAR_ALONE: "far" by a thread
    working alone, `L2_ONE_INPUT`); the same bits whichever."""
    G, T, mode, fetch = _literal(G_t), _literal(T_t), _literal(mode_t), _literal(fetch_t)
    if G is None or T is None or mode is None or fetch is None:
        return None
    if mode not in STEP:
        raise TypeError(mode_error(mode))
    if fetch not in (FAR, FAR_ALONE, NEAR):
        raise TypeError(f"fp4_lanes_dot: fetch must be FAR ({FAR}), FAR_ALONE ({FAR_ALONE}) or NEAR ({NEAR}), got {fetch}")
    sig = types.void(G_t, T_t, mode_t, fetch_t, codes, c_off, g_stride, scales, s_off, gs_stride, xq, xc, xr, a0, K,
                     out, o_off, o_stride, og_stride)

    def codegen(context, builder, signature, args):
        rule = L2_ONE_INPUT.get(mode, "always")                             # read as the kernel is emitted
        if rule not in L2_RULES:
            raise ValueError(f"fp4_lanes.L2_ONE_INPUT[{mode}] = {rule!r}: one of {L2_RULES}")
        l2 = T > 1 or (fetch != NEAR and (rule == "always" or (rule == "shared" and fetch == FAR)))
        ahead = NEAR_L1_AHEAD if fetch == NEAR else L1_AHEAD
        (_, _, _, _, _, c_off_v, g_stride_v, _, s_off_v, gs_stride_v, _, _, _, a0_v, K_v,
         _, o_off_v, o_stride_v, og_stride_v) = args
        cb, sb, qb, cxb, rb, ob = _data_ptrs(context, builder, signature.args, args, (4, 7, 10, 11, 12, 15))
        c64 = lambda v: ir.Constant(i64, v)  # noqa: E731
        st = _Step(builder, STEP[mode], mode)
        R = st.n                                                    # rows a vector: its 32-bit lanes
        prefetch = _fn(builder, "llvm.prefetch.p0i8", ir.VoidType(), [i8.as_pointer(), i32, i32, i32])
        half, nb = builder.udiv(K_v, c64(2)), builder.udiv(K_v, c64(32))
        accs = [[cgutils.alloca_once_value(builder, ir.Constant(st.vf, [0.0] * R)) for _ in range(T)] for _ in range(G)]

        def splat(v, t):
            vec = builder.insert_element(ir.Constant(t, ir.Undefined), v, ir.Constant(i32, 0))
            return builder.shuffle_vector(vec, ir.Constant(t, ir.Undefined), ir.Constant(ir.VectorType(i32, R), [0] * R))

        def broadcast(at):                                          # 4 int8 of xq -> every lane
            return builder.bitcast(splat(st.load(qb, at, i32), st.vi), st.vb)

        with cgutils.for_range(builder, nb) as loop:
            b = loop.index
            for g in range(G):
                gc = builder.add(builder.add(c_off_v, builder.mul(c64(g), g_stride_v)), builder.mul(b, c64(16 * R)))
                for k in range(0, 16 * R, 64):
                    if l2:
                        prefetch_weights(builder, prefetch, builder.gep(cb, [builder.add(gc, c64(k))]))
                    if ahead > 0:
                        builder.call(prefetch, [builder.gep(cb, [builder.add(gc, c64(k + ahead))]), ir.Constant(i32, 0),
                                                ir.Constant(i32, 3), ir.Constant(i32, 1)])
                lohi = [st.decode(st.load(cb, builder.add(gc, c64(4 * R * v)), st.vb)) for v in range(4)]
                s_at = builder.add(builder.add(s_off_v, builder.mul(c64(g), gs_stride_v)), builder.mul(b, c64(R)))
                ws = st.scale(sb, s_at, list(range(R)))
                for j in range(T):
                    a = builder.add(a0_v, c64(j))
                    qe = builder.add(builder.mul(a, K_v), builder.mul(b, c64(16)))
                    e = builder.add(builder.mul(a, nb), b)                # xc / xr [A, K/32]
                    init = splat(st.load(cxb, e, i32, 4), st.vi)
                    qs = [(broadcast(builder.add(qe, c64(4 * v))), broadcast(builder.add(builder.add(qe, half), c64(4 * v))))
                          for v in range(4)]
                    f = builder.sitofp(st.dot(init, lohi, qs), st.vf)
                    xs = splat(st.load(rb, e, f32, 4), st.vf)
                    builder.store(builder.call(st.fma, [f, builder.fmul(ws, xs), builder.load(accs[g][j])]), accs[g][j])
        for g in range(G):
            for j in range(T):
                o = builder.add(o_off_v, builder.add(builder.mul(o_stride_v, c64(j)), builder.mul(og_stride_v, c64(g))))
                builder.store(builder.load(accs[g][j]), builder.bitcast(builder.gep(ob, [o]), st.vf.as_pointer()), align=4)
        return context.get_dummy_value()
    return sig, codegen
