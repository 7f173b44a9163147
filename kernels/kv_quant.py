"""The KV formats' quantizers (kernels/formats.py `quantize_fp4_e4m3`, `quantize_fp8_rowscale`) in one
numba call each: the same codes bit for bit (tests/kernels/test_kv_quant.py holds them to the torch
forms on random and hand-made inputs: ties, zeros, subnormal scales, values past E4M3's 448).

A decode token completes one compressed row per kv source (kv.py `Compressed.write`): one latent row
[1, C] to FP4 with E4M3 scales per 16, one index key [1, Di] to FP8 with a row scale. The torch forms
are ~20 small ops each: ~290 us a row in a loop on the Zen 2 VM and ~600 us in the decode step, about
as much as a layer's attention. Where numba cannot take the tensors (a GPU's, another dtype) or an
input is not finite (the torch forms raise, naming it), the callers get the torch forms.

`write_rows` does a kv source's whole write (the rows' means, both quantizers, the tail ring) in one
call: ~270 us a call in the mini decode as ~20 torch ops.

E4M3 (fn) from a float: round to nearest, ties to even, magnitudes past 448 saturate to 448 (what
torch's conversion does on the CPU), the sign kept (-0.0 -> 0x80).
"""
from __future__ import annotations

import math

import numpy as np
import torch
from numba import njit

from kernels.arrays import numba_ok
from kernels.cpu_moe import CACHE
from kernels.window_keys import _write
from kernels.formats import E2M1_MAX, E2M1_MIDPOINTS, E4M3_MAX, KV_FP4_GROUP, quantize_fp4_e4m3, quantize_fp8_rowscale

MIDPOINTS = E2M1_MIDPOINTS.numpy()          # between E2M1's magnitudes: a code counts those below |y| (bucketize's rule)
E4M3_F64 = torch.arange(256, dtype=torch.int32).to(torch.uint8).view(torch.float8_e4m3fn).to(torch.float64).numpy()


@njit(nogil=True, cache=CACHE, inline="always")
def _rne(m):
    r = math.floor(m)
    f = m - r
    if f > 0.5 or (f == 0.5 and r % 2 == 1):
        r += 1
    return int(r)


@njit(nogil=True, cache=CACHE)
def e4m3_code(v):
    """float64 v (finite) -> its E4M3 byte: nearest, ties to even, saturating at 448, sign kept."""
    sign = 0x80 if math.copysign(1.0, v) < 0 else 0
    a = abs(v)
    if a >= 448.0:
        return sign | 126
    if a < 2.0 ** -6:                                     # subnormals: steps of 2^-9 (8 -> the first normal)
        return sign | _rne(a * 512.0)
    f, e = math.frexp(a)                                  # a = f 2^e, f in [0.5, 1)
    code = (e - 1 + 7) * 8 + _rne((2.0 * f - 1.0) * 8.0)  # a carry of the mantissa lands in the exponent
    return sign | min(code, 126)


