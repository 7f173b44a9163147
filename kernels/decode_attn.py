"""One decode query's attention on the CPU in one numba call: its window keys gathered, the scores, the
softmax and the weighted values (runtime/model/attention.py attend_decode).

Per sequence, q [Hq, C] at position p; rows lo..at-1 of the buffers K, V [M, C] hold its selected
global rows (roped keys, values; none on a window layer), and kernels/window_keys.py's gather writes
its visible window keys and its own after them (rows at..at+n-1). Then, over the m = at + n - lo rows:
  s[h, r] = scale x sum_c q[h, c] K[r, c]       float64, summed in the vector order the compiler picks
  P[h, r] = exp(s[h, r] - max_r s) / sum_r(..)    float64
  out[h, c] = sum_r P[h, r] V[r, c]               float64 in row order, rounded once to q's dtype
The torch form (three BLAS calls and a softmax over the same rows: a GPU's, or any tensor numba cannot
read) costs ~120 us of dispatch per layer on a decode token here against ~20 us for this call, for
~65 K multiply-adds at V4.1's 64 heads x 512 (mini: 2 x 128 over ~250 rows). The two forms sum in
other orders: both are held against float64 softmax attention (tests/kernels/test_window_keys.py) and
give the same greedy tokens (tests/runtime/test_decode_forms.py). The scores are compiled with fast-math's
`reassoc` flag alone (no FMA contraction, no NaN or sign liberties): the compiler groups their sums in
vector lanes (the plain loop: ~50 us here, 4x slower), so another ISA's build may group them
otherwise; on one host, each sequence's arithmetic depends on its own rows alone: the same bits alone or
batched, whatever the thread count (one thread, no prange), so every plan decodes the same tokens.
"""
from __future__ import annotations

import numpy as np
from numba import njit

from kernels.cpu_moe import CACHE
from kernels.window_keys import _gather

REASSOC = {"reassoc"}        # the scores' sums may be regrouped (vectorized): no contraction, no other liberty


@njit(nogil=True, cache=CACHE, fastmath=REASSOC)
def _scores(q, h, K, lo, hi, scale, s):
    """s[r - lo] = scale x q[h] . K[r], r in lo..hi-1 (float64); -> their max."""
    top = -np.inf
    for r in range(lo, hi):
        v = 0.0
        for c in range(q.shape[1]):
            v += np.float64(q[h, c]) * np.float64(K[r, c])
        v *= scale
        s[r - lo] = v
        top = max(top, v)
    return top


@njit(nogil=True, cache=CACHE)
def _weighted(s, top, V, lo, hi, o):
    """o = softmax(s) . V[lo:hi], float64, summed in row order (plain: `reassoc` slows this loop 4x)."""
    tot = 0.0
    for r in range(hi - lo):
        s[r] = np.exp(s[r] - top)
        tot += s[r]
    o[:] = 0.0
    for r in range(lo, hi):
        w = s[r - lo] / tot
        for c in range(o.shape[0]):
            o[c] += w * np.float64(V[r, c])


@njit(nogil=True, cache=CACHE)
def _attend(rk, rv, rp, p, window, kn, vn, K, V, at, lo, q, scale, out):
    n = _gather(rk, rv, rp, p, window, kn, vn, K, V, at)
    hi = at + n
    Hq, C = q.shape
    s = np.empty(hi - lo)
    o = np.empty(C)
    for h in range(Hq):
        top = _scores(q, h, K, lo, hi, scale, s)
        _weighted(s, top, V, lo, hi, o)
        for c in range(C):
            out[h, c] = o[c]
    return n


def attend(ring, p: int, window: int, kn, vn, K, V, at: int, lo: int, q, scale: float, out) -> int:
    """ring = (keys, values [R, C], positions [R]) a window ring; kn, vn [C] the query's own key and
    value at p; K, V [M, C] the buffers (rows lo..at-1 selected rows, the window's written from `at`);
    q, out [Hq, C]. numpy arrays only (kernels/arrays.py). -> window rows written."""
    rk = ring[0]
    if K.shape[0] < at + rk.shape[0] + 1:
        raise ValueError(f"decode_attn.attend: a buffer of {K.shape[0]} rows cannot take {rk.shape[0] + 1} from row {at}")
    return _attend(rk, ring[1], ring[2], p, window, kn, vn, K, V, at, lo, q, scale, out)
