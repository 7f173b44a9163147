"""FP8 E4M3 GEMV variants (dense linears at decode, T = 1..4), measured against each other and the DRAM
stream probe in one run:  python -m kernels.lab.fp8_gemv_variants [--mib 512] [--rounds 5]

  v0  the package before: E4M3 decoded with integer ops to float32 (and, shift, add, select for
      subnormals, sign), per weight a multiply then an FMA with the block scale
  v1  (the package: kernels/fp8_simd.py, kernels/fp8_dense.py) decode through half precision: the code byte shifted into an fp16 bit pattern (sign kept by an
      arithmetic shift, bit 14 cleared) is the weight times 2^-8 exactly, subnormals included; one
      vcvtph2ps widens it; the 2^8 joins the block scale. Per block an FMA chain over its 32 weights,
      then one FMA with the scale (the scalar path's order: part sum, then times the scale); one row
      per call, so each thread reads one sequential stream (v0 reads 4 consecutive rows per call)

Measured (AMD EPYC Zen 4 VM, 2 threads, 4096 x 4096 matrices, 384 MiB bank, 5 interleaved rounds,
medians): v0 11.7 GB/s, v1 18.9 GB/s, DRAM probe 31.3 (v1 / probe 0.60); from L3 12.3 vs 22.5. The
decode alone (v1's decode with v0's 4 rows per call) moved nothing from DRAM (11.3 vs 10.8): on this
VM one stream per thread reads ~1.5x four (the DRAM probe's layouts say the same), and 1, 2 and 4 rows
per call measured 21.2 / 15.3 / 15.2 GB/s in one run. In L2 one thread runs 15.6 GB/s: compute
(vcvtph2ps and the FMA are double-pumped zmm ops on Zen 4) is the next limit.
"""
from __future__ import annotations

from llvmlite import ir
from numba import types
from numba.core import cgutils
from numba.extending import intrinsic

from kernels.fp4_simd import PREFETCH, _data_ptrs, _literal, _splat, _store_sums, f32, i8, i32, i64


def decode_e4m3_int(builder, c, lanes):
    """<lanes x i32> codes (0..255) -> <lanes x float> values."""
    vi, vf = ir.VectorType(i32, lanes), ir.VectorType(f32, lanes)

    def k(v):
        return ir.Constant(vi, [v] * lanes)
    norm = builder.bitcast(builder.add(builder.shl(builder.and_(c, k(0x7F)), k(20)), k(120 << 23)), vf)
    sub = builder.fmul(builder.sitofp(builder.and_(c, k(7)), vf), ir.Constant(vf, [2.0 ** -9] * lanes))
    is_sub = builder.icmp_unsigned("==", builder.and_(c, k(0x78)), k(0))
    mag = builder.select(is_sub, sub, norm)
    sign = builder.shl(builder.and_(c, k(0x80)), k(24))
    return builder.bitcast(builder.or_(builder.bitcast(mag, vi), sign), vf)


