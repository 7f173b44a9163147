"""SIMD building block for FP8 E4M3 weights with E8M0 block scales on the CPU (numba intrinsic, LLVM IR).

E4M3 is decoded in registers through half precision, no table: each code byte sign-extended to 16 bits
and shifted into the fp16 bit pattern of its value times 2^-8 (exact for every finite E4M3 value,
subnormals included; 0x7F/0xFF, NaN in E4M3, decode to 480: checkpoints hold none, the loader
checks), then one `vcvtph2ps` to float32; the 2^8 is undone once per output. Three integer ops and a
convert per vector of weights, against eleven for the integer decode this replaced
(kernels/lab/fp8_gemv_variants.py v0 / v1: 2x the GEMV rate in one run) and four for its first form.

`fp8_dot(R, T, lanes, q, q_off, q_stride, scales, s_off, s_stride, x, x_off, x_stride, stab, nblocks,
         bk, out, o_off, o_stride, or_stride)` (R, T, lanes, bk literals)
computes out[o_off + j*o_stride + r*or_stride] = sum_b stab[scales[s_off + r*s_stride + b]] *
sum_{i < bk} e4m3(q[q_off + r*q_stride + b*bk + i]) * x[x_off + j*x_stride + b*bk + i]
for r < R rows, j < T inputs: each row's codes are decoded once for all T inputs; per block an FMA
chain over its bk weights, then one FMA with the block scale into the (row, input) accumulator; one
ordered reduction at the end (deterministic, batch-invariant).
"""
from __future__ import annotations

from llvmlite import ir
from numba import types
from numba.core import cgutils
from numba.extending import intrinsic

from kernels.fp4_simd import _data_ptrs, _fma_prefetch, _literal, _splat, _store_sums, _zeroed_accs, f32, i8, i64, prefetch_weights

i16, f16 = ir.IntType(16), ir.HalfType()
UNDO = 256.0                      # the half decode's 2^-8, undone once per output (exact)


def _decode_e4m3(builder, codes_i8, lanes):
    """<lanes x i8> E4M3 codes -> <lanes x float> = value * 2^-8, exactly: the code sign-extended to 16
    bits and shifted left by 7 is an fp16 bit pattern with the sign at bit 15 and exponent and mantissa
    at bits 7-13; bit 14 (a copy of the sign) cleared, it is the value times 2^-8 for every finite code,
    subnormals included; `vcvtph2ps` widens it (F16C, on every AVX2 host). Three integer ops
    (`vpmovsxbw` with the load, `vpsllw`, `vpand`): the same bits as the zero-extend, shift left 8,
    arithmetic shift right 1 it replaced, 1.22x the GEMV's rate on the Zen 2 VM (kernels/lab/README.md)."""
    vh = ir.VectorType(i16, lanes)

    def k(v):
        return ir.Constant(vh, [v] * lanes)
    w = builder.and_(builder.shl(builder.sext(codes_i8, vh), k(7)), k(0xBFFF))
    return builder.fpext(builder.bitcast(w, ir.VectorType(f16, lanes)), ir.VectorType(f32, lanes))


