"""The package's ds_fp4 x int8 kernel before superblocks (kernels/fp4_i8.py), kept as a lab variant:
one accumulator lane per 4 code bytes (8 weights), so every 8 weights of every input pay a convert, a
multiply and an FMA, and every 64 code bytes build a scale vector. Inputs as the package prepares them
with no superblocks (`_prepare(x, rows, 0)` in kernels/cpu_moe.py: every entry 4 code bytes, xc holding
-12 x the q sum, added here).

`fp4_i8_dot_lanes(R, T, mode, ...)`: the package's `fp4_i8_dot` signature.
"""
from __future__ import annotations

from llvmlite import ir
from numba import types
from numba.core import cgutils
from numba.extending import intrinsic

from kernels.fp4_simd import E2M1, PREFETCH, _data_ptrs, _literal

OFFSET = 12                                           # 2 x E2M1 in [-12, 12] -> + 12 in [0, 24]
LUT16 = [int(2 * v) + OFFSET for v in E2M1]
STEP = {1: 32, 2: 64, 3: 64}

i8, i16, i32, i64, f32 = ir.IntType(8), ir.IntType(16), ir.IntType(32), ir.IntType(64), ir.FloatType()


def _vec(t, n):
    return ir.VectorType(t, n)


def _fn(builder, name, ret, args):
    return cgutils.get_or_insert_function(builder.module, ir.FunctionType(ret, args), name)


