"""The MoE router for a few tokens on the CPU in one numba call (torch's form is ~8 small ops a layer).

Per token t: s = sigmoid(logits[t]) (computed in float64, rounded to the output dtype), the K experts of
highest s + bias (best first; of equal values the lower expert id, where torch.topk leaves the order
unspecified), weights s[ids] / (their sum, in that order) x scale.
"""
from __future__ import annotations

import numpy as np
from numba import njit

from kernels.cpu_moe import CACHE


@njit(nogil=True, cache=CACHE)
def _route(logits, bias, scale, s, taken, ids, wts):
    T, E = logits.shape
    K = ids.shape[1]
    for t in range(T):
        for e in range(E):
            s[e] = 1.0 / (1.0 + np.exp(-np.float64(logits[t, e])))
            taken[e] = False
        for k in range(K):
            best, bi = 0.0, -1
            for e in range(E):
                if not taken[e]:
                    v = s[e] + bias[e]
                    if bi < 0 or v > best:
                        best, bi = v, e
            taken[bi] = True
            ids[t, k] = bi
            wts[t, k] = s[bi]
        total = wts[t, 0] * 0
        for k in range(K):
            total += wts[t, k]
        for k in range(K):
            wts[t, k] = wts[t, k] / total * scale


def route(logits: np.ndarray, bias: np.ndarray, scale: float, ids: np.ndarray, wts: np.ndarray) -> None:
    """logits [T, E], bias [E] -> ids [T, K] int64, wts [T, K] (logits' dtype), written in place."""
    _route(logits, bias, scale, np.empty(logits.shape[1], wts.dtype), np.empty(logits.shape[1], np.bool_), ids, wts)


@njit(nogil=True, cache=CACHE)
def _with_row(ids, wts, row, sub, w):
    T, K = ids.shape
    seen = np.zeros(max(row, ids.max()) + 1 if ids.size else row + 1, np.bool_)
    distinct = 0
    for t in range(T):
        for k in range(K):
            sub[t, k], w[t, k] = ids[t, k], wts[t, k]
            if not seen[ids[t, k]]:
                seen[ids[t, k]] = True
                distinct += 1
        sub[t, K], w[t, K] = row, 1.0
    return distinct


def with_row(ids: np.ndarray, wts: np.ndarray, row: int) -> tuple[np.ndarray, np.ndarray, int]:
    """A layer's routing ids, wts [T, K] (int64, float32) with one more bank row of weight 1 after them
    (the shared expert riding in the routed call) -> (ids [T, K+1], wts [T, K+1], distinct routed ids):
    one call for what numpy does in five small ones."""
    sub, w = np.empty((ids.shape[0], ids.shape[1] + 1), np.int64), np.empty((ids.shape[0], ids.shape[1] + 1), np.float32)
    return sub, w, _with_row(ids, wts, row, sub, w)
