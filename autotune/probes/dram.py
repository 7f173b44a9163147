"""DRAM stream read: the figure every CPU-side ratio is held against.

A numba parallel reduction (4 sub-streams per thread) over a float32 buffer of at least 4x the last-level cache and 2 GiB
(capped at a quarter of available memory), one contiguous share per thread; the buffer is
touched first (no page faults in the timed runs). GB/s = buffer bytes / time.
"""
from __future__ import annotations

import numba
import numpy as np
from numba import njit, prange

from autotune.host import available_bytes, llc_bytes
from autotune.measure import Measurement, measure


class BufferTooSmall(ValueError):
    pass


@njit(parallel=True, nogil=True, cache=True, fastmath=True)
def _sum_streams(a, nthreads):
    """Each thread sums its contiguous share as 4 interleaved sub-streams: one sequential stream per
    thread leaves DRAM bandwidth unused here (7.4 vs 11.8 GB/s on one thread, measured)."""
    n = a.shape[0] // nthreads
    q = n // 4
    part = np.zeros(nthreads, np.float32)
    for b in prange(nthreads):
        base = b * n
        s0 = np.float32(0.0)
        s1 = np.float32(0.0)
        s2 = np.float32(0.0)
        s3 = np.float32(0.0)
        for i in range(q):                       # fastmath: vectorized
            s0 += a[base + i]
            s1 += a[base + q + i]
            s2 += a[base + 2 * q + i]
            s3 += a[base + 3 * q + i]
        part[b] = s0 + s1 + s2 + s3
    return part.sum()


def stream_buffer_bytes(min_bytes: int = 2 << 30) -> int:
    want = max(4 * llc_bytes(), min_bytes)
    return int(min(want, available_bytes() // 4)) // 4096 * 4096


def dram_stream_read(threads: int, nbytes: int | None = None, repeats: int = 7) -> Measurement:
    nbytes = nbytes or stream_buffer_bytes()
    if nbytes < 4 * llc_bytes():
        raise BufferTooSmall(f"a {nbytes / 2**20:.0f} MiB buffer is under 4x the last-level cache "
                             f"({llc_bytes() / 2**20:.0f} MiB): the probe would measure the cache, not DRAM")
    a = np.ones(nbytes // 4, np.float32)
    numba.set_num_threads(threads)
    m = measure(lambda: _sum_streams(a, threads), repeats=repeats, warmup=1)
    return m.map(lambda s: nbytes / s / 1e9, "GB/s")
