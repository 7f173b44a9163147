"""Lab: the CPU-MoE GEMV's integers on AMX tiles, the same bits as kernels/fp4_i8.py's AVX-512 VNNI path.

  python -m kernels.lab.fp4_amx_tiles [--widths 1,16,32,64,128] [--rounds 9]

Needs an AMX host (hostinfo `amx_tiles`: the CPU's amx-tile and amx-int8, and Linux's grant of the tile
state). Not in the package: on the AMX Xeon VM it beat the GEMV in some runs from 64 inputs per
expert (1.6-2.0x on one pass) and lost in others (0.73-0.92); its first version gained nothing in a
whole FFN call (kernels/lab/README.md, "AMX tiles"). The route is exact, so a faster one can replace
the GEMV for wide slots without making any plan knob inexact. Rows must be whole superblocks (the
pass refuses others).

The GEMV kernel spends per input and superblock 8 `vpdpbusd`, 8 input loads and ~6 more operations
on the integers, then one convert, one multiply and one FMA on the floats. A call with many inputs per
expert (prefill, wide verify blocks) is bound by those operations, not by the weights' bytes. Here the
integers come from AMX: one `tdpbssd` with K = 32 sums one 32-weight block for 16 rows x 16 inputs
(C[m][n] = sum_k q[m][k] x 2 E2M1[n][k], exact in int32, the very integer the GEMV's lane holds: its
+12 offset and its correction xc cancel), and only the float chain is left to the vector units.

Bits. The GEMV's output for (row n, input m) is: per lane L of 16 (lane L <-> block order[L] of each
superblock of 16 blocks, `ORDER`) an FMA chain over the superblocks,
    acc_L = fma(float(D[block]), ws[block] * xr[entry L], acc_L)        (ws: the weight scale, 2^(byte-127))
then the lanes summed pairwise (L + 8, then + 4, + 2, + 1), then 0.0 + that, then + 0.0 (the empty
16-byte steps' share). `tile_sums` does exactly these operations on the same values, with the 16 rows
of a tile in the vector lanes instead of the 16 blocks, so every output is the same float. Rows
whose code bytes are not whole superblocks (the GEMV then adds vector steps; V4.1's down rows, 1152
code bytes) are not handled.

Layouts. A tile (inputs, `tile_inputs`): per input K bytes, per block g 32 bytes: q of weights
32g + 2o (o < 16), then of 32g + 2o + 1, so an A tile row is one block (16 rows of 32 bytes, stride
K). B tile (weights, built per block from the codes, a row tile's all before its products): 8 rows of 64 bytes, row k4 holding for each of the
16 weight rows n the 4 signed codes 2 E2M1 of the low nibbles (k4 < 4) or high nibbles (k4 >= 4) of
its code bytes 16g + 4 (k4 % 4) .. + 3: the 16 rows' 4-byte words transposed (8 two-source permutes),
then one byte shuffle per nibble half. C tiles are stored per input row, all blocks side by side.

What bounds it (one 4096 x 4096 pass, 2 threads, components alone): the B tiles ~0.27 ms a pass
(built once per row tile: an AMX load of bytes just stored waits for them to drain), ~0.4 ms per 16
inputs of products (~4x `tdpbssd`'s rate: each product moves 512 B of A and 512 B of B and stores a
1 KiB C tile, because each block's sum must come out on its own), and the float chain ~19 us per
input (the floor of any exact route: the GEMV's whole cost is ~50-100 us per input).
"""
from __future__ import annotations

import argparse
import time

import numpy as np
from llvmlite import ir
from numba import njit, prange, types
from numba.core import cgutils
from numba.extending import intrinsic

from hostinfo import amx_tiles
from kernels.fp4_i8 import _fn, _vec, f32, i8, i32, i64
from kernels.fp4_simd import E2M1, _data_ptrs, _literal