@intrinsic
def fp8_dot_v0(typingctx, R_t, T_t, lanes_t, q, q_off, q_stride, scales, s_off, s_stride, x, x_off, x_stride,
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
        vf, vb, vi = ir.VectorType(f32, lanes), ir.VectorType(i8, lanes), ir.VectorType(i32, lanes)
        qbase, sbase, xbase, tbase, obase = _data_ptrs(context, builder, at, args[3:], (0, 3, 6, 9, 12))
        fma = cgutils.get_or_insert_function(builder.module, ir.FunctionType(vf, [vf, vf, vf]), f"llvm.fma.v{lanes}f32")
        prefetch = cgutils.get_or_insert_function(
            builder.module, ir.FunctionType(ir.VoidType(), [i8.as_pointer(), i32, i32, i32]), "llvm.prefetch.p0i8")
        accs = [[cgutils.alloca_once(builder, vf) for _ in range(T)] for _ in range(R)]
        for row in accs:
            for a in row:
                builder.store(ir.Constant(vf, [0.0] * lanes), a)
        rows_q = [builder.add(q_off_v, builder.mul(q_stride_v, ir.Constant(i64, r))) for r in range(R)]
        rows_s = [builder.add(s_off_v, builder.mul(s_stride_v, ir.Constant(i64, r))) for r in range(R)]
        toks_x = [builder.add(x_off_v, builder.mul(x_stride_v, ir.Constant(i64, j))) for j in range(T)]
        with cgutils.for_range(builder, nb) as loop:
            b = loop.index
            kb = builder.mul(b, ir.Constant(i64, bk))
            svs = []
            for r in range(R):
                sb = builder.load(builder.gep(sbase, [builder.add(rows_s[r], b)]))
                svs.append(_splat(builder, builder.load(builder.gep(tbase, [builder.zext(sb, i64)])), lanes))
            for h in range(bk // lanes):
                k0 = builder.add(kb, ir.Constant(i64, h * lanes))
                xs = [builder.load(builder.bitcast(builder.gep(xbase, [builder.add(toks_x[j], k0)]), vf.as_pointer()), align=4)
                      for j in range(T)]
                for r in range(R):
                    qp = builder.gep(qbase, [builder.add(rows_q[r], k0)])
                    if h == 0:
                        builder.call(prefetch, [builder.gep(qp, [ir.Constant(i64, PREFETCH)]),
                                                ir.Constant(i32, 0), ir.Constant(i32, 3), ir.Constant(i32, 1)])
                    w = decode_e4m3_int(builder, builder.zext(builder.load(builder.bitcast(qp, vb.as_pointer()), align=1), vi), lanes)
                    for j in range(T):
                        p = builder.fmul(w, xs[j])
                        builder.store(builder.call(fma, [p, svs[r], builder.load(accs[r][j])]), accs[r][j])
        _store_sums(builder, accs, vf, lanes, obase, o_off_v, o_stride_v, or_stride_v)
        return context.get_dummy_value()
    return sig, codegen


# ---------------------------------------------------------------------------------------------- harness
def _gemv_v0_factory():
    from numba import njit, prange

    from kernels.cpu_moe import CACHE, LANES

    @njit(parallel=True, nogil=True, cache=CACHE)
    def gemv_v0(q, s, bn, bk, x, out, stab):
        N, K = q.shape
        T = x.shape[0]
        nb, sK = K // bk, s.shape[1]
        qf, sf, xf, of = q.reshape(-1), s.reshape(-1), x.reshape(-1), out.reshape(-1)
        for c in prange(N // 4):
            n0 = 4 * c
            if T == 1:
                fp8_dot_v0(4, 1, LANES, qf, n0 * K, K, sf, (n0 // bn) * sK, 0, xf, 0, K, stab, nb, 32, of, n0, N, 1)
            else:
                for j in range(T):
                    fp8_dot_v0(4, 1, LANES, qf, n0 * K, K, sf, (n0 // bn) * sK, 0, xf, j * K, K, stab, nb, 32, of, j * N + n0, N, 1)
    return gemv_v0


def main():
    import argparse
    import statistics
    import time

    import numpy as np
    import torch

    from kernels.cpu_moe import STAB
    from kernels.fp8_dense import Fp8Weight, _gemv_simd
    from kernels.stream import dram_stream_read
    from hostinfo import usable_cores

    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--mib", type=int, default=512, help="bank of weights (far above the LLC)")
    ap.add_argument("--rows", type=int, default=4096)
    ap.add_argument("--cols", type=int, default=4096)
    ap.add_argument("--rounds", type=int, default=5)
    a = ap.parse_args()
    rng = np.random.default_rng(0)
    N, K = a.rows, a.cols
    n_mat = max(1, a.mib * 2**20 // (N * K))
    codes = rng.integers(0, 256, (n_mat, N, K), dtype=np.uint8)
    codes[(codes & 0x7F) == 0x7F] = 0x10                                      # no NaN codes
    scales = rng.integers(120, 130, (n_mat, N // 128, K // 32), dtype=np.uint8)
    x = rng.standard_normal((1, K)).astype(np.float32)
    v0 = _gemv_v0_factory()
    w0 = Fp8Weight(codes[0], scales[0], (128, 32))
    ref = (torch.from_numpy(x).double() @ w0.reference().T).numpy()
    outs = {k: np.empty((1, N), np.float32) for k in ("v0", "v1")}
    runs = {"v0": lambda m, o: v0(codes[m], scales[m], 128, 32, x, o, STAB),
            "v1": lambda m, o: _gemv_simd(codes[m], scales[m], 128, 32, x, o, STAB)}
    for k, f in runs.items():
        f(0, outs[k])
        err = float(np.abs(outs[k] - ref).max() / np.abs(ref).max())
        print(f"{k}: max |err| / max |ref| vs float64 = {err:.2e}")
    samples = {k: [] for k in runs} | {"hot_" + k: [] for k in runs} | {"stream": []}
    for _ in range(a.rounds):
        samples["stream"].append(dram_stream_read(usable_cores(), repeats=1).median)
        for k, f in runs.items():
            t0 = time.perf_counter()
            for m in range(n_mat):
                f(m, outs[k])
            samples[k].append(n_mat * N * K / (time.perf_counter() - t0) / 1e9)
            t0 = time.perf_counter()
            for _ in range(20):
                f(0, outs[k])
            samples["hot_" + k].append(20 * N * K / (time.perf_counter() - t0) / 1e9)
    for k, v in samples.items():
        print(f"{k:8s} GB/s median {statistics.median(v):6.2f}  ({min(v):.2f}-{max(v):.2f})")


if __name__ == "__main__":
    main()
