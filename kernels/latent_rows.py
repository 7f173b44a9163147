"""A decode query's selected compressed rows, dequantized and roped in one numba call (CPU).

Row g of a kv source holds its latent as FP4 E2M1 codes [C/2] (low nibble first) with one E4M3 scale
per 16 channels (runtime/model/kv.py). For rows[i]: V[i] = the latent (each value an exact E2M1 x
E4M3 product, as kernels/formats.py dequantize_fp4_e4m3 gives it), K[i] = its rotate-half RoPE with the
tables (cos, sin) [n, C/2] of its position: x1 cos - x2 sin, x2 cos + x1 sin, each product and sum
rounded in the tables' dtype as torch's elementwise ops round them (no fused multiply-add). Both are
then the same bits as the torch form (tests/kernels/test_latent_rows.py), so prefill and decode see
the same keys.
"""
from __future__ import annotations

import numpy as np
import torch
from numba import njit

from kernels.cpu_moe import CACHE
from kernels.formats import KV_FP4_GROUP, _e2m1_pairs
from kernels.indexer_top import E4M3

PAIRS = _e2m1_pairs(torch.float64, "cpu").numpy()       # [256, 2] a code byte's two values


@njit(nogil=True, cache=CACHE)
def _rows(codes, scales, rows, pairs, e4m3, group, cos, sin, K, V):
    half = codes.shape[1]
    for i in range(rows.shape[0]):
        g = rows[i]
        for b in range(half):
            s = e4m3[scales[g, (2 * b) // group]]
            c = codes[g, b]
            V[i, 2 * b] = pairs[c, 0] * s
            V[i, 2 * b + 1] = pairs[c, 1] * s
        for c in range(half):
            x1, x2 = V[i, c], V[i, half + c]
            K[i, c] = x1 * cos[i, c] - x2 * sin[i, c]
            K[i, half + c] = x2 * cos[i, c] + x1 * sin[i, c]


def selected(codes: np.ndarray, scales: np.ndarray, rows: np.ndarray, cos: np.ndarray, sin: np.ndarray,
             K: np.ndarray, V: np.ndarray) -> None:
    """codes [N, C/2], scales [N, C/16] uint8; rows [n] int64; cos, sin [n, C/2]; K, V [n, C] (out)."""
    _rows(codes, scales, rows, PAIRS, E4M3, KV_FP4_GROUP, cos, sin, K, V)
