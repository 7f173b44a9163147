"""A decode query's visible window keys, gathered in one call (numba; plain copies, no arithmetic).

A sequence's window ring holds R = window - 1 + spare slots of roped keys and values [R, C] with their
positions [R] (-1: empty). A decode query at position p sees the slots whose position q satisfies
0 <= q < p (a slot at or past p is stale: rolled back) and q > p - window, then its own new key. The
torch form of this (compare, mask, concatenate rings and the new key, mask the scores) is ~20 small
ops per layer, each ~10 us of dispatch on a CPU: more than the attention's arithmetic at small head
counts. Here one call copies the visible keys and values, in slot order, then the new one, into rows
at..at+n-1 of a buffer the forward holds; the scores then run over those rows only (no mask).
`gather_torch` is the same copy in torch ops for tensors numba cannot read (a GPU's): the same rows in
the same order, so both give the attention the same bits (tests/kernels/test_window_keys.py).
"""
from __future__ import annotations

import numpy as np
from numba import njit

from kernels.cpu_moe import CACHE


@njit(nogil=True, cache=CACHE)
def _gather(rk, rv, rp, p, window, kn, vn, K, V, at):
    n = at
    for s in range(rp.shape[0]):
        q = rp[s]
        if q >= 0 and q < p and q > p - window:
            K[n, :] = rk[s, :]
            V[n, :] = rv[s, :]
            n += 1
    K[n, :] = kn
    V[n, :] = vn
    return n + 1 - at


def gather(ring, p: int, window: int, kn, vn, K, V, at: int) -> int:
    """ring = (keys, values [R, C], positions [R]) a window ring, kn, vn [C] the query's own key and
    value at position p; K, V [M, C] the buffer, written from row `at`. -> rows written (n <= R + 1).
    numpy arrays (kernels/arrays.py) through numba, tensors through `gather_torch`."""
    rk, rv, rp = ring
    if K.shape[0] < at + rk.shape[0] + 1:
        raise ValueError(f"window_keys.gather: a buffer of {K.shape[0]} rows cannot take {rk.shape[0] + 1} from row {at}")
    if not isinstance(K, np.ndarray):
        return gather_torch(rk, rv, rp, p, window, kn, vn, K, V, at)
    return _gather(rk, rv, rp, p, window, kn, vn, K, V, at)


def gather_torch(rk, rv, rp, p: int, window: int, kn, vn, K, V, at: int) -> int:
    vis = ((rp >= 0) & (rp < p) & (rp > p - window)).nonzero().flatten()     # slot order
    n = len(vis)
    K[at:at + n], V[at:at + n] = rk[vis], rv[vis]
    K[at + n], V[at + n] = kn, vn
    return n + 1

