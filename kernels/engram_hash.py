"""Engram n-gram hashing (numba): token ids -> table rows, for every position, order and head.

The exact V4.1 hash and table layout are not published in our sources, so this is a documented,
pluggable stand-in with the same access pattern:
  - a table of `rows` rows is split into S = (max_ngram - 1) * heads ranges, one per (order, head);
    range sizes are distinct primes, the largest below rows // S, descending (so ranges never overlap
    and every modulus is prime); unused rows at the end stay unread;
  - for position t and order n (2..max_ngram) the n-gram is the compressed ids of tokens t-n+1..t
    (positions before the start read PAD = compressed vocab size);
  - head h hashes it with its own 64-bit seed: x = seed; for each id: x = (x ^ (id + 1)) * GOLDEN
    (mod 2^64); then x ^= x >> 29; row = offset[n, h] + x mod prime[n, h].
Row indices depend only on token ids, so prefill can hash every position before the forward pass.
"""
from __future__ import annotations

import numpy as np
from numba import njit

GOLDEN = 0x9E3779B97F4A7C15
MASK64 = (1 << 64) - 1


def _is_prime(n: int) -> bool:
    if n < 2:
        return False
    if n % 2 == 0:
        return n == 2
    f = 3
    while f * f <= n:
        if n % f == 0:
            return False
        f += 2
    return True


def slot_ranges(rows: int, n_slots: int) -> tuple[np.ndarray, np.ndarray]:
    """-> (primes [S], offsets [S]) int64: distinct primes below rows // S, descending; cumulative offsets."""
    if rows < n_slots * 2:
        raise ValueError(f"an Engram table of {rows} rows cannot hold {n_slots} prime ranges")
    primes, p = [], rows // n_slots
    while len(primes) < n_slots:
        if _is_prime(p):
            primes.append(p)
        p -= 1
        if p < 2:
            raise ValueError(f"not enough primes below {rows // n_slots} for {n_slots} ranges")
    primes = np.array(primes, dtype=np.int64)
    offsets = np.concatenate([[0], np.cumsum(primes)[:-1]]).astype(np.int64)
    return primes, offsets


def slot_seeds(layer: int, n_slots: int) -> np.ndarray:
    """64-bit seeds per (order, head) slot, distinct per Engram layer (as uint64)."""
    return np.array([(GOLDEN * (layer * 1000 + s + 1)) & MASK64 for s in range(n_slots)], dtype=np.uint64)


@njit(nogil=True, cache=True)
def engram_rows(cids, start, pad, max_ngram, n_heads, primes, offsets, seeds):
    """cids [T] int64 compressed ids of the whole sequence -> rows [T - start, S] int64 for
    positions start..T-1; slot s = (n - 2) * n_heads + h."""
    T = cids.shape[0]
    S = (max_ngram - 1) * n_heads
    out = np.empty((T - start, S), np.int64)
    golden = np.uint64(GOLDEN)
    for t in range(start, T):
        for n in range(2, max_ngram + 1):
            for h in range(n_heads):
                s = (n - 2) * n_heads + h
                x = seeds[s]
                for i in range(t - n + 1, t + 1):
                    c = cids[i] if i >= 0 else pad
                    x = (x ^ np.uint64(c + 1)) * golden
                x ^= x >> np.uint64(29)
                out[t - start, s] = offsets[s] + np.int64(x % np.uint64(primes[s]))
    return out


def engram_rows_reference(cids, start, pad, max_ngram, n_heads, primes, offsets, seeds) -> np.ndarray:
    """Plain-Python reference of engram_rows (arbitrary-precision ints, masked to 64 bits)."""
    T, S = len(cids), (max_ngram - 1) * n_heads
    out = np.empty((T - start, S), dtype=np.int64)
    for t in range(start, T):
        for n in range(2, max_ngram + 1):
            for h in range(n_heads):
                s = (n - 2) * n_heads + h
                x = int(seeds[s])
                for i in range(t - n + 1, t + 1):
                    c = int(cids[i]) if i >= 0 else int(pad)
                    x = ((x ^ (c + 1)) * GOLDEN) & MASK64
                x ^= x >> 29
                out[t - start, s] = int(offsets[s]) + x % int(primes[s])
    return out
