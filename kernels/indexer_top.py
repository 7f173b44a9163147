"""The indexer's steps around its matmul on the CPU, in numba calls instead of torch's small ops.

  index_keys: E4M3 codes [t, Di] x a float32 scale per row -> keys in float32 or float64, through a
         table of the 256 codes' exact values: the same bits as torch's float8 conversion times the
         scale (an exact float32 x float32 product is rounded once either way), ~10x faster here.
For one decode query:

An index layer scores visible compressed row j as sum_h w_h relu(qi_h . ik_j) (runtime/model/attention.py
`select`).
  weigh: score[j0 + j] = sum over h in order of relu(act[h, j]) x w_h    (float32 or float64, as given)
         (act [Hi, t] the products qi . ik of a tile of keys, a BLAS matmul: wide forwards)
  top:   the k best rows, best first, ties to the lower row (a stable sort of -score, as torch's stable
         descending sort orders them), and whether each score is finite (a NaN score sorts last here,
         first in torch's sort; either way it is not `ok`).
  select_one: all of it for one query in one call, no tile: each row's key dequantized as index_keys
         does (rounded to the dtype), each act = qi_h . ik_j summed in float64 in the vector order the
         compiler picks (fast-math `reassoc` alone) and rounded to the dtype, then weigh and top as
         above. ~30 us against ~190 us for the tiled form's five calls and a matmul on mini's decode
         token here; its scores differ from the matmul's by the summation order only.
"""
from __future__ import annotations

import numpy as np
import torch
from numba import njit

from kernels.cpu_moe import CACHE

E4M3 = torch.arange(256, dtype=torch.int32).to(torch.uint8).view(torch.float8_e4m3fn).to(torch.float64).numpy()


@njit(nogil=True, cache=CACHE)
def _index_keys(codes, scale, lut, out):
    for j in range(codes.shape[0]):
        s = np.float64(scale[j])
        for c in range(codes.shape[1]):
            out[j, c] = lut[codes[j, c]] * s


def index_keys(codes: np.ndarray, scale: np.ndarray, out: np.ndarray) -> np.ndarray:
    """codes [t, Di] uint8 E4M3 bits, scale [t] float32 -> out [t, Di] (float32 or float64)."""
    return _index_keys(codes, scale, E4M3, out)


@njit(nogil=True, cache=CACHE)
def weigh(act, wh, score, j0):
    """act [Hi, t], wh [Hi] -> score[j0:j0+t] (overwritten)."""
    Hi, t = act.shape
    for j in range(t):
        score[j0 + j] = 0
    for h in range(Hi):
        w = wh[h]
        for j in range(t):
            a = act[h, j]
            if a > 0 or a != a:                                 # relu(a) x w (NaN kept); a zero adds nothing
                score[j0 + j] += a * w
    return score


@njit(nogil=True, cache=CACHE, fastmath={"reassoc"})
def _acts(codes, scale, lut, j, qi, key, act):
    """act[h] = qi[h] . key_j (float64 sums, then the dtype), key = row j's dequantized index key."""
    s = np.float64(scale[j])
    for c in range(codes.shape[1]):
        key[c] = lut[codes[j, c]] * s
    for h in range(qi.shape[0]):
        v = 0.0
        for c in range(codes.shape[1]):
            v += np.float64(qi[h, c]) * np.float64(key[c])
        act[h, 0] = v


@njit(nogil=True, cache=CACHE)
def select_one(codes, scale, lut, qi, wh, score, k, idx, ok):
    """One query over rows 0..n-1 (n = len(score)): codes [>=n, Di] uint8, scale [>=n] float32, qi
    [Hi, Di], wh [Hi] -> score [n] (overwritten), the top k (k <= n) into idx [k], ok [k]."""
    key = np.empty(codes.shape[1], score.dtype)
    act = np.empty((qi.shape[0], 1), score.dtype)
    for j in range(score.shape[0]):
        _acts(codes, scale, lut, j, qi, key, act)
        weigh(act, wh, score, j)
    top(score, k, idx, ok)


@njit(nogil=True, cache=CACHE)
def top(score, k, idx, ok):
    """The k highest of score [n] (k <= n) into idx [k] (int64), ok [k] (bool: finite)."""
    order = np.argsort(-score, kind="mergesort")
    for i in range(k):
        idx[i] = order[i]
        ok[i] = np.isfinite(score[order[i]])
