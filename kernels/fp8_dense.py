"""Dense linears in FP8 E4M3 with E8M0 block scales, computed without a full-precision copy (numba).

  y [T, N] = x [T, K] @ W.T,  W [N, K] = e4m3(q) * 2^(s[n // bn, k // bk] - 127)

The weights stay as the checkpoint stores them (1 B per weight + one scale byte per bn x bk block):
4x fewer bytes held, and read per decode step, than float32 copies.
  T < TILE_MIN_TOKENS   GEMV: `fp8_dot` (kernels/fp8_simd.py) decodes each row in registers, one row
                        per call (each thread one sequential stream), up to 4 inputs per decode;
                        fixed summation order (bit-identical for any thread count, and a token's
                        output is the same alone or in a batch)
  T >= TILE_MIN_TOKENS  prefill widths: TILE_ROWS rows at a time decoded into a float32 tile (in
                        cache) and multiplied with torch; never the whole matrix
The scalar ISA (and shapes whose K is not a multiple of the block) take a plain loop with the same
arithmetic order per block. `Fp8Weight.reference()` is the plain dequantization tests compare with.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch
from numba import njit, prange

from kernels.cpu_moe import CACHE, LANES, STAB
from kernels.fp8_simd import fp8_dequant, fp8_dot
from kernels.threads import set_threads

TILE_MIN_TOKENS = 16
TILE_ROWS = 256
E4M3 = torch.arange(256, dtype=torch.int32).to(torch.uint8).view(torch.float8_e4m3fn).to(torch.float32).numpy()


@dataclass(frozen=True)
class Fp8Weight:
    q: np.ndarray            # uint8 [N, K]: E4M3 codes
    scale: np.ndarray        # uint8 [ceil(N / bn), ceil(K / bk)]: E8M0
    block: tuple             # (bn, bk)

    def __post_init__(self):
        N, K = self.q.shape
        bn, bk = self.block
        want = (-(-N // bn), -(-K // bk))
        if self.q.dtype != np.uint8 or self.scale.dtype != np.uint8 or self.scale.shape != want:
            raise ValueError(f"Fp8Weight: q {self.q.dtype}{self.q.shape}, scale {self.scale.dtype}{self.scale.shape}; "
                             f"expected uint8 codes and uint8 scales of shape {want} for {bn}x{bk} blocks")
        if not (self.q.flags.c_contiguous and self.scale.flags.c_contiguous):
            raise ValueError("Fp8Weight: codes and scales must be C-contiguous")

    @property
    def shape(self) -> tuple:
        return self.q.shape

    @property
    def nbytes(self) -> int:
        return self.q.nbytes + self.scale.nbytes

    def reference(self, dtype=torch.float64) -> torch.Tensor:
        from kernels.formats import dequantize_fp8_block
        return dequantize_fp8_block(torch.from_numpy(self.q).view(torch.float8_e4m3fn), torch.from_numpy(self.scale),
                                    self.block, dtype)


@njit(parallel=True, nogil=True, cache=CACHE)
def _gemv_simd(q, s, bn, bk, x, out, stab):
    """SIMD path (K % bk == 0, bk % LANES == 0): one row per call, inputs in blocks of up to 4. Each
    thread walks its contiguous range of rows in order: one sequential DRAM stream per thread (4 rows
    per call read as 4 page streams ran 0.7x as fast: kernels/lab/fp8_gemv_variants.py)."""
    N, K = q.shape
    T = x.shape[0]
    nb, sK = K // bk, s.shape[1]
    qf, sf, xf, of = q.reshape(-1), s.reshape(-1), x.reshape(-1), out.reshape(-1)
    for n in prange(N):
        j = 0
        while j < T:
            left = T - j
            if left >= 4:
                fp8_dot(1, 4, LANES, qf, n * K, K, sf, (n // bn) * sK, 0, xf, j * K, K, stab, nb, 32, of, j * N + n, N, 1)
                j += 4
            elif left == 3:
                fp8_dot(1, 3, LANES, qf, n * K, K, sf, (n // bn) * sK, 0, xf, j * K, K, stab, nb, 32, of, j * N + n, N, 1)
                j += 3
            elif left == 2:
                fp8_dot(1, 2, LANES, qf, n * K, K, sf, (n // bn) * sK, 0, xf, j * K, K, stab, nb, 32, of, j * N + n, N, 1)
                j += 2
            else:
                fp8_dot(1, 1, LANES, qf, n * K, K, sf, (n // bn) * sK, 0, xf, j * K, K, stab, nb, 32, of, j * N + n, N, 1)
                j += 1


@njit(parallel=True, nogil=True, cache=CACHE)
def _gemv_scalar(q, s, bn, bk, x, out, lut, stab):
    """Plain loops: per block an fp32 sum of code * input, times the block scale, summed over blocks."""
    N, K = q.shape
    T = x.shape[0]
    for n in prange(N):
        for t in range(T):
            acc = np.float32(0.0)
            for b in range(-(-K // bk)):
                part = np.float32(0.0)
                for k in range(b * bk, min(K, (b + 1) * bk)):
                    part += lut[q[n, k]] * x[t, k]
                acc += part * stab[s[n // bn, b]]
            out[t, n] = acc


@njit(parallel=True, nogil=True, cache=CACHE)
def _dequant_rows(q, s, bn, bk, r0, out, lut, stab):
    """out[i, :] = row r0 + i of W as float32 (scalar path)."""
    R, K = out.shape
    for i in prange(R):
        n = r0 + i
        for k in range(K):
            out[i, k] = lut[q[n, k]] * stab[s[n // bn, k // bk]]


@njit(parallel=True, nogil=True, cache=CACHE)
def _dequant_rows_simd(q, s, bn, bk, r0, out, stab):
    """The same, decoded in registers (K % bk == 0, bk == 32)."""
    R, K = out.shape
    sK = s.shape[1]
    qf, sf, of = q.reshape(-1), s.reshape(-1), out.reshape(-1)
    for i in prange(R):
        n = r0 + i
        fp8_dequant(LANES, qf, n * K, sf, (n // bn) * sK, stab, K // bk, 32, of, i * K)


def simd_ok(w: Fp8Weight) -> bool:
    bk = w.block[1]
    return LANES > 0 and bk == 32 and w.q.shape[1] % bk == 0


def fp8_linear(x: torch.Tensor, w: Fp8Weight, threads: int | None = None) -> torch.Tensor:
    """x [T, K] (any float dtype, CPU) -> float32 [T, N]."""
    T, K = x.shape
    N, Kw = w.q.shape
    if K != Kw:
        raise ValueError(f"fp8_linear: x has {K} inputs, the weight is {N}x{Kw}")
    set_threads(threads)
    xf = np.ascontiguousarray(x.detach().to(torch.float32).numpy())
    bn, bk = w.block
    if T < TILE_MIN_TOKENS:
        out = np.empty((T, N), np.float32)
        if simd_ok(w):
            _gemv_simd(w.q, w.scale, bn, bk, xf, out, STAB)
        else:
            _gemv_scalar(w.q, w.scale, bn, bk, xf, out, E4M3, STAB)
        return torch.from_numpy(out)
    xt, y = torch.from_numpy(xf), torch.empty(T, N)
    tile = np.empty((min(TILE_ROWS, N), K), np.float32)
    for r0 in range(0, N, TILE_ROWS):
        r = min(TILE_ROWS, N - r0)
        if simd_ok(w):
            _dequant_rows_simd(w.q, w.scale, bn, bk, r0, tile[:r], STAB)
        else:
            _dequant_rows(w.q, w.scale, bn, bk, r0, tile[:r], E4M3, STAB)
        y[:, r0:r0 + r] = xt @ torch.from_numpy(tile[:r]).T
    return y
