"""SIMD building blocks for ds_fp4 on the CPU, emitted as LLVM IR from numba intrinsics.

Plain numba loops over packed E2M1 reach 0.5-2 GB/s (a table gather and a horizontal reduction per
32-weight group sink them). These intrinsics do what a C++ kernel would:
  - the 16-entry E2M1 table lives in one vector register and is applied with a permute
    (`vpermps`: AVX-512 16 lanes = one byte's low nibbles for 16 bytes at once; AVX2 8 lanes, the
    sign applied separately because the 8-lane permute indexes only 8 entries);
  - x is de-interleaved once per token (even inputs then odd inputs), so low nibbles multiply the even
    half and high nibbles the odd half with no shuffles in the inner loop;
  - one vector accumulator per row, one ordered reduction at the end (deterministic);
  - R rows share each x load, T inputs share each decode; a software prefetch runs `PREFETCH`
    bytes ahead in each row.

`fp4_dot(R, T, lanes, codes u8[:], c_off, c_stride, scales u8[:], s_off, s_stride, x f32[:], x_off,
         x_stride, stab f32[256], ngroups, out f32[:], o_off, o_stride, or_stride)` (R, T, lanes literals)
computing out[o_off + j*o_stride + r*or_stride] = sum_g stab[scale[r, g]] * sum_i E2M1[code[r, g, i]] * x_j[...]
for r < R rows and j < T inputs, where row r's codes start at codes[c_off + r*c_stride] (16 B per
group) and its scales at scales[s_off + r*s_stride]; input j at x[x_off + j*x_stride:] holds 16*ngroups
even inputs then 16*ngroups odd ones. Each row is decoded once for all T inputs (DSpark verify and
prefill widths reuse the decode). `fp4_dequant(lanes, ...)` writes a decoded float32 row instead (prefill tiles).
"""
from __future__ import annotations

from llvmlite import ir
from numba import types
from numba.core import cgutils
from numba.extending import intrinsic

E2M1 = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0)
PREFETCH = 2048

f32, i8, i32, i64 = ir.FloatType(), ir.IntType(8), ir.IntType(32), ir.IntType(64)


def _splat(builder, val, n):
    vt = ir.VectorType(val.type, n)
    v = builder.insert_element(ir.Constant(vt, ir.Undefined), val, ir.Constant(i32, 0))
    return builder.shuffle_vector(v, ir.Constant(vt, ir.Undefined), ir.Constant(ir.VectorType(i32, n), [0] * n))


class _Decoder:
    """Emits E2M1 decode of `lanes` codes (as <lanes x i32>) to <lanes x float>."""

    def __init__(self, builder, lanes):
        self.b, self.n = builder, lanes
        mod = builder.module
        vf, vi = ir.VectorType(f32, lanes), ir.VectorType(i32, lanes)
        self.vf, self.vi = vf, vi
        if lanes == 16:
            self.perm = cgutils.get_or_insert_function(mod, ir.FunctionType(vf, [vf, vi]), "llvm.x86.avx512.permvar.sf.512")
            self.table = ir.Constant(vf, list(E2M1))
        else:
            self.perm = cgutils.get_or_insert_function(mod, ir.FunctionType(vf, [vf, vi]), "llvm.x86.avx2.permps")
            self.table = ir.Constant(vf, list(E2M1[:8]))
        self.fma = cgutils.get_or_insert_function(mod, ir.FunctionType(vf, [vf, vf, vf]), f"llvm.fma.v{lanes}f32")

    def decode(self, codes_i32):
        b = self.b
        if self.n == 16:
            return b.call(self.perm, [self.table, codes_i32])
        mag = b.call(self.perm, [self.table, b.and_(codes_i32, ir.Constant(self.vi, [7] * 8))])
        sign = b.shl(b.and_(codes_i32, ir.Constant(self.vi, [8] * 8)), ir.Constant(self.vi, [28] * 8))
        return b.bitcast(b.xor(b.bitcast(mag, self.vi), sign), self.vf)


