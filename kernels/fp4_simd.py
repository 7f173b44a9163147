"""SIMD building blocks for ds_fp4 on the CPU, emitted as LLVM IR from numba intrinsics.

Plain numba loops over packed E2M1 reach 0.5-2 GB/s (a table gather and a horizontal reduction per
32-weight group sink them). These intrinsics do what a C++ kernel would:
  - the 16-entry E2M1 table lives in one vector register and is applied with a permute
    (`vpermps`: AVX-512 16 lanes = one byte's low nibbles for 16 bytes at once; AVX2 8 lanes, the
    sign applied separately because the 8-lane permute indexes only 8 entries);
  - x is de-interleaved once per token (even inputs then odd inputs), so low nibbles multiply the even
    half and high nibbles the odd half with no shuffles in the inner loop;
  - one vector accumulator per row, one ordered reduction at the end (deterministic);
  - R rows share each x load, T inputs share each decode; a software prefetch runs ahead in each row
    (`PREFETCH` bytes into L1 in the lab's float kernels; the package's weight streams use
    `prefetch_weights`: WEIGHT_PREFETCH bytes into L2).

`fp4_dequant(lanes, ...)` writes a decoded float32 row (prefill tiles). The float dot product built on
the same decoder (`fp4_dot`, the package's kernel until int8 inputs replaced it: kernels/fp4_i8.py) now
lives in the lab (kernels/lab/fp4_float_dot.py); the helpers below serve the int8, FP8 and BF16 kernels.
"""
from __future__ import annotations

from llvmlite import ir
from numba import types
from numba.core import cgutils
from numba.extending import intrinsic

E2M1 = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0)
PREFETCH = 2048                    # the lab's float kernels: 2 KiB ahead into L1
# The package's weight streams (the ds_fp4 int8 kernel, the FP8 and BF16 GEMVs): WEIGHT_PREFETCH bytes
# ahead, into L2 (llvm.prefetch locality 1: prefetcht2); `prefetch_weights` emits it. A prefetcht0
# holds one of the L1's few miss buffers until its line arrives; far ahead, that stalls the loads the
# kernel is waiting for. Zen 4 VM, 2 threads, from DRAM, every configuration compiled into its own
# copy of a kernel and all interleaved in one process, per-round ratio to the former 2 KiB into L1
# (kernels/lab/weight_prefetch.py, kernels/lab/README.md): ds_fp4 rows 1.02-1.28 (six runs, never
# below), FP8 rows 1.28 / 1.31, BF16 rows 1.21 / 1.11 / 1.14; 16 KiB into L1 0.78-1.12.
WEIGHT_PREFETCH = 16384
WEIGHT_LOCALITY = 1

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


def prefetch_weights(builder, prefetch, ptr):
    """Emit the weight stream's prefetch: WEIGHT_PREFETCH bytes past the i8* `ptr`, into L2 (read at
    code-emission time: kernels/lab/weight_prefetch.py compiles copies with other values; a negative
    distance emits none)."""
    if WEIGHT_PREFETCH < 0:
        return
    builder.call(prefetch, [builder.gep(ptr, [ir.Constant(i64, WEIGHT_PREFETCH)]), ir.Constant(i32, 0),
                            ir.Constant(i32, WEIGHT_LOCALITY), ir.Constant(i32, 1)])


def _fma_prefetch(builder, vf, lanes):
    """The <lanes x float> FMA and the data-prefetch intrinsics, declared in this module."""
    fma = cgutils.get_or_insert_function(builder.module, ir.FunctionType(vf, [vf, vf, vf]), f"llvm.fma.v{lanes}f32")
    prefetch = cgutils.get_or_insert_function(
        builder.module, ir.FunctionType(ir.VoidType(), [i8.as_pointer(), i32, i32, i32]), "llvm.prefetch.p0i8")
    return fma, prefetch


def _zeroed_accs(builder, vf, rows, cols):
    """rows x cols vector accumulators (stack slots), each set to zero."""
    accs = [[cgutils.alloca_once(builder, vf) for _ in range(cols)] for _ in range(rows)]
    for row in accs:
        for a in row:
            builder.store(ir.Constant(vf, [0.0] * vf.count), a)
    return accs


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
