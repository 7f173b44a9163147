"""Lab: the float ds_fp4 dot product (variants v1-v3 of fp4_gemv_variants.py; the package kernel until
int8 inputs replaced it, kernels/fp4_i8.py).

`fp4_dot(R, T, lanes, codes u8[:], c_off, c_stride, scales u8[:], s_off, s_stride, x f32[:], x_off,
         x_stride, stab f32[256], ngroups, out f32[:], o_off, o_stride, or_stride)` (R, T, lanes literals)
computing out[o_off + j*o_stride + r*or_stride] = sum_g stab[scale[r, g]] * sum_i E2M1[code[r, g, i]] * x_j[...]
for r < R rows and j < T inputs, where row r's codes start at codes[c_off + r*c_stride] (16 B per
group) and its scales at scales[s_off + r*s_stride]; input j at x[x_off + j*x_stride:] holds 16*ngroups
even inputs then 16*ngroups odd ones. Each row is decoded once for all T inputs.
"""
from __future__ import annotations

from llvmlite import ir
from numba import types
from numba.core import cgutils
from numba.extending import intrinsic

from kernels.fp4_simd import PREFETCH, _Decoder, _data_ptrs, _literal, _splat, _store_sums, i8, i32, i64


@intrinsic
def fp4_dot(typingctx, R_t, T_t, lanes_t, codes, c_off, c_stride, scales, s_off, s_stride,
            x, x_off, x_stride, stab, ngroups, out, o_off, o_stride, or_stride):
    """fp4_dot(R, T, lanes, ...): R rows x T de-interleaved inputs, each row decoded once per group
    and multiplied into all T inputs (token j's input at x_off + j*x_stride, its outputs at
    out[o_off + j*o_stride + r*or_stride]). R*T accumulators: keep R*T <= 16 (AVX-512 has 32 registers)."""
    R, T, lanes = _literal(R_t), _literal(T_t), _literal(lanes_t)
    if R is None or T is None or lanes is None:
        return None
    if lanes not in (8, 16):
        raise TypeError("lanes must be 8 (AVX2) or 16 (AVX-512)")
    sig = types.void(R_t, T_t, lanes_t, codes, c_off, c_stride, scales, s_off, s_stride, x, x_off, x_stride,
                     stab, ngroups, out, o_off, o_stride, or_stride)

    def codegen(context, builder, signature, args):
        (_, _, _, _, c_off_v, c_stride_v, _, s_off_v, s_stride_v, _, x_off_v, x_stride_v,
         _, ng, _, o_off_v, o_stride_v, or_stride_v) = args
        at = signature.args[3:]
        d = _Decoder(builder, lanes)
        vf, vb = d.vf, ir.VectorType(i8, lanes)
        cbase, sbase, xbase, tbase, obase = _data_ptrs(context, builder, at, args[3:], (0, 3, 6, 9, 11))
        half = builder.mul(ng, ir.Constant(i64, 16))
        accs = [[cgutils.alloca_once(builder, vf) for _ in range(T)] for _ in range(R)]
        for row in accs:
            for a in row:
                builder.store(ir.Constant(vf, [0.0] * lanes), a)
        prefetch = cgutils.get_or_insert_function(
            builder.module, ir.FunctionType(ir.VoidType(), [i8.as_pointer(), i32, i32, i32]), "llvm.prefetch.p0i8")
        rows_c = [builder.add(c_off_v, builder.mul(c_stride_v, ir.Constant(i64, r))) for r in range(R)]
        rows_s = [builder.add(s_off_v, builder.mul(s_stride_v, ir.Constant(i64, r))) for r in range(R)]
        toks_x = [builder.add(x_off_v, builder.mul(x_stride_v, ir.Constant(i64, j))) for j in range(T)]
        with cgutils.for_range(builder, ng) as loop:
            g = loop.index
            g16 = builder.mul(g, ir.Constant(i64, 16))
            for h in range(16 // lanes):                      # AVX2: two halves of a 16-byte group
                xs = []
                for j in range(T):
                    xe_off = builder.add(builder.add(toks_x[j], g16), ir.Constant(i64, h * lanes))
                    xe = builder.load(builder.bitcast(builder.gep(xbase, [xe_off]), vf.as_pointer()), align=4)
                    xo = builder.load(builder.bitcast(builder.gep(xbase, [builder.add(xe_off, half)]), vf.as_pointer()), align=4)
                    xs.append((xe, xo))
                for r in range(R):
                    cp = builder.gep(cbase, [builder.add(builder.add(rows_c[r], g16), ir.Constant(i64, h * lanes))])
                    if h == 0:
                        builder.call(prefetch, [builder.gep(cp, [ir.Constant(i64, PREFETCH)]),
                                                ir.Constant(i32, 0), ir.Constant(i32, 3), ir.Constant(i32, 1)])
                    c = builder.zext(builder.load(builder.bitcast(cp, vb.as_pointer()), align=1), d.vi)
                    lo = d.decode(builder.and_(c, ir.Constant(d.vi, [15] * lanes)))
                    hi = d.decode(builder.lshr(c, ir.Constant(d.vi, [4] * lanes)))
                    sb = builder.load(builder.gep(sbase, [builder.add(rows_s[r], g)]))
                    sv = _splat(builder, builder.load(builder.gep(tbase, [builder.zext(sb, i64)])), lanes)
                    for j, (xe, xo) in enumerate(xs):
                        p = builder.call(d.fma, [hi, xo, builder.fmul(lo, xe)])
                        builder.store(builder.call(d.fma, [p, sv, builder.load(accs[r][j])]), accs[r][j])
        _store_sums(builder, accs, vf, lanes, obase, o_off_v, o_stride_v, or_stride_v)
        return context.get_dummy_value()
    return sig, codegen