def _data_ptrs(context, builder, arg_types, arg_values, which):
    """The data pointers of the array arguments at positions `which`."""
    return [context.make_array(arg_types[i])(context, builder, arg_values[i]).data for i in which]


def _store_sums(builder, accs, vf, lanes, obase, o_off, o_stride, or_stride):
    """out[o_off + j*o_stride + r*or_stride] = the lanes of accs[r][j] summed in order (deterministic)."""
    red = cgutils.get_or_insert_function(builder.module, ir.FunctionType(f32, [f32, vf]),
                                         f"llvm.vector.reduce.fadd.v{lanes}f32")
    for r, row in enumerate(accs):
        for j, acc in enumerate(row):
            total = builder.call(red, [ir.Constant(f32, 0.0), builder.load(acc)])
            o = builder.add(builder.add(o_off, builder.mul(o_stride, ir.Constant(i64, j))),
                            builder.mul(or_stride, ir.Constant(i64, r)))
            builder.store(total, builder.gep(obase, [o]))


def _literal(t):
    """The value of a compile-time integer literal, else None (numba then retries with literals)."""
    return t.literal_value if isinstance(t, types.IntegerLiteral) else None


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


@intrinsic
def fp4_dequant(typingctx, lanes_t, codes, c_off, scales, s_off, stab, ngroups, out, o_off):
    """fp4_dequant(lanes, codes, c_off, scales, s_off, stab, ngroups, out, o_off): one row of
    32*ngroups weights decoded to float32, in input order."""
    lanes = _literal(lanes_t)
    if lanes is None:
        return None
    if lanes not in (8, 16):
        raise TypeError("lanes must be 8 (AVX2) or 16 (AVX-512)")
    sig = types.void(lanes_t, codes, c_off, scales, s_off, stab, ngroups, out, o_off)

    def codegen(context, builder, signature, args):
        _, _, c_off_v, _, s_off_v, _, ng, _, o_off_v = args
        at = signature.args[1:]
        d = _Decoder(builder, lanes)
        vf, vb = d.vf, ir.VectorType(i8, lanes)
        cbase, sbase, tbase, obase = _data_ptrs(context, builder, at, args[1:], (0, 2, 4, 6))
        # interleave lo/hi back to input order: out[2j] = lo[j], out[2j+1] = hi[j]
        mask_lo = [(k // 2) + (lanes if k % 2 else 0) for k in range(lanes)]
        mask_hi = [lanes // 2 + (k // 2) + (lanes if k % 2 else 0) for k in range(lanes)]
        with cgutils.for_range(builder, ng) as loop:
            g = loop.index
            s = builder.load(builder.gep(tbase, [builder.zext(builder.load(builder.gep(sbase, [builder.add(s_off_v, g)])), i64)]))
            sv = _splat(builder, s, lanes)
            for h in range(16 // lanes):
                cp = builder.gep(cbase, [builder.add(builder.add(c_off_v, builder.mul(g, ir.Constant(i64, 16))), ir.Constant(i64, h * lanes))])
                c = builder.zext(builder.load(builder.bitcast(cp, vb.as_pointer()), align=1), d.vi)
                lo = builder.fmul(d.decode(builder.and_(c, ir.Constant(d.vi, [15] * lanes))), sv)
                hi = builder.fmul(d.decode(builder.lshr(c, ir.Constant(d.vi, [4] * lanes))), sv)
                base = builder.add(builder.add(o_off_v, builder.mul(g, ir.Constant(i64, 32))), ir.Constant(i64, 2 * h * lanes))
                for k, m in enumerate((mask_lo, mask_hi)):
                    v = builder.shuffle_vector(lo, hi, ir.Constant(ir.VectorType(i32, lanes), m))
                    op = builder.bitcast(builder.gep(obase, [builder.add(base, ir.Constant(i64, k * lanes))]), vf.as_pointer())
                    builder.store(v, op, align=4)
        return context.get_dummy_value()
    return sig, codegen
