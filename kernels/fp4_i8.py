"""ds_fp4 x int8 dot products on the CPU, emitted as LLVM IR from a numba intrinsic.

This is the kernel for banks with rows in order (AVX2 + AVX-VNNI, and any path taken out of
kernels/cpu_moe.py `LANES_MODES`). On the paths in LANES_MODES the banks are built 16 rows a vector (8
with AVX2) and kernels/fp4_lanes.py serves them; its `_Step` (decode, scales, products) is this module's.

The float kernel it replaced (kernels/lab/fp4_float_dot.py) spends ~8 vector uops per 16 code bytes (zero-extend, shift, two
permutes, three FP ops) and is compute-bound at ~10 GB/s per core. Here an expert's input is quantized
per 32-block to int8 (kernels/formats.py `quantize_act`, the arithmetic every expert path uses) and
the weights are summed against it in integers: nibbles through a byte shuffle (`vpshufb`: nibble ->
2 x E2M1 + 12, an unsigned byte in [0, 24]; with AVX-512 VBMI a byte permute, below), products through
`vpdpbusd` (AVX-512 VNNI; AVX-VNNI on 32-byte vectors) or `vpmaddubsw` + `vpmaddwd` (AVX2,
AVX-512BW): the same integer per 32-bit lane either way (its 4 bytes' products), so paths of one vector
width give the same bits (AVX2's 32-byte superblocks sum their floats in another order than AVX-512's).

Superblocks (the main part of a row). A row is read in superblocks of 4 vectors of code bytes (4 x 64
with AVX-512, 4 x 32 with AVX2: 16 or 8 blocks of 32 weights). The 4 vectors are transposed by 32-bit
words within each 128-bit lane (eight unpacks), after which one 32-bit lane of every vector holds
bytes of one block only: an integer accumulator per lane then sums a whole block (32 weights), and the
block scale, the float convert and the multiply-add happen once per block and input, not once per 8
weights. Per input and superblock (AVX-512 VNNI): 8 `vpdpbusd` started from the offset's share, one
convert, one multiply, one FMA; per row and superblock the decode (4 loads, 8 unpacks, 4 ops per
vector: `vpandq` + `vpshufb` for the low nibbles, `vgf2p8affineqb` (LLVM's shift-and-mask on GFNI
hosts) + `vpshufb` for the high ones; 3 with VBMI) and one scale vector.
The VBMI decode (mode 4): `vpermb` reads only an index's low 6 bits, so with the 16-entry table
repeated 4 times the code byte itself indexes its low nibble, and the byte shifted right by 4 within
its 16-bit word its high nibble (bits 4-5 then hold the next byte's low bits: ignored). The same bytes,
so the same bits as mode 3 (tested); one op fewer per vector: +3% in L2 and +4-7% from DRAM on the
AMX Xeon VM (kernels/lab/fp4_vpermb.py).
Order within a superblock: where a call's R rows fit half the vector registers decoded (`ROWS_FIRST`:
2 rows with AVX-512, 1 with AVX2) every row is decoded first, then each input's vectors are loaded and
used by all R rows, so a pair of rows loads each input vector once; with more rows every input's vectors
come first, then row by row. The order changes no sum. Zen 4 VM (kernels/lab/fp4_row_pairs.py): rows
first 1.03-1.07x in L2 at 1-4 inputs on AVX-512 and 1.04-1.16x with AVX2's 16 registers (code built for
Zen 2); two rows first on AVX-512 1.3-2x from DRAM at 5-8 inputs, where the one-row order's inputs no
longer fit L1 with the rows passing. Decoded rows that would take every register spill: AVX2 with 2
rows first read 0.47-0.89x of one row, 4 rows first 0.85-0.92x of 4 rows after the inputs (AVX-512's 4
rows: within 5% either way), so more rows keep the inputs-first order. The vector steps after the
superblocks always take their rows first (3 vectors a row, 4 an input): V4.1's down rows (2304 weights:
4 superblocks and 2 vector steps) 1.10-1.13x in L2 at 4 inputs, 0.95-1.22x at 1, 2 and 8 (before and
after in alternate processes, not interleaved in one).
The rest of a row (its length modulo a superblock) goes in vector steps, then 16-byte SSE steps, with
one accumulator lane per 4 code bytes (the layout below, "lanes").

Per input a (one expert assignment) the caller prepares (`_prepare` in kernels/cpu_moe.py, laid out as
`act_slot` defines):
  xq [a*K : a*K + K]   int8 q: the K/2 even inputs q[2p], then the K/2 odd ones q[2p+1], each half in
                       the order the kernel reads code bytes p (code byte p holds weight 2p in its low
                       nibble, 2p+1 in its high nibble): transposed within superblocks, in order after
  xc [a*K/8 + L]       int32 -12 x (sum of the q's that meet entry L's code bytes): the +12 offset's share
  xr [a*K/8 + L]       float32 s_g / 2 for the block g of those bytes (s_g: the block's scale)
where an entry L is one block in the superblock part (in lane order) and 4 code bytes in the rest.
Integer lane L sums (2 E2M1[lo_p] + 12) q[2p] + (2 E2M1[hi_p] + 12) q[2p+1] over its bytes exactly
(|.| < 2^17), plus xc gives 2 x the exact dot product of its bytes (exact in float32), and
    out = sum of float(lane) * (xr * 2^(scale byte - 127)): per vector lane an FMA chain over the row,
then the lanes summed pairwise (halves added), then the 16-byte steps' lanes the same way; the order
is fixed by the instruction path alone, so an output is the same bits whatever the row layout,
thread count or inputs beside it.
Weight scale bytes become floats by a shift into the exponent (byte 255 -> NaN as the OCP spec says;
byte 0, 2^-127, flushes to 0: under 1e-38 of any product).

`fp4_i8_dot(R, T, mode, codes, c_off, c_stride, scales, s_off, s_stride, xq, xc, xr, a0, K, out, o_off,
o_stride, or_stride)` (R, T, mode literals): for rows r < R (codes at c_off + r*c_stride, scales at
s_off + r*s_stride) and inputs a0 + j, j < T: out[o_off + j*o_stride + r*or_stride] = row r . input j.
mode 1: AVX2 (32-byte vectors), 2: AVX-512BW (64-byte), 3: AVX-512 VNNI (64-byte), 4: AVX-512 VNNI with
the VBMI decode (64-byte), 5: AVX2 with AVX-VNNI (32-byte; mode 1's bits). `MODES` names them.
"""
from __future__ import annotations

