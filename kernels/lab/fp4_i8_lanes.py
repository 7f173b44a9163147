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

from kernels import fp4_i8
from kernels.fp4_i8 import STEP, _fn, i8, i32, i64, f32
from kernels.fp4_simd import PREFETCH, _data_ptrs, _literal


class _Step(fp4_i8._Step):
    """The package's vector step, one accumulator lane per 4 code bytes."""

    def weights(self, cbase, c_at, sbase, s_at):
        """-> (low-nibble bytes, high-nibble bytes, weight scale per lane as float)."""
        lo, hi = self.decode(self.load(cbase, c_at, self.vb))
        return lo, hi, self.scale(sbase, s_at, [L // 4 for L in range(self.n)])

    def dot(self, lo, hi, qe, qo):
        return super().dot(ir.Constant(self.vi, [0] * self.n), [(lo, hi)], [(qe, qo)])


@intrinsic
def fp4_i8_dot_lanes(typingctx, R_t, T_t, mode_t, codes, c_off, c_stride, scales, s_off, s_stride,
               xq, xc, xr, a0, K, out, o_off, o_stride, or_stride):
    R, T, mode = _literal(R_t), _literal(T_t), _literal(mode_t)
    if R is None or T is None or mode is None:
        return None
    if mode not in STEP:
        raise TypeError(fp4_i8.mode_error(mode))
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

        run(_Step(builder, step, mode), n_main, c64(0))
        run(_Step(builder, 16, mode), n_tail, builder.mul(n_main, c64(step)))
        for r in range(R):
            for j in range(T):
                o = builder.add(builder.add(o_off_v, builder.mul(o_stride_v, c64(j))), builder.mul(or_stride_v, c64(r)))
                builder.store(sums[r][j], builder.gep(obase, [o]))
        return context.get_dummy_value()
    return sig, codegen