class _Step:
    """Emits one step of `nb` code bytes (16, 32 or 64) for one row and T inputs."""

    def __init__(self, builder, nb, vnni):
        self.b, self.nb, self.n = builder, nb, nb // 4
        self.vb, self.vw, self.vi, self.vf = _vec(i8, nb), _vec(i16, nb // 2), _vec(i32, nb // 4), _vec(f32, nb // 4)
        self.vnni = vnni and nb == 64
        suffix = {16: ("ssse3.pshuf.b.128", "ssse3.pmadd.ub.sw.128", "sse2.pmadd.wd"),
                  32: ("avx2.pshuf.b", "avx2.pmadd.ub.sw", "avx2.pmadd.wd"),
                  64: ("avx512.pshuf.b.512", "avx512.pmaddubs.w.512", "avx512.pmaddw.d.512")}[nb]
        self.shuf = _fn(builder, "llvm.x86." + suffix[0], self.vb, [self.vb, self.vb])
        self.maddubs = _fn(builder, "llvm.x86." + suffix[1], self.vw, [self.vb, self.vb])
        self.maddwd = _fn(builder, "llvm.x86." + suffix[2], self.vi, [self.vw, self.vw])
        if self.vnni:
            self.dpbusd = _fn(builder, "llvm.x86.avx512.vpdpbusd.512", self.vi, [self.vi, self.vi, self.vi])
        self.fma = _fn(builder, f"llvm.fma.v{self.n}f32", self.vf, [self.vf, self.vf, self.vf])
        self.lut = ir.Constant(self.vb, LUT16 * (nb // 16))
        self.ones = ir.Constant(self.vw, [1] * (nb // 2))
        self.rep = ir.Constant(_vec(i32, self.n), [k // 4 for k in range(self.n)])   # scale byte g -> lanes 4g..4g+3

    def load(self, base, off, t, align=1):
        return self.b.load(self.b.bitcast(self.b.gep(base, [off]), t.as_pointer()), align=align)

    def weights(self, cbase, c_at, sbase, s_at):
        """-> (low-nibble bytes, high-nibble bytes, weight scale per lane as float)."""
        b = self.b
        c = self.load(cbase, c_at, self.vb)
        m = ir.Constant(self.vb, [15] * self.nb)
        lo = b.call(self.shuf, [self.lut, b.and_(c, m)])
        hi = b.call(self.shuf, [self.lut, b.and_(b.lshr(c, ir.Constant(self.vb, [4] * self.nb)), m)])
        g = self.nb // 16
        sb = b.zext(self.load(sbase, s_at, _vec(i8, g)), _vec(i32, g))
        s = b.shuffle_vector(sb, ir.Constant(_vec(i32, g), ir.Undefined), self.rep)
        bits = b.shl(s, ir.Constant(self.vi, [23] * self.n))
        nan = b.icmp_unsigned("==", s, ir.Constant(self.vi, [255] * self.n))
        bits = b.select(nan, ir.Constant(self.vi, [0x7FC00000] * self.n), bits)
        return lo, hi, b.bitcast(bits, self.vf)

    def dot(self, lo, hi, qe, qo):
        """-> <n x i32>: per lane, sum of (2 E2M1 + 12) x q over its 4 code bytes (8 weights)."""
        b = self.b
        if self.vnni:
            z = ir.Constant(self.vi, [0] * self.n)
            acc = b.call(self.dpbusd, [z, b.bitcast(lo, self.vi), b.bitcast(qe, self.vi)])
            return b.call(self.dpbusd, [acc, b.bitcast(hi, self.vi), b.bitcast(qo, self.vi)])
        p = b.add(b.call(self.maddubs, [lo, qe]), b.call(self.maddubs, [hi, qo]))   # |.| <= 2*2*24*127 < 2^15
        return b.call(self.maddwd, [p, self.ones])


@intrinsic
def fp4_i8_dot_lanes(typingctx, R_t, T_t, mode_t, codes, c_off, c_stride, scales, s_off, s_stride,
               xq, xc, xr, a0, K, out, o_off, o_stride, or_stride):
    R, T, mode = _literal(R_t), _literal(T_t), _literal(mode_t)
    if R is None or T is None or mode is None:
        return None
    if mode not in STEP:
        raise TypeError("mode must be 1 (AVX2), 2 (AVX-512BW) or 3 (AVX-512 VNNI)")
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
        n_main = builder.udiv(half, c64(step))
        n_tail = builder.udiv(builder.sub(half, builder.mul(n_main, c64(step))), c64(16))
        rows_c = [builder.add(c_off_v, builder.mul(c_stride_v, c64(r))) for r in range(R)]
        rows_s = [builder.add(s_off_v, builder.mul(s_stride_v, c64(r))) for r in range(R)]
        toks_q = [builder.mul(builder.add(a0_v, c64(j)), K_v) for j in range(T)]
        toks_k = [builder.udiv(q, c64(8)) for q in toks_q]
        prefetch = _fn(builder, "llvm.prefetch.p0i8", ir.VoidType(), [i8.as_pointer(), i32, i32, i32])
        sums = [[ir.Constant(f32, 0.0)] * T for _ in range(R)]

        def run(st: _Step, count, p0):
            """Steps k < count at code byte p0 + k*nb of every row; returns the per-(row, input) sums."""
            accs = [[cgutils.alloca_once_value(builder, ir.Constant(st.vf, [0.0] * st.n)) for _ in range(T)] for _ in range(R)]
            with cgutils.for_range(builder, count) as loop:
                p = builder.add(p0, builder.mul(loop.index, c64(st.nb)))
                lane = builder.udiv(p, c64(4))
                ins = []
                for j in range(T):
                    qe = st.load(qbase, builder.add(toks_q[j], p), st.vb)
                    qo = st.load(qbase, builder.add(builder.add(toks_q[j], half), p), st.vb)
                    k = builder.add(toks_k[j], lane)
                    ins.append((qe, qo, st.load(cxbase, k, st.vi, 4), st.load(rbase, k, st.vf, 4)))
                for r in range(R):
                    cp = builder.add(rows_c[r], p)
                    if st.nb > 16:
                        builder.call(prefetch, [builder.gep(cbase, [builder.add(cp, c64(PREFETCH))]),
                                                ir.Constant(i32, 0), ir.Constant(i32, 3), ir.Constant(i32, 1)])
                    lo, hi, ws = st.weights(cbase, cp, sbase, builder.add(rows_s[r], builder.udiv(p, c64(16))))
                    for j, (qe, qo, corr, xs) in enumerate(ins):
                        f = builder.sitofp(builder.add(st.dot(lo, hi, qe, qo), corr), st.vf)
                        builder.store(builder.call(st.fma, [f, builder.fmul(ws, xs), builder.load(accs[r][j])]), accs[r][j])
            red = _fn(builder, f"llvm.vector.reduce.fadd.v{st.n}f32", f32, [f32, st.vf])
            for r in range(R):
                for j in range(T):
                    sums[r][j] = builder.call(red, [sums[r][j], builder.load(accs[r][j])])

        run(_Step(builder, step, mode == 3), n_main, c64(0))
        run(_Step(builder, 16, False), n_tail, builder.mul(n_main, c64(step)))
        for r in range(R):
            for j in range(T):
                o = builder.add(builder.add(o_off_v, builder.mul(o_stride_v, c64(j))), builder.mul(or_stride_v, c64(r)))
                builder.store(sums[r][j], builder.gep(obase, [o]))
        return context.get_dummy_value()
    return sig, codegen