from contextlib import contextmanager

from llvmlite import ir
from numba import types
from numba.core import cgutils
from numba.extending import intrinsic

from kernels.fp4_simd import E2M1, _data_ptrs, _literal, prefetch_weights

OFFSET = 12                                           # 2 x E2M1 in [-12, 12] -> + 12 in [0, 24]
LUT16 = [int(2 * v) + OFFSET for v in E2M1]
STEP = {1: 32, 2: 64, 3: 64, 4: 64, 5: 32}            # bytes per vector
MODES = {1: "AVX2", 2: "AVX-512BW", 3: "AVX-512 VNNI", 4: "AVX-512 VNNI + VBMI", 5: "AVX2 + AVX-VNNI"}
VNNI_MODES, VBMI_MODES = (3, 4, 5), (4,)              # their main vectors sum with vpdpbusd / decode with vpermb
SUPER = 4                                             # vectors per superblock
# The most rows a call decodes before it loads its inputs (`fp4_i8_dot`'s superblock order): decoded rows
# (8 vectors each) in at most half the vector registers, 2 rows of AVX-512's 32, 1 of AVX2's 16.
ROWS_FIRST = {1: 1, 2: 2, 3: 2, 4: 2, 5: 1}
# Each row's codes are also prefetched into L1 (prefetcht0) this many superblocks ahead, on the paths where it
# was measured to help (a path missing here, or a value < 1, emits none); the stream's far prefetch into L2
# (kernels/fp4_simd.py WEIGHT_PREFETCH) is there either way. Zen 4 VM, 2 threads, whole expert FFN steps
# (V4.1 geometry, fresh experts), copies compiled with and without it in one process, interleaved step by
# step (kernels/lab/code_prefetch.py), 2 superblocks ahead against none, with an identical copy of the
# baseline beside it: on the VBMI path verify 8 1.03-1.08 (that copy 0.99-1.03), verify 6 1.03-1.05
# (0.97-1.03), batch 1 and verify 2 / 4 1.01-1.03 (1.00-1.02: no more than the copy); on the VNNI path
# without VBMI (forced on the same CPU) verify 8 0.97 (0.995), so not there (kernels/lab/README.md). A line
# past a row's end is the next row's, or past the bank (a prefetch never faults).
CODE_L1_AHEAD = {4: 2}


