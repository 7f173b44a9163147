"""An Engram layer's CPU work outside its two linears, one numba call each (the torch forms: ~8 small ops
for the rows, ~8 for the gate, 20-80 us each on a decode token after a layer's expert read).

  rows  x[j] = e4m3(codes[ids[j]]) * 2^(scales[ids[j], c // 32] - 127)   (FP8 rows, E8M0 per 32)
        each value an exact product: the same bits as kernels/formats.py dequantize_fp8_rows
  gate  out[t] = h[t] + g_t v[t],  g_t = sigmoid(<n(h[t]), n(k[t])> / sqrt(H)),  n = RMSNorm (no weight)
        n as kernels/norms.py rounds it; the dot in float64 over LANES partial sums in a fixed order
        (torch's form sums the float32 row in float32, in an order of its own), the sigmoid in float64,
        g_t rounded to h's dtype; g_t v and the sum rounded in turn as torch's elementwise ops round them
Each row's arithmetic depends on that row alone: the same bits whatever the batch beside it.
"""
from __future__ import annotations

import math

import numpy as np
from numba import njit

from kernels.cpu_moe import CACHE
from kernels.norms import LANES, _row


@njit(nogil=True, cache=CACHE)
def _rows(codes, scales, ids, lut, stab, out):
    D, G = codes.shape[1], codes.shape[1] // scales.shape[1]
    for j in range(ids.shape[0]):
        r = ids[j]
        for c in range(D):
            out[j, c] = np.float64(lut[codes[r, c]]) * np.float64(stab[scales[r, c // G]])


def rows(codes: np.ndarray, scales: np.ndarray, ids: np.ndarray, lut: np.ndarray, stab: np.ndarray, out: np.ndarray) -> np.ndarray:
    """codes uint8 [N, D] (E4M3), scales uint8 [N, D/32] (E8M0), ids int64 [n] -> out [n, D] (float32
    or float64); lut, stab: the E4M3 values and E8M0 powers (float32 [256])."""
    if codes.shape[1] % scales.shape[1] or ids.shape[0] != out.shape[0] or out.shape[1] != codes.shape[1]:
        raise ValueError(f"engram_gate.rows: codes {codes.shape}, scales {scales.shape}, ids {ids.shape}, out {out.shape}")
    _rows(codes, scales, ids, lut, stab, out)
    return out


@njit(nogil=True, cache=CACHE)
def _gate(h, k, v, eps, inv_sqrt_h, out):
    T, H = h.shape
    ones = np.ones(H, h.dtype)
    r = np.empty(T, h.dtype)
    nh, nk = np.empty((T, H), h.dtype), np.empty((T, H), h.dtype)
    acc, g = np.zeros(LANES), np.empty(1, h.dtype)
    for t in range(T):
        _row(h, ones, eps, r, nh, t)
        _row(k, ones, eps, r, nk, t)
        acc[:] = 0.0
        m = H - H % LANES
        for i in range(0, m, LANES):
            for j in range(LANES):
                acc[j] += np.float64(nh[t, i + j]) * np.float64(nk[t, i + j])
        dot = 0.0
        for j in range(LANES):
            dot += acc[j]
        for i in range(m, H):
            dot += np.float64(nh[t, i]) * np.float64(nk[t, i])
        g[0] = 1.0 / (1.0 + np.exp(-dot * inv_sqrt_h))          # rounded to h's dtype
        for i in range(H):
            out[t, i] = h[t, i] + g[0] * v[t, i]


def gate(h: np.ndarray, k: np.ndarray, v: np.ndarray, eps: float, out: np.ndarray) -> np.ndarray:
    """h, k, v [T, H] (one float dtype) -> out [T, H] = h + sigmoid(<n(h), n(k)> / sqrt(H)) v."""
    if not (h.shape == k.shape == v.shape == out.shape) or h.ndim != 2:
        raise ValueError(f"engram_gate.gate: h {h.shape}, k {k.shape}, v {v.shape}, out {out.shape}")
    _gate(h, k, v, eps, 1.0 / math.sqrt(h.shape[1]), out)
    return out
