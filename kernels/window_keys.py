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
    n, C = at, rk.shape[1]
    for s in range(rp.shape[0]):
        q = rp[s]
        if q >= 0 and q < p and q > p - window:
            for c in range(C):                # element loops: 3x faster here than row slices' copies
                K[n, c] = rk[s, c]
            for c in range(C):
                V[n, c] = rv[s, c]
            n += 1
    for c in range(C):
        K[n, c] = kn[c]
        V[n, c] = vn[c]
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


@njit(nogil=True, cache=CACHE)
def _write(d0, d1, rp, pos, v0, v1):
    R, T = rp.shape[0], pos.shape[0]
    for t in range(max(0, T - R), T):
        s = pos[t] % R
        for c in range(d0.shape[1]):
            d0[s, c] = v0[t, c]
        for c in range(d1.shape[1]):
            d1[s, c] = v1[t, c]
        rp[s] = pos[t]


def write(ring, pos, v0, v1) -> None:
    """A ring's write (runtime/model/kv.py Ring.write) in one call: positions pos [T] (ascending,
    non-negative) with their vectors v0, v1 [T, w0 / w1] into ring = (d0, d1, positions) numpy arrays,
    slot = position % R, only the last R kept. The same copies as the torch form (~4 small ops, ~35 us
    per layer on a decode token here; this ~3 us)."""
    _write(ring[0], ring[1], ring[2], pos, v0, v1)


def gather_torch(rk, rv, rp, p: int, window: int, kn, vn, K, V, at: int) -> int:
    vis = ((rp >= 0) & (rp < p) & (rp > p - window)).nonzero().flatten()     # slot order
    n = len(vis)
    K[at:at + n], V[at:at + n] = rk[vis], rv[vis]
    K[at + n], V[at + n] = kn, vn
    return n + 1

