"""RMSNorm and RoPE on the CPU, one numba call each (torch's forms are 6 and ~10 small ops, each ~5-15 us
on a decode token's row).

  y[t] = x[t] * r_t * w,   r_t = 1 / sqrt(mean(x[t]^2) + eps)
The sum of squares is accumulated in float64 over LANES partial sums in a fixed order (torch sums
float32 rows in float32), r_t is rounded to
x's dtype, then the two products are rounded in turn as torch rounds them. Each row's arithmetic
depends on that row alone: the same bits whatever the batch beside it or the thread count.
"""
from __future__ import annotations

import numpy as np
from numba import njit, prange

from kernels.cpu_moe import CACHE


RMS_EPS = 1e-6             # RMSNorm's eps where the model gives none (the Engram gate's norms)
LANES = 8                  # independent float64 partial sums (a fixed order: the same bits on every host)
PARALLEL_ROWS = 16         # rows from which the rows are split over threads (the same per-row arithmetic)


@njit(nogil=True, cache=CACHE, inline="always")
def _row(x, w, eps, r, out, t):
    H = x.shape[1]
    acc = np.zeros(LANES)
    m = H - H % LANES
    for i in range(0, m, LANES):
        for j in range(LANES):
            v = np.float64(x[t, i + j])
            acc[j] += v * v
    ss = 0.0
    for j in range(LANES):
        ss += acc[j]
    for i in range(m, H):
        v = np.float64(x[t, i])
        ss += v * v
    r[t] = 1.0 / np.sqrt(ss / H + eps)
    for i in range(H):
        out[t, i] = x[t, i] * r[t] * w[i]


@njit(nogil=True, cache=CACHE)
def _rows(x, w, eps, r, out):
    for t in range(x.shape[0]):
        _row(x, w, eps, r, out, t)


@njit(parallel=True, nogil=True, cache=CACHE)
def _rows_parallel(x, w, eps, r, out):
    for t in prange(x.shape[0]):
        _row(x, w, eps, r, out, t)


def rmsnorm(x: np.ndarray, w: np.ndarray | None, eps: float, out: np.ndarray) -> np.ndarray:
    """x [T, H] float32 or float64, w [H] (None: ones) -> out [T, H] (x's dtype)."""
    if w is None:
        w = np.ones(x.shape[1], x.dtype)
    (_rows_parallel if x.shape[0] >= PARALLEL_ROWS else _rows)(x, w, eps, np.empty(x.shape[0], x.dtype), out)
    return out


@njit(nogil=True, cache=CACHE)
def _rope(x, cos, sin, out):
    T, Hd, D = x.shape
    d = D // 2
    for t in range(T):
        for h in range(Hd):
            for c in range(d):
                x1, x2 = x[t, h, c], x[t, h, d + c]
                out[t, h, c] = x1 * cos[t, c] - x2 * sin[t, c]
                out[t, h, d + c] = x2 * cos[t, c] + x1 * sin[t, c]


def rope(x: np.ndarray, cos: np.ndarray, sin: np.ndarray, out: np.ndarray) -> np.ndarray:
    """Rotate-half RoPE: x [T, heads, D] with tables cos, sin [T, D/2] (x's dtype) -> out. Each product
    and sum rounded as torch's elementwise form rounds it (no fused multiply-add): the same bits."""
    _rope(x, cos, sin, out)
    return out


@njit(nogil=True, cache=CACHE)
def _rope_tables(pos, inv_freq, cos, sin):
    for t in range(pos.shape[0]):
        a = np.float64(pos[t])
        for c in range(inv_freq.shape[0]):
            ang = a * inv_freq[c]
            cos[t, c] = np.cos(ang)
            sin[t, c] = np.sin(ang)


def rope_tables(pos: np.ndarray, inv_freq: np.ndarray, cos: np.ndarray, sin: np.ndarray) -> None:
    """RoPE's tables of integer positions pos [T]: angle = pos x inv_freq [d] in float64, its cosine and
    sine (the C library's) rounded to the outputs' dtype: cos, sin [T, d]. Every CPU path (prefill
    chunks, decode steps, selected rows) takes its tables here, so they agree to the bit."""
    _rope_tables(pos, inv_freq, cos, sin)