@njit(nogil=True, cache=CACHE)
def _fp4_e4m3(x, codes, scales, table, mids):
    """x [R, K] -> codes [R, K/2] (E2M1 pairs, low nibble first), scales [R, K/16] (E4M3 bytes); the
    arithmetic of formats.quantize_fp4_e4m3 (float64 divides, the scale through float32)."""
    R, K = x.shape
    G = K // 16
    for r in range(R):
        for g in range(G):
            amax = 0.0
            for i in range(16):
                amax = max(amax, abs(np.float64(x[r, g * 16 + i])))
            sc = e4m3_code(np.float64(np.float32(amax / 6.0)))
            scales[r, g] = sc
            s = table[sc]
            for i in range(0, 16, 2):
                pair = 0
                for h in range(2):
                    y = np.float64(x[r, g * 16 + i + h]) / s if s > 0 else 0.0
                    a = min(abs(y), 6.0)
                    c = 0
                    for m in mids:
                        if m < a:
                            c += 1
                    if y < 0 and c > 0:
                        c |= 8
                    pair |= c << (4 * h)
                codes[r, (g * 16 + i) // 2] = pair


@njit(nogil=True, cache=CACHE)
def _fp8_rowscale(x, codes, scale):
    """x [R, D] -> codes [R, D] (E4M3 bytes of x / s), scale [R] = amax / 448 (float32 arithmetic)."""
    R, D = x.shape
    for r in range(R):
        amax = 0.0
        for i in range(D):
            amax = max(amax, abs(np.float64(x[r, i])))
        s = np.float32(amax) / np.float32(448.0)
        scale[r] = s
        d = s if s > 0 else np.float32(1.0)
        for i in range(D):
            codes[r, i] = e4m3_code(np.float64(np.float32(x[r, i]) / d))


@njit(nogil=True, cache=CACHE)
def _finite(x):
    for v in x.ravel():
        if not math.isfinite(v):
            return False
    return True


def _rows(x: torch.Tensor):
    """x as a C-contiguous float32 numpy matrix, or None where the torch form must run (another
    device, dtype or rank; a value not finite: the torch form names it)."""
    if x.dim() != 2 or x.dtype != torch.float32 or not numba_ok(x):
        return None
    xn = np.ascontiguousarray(x.numpy())
    return xn if _finite(xn) else None


def fp4_e4m3(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """formats.quantize_fp4_e4m3 of x [R, K], in one call where numba can take x."""
    xn = _rows(x)
    if xn is None or x.shape[1] % KV_FP4_GROUP:
        return quantize_fp4_e4m3(x)
    R, K = xn.shape
    codes, scales = torch.empty(R, K // 2, dtype=torch.uint8), torch.empty(R, K // KV_FP4_GROUP, dtype=torch.uint8)
    _fp4_e4m3(xn, codes.numpy(), scales.numpy(), E4M3_F64, MIDPOINTS)
    return codes, scales


def fp8_rowscale(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """formats.quantize_fp8_rowscale of x [R, D], in one call where numba can take x."""
    xn = _rows(x)
    if xn is None:
        return quantize_fp8_rowscale(x)
    codes, scale = torch.empty(xn.shape, dtype=torch.uint8), torch.empty(xn.shape[0], dtype=torch.float32)
    _fp8_rowscale(xn, codes.numpy(), scale.numpy())
    return codes, scale


@njit(nogil=True, cache=CACHE)
def _row_means(t_lat, t_ik, t_pos, pos, lat, ik, r, g0, g1, ml, mi):
    """Rows g0..g1-1's means of their r positions (float64 sums in position order, / r, rounded to
    float32): positions before pos[0] from the tail ring (t_pos: each slot's position), the others from
    lat, ik. -> False where the ring no longer holds one."""
    p0, R = pos[0], t_pos.shape[0]
    for g in range(g0, g1):
        acc_l, acc_i = np.zeros(lat.shape[1]), np.zeros(ik.shape[1])
        for q in range(g * r, g * r + r):
            if q < p0:
                s = q % R
                if t_pos[s] != q:
                    return False
                for c in range(acc_l.shape[0]):
                    acc_l[c] += t_lat[s, c]
                for c in range(acc_i.shape[0]):
                    acc_i[c] += t_ik[s, c]
            else:
                for c in range(acc_l.shape[0]):
                    acc_l[c] += lat[q - p0, c]
                for c in range(acc_i.shape[0]):
                    acc_i[c] += ik[q - p0, c]
        for c in range(acc_l.shape[0]):
            ml[g - g0, c] = acc_l[c] / r
        for c in range(acc_i.shape[0]):
            mi[g - g0, c] = acc_i[c] / r
    return True


@njit(nogil=True, cache=CACHE)
def _write_rows(t_lat, t_ik, t_pos, pos, lat, ik, r, lat_codes, lat_scales, ik_codes, ik_scale, table, mids):
    g0, g1 = pos[0] // r, (pos[-1] + 1) // r
    if g1 > g0:
        ml, mi = np.empty((g1 - g0, lat.shape[1]), np.float32), np.empty((g1 - g0, ik.shape[1]), np.float32)
        if not _row_means(t_lat, t_ik, t_pos, pos, lat, ik, r, g0, g1, ml, mi):
            return -1
        if not (_finite(ml) and _finite(mi)):
            return -2
        _fp4_e4m3(ml, lat_codes[g0:g1], lat_scales[g0:g1], table, mids)
        _fp8_rowscale(mi, ik_codes[g0:g1], ik_scale[g0:g1])
    _write(t_lat, t_ik, t_pos, pos, lat, ik)
    return 0


def write_rows(tail: tuple, pos: np.ndarray, lat: np.ndarray, ik: np.ndarray, r: int, lat_rows: tuple, ik_rows: tuple) -> bool:
    """A kv source's write on the CPU in one call (runtime/model/kv.py Compressed.write): positions pos
    [T] (contiguous) with latents lat [T, C] and index keys ik [T, Di] (float32); every row whose last
    position is among them gets the mean of its r positions (`_row_means`), quantized as
    `fp4_e4m3` / `fp8_rowscale` into lat_rows = (codes, scales), ik_rows = (codes, scale); then the
    positions go into the tail ring = (latents, keys, positions). -> False, nothing written, where the
    ring lost a position or a mean is not finite: the torch form then runs (and names which)."""
    return _write_rows(*tail, pos, lat, ik, r, *lat_rows, *ik_rows, E4M3_F64, MIDPOINTS) == 0


assert E2M1_MAX == 6.0 and E4M3_MAX == 448.0 and KV_FP4_GROUP == 16   # the constants the loops above spell out