TILE = 16                                    # rows (and inputs) per tile
SUPER_BLOCKS = 16                            # blocks per AVX-512 superblock (256 code bytes)
ORDER = [(L % 4) * 4 + L // 4 for L in range(SUPER_BLOCKS)]   # GEMV lane L <-> block ORDER[L] of a superblock
SIGNED = [int(2 * v) & 0xFF for v in E2M1]   # nibble -> 2 E2M1 as a signed byte
A_PAD = 64                                   # bytes after each input's row in `tile_inputs`: 16 rows a power of two
                                             # apart would share one L1 set
GRANTED = amx_tiles()                        # asks Linux for the tile state: without it the first tile op kills the process
SKIP: set = set()                            # lab only, read when a caller compiles: "products" (none run)


def tile_config() -> np.ndarray:
    """The 64-byte tile configuration (palette 1): tmm0-1 A (16 x 32 bytes), tmm2 B (8 x 64), tmm4-7 C
    (16 x 64 bytes: 16 int32 per row); tmm3 a second B."""
    cfg = np.zeros(64, np.uint8)
    cfg[0] = 1
    colsb, rows = cfg[16:48].view(np.uint16), cfg[48:64]
    for t, (r, c) in {0: (16, 32), 1: (16, 32), 2: (8, 64), 3: (8, 64), 4: (16, 64), 5: (16, 64), 6: (16, 64), 7: (16, 64)}.items():
        colsb[t], rows[t] = c, r
    return cfg


def _tile_fns(builder):
    P = i8.as_pointer()
    return (_fn(builder, "llvm.x86.ldtilecfg", ir.VoidType(), [P]),
            _fn(builder, "llvm.x86.tileloadd64", ir.VoidType(), [i8, P, i64]),
            _fn(builder, "llvm.x86.tilestored64", ir.VoidType(), [i8, P, i64]),
            _fn(builder, "llvm.x86.tilezero", ir.VoidType(), [i8]),
            _fn(builder, "llvm.x86.tdpbssd", ir.VoidType(), [i8, i8, i8]))


def _b_tile(builder, cbase, row0, c_stride, g, bbuf):
    """Write the B tile of block g of 16 rows (codes at row0 + n c_stride) to bbuf (512 bytes)."""
    b = builder
    c64 = lambda v: ir.Constant(i64, v)  # noqa: E731
    v4, v8, v16 = _vec(i32, 4), _vec(i32, 8), _vec(i32, 16)
    at = b.add(row0, b.mul(g, c64(16)))
    rows = [b.load(b.bitcast(b.gep(cbase, [b.add(at, b.mul(c_stride, c64(n)))]), v4.as_pointer()), align=1)
            for n in range(TILE)]
    pairs = [b.shuffle_vector(rows[2 * i], rows[2 * i + 1], ir.Constant(v8, list(range(8)))) for i in range(8)]
    z = [b.shuffle_vector(pairs[2 * i], pairs[2 * i + 1], ir.Constant(v16, list(range(16)))) for i in range(4)]
    # z[q][4 (n % 4) + d] = word d of row 4q + n % 4; wanted: v[d][n] = word d of row n

    def half(x, y, ds):                                              # rows 0-7 (x: z0, y: z1) for words ds
        return b.shuffle_vector(x, y, ir.Constant(v16, [(n // 4) * 16 + 4 * (n % 4) + d for d in ds for n in range(8)]))
    lo01, lo23, hi01, hi23 = half(z[0], z[1], (0, 1)), half(z[2], z[3], (0, 1)), half(z[0], z[1], (2, 3)), half(z[2], z[3], (2, 3))

    def words(x, y, k):                                              # the k-th 8-row group of x then of y
        return b.shuffle_vector(x, y, ir.Constant(v16, [8 * k + n for n in range(8)] + [16 + 8 * k + n for n in range(8)]))
    v = [words(lo01, lo23, 0), words(lo01, lo23, 1), words(hi01, hi23, 0), words(hi01, hi23, 1)]
    vb = _vec(i8, 64)
    shuf = _fn(b, "llvm.x86.avx512.pshuf.b.512", vb, [vb, vb])
    lut, m15, four = ir.Constant(vb, SIGNED * 4), ir.Constant(vb, [15] * 64), ir.Constant(vb, [4] * 64)
    for d in range(4):
        c = b.bitcast(v[d], vb)
        lo = b.call(shuf, [lut, b.and_(c, m15)])
        hi = b.call(shuf, [lut, b.and_(b.lshr(c, four), m15)])
        b.store(lo, b.bitcast(b.gep(bbuf, [c64(64 * d)]), vb.as_pointer()), align=1)
        b.store(hi, b.bitcast(b.gep(bbuf, [c64(64 * (4 + d))]), vb.as_pointer()), align=1)


@intrinsic
def tile_b(typingctx, codes, c_off, c_stride, bbuf, nblk):
    """bbuf[512 g ..] = the B tile of block g < nblk of 16 rows (codes at c_off + n c_stride). Built for a
    whole row tile before any product: an AMX load of bytes just stored waits for them to drain, which
    made each block's products wait for its own B tile (~2x slower, kernels/lab/README.md)."""
    sig = types.void(codes, c_off, c_stride, bbuf, nblk)

    def codegen(context, builder, signature, args):
        _, c_off_v, c_stride_v, _, nblk_v = args
        cbase, bbase = _data_ptrs(context, builder, signature.args, args, (0, 3))
        bbase = builder.bitcast(bbase, i8.as_pointer())
        with cgutils.for_range(builder, nblk_v) as loop:
            g = loop.index
            _b_tile(builder, cbase, c_off_v, c_stride_v, g, builder.gep(bbase, [builder.mul(g, ir.Constant(i64, 512))]))
        return context.get_dummy_value()
    return sig, codegen


@intrinsic
def tile_products(typingctx, NI_t, cfg, bbuf, aq, a_off, a_stride, cbuf, nblk):
    """For blocks g < nblk (even; B tiles in bbuf from `tile_b`) and NI (1-2) tiles of 16 inputs (tile i's
    A rows at a_off + (16 i + m) a_stride): cbuf[(16 i + m) 16 (nblk + 1) + 16 g + n] = the block's int32
    sum for input 16 i + m and row n. Blocks alternate two sets of tiles (tile registers are not renamed)."""
    NI = _literal(NI_t)
    if NI is None:
        return None
    if not 1 <= NI <= 2:
        raise TypeError("tile_products: NI must be 1 or 2")
    sig = types.void(NI_t, cfg, bbuf, aq, a_off, a_stride, cbuf, nblk)

    def codegen(context, builder, signature, args):
        _, _, _, _, a_off_v, a_stride_v, _, nblk_v = args
        cfgp, bbase, qbase, obase = _data_ptrs(context, builder, signature.args, args, (1, 2, 3, 6))
        bbase, obase = builder.bitcast(bbase, i8.as_pointer()), builder.bitcast(obase, i8.as_pointer())
        ldcfg, load, store, zero, dot = _tile_fns(builder)
        c64 = lambda v: ir.Constant(i64, v)  # noqa: E731
        t8 = lambda v: ir.Constant(i8, v)    # noqa: E731
        builder.call(ldcfg, [cfgp])
        row_bytes = builder.mul(builder.add(nblk_v, c64(1)), c64(64))   # C rows: input m's blocks side by side (+ 64 bytes:
                                                                        # rows a power of two apart share L1 sets)
        with cgutils.for_range(builder, builder.udiv(nblk_v, c64(2))) as loop:
            for parity in range(2):                                     # B, A and C tiles alternate by block parity
                g = builder.add(builder.mul(loop.index, c64(2)), c64(parity))
                tb, ta = 2 + parity, parity
                builder.call(load, [t8(tb), builder.gep(bbase, [builder.mul(g, c64(512))]), c64(64)])
                for i in range(NI if "products" not in SKIP else 0):
                    tc = 4 + 2 * parity + i
                    at = builder.add(builder.add(a_off_v, builder.mul(a_stride_v, c64(TILE * i))), builder.mul(g, c64(32)))
                    builder.call(zero, [t8(tc)])
                    builder.call(load, [t8(ta), builder.gep(qbase, [at]), a_stride_v])
                    builder.call(dot, [t8(tc), t8(ta), t8(tb)])
                    o = builder.add(builder.mul(row_bytes, c64(TILE * i)), builder.mul(g, c64(64)))
                    builder.call(store, [t8(tc), builder.gep(obase, [o]), row_bytes])
        return context.get_dummy_value()
    return sig, codegen


@intrinsic
def tile_sums(typingctx, cbuf, c_off, wsv, xr, x_off, n_super, out, o_off):
    """out[o_off + n] (16 rows n) = the GEMV's float chain for one input: cbuf[c_off + 16 g + n] the
    block sums (g = 16 sb + block), wsv[16 g + n] the rows' weight scales, xr[x_off + 16 sb + L] the
    input's entries (lane order)."""
    sig = types.void(cbuf, c_off, wsv, xr, x_off, n_super, out, o_off)

    def codegen(context, builder, signature, args):
        _, c_off_v, _, _, x_off_v, n_super_v, _, o_off_v = args
        cb, wb, xb, ob = _data_ptrs(context, builder, signature.args, args, (0, 2, 3, 6))
        c64 = lambda v: ir.Constant(i64, v)  # noqa: E731
        vi, vf = _vec(i32, TILE), _vec(f32, TILE)
        fma = _fn(builder, "llvm.fma.v16f32", vf, [vf, vf, vf])
        accs = [cgutils.alloca_once_value(builder, ir.Constant(vf, [0.0] * TILE)) for _ in range(SUPER_BLOCKS)]
        undef = ir.Constant(vf, ir.Undefined)
        with cgutils.for_range(builder, n_super_v) as loop:
            sb = loop.index
            for L in range(SUPER_BLOCKS):
                g = builder.add(builder.mul(sb, c64(SUPER_BLOCKS)), c64(ORDER[L]))
                d = builder.load(builder.bitcast(builder.gep(cb, [builder.add(c_off_v, builder.mul(g, c64(TILE)))]),
                                                 vi.as_pointer()), align=4)
                ws = builder.load(builder.bitcast(builder.gep(wb, [builder.mul(g, c64(TILE))]), vf.as_pointer()), align=4)
                x = builder.load(builder.gep(xb, [builder.add(x_off_v, builder.add(builder.mul(sb, c64(SUPER_BLOCKS)), c64(L)))]))
                xs = builder.shuffle_vector(builder.insert_element(undef, x, ir.Constant(i32, 0)), undef,
                                            ir.Constant(_vec(i32, TILE), [0] * TILE))
                f = builder.sitofp(d, vf)
                builder.store(builder.call(fma, [f, builder.fmul(ws, xs), builder.load(accs[L])]), accs[L])
        v = [builder.load(a) for a in accs]
        m = SUPER_BLOCKS
        while m > 1:                                                  # lanes summed pairwise, as the GEMV does
            m //= 2
            v = [builder.fadd(v[i], v[i + m]) for i in range(m)]
        zero = ir.Constant(vf, [0.0] * TILE)
        total = builder.fadd(builder.fadd(zero, v[0]), zero)
        builder.store(total, builder.bitcast(builder.gep(ob, [o_off_v]), vf.as_pointer()), align=4)
        return context.get_dummy_value()
    return sig, codegen


# ----------------------------------------------------------------------------------------- the pass
GROUP = 2                                                     # input tiles per `tile_products` call (C tiles tmm4-5 / 6-7)


@njit(parallel=True, nogil=True, cache=False)
def tile_inputs(xq):
    """xq [A, K] in the GEMV's layout (kernels/fp4_i8.py `act_slot`, AVX-512 superblocks: every block in
    one) -> aq [A + 15, K + A_PAD]: per block its 16 even q then its 16 odd q (`A` tile rows); 15 zero rows
    after, so the last 16-input tile never reads past the array."""
    A, K = xq.shape
    if K % (32 * SUPER_BLOCKS):
        raise ValueError("tile_inputs: rows must be whole superblocks (K a multiple of 512)")
    h, nblk = K // 2, K // 32
    aq = np.zeros((A + TILE - 1, K + A_PAD), np.int8)
    src, dst = xq.reshape(-1).view(np.int32), aq.reshape(-1).view(np.int32)
    for a in prange(A):
        s0, d0 = a * K // 4, a * (K + A_PAD) // 4
        for g in range(nblk):
            sb, gl = g // SUPER_BLOCKS, g % SUPER_BLOCKS
            base = (sb * 256 + 16 * (gl % 4) + 4 * (gl // 4)) // 4         # word of byte o = 0 of block g
            for o4 in range(4):
                dst[d0 + 8 * g + o4] = src[s0 + base + 16 * o4]
                dst[d0 + 8 * g + 4 + o4] = src[s0 + h // 4 + base + 16 * o4]
    return aq


@njit(nogil=True, cache=False, inline="always")
def _scales(sf, s_at, s_row, nblk, wsv):
    """wsv[16 g + n] = the float weight scale of row n's block g (2^(byte - 127); 255 -> NaN; 0 -> 0)."""
    bits = wsv.view(np.int32)
    for n in range(TILE):
        for g in range(nblk):
            byte = np.int32(sf[s_at + n * s_row + g])
            v = byte << 23
            bits[TILE * g + n] = v if byte != 255 else np.int32(0x7FC00000)


@njit(parallel=True, nogil=True, cache=False)
def tile_matvecs(codes, scales, experts, off, aq, xr, out, cfg, threads):
    """out[a, r] = W_{experts[s]}[r] . x(a) for the assignments a of slot s, as kernels/cpu_moe.py
    `_matvecs` gives them (the same bits), on AMX tiles: a work item is 16 rows of one slot's expert;
    its B tiles are built once, then met by its slot's inputs 32 at a time. aq from `tile_inputs`, xr as
    `_prepare` gives; threads: numba's thread count (each thread takes every threads-th item, with scratch
    of its own). Rows must be whole superblocks (K a multiple of 512): the GEMV adds other steps there."""
    S, N, K = len(experts), out.shape[1], aq.shape[1] - A_PAD
    if K % (32 * SUPER_BLOCKS) or N % TILE:
        raise ValueError("tile_matvecs: rows must be whole superblocks (K a multiple of 512) and N a multiple of 16")
    nblk = K // 32
    cf, sf, qf, rf, of = codes.reshape(-1), scales.reshape(-1), aq.reshape(-1), xr.reshape(-1), out.reshape(-1)
    per = N // TILE
    cbufs = np.empty((threads, GROUP * (nblk + 1) * TILE * TILE), np.int32)   # per thread: C tiles of 2 input tiles
    bbufs = np.empty((threads, nblk * 512), np.int8)                          # and the row tile's B tiles
    wsvs = np.empty((threads, nblk * TILE), np.float32)
    for me in prange(threads):                                            # static: item me, me + threads, ...
        cbuf, bbuf, wsv = cbufs[me], bbufs[me], wsvs[me]
        for item in range(me, S * per, threads):
            _item(cf, sf, qf, rf, of, cfg, cbuf, bbuf, wsv, experts[item // per] * N + (item % per) * TILE, (item % per) * TILE,
                  off[item // per], off[item // per + 1], N, K)


@njit(nogil=True, cache=False)
def _item(cf, sf, qf, rf, of, cfg, cbuf, bbuf, wsv, row, r0, a0, a1, N, K):
    """16 rows (the expert's rows from `row`, output columns r0..r0+15) against inputs a0..a1-1."""
    c_row, s_row, nblk = K // 2, K // 32, K // 32
    n_super = nblk // SUPER_BLOCKS
    _scales(sf, row * s_row, s_row, nblk, wsv)
    tile_b(cf, row * c_row, c_row, bbuf, nblk)
    for i0 in range(a0, a1, GROUP * TILE):
        n_in = min(GROUP * TILE, a1 - i0)
        ni = (n_in + TILE - 1) // TILE
        if ni == 2:
            tile_products(2, cfg, bbuf, qf, i0 * (K + A_PAD), K + A_PAD, cbuf, nblk)
        else:
            tile_products(1, cfg, bbuf, qf, i0 * (K + A_PAD), K + A_PAD, cbuf, nblk)
        for m in range(n_in):
            a = i0 + m
            tile_sums(cbuf, m * (nblk + 1) * TILE, wsv, rf, a * (K // 8), n_super, of, a * N + r0)


# ----------------------------------------------------------------------------------------- the lab
def _pass_pair(bank, width, seed=0):
    """One expert's gate/up pass at `width` inputs, by the package's GEMV (`_passes`) and by the tiles."""
    import numba

    from kernels import cpu_moe as cm
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((width, bank.hidden)).astype(np.float32)
    experts, off = np.array([0], np.int64), np.array([0, width], np.int64)
    xq, xc, xr = cm._prepare(x, np.arange(width))
    gemv_out = np.empty((width, 2 * bank.inter), np.float32)
    tile_out = np.empty_like(gemv_out)
    cfg, threads, l1 = tile_config(), numba.get_num_threads(), cm.l1_input_bytes()
    inputs = 8 if width >= 8 else 4

    def gemv():
        cm._passes(bank.w13_codes, bank.w13_scales, experts, off, xq, xc, xr, gemv_out, 1, inputs, l1, threads, False)

    def tiles():
        tile_matvecs(bank.w13_codes, bank.w13_scales, experts, off, tile_inputs(xq), xr, tile_out, cfg, threads)
    return gemv, tiles, gemv_out, tile_out


def main(argv=None):
    from kernels import cpu_moe as cm
    from kernels.threads import set_threads
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--widths", default="1,16,32,64,128")
    ap.add_argument("--rounds", type=int, default=9)
    ap.add_argument("--threads", type=int, default=None)
    args = ap.parse_args(argv)
    if not GRANTED:
        raise SystemExit("fp4_amx_tiles: this host's kernels cannot use AMX tiles (hostinfo.amx_tiles)")
    set_threads(args.threads)
    bank = cm.Fp4Bank.random(1, 4096, 2048, seed=3)                 # one expert, 4096 x 4096 gate/up: in the LLC
    print("one gate/up pass, 4096 rows x 4096, interleaved rounds (order reversed every other), median of 3 calls each")
    for width in (int(w) for w in args.widths.split(",")):
        gemv, tiles, a, b = _pass_pair(bank, width)
        gemv(), tiles()
        if not np.array_equal(a.view(np.int32), b.view(np.int32)):
            raise SystemExit(f"width {width}: the tiles' outputs are not the GEMV's bits")
        ts = {gemv: [], tiles: []}
        for r in range(args.rounds):
            for f in ((gemv, tiles) if r % 2 == 0 else (tiles, gemv)):
                t0 = time.perf_counter()
                for _ in range(3):
                    f()
                ts[f].append((time.perf_counter() - t0) / 3)
        flop = 2 * width * 2 * bank.inter * bank.hidden
        g, t = np.median(ts[gemv]), np.median(ts[tiles])
        ratio = np.array(ts[gemv]) / np.array(ts[tiles])
        print(f"width {width:4d}: GEMV {g * 1e3:7.3f} ms {flop / g / 1e9:5.0f} GFLOP/s | tiles {t * 1e3:7.3f} ms "
              f"{flop / t / 1e9:5.0f} GFLOP/s | tiles/GEMV rate {np.median(ratio):.2f} ({ratio.min():.2f}-{ratio.max():.2f}), same bits")


if __name__ == "__main__":
    main()