@contextmanager
def emitting(table: dict, mode: int, value):
    """`table[mode] = value` (ROWS_FIRST, CODE_L1_AHEAD: read when a kernel's code is emitted) for the kernels
    compiled inside; the table as it was afterwards, even when a compile fails (the labs compile copies)."""
    before = dict(table)
    table[mode] = value
    try:
        yield
    finally:
        table.clear()
        table.update(before)

i8, i16, i32, i64, f32 = ir.IntType(8), ir.IntType(16), ir.IntType(32), ir.IntType(64), ir.FloatType()


def superblock_bytes(mode: int) -> int:
    """Code bytes per superblock on instruction path `mode` (0, the scalar path: none, lanes only)."""
    return SUPER * STEP[mode] if mode else 0


def act_slot(p, half, sbb):
    """Code byte p of a row of `half` code bytes, superblocks of `sbb` bytes -> (where its inputs sit in
    each half of xq, its xc / xr entry): the layout's definition (`_prepare` in kernels/cpu_moe.py walks
    it block by block; tests hold the two together). In a superblock the kernel's vector k, lane (b, m) (128-bit
    lane b, word m) holds bytes 4k..4k+3 of block m * nl + b (nl = 128-bit lanes per vector)."""
    p0 = (half // sbb) * sbb if sbb else 0
    if p >= p0:                                       # in order, one entry per 4 code bytes
        return p, p0 // 16 + (p - p0) // 4
    v = sbb // SUPER
    nl = v // 16
    sb, w = p // sbb, p % sbb
    g, o = w // 16, w % 16                            # block in the superblock, byte in the block
    m, b = g // nl, g % nl
    k, t = o // 4, o % 4
    return sb * sbb + k * v + 16 * b + 4 * m + t, sb * (v // 4) + 4 * b + m


def _vec(t, n):
    return ir.VectorType(t, n)


def _fn(builder, name, ret, args):
    return cgutils.get_or_insert_function(builder.module, ir.FunctionType(ret, args), name)


def mode_error(mode) -> str:
    return "mode must be " + ", ".join(f"{m} ({n})" for m, n in MODES.items()) + f", got {mode}"


class _Step:
    """Emits the arithmetic of one vector of `nb` code bytes (16, 32 or 64) on instruction path `mode`."""

    def __init__(self, builder, nb, mode):
        self.b, self.nb, self.n = builder, nb, nb // 4
        self.vb, self.vw, self.vi, self.vf = _vec(i8, nb), _vec(i16, nb // 2), _vec(i32, nb // 4), _vec(f32, nb // 4)
        main = nb == STEP[mode]                       # the 16-byte tail steps keep the SSE ops
        self.vnni, self.vbmi = main and mode in VNNI_MODES, main and mode in VBMI_MODES
        suffix = {16: ("ssse3.pshuf.b.128", "ssse3.pmadd.ub.sw.128", "sse2.pmadd.wd"),
                  32: ("avx2.pshuf.b", "avx2.pmadd.ub.sw", "avx2.pmadd.wd"),
                  64: ("avx512.pshuf.b.512", "avx512.pmaddubs.w.512", "avx512.pmaddw.d.512")}[nb]
        self.shuf = _fn(builder, "llvm.x86." + suffix[0], self.vb, [self.vb, self.vb])
        self.maddubs = _fn(builder, "llvm.x86." + suffix[1], self.vw, [self.vb, self.vb])
        self.maddwd = _fn(builder, "llvm.x86." + suffix[2], self.vi, [self.vw, self.vw])
        if self.vnni:
            self.dpbusd = _fn(builder, f"llvm.x86.avx512.vpdpbusd.{8 * nb}", self.vi, [self.vi, self.vi, self.vi])
        self.fma = _fn(builder, f"llvm.fma.v{self.n}f32", self.vf, [self.vf, self.vf, self.vf])
        if self.vbmi:
            self.permb = _fn(builder, "llvm.x86.avx512.permvar.qi.512", self.vb, [self.vb, self.vb])
        self.lut = ir.Constant(self.vb, LUT16 * (nb // 16))
        self.ones = ir.Constant(self.vw, [1] * (nb // 2))

    def load(self, base, off, t, align=1):
        return self.b.load(self.b.bitcast(self.b.gep(base, [off]), t.as_pointer()), align=align)

    def decode(self, c):
        """code bytes -> (low-nibble bytes, high-nibble bytes), each 2 E2M1 + 12."""
        b = self.b
        if self.vbmi:                                 # vpermb: index bits 4-5 fall on the table's repeats
            hi = b.lshr(b.bitcast(c, self.vw), ir.Constant(self.vw, [4] * (self.nb // 2)))
            return b.call(self.permb, [self.lut, c]), b.call(self.permb, [self.lut, b.bitcast(hi, self.vb)])
        m = ir.Constant(self.vb, [15] * self.nb)
        lo = b.call(self.shuf, [self.lut, b.and_(c, m)])
        hi = b.call(self.shuf, [self.lut, b.and_(b.lshr(c, ir.Constant(self.vb, [4] * self.nb)), m)])
        return lo, hi

    def scale(self, sbase, s_at, order):
        """Weight scale bytes s_at + order[L] -> the float scale of lane L (255 -> NaN)."""
        b, g = self.b, max(order) + 1
        sb = b.zext(self.load(sbase, s_at, _vec(i8, g)), _vec(i32, g))
        s = b.shuffle_vector(sb, ir.Constant(_vec(i32, g), ir.Undefined), ir.Constant(_vec(i32, self.n), order))
        bits = b.shl(s, ir.Constant(self.vi, [23] * self.n))
        nan = b.icmp_unsigned("==", s, ir.Constant(self.vi, [255] * self.n))
        bits = b.select(nan, ir.Constant(self.vi, [0x7FC00000] * self.n), bits)
        return b.bitcast(bits, self.vf)

    def transpose(self, vs):
        """4 code vectors -> 4 whose 32-bit word (128-bit lane c, word m) of vector k is word (c, k) of vs[m]."""
        b, n = self.b, self.n
        w = [b.bitcast(v, self.vi) for v in vs]
        def mix(x, y, pick):
            return b.shuffle_vector(x, y, ir.Constant(_vec(i32, n), [i for c in range(n // 4) for i in pick(4 * c)]))
        lo32 = lambda c: (c, n + c, c + 1, n + c + 1)              # noqa: E731  unpack low 32-bit words
        hi32 = lambda c: (c + 2, n + c + 2, c + 3, n + c + 3)      # noqa: E731
        lo64 = lambda c: (c, c + 1, n + c, n + c + 1)              # noqa: E731  unpack low 64-bit halves
        hi64 = lambda c: (c + 2, c + 3, n + c + 2, n + c + 3)      # noqa: E731
        t0, t1, t2, t3 = mix(w[0], w[1], lo32), mix(w[2], w[3], lo32), mix(w[0], w[1], hi32), mix(w[2], w[3], hi32)
        return [b.bitcast(v, self.vb) for v in (mix(t0, t1, lo64), mix(t0, t1, hi64), mix(t2, t3, lo64), mix(t2, t3, hi64))]

    def dot(self, acc, lohi, qs):
        """acc + per lane, sum of (2 E2M1 + 12) x q over the pairs (lo, hi) x (q even, q odd) given."""
        b = self.b
        if self.vnni:                                 # two chains, joined at the end
            chains = [acc, ir.Constant(self.vi, [0] * self.n)]
            for k, ((lo, hi), (qe, qo)) in enumerate(zip(lohi, qs)):
                c = chains[k % 2]
                c = b.call(self.dpbusd, [c, b.bitcast(lo, self.vi), b.bitcast(qe, self.vi)])
                chains[k % 2] = b.call(self.dpbusd, [c, b.bitcast(hi, self.vi), b.bitcast(qo, self.vi)])
            return b.add(chains[0], chains[1])
        for k in range(0, len(lohi), 2):              # 16-bit sums of <= 4 products pairs: |.| <= 4*2*24*127 < 2^15
            p = None
            for (lo, hi), (qe, qo) in zip(lohi[k:k + 2], qs[k:k + 2]):
                s = b.add(b.call(self.maddubs, [lo, qe]), b.call(self.maddubs, [hi, qo]))
                p = s if p is None else b.add(p, s)
            acc = b.add(acc, b.call(self.maddwd, [p, self.ones]))
        return acc


@intrinsic
def fp4_i8_dot(typingctx, R_t, T_t, mode_t, codes, c_off, c_stride, scales, s_off, s_stride,
               xq, xc, xr, a0, K, out, o_off, o_stride, or_stride):
    R, T, mode = _literal(R_t), _literal(T_t), _literal(mode_t)
    if R is None or T is None or mode is None:
        return None
    if mode not in STEP:
        raise TypeError(mode_error(mode))
    sig = types.void(R_t, T_t, mode_t, codes, c_off, c_stride, scales, s_off, s_stride, xq, xc, xr, a0, K,
                     out, o_off, o_stride, or_stride)

    def codegen(context, builder, signature, args):
        (_, _, _, _, c_off_v, c_stride_v, _, s_off_v, s_stride_v, _, _, _, a0_v, K_v,
         _, o_off_v, o_stride_v, or_stride_v) = args
        cbase, sbase, qbase, cxbase, rbase, obase = _data_ptrs(context, builder, signature.args[3:], args[3:],
                                                               (0, 3, 6, 7, 8, 11))
        c64 = lambda v: ir.Constant(i64, v)  # noqa: E731
        half = builder.udiv(K_v, c64(2))                                # code bytes per row
        step = STEP[mode]
        sbb = SUPER * step
        n_super = builder.udiv(half, c64(sbb))
        p0 = builder.mul(n_super, c64(sbb))                             # where the superblocks end
        e0 = builder.udiv(p0, c64(16))                                  # their xc / xr entries (one per block)
        n_main = builder.udiv(builder.sub(half, p0), c64(step))
        p1 = builder.add(p0, builder.mul(n_main, c64(step)))
        n_tail = builder.udiv(builder.sub(half, p1), c64(16))
        rows_c = [builder.add(c_off_v, builder.mul(c_stride_v, c64(r))) for r in range(R)]
        rows_s = [builder.add(s_off_v, builder.mul(s_stride_v, c64(r))) for r in range(R)]
        toks_q = [builder.mul(builder.add(a0_v, c64(j)), K_v) for j in range(T)]
        toks_k = [builder.udiv(q, c64(8)) for q in toks_q]
        prefetch = _fn(builder, "llvm.prefetch.p0i8", ir.VoidType(), [i8.as_pointer(), i32, i32, i32])
        sums = [[ir.Constant(f32, 0.0)] * T for _ in range(R)]

        def fetch_ahead(at):
            prefetch_weights(builder, prefetch, builder.gep(cbase, [at]))

        l1_ahead = CODE_L1_AHEAD.get(mode, 0) * SUPER * step          # bytes; read when the code is emitted

        def fetch_l1(at):
            if l1_ahead > 0:
                builder.call(prefetch, [builder.gep(cbase, [builder.add(at, c64(l1_ahead))]), ir.Constant(i32, 0),
                                        ir.Constant(i32, 3), ir.Constant(i32, 1)])

        def accumulators(st):
            return [[cgutils.alloca_once_value(builder, ir.Constant(st.vf, [0.0] * st.n)) for _ in range(T)] for _ in range(R)]

        def total(accs, n):
            """sums[r][j] += each accumulator's lanes, summed pairwise (halves added until one lane is
            left: 4 shuffles and 4 adds for 16 lanes; an ordered sum is a 16-add chain per output)."""
            for r in range(R):
                for j in range(T):
                    v, m = builder.load(accs[r][j]), n
                    while m > 1:
                        m //= 2
                        lo = builder.shuffle_vector(v, v, ir.Constant(_vec(i32, m), list(range(m))))
                        hi = builder.shuffle_vector(v, v, ir.Constant(_vec(i32, m), list(range(m, 2 * m))))
                        v = builder.fadd(lo, hi)
                    sums[r][j] = builder.fadd(sums[r][j], builder.extract_element(v, ir.Constant(i32, 0)))

        def superblocks(st: _Step, accs):
            nl = st.nb // 16
            order = [(L % 4) * nl + L // 4 for L in range(st.n)]       # lane (c, m) <- block m * nl + c

            def body(i, accs):
                p = builder.mul(i, c64(sbb))
                e = builder.mul(i, c64(st.n))                            # st.n blocks per superblock

                def inputs(j):
                    return [(st.load(qbase, builder.add(toks_q[j], builder.add(p, c64(k * step))), st.vb),
                             st.load(qbase, builder.add(builder.add(toks_q[j], half), builder.add(p, c64(k * step))), st.vb))
                            for k in range(SUPER)]

                def row(r):
                    cp = builder.add(rows_c[r], p)
                    for k in range(0, sbb, 64):
                        fetch_ahead(builder.add(cp, c64(k)))
                        fetch_l1(builder.add(cp, c64(k)))
                    vs = st.transpose([st.load(cbase, builder.add(cp, c64(k * step)), st.vb) for k in range(SUPER)])
                    return [st.decode(v) for v in vs], st.scale(sbase, builder.add(rows_s[r], e), order)

                def dot(r, j, lohi, ws, qs):
                    k = builder.add(toks_k[j], e)
                    f = builder.sitofp(st.dot(st.load(cxbase, k, st.vi, 4), lohi, qs), st.vf)
                    xs = st.load(rbase, k, st.vf, 4)
                    builder.store(builder.call(st.fma, [f, builder.fmul(ws, xs), builder.load(accs[r][j])]), accs[r][j])

                if R <= ROWS_FIRST[mode]:                     # every row decoded, then each input's loads, used by all
                    rs = [row(r) for r in range(R)]
                    for j in range(T):
                        qs = inputs(j)
                        for r in range(R):
                            dot(r, j, *rs[r], qs)
                else:                                         # every input's loads, then row by row (fewer registers)
                    qs = [inputs(j) for j in range(T)]
                    for r in range(R):
                        lohi, ws = row(r)
                        for j in range(T):
                            dot(r, j, lohi, ws, qs[j])
            with cgutils.for_range(builder, n_super) as loop:
                body(loop.index, accs)

        def steps(st: _Step, count, start, accs):
            """Vectors of code bytes in order from byte `start`: one entry (xc, xr) per 4 code bytes."""
            def body(i, accs):
                p = builder.add(start, builder.mul(i, c64(st.nb)))
                e = builder.add(e0, builder.udiv(builder.sub(p, p0), c64(4)))
                rows = []                                 # rows first: 3 vectors a row, 4 an input
                for r in range(R):
                    cp = builder.add(rows_c[r], p)
                    if st.nb > 16:
                        fetch_ahead(cp)
                    ws = st.scale(sbase, builder.add(rows_s[r], builder.udiv(p, c64(16))), [L // 4 for L in range(st.n)])
                    rows.append((st.decode(st.load(cbase, cp, st.vb)), ws))
                for j in range(T):
                    q = (st.load(qbase, builder.add(toks_q[j], p), st.vb),
                         st.load(qbase, builder.add(builder.add(toks_q[j], half), p), st.vb))
                    k = builder.add(toks_k[j], e)
                    corr, xs = st.load(cxbase, k, st.vi, 4), st.load(rbase, k, st.vf, 4)
                    for r, (lohi, ws) in enumerate(rows):
                        f = builder.sitofp(st.dot(corr, [lohi], [q]), st.vf)
                        builder.store(builder.call(st.fma, [f, builder.fmul(ws, xs), builder.load(accs[r][j])]), accs[r][j])
            with cgutils.for_range(builder, count) as loop:
                body(loop.index, accs)

        main, tail = _Step(builder, step, mode), _Step(builder, 16, mode)
        accs, tail_accs = accumulators(main), accumulators(tail)        # float vector accumulators per (row, input)
        superblocks(main, accs)
        steps(main, n_main, p0, accs)
        steps(tail, n_tail, p1, tail_accs)
        total(accs, main.n)
        total(tail_accs, tail.n)
        for r in range(R):
            for j in range(T):
                o = builder.add(builder.add(o_off_v, builder.mul(o_stride_v, c64(j))), builder.mul(or_stride_v, c64(r)))
                builder.store(sums[r][j], builder.gep(obase, [o]))
        return context.get_dummy_value()
    return sig, codegen