@intrinsic
def fp8_dot(typingctx, R_t, T_t, lanes_t, q, q_off, q_stride, scales, s_off, s_stride, x, x_off, x_stride,
            stab, nblocks, bk_t, out, o_off, o_stride, or_stride):
    R, T, lanes, bk = _literal(R_t), _literal(T_t), _literal(lanes_t), _literal(bk_t)
    if None in (R, T, lanes, bk):
        return None
    if lanes not in (8, 16) or bk % lanes:
        raise TypeError("lanes must be 8 (AVX2) or 16 (AVX-512) and divide the block width")
    sig = types.void(R_t, T_t, lanes_t, q, q_off, q_stride, scales, s_off, s_stride, x, x_off, x_stride,
                     stab, nblocks, bk_t, out, o_off, o_stride, or_stride)

    def codegen(context, builder, signature, args):
        (_, _, _, _, q_off_v, q_stride_v, _, s_off_v, s_stride_v, _, x_off_v, x_stride_v,
         _, nb, _, _, o_off_v, o_stride_v, or_stride_v) = args
        at = signature.args[3:]
        vf, vb = ir.VectorType(f32, lanes), ir.VectorType(i8, lanes)
        qbase, sbase, xbase, tbase, obase = _data_ptrs(context, builder, at, args[3:], (0, 3, 6, 9, 12))
        fma, prefetch = _fma_prefetch(builder, vf, lanes)
        accs = _zeroed_accs(builder, vf, R, T)
        rows_q = [builder.add(q_off_v, builder.mul(q_stride_v, ir.Constant(i64, r))) for r in range(R)]
        rows_s = [builder.add(s_off_v, builder.mul(s_stride_v, ir.Constant(i64, r))) for r in range(R)]
        toks_x = [builder.add(x_off_v, builder.mul(x_stride_v, ir.Constant(i64, j))) for j in range(T)]
        zero = ir.Constant(vf, [0.0] * lanes)
        with cgutils.for_range(builder, nb) as loop:
            b = loop.index
            kb = builder.mul(b, ir.Constant(i64, bk))
            parts = [[zero] * T for _ in range(R)]            # per block: an FMA chain over its weights
            for h in range(bk // lanes):
                k0 = builder.add(kb, ir.Constant(i64, h * lanes))
                xs = [builder.load(builder.bitcast(builder.gep(xbase, [builder.add(toks_x[j], k0)]), vf.as_pointer()), align=4)
                      for j in range(T)]
                for r in range(R):
                    qp = builder.gep(qbase, [builder.add(rows_q[r], k0)])
                    if h == 0:
                        prefetch_weights(builder, prefetch, qp)
                    w = _decode_e4m3(builder, builder.load(builder.bitcast(qp, vb.as_pointer()), align=1), lanes)
                    for j in range(T):
                        parts[r][j] = builder.call(fma, [w, xs[j], parts[r][j]])
            for r in range(R):                                # then once times the block's scale
                sb = builder.load(builder.gep(sbase, [builder.add(rows_s[r], b)]))
                sv = _splat(builder, builder.load(builder.gep(tbase, [builder.zext(sb, i64)])), lanes)
                for j in range(T):
                    builder.store(builder.call(fma, [parts[r][j], sv, builder.load(accs[r][j])]), accs[r][j])
        undo = ir.Constant(vf, [UNDO] * lanes)
        for row in accs:
            for a in row:
                builder.store(builder.fmul(builder.load(a), undo), a)
        _store_sums(builder, accs, vf, lanes, obase, o_off_v, o_stride_v, or_stride_v)
        return context.get_dummy_value()
    return sig, codegen


@intrinsic
def fp8_dequant(typingctx, lanes_t, q, q_off, scales, s_off, stab, nblocks, bk_t, out, o_off):
    """fp8_dequant(lanes, q, q_off, scales, s_off, stab, nblocks, bk, out, o_off): one row of
    nblocks * bk weights decoded to float32 (prefill tiles)."""
    lanes, bk = _literal(lanes_t), _literal(bk_t)
    if lanes is None or bk is None:
        return None
    if lanes not in (8, 16) or bk % lanes:
        raise TypeError("lanes must be 8 (AVX2) or 16 (AVX-512) and divide the block width")
    sig = types.void(lanes_t, q, q_off, scales, s_off, stab, nblocks, bk_t, out, o_off)

    def codegen(context, builder, signature, args):
        _, _, q_off_v, _, s_off_v, _, nb, _, _, o_off_v = args
        at = signature.args[1:]
        vf, vb = ir.VectorType(f32, lanes), ir.VectorType(i8, lanes)
        qbase, sbase, tbase, obase = _data_ptrs(context, builder, at, args[1:], (0, 2, 4, 7))
        with cgutils.for_range(builder, nb) as loop:
            b = loop.index
            sb = builder.load(builder.gep(sbase, [builder.add(s_off_v, b)]))
            sv = _splat(builder, builder.load(builder.gep(tbase, [builder.zext(sb, i64)])), lanes)
            for h in range(bk // lanes):
                k0 = builder.add(builder.mul(b, ir.Constant(i64, bk)), ir.Constant(i64, h * lanes))
                qp = builder.gep(qbase, [builder.add(q_off_v, k0)])
                w = _decode_e4m3(builder, builder.load(builder.bitcast(qp, vb.as_pointer()), align=1), lanes)
                op = builder.bitcast(builder.gep(obase, [builder.add(o_off_v, k0)]), vf.as_pointer())
                builder.store(builder.fmul(builder.fmul(w, ir.Constant(vf, [UNDO] * lanes)), sv), op, align=4)
        return context.get_dummy_value()
    return sig, codegen
