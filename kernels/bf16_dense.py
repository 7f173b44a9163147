"""BF16 linears (the LM head, the MoE routers, the indexer's head weights) computed from the weights as
stored: 2 B per weight read per decode step, not the 4 B of a float32 copy.

  y [T, N] = x [T, K] @ W.T,  W [N, K] BF16 (held as uint16), x and y float32

A BF16 value is the top half of its float32: widening is a 16-bit shift, exact. So every product is
the float32 one; only the order of the sums is the kernel's own.
  GEMV                  `bf16_dot` (below) widens each row in registers, one row per call (each
                        thread one sequential stream), up to 4 inputs per widening; UNROLL vector
                        accumulators per (row, input), added in a fixed order (bit-identical for any
                        thread count, and a token's output is the same alone or in a batch). At decode
                        widths (T < TILE_MIN_TOKENS), and at every width for a matrix of at most
                        GEMV_ANY_WIDTH_BYTES (the routers: a token's routing must not depend on how many
                        tokens share its pass; the matrix stays in cache, so re-reading it per 4 inputs
                        costs compute, not DRAM)
  tiles                 wide calls on large matrices (the LM head at prefill), hosts without SIMD, K not
                        a multiple of the unrolled width: TILE_ROWS rows widened into a float32 tile with
                        torch and multiplied there; never the whole matrix
Roofline (V4.1, a CPU host): the head is 129280 x 5120, 1.32 GB per decoded token here against 2.65 GB
as a float32 copy; the 43 routers 0.16 GB against 0.31 GB.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch
from llvmlite import ir
import numba
from numba import njit, prange, types
from numba.core import cgutils
from numba.extending import intrinsic

from kernels.cpu_moe import CACHE, LANES
from kernels.fp4_simd import _data_ptrs, _fma_prefetch, _literal, _store_sums, _zeroed_accs, f32, i8, i32, i64, prefetch_weights
from kernels.threads import set_threads

TILE_MIN_TOKENS = 16
TILE_ROWS = 256
GEMV_ANY_WIDTH_BYTES = 8 << 20     # V4.1's router is 2.6 MB; its head 1.3 GB
UNROLL = 4                         # independent FMA chains per (row, input): latency hidden (a power of 2)
# Each weight line is prefetched into L2 16 KiB ahead (`prefetch_weights`) and into L1 this many bytes ahead (< 1:
# none; read when the kernel is emitted): the CPU-MoE kernel's "far" fetching (kernels/fp4_lanes.py). AMX Xeon VM, a
# 2048 x 5120 head over copies spanning 4x the LLC, 2 threads, 6 interleaved rounds, ratios to the stream: the L2
# prefetch on every other line (one a 128-byte chunk on AVX-512, as it was) 0.59, plus this 0.71; on every line 0.81,
# plus this 0.88 (the AVX2 path's 64-byte chunks always had one a line: 0.70-0.71 with or without this). Those are
# copies compiled in the process; loaded from numba's cache the loop over rows read 0.48 before and 0.57-0.68 after,
# the loop over thread ranges (`_gemv_simd`) 0.75-0.90 (kernels/lab/README.md, "a sixth time").
# The FP8 GEMV gained nothing from it there (0.54-0.60 either way: its compute rate, about one thread's DRAM reach,
# is its limit: kernels/lab/README.md, "a sixth time").
L1_AHEAD = 4096


@dataclass(frozen=True)
class Bf16Weight:
    bits: np.ndarray         # uint16 [N, K]: the BF16 values' bits, as stored

    def __post_init__(self):
        if self.bits.dtype != np.uint16 or self.bits.ndim != 2 or not self.bits.flags.c_contiguous:
            raise ValueError(f"Bf16Weight: expected C-contiguous uint16 [N, K] bits, got {self.bits.dtype}{self.bits.shape}")

    @classmethod
    def from_tensor(cls, t: torch.Tensor) -> "Bf16Weight":
        """A BF16 tensor -> its bits in a fresh (anonymous) array."""
        if t.dtype != torch.bfloat16:
            raise ValueError(f"Bf16Weight.from_tensor: expected bfloat16, got {t.dtype}")
        return cls(np.array(t.contiguous().view(torch.int16).numpy().view(np.uint16)))

    @property
    def shape(self) -> tuple:
        return self.bits.shape

    @property
    def nbytes(self) -> int:
        return self.bits.nbytes

    def tensor(self) -> torch.Tensor:
        """The weight as a BF16 tensor (a view of the bits)."""
        return torch.from_numpy(self.bits.view(np.int16)).view(torch.bfloat16)

    def reference(self, dtype=torch.float64) -> torch.Tensor:
        return self.tensor().to(dtype)


@intrinsic
def bf16_dot(typingctx, T_t, lanes_t, w, w_off, nchunks, x, x_off, x_stride, out, o_off, o_stride):
    """bf16_dot(T, lanes, w, w_off, nchunks, x, x_off, x_stride, out, o_off, o_stride) (T, lanes literals):
    out[o_off + j*o_stride] = sum_k f32(w[w_off + k]) * x[x_off + j*x_stride + k] over k < nchunks *
    UNROLL * lanes, j < T: each chunk widens UNROLL vectors of the row once for all T inputs, one FMA chain
    per vector; the chains are added pairwise ((0 + 1) + (2 + 3)), then one ordered reduction. Each of a chunk's
    lines is prefetched into L2 16 KiB ahead and into L1 L1_AHEAD bytes ahead."""
    T, lanes = _literal(T_t), _literal(lanes_t)
    if None in (T, lanes):
        return None
    if lanes not in (8, 16):
        raise TypeError("lanes must be 8 (AVX2) or 16 (AVX-512)")
    sig = types.void(T_t, lanes_t, w, w_off, nchunks, x, x_off, x_stride, out, o_off, o_stride)

    def codegen(context, builder, signature, args):
        _, _, _, w_off_v, nc, _, x_off_v, x_stride_v, _, o_off_v, o_stride_v = args
        vf, vh, vi = ir.VectorType(f32, lanes), ir.VectorType(ir.IntType(16), lanes), ir.VectorType(i32, lanes)
        wbase, xbase, obase = _data_ptrs(context, builder, signature.args, args, (2, 5, 8))
        fma, prefetch = _fma_prefetch(builder, vf, lanes)
        accs = _zeroed_accs(builder, vf, T, UNROLL)
        toks_x = [builder.add(x_off_v, builder.mul(x_stride_v, ir.Constant(i64, j))) for j in range(T)]
        sixteen = ir.Constant(vi, [16] * lanes)
        with cgutils.for_range(builder, nc) as loop:
            k0 = builder.mul(loop.index, ir.Constant(i64, UNROLL * lanes))
            wp0 = builder.gep(wbase, [builder.add(w_off_v, k0)])
            for line in range(0, UNROLL * lanes * 2, 64):                # each of the chunk's lines: into L2, and L1
                at = builder.gep(builder.bitcast(wp0, i8.as_pointer()), [ir.Constant(i64, line)])
                prefetch_weights(builder, prefetch, at)
                if L1_AHEAD > 0:
                    builder.call(prefetch, [builder.gep(at, [ir.Constant(i64, L1_AHEAD)]), ir.Constant(i32, 0), ir.Constant(i32, 3),
                                            ir.Constant(i32, 1)])
            for u in range(UNROLL):
                k = builder.add(k0, ir.Constant(i64, u * lanes))
                wp = builder.gep(wbase, [builder.add(w_off_v, k)])
                bits = builder.load(builder.bitcast(wp, vh.as_pointer()), align=2)
                wv = builder.bitcast(builder.shl(builder.zext(bits, vi), sixteen), vf)     # exact widening
                for j in range(T):
                    xp = builder.bitcast(builder.gep(xbase, [builder.add(toks_x[j], k)]), vf.as_pointer())
                    builder.store(builder.call(fma, [wv, builder.load(xp, align=4), builder.load(accs[j][u])]), accs[j][u])
        sums = []
        for j in range(T):
            a = [builder.load(p) for p in accs[j]]
            while len(a) > 1:                                          # pairwise: (0 + 1) + (2 + 3)
                a = [builder.fadd(a[i], a[i + 1]) for i in range(0, len(a), 2)]
            sums.append([cgutils.alloca_once_value(builder, a[0])])
        _store_sums(builder, list(zip(*sums)), vf, lanes, obase, o_off_v, o_stride_v, ir.Constant(i64, 0))
        return context.get_dummy_value()
    return sig, codegen


@njit(nogil=True, cache=CACHE, inline="always")
def _row(wf, xf, of, n, N, K, T, nc):
    """Row n against the T inputs, up to 4 a widening."""
    j = 0
    while j < T:
        left = T - j
        if left >= 4:
            bf16_dot(4, LANES, wf, n * K, nc, xf, j * K, K, of, j * N + n, N)
            j += 4
        elif left == 3:
            bf16_dot(3, LANES, wf, n * K, nc, xf, j * K, K, of, j * N + n, N)
            j += 3
        elif left == 2:
            bf16_dot(2, LANES, wf, n * K, nc, xf, j * K, K, of, j * N + n, N)
            j += 2
        else:
            bf16_dot(1, LANES, wf, n * K, nc, xf, j * K, K, of, j * N + n, N)
            j += 1


@njit(parallel=True, nogil=True, cache=CACHE)
def _gemv_simd(w, x, out, nt):
    """Each of nt threads (numba's count, passed in: reading it here would keep the kernel from numba's cache)
    its contiguous range of rows in order, one DRAM stream; inputs in groups of <= 4. Not numba's loop over
    rows: loaded from numba's cache that loop read the head at 0.57-0.68 of the stream on the AMX Xeon VM where
    the same code compiled in the process read 0.73-0.87; this one reads 0.78 compiled, 0.78-0.90 cached
    (kernels/lab/README.md, "a sixth time"). The same rows, so the same bits, at any split."""
    N, K = w.shape
    nc = K // (UNROLL * LANES)
    wf, xf, of = w.reshape(-1), x.reshape(-1), out.reshape(-1)
    for t in prange(nt):
        for n in range(N * t // nt, N * (t + 1) // nt):
            _row(wf, xf, of, n, N, K, x.shape[0], nc)


def simd_ok(w: Bf16Weight) -> bool:
    return LANES > 0 and w.shape[1] % (UNROLL * LANES) == 0


def bf16_linear(x: torch.Tensor, w: Bf16Weight, threads: int | None = None) -> torch.Tensor:
    """x [T, K] (any float dtype, CPU) -> float32 [T, N]."""
    T, K = x.shape
    N, Kw = w.shape
    if K != Kw:
        raise ValueError(f"bf16_linear: x has {K} inputs, the weight is {N}x{Kw}")
    xf = x.detach().to(torch.float32).contiguous()
    if (T < TILE_MIN_TOKENS or w.nbytes <= GEMV_ANY_WIDTH_BYTES) and simd_ok(w):
        set_threads(threads)
        out = np.empty((T, N), np.float32)
        _gemv_simd(w.bits, xf.numpy(), out, numba.get_num_threads())
        return torch.from_numpy(out)
    wt, y = w.tensor(), torch.empty(T, N)
    tile = torch.empty(min(TILE_ROWS, N), K)
    for r0 in range(0, N, TILE_ROWS):
        r = min(TILE_ROWS, N - r0)
        tile[:r].copy_(wt[r0:r0 + r])                              # widened in cache, never the whole matrix
        y[:, r0:r0 + r] = xf @ tile[:r].T
    return y
