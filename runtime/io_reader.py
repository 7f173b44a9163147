"""The runtime's one batched reader: many (file, offset, length) reads, `depth` outstanding at once.

With O_DIRECT (the page cache neither helps nor lies) reads must be 4 KiB aligned in offset, length and
buffer address: each request reads the aligned blocks that contain it into one mmap-allocated (page
aligned) buffer and returns views of the requested bytes. `depth` worker threads each run their own
batch of requests through a numba loop calling libc pread (one task per worker, not per read: a task
per read costs ~45 us here; a Python preadv loop is GIL-bound near 40k reads/s, the compiled loop
is not). Where O_DIRECT is refused (tmpfs, some filesystems) the reader falls back to buffered
reads and says so in `path`. The expert NVMe tier, the Engram store and the profiler's NVMe probes
all use this reader, so the figure the profiler reports is the one serving sees.
"""
from __future__ import annotations

import ctypes
import mmap
import os
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import numpy as np
from numba import njit

_libc = ctypes.CDLL(None, use_errno=True)
_pread = _libc.pread
_pread.argtypes = (ctypes.c_int, ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int64)
_pread.restype = ctypes.c_ssize_t
_clock = _libc.clock_gettime
_clock.argtypes = (ctypes.c_int, ctypes.c_void_p)
_clock.restype = ctypes.c_int
CLOCK_MONOTONIC = 1


@njit(nogil=True)          # not cached: numba cannot cache code that holds ctypes function pointers
def _pread_batch(fds, base, offs, dests, sizes, got, ns, timed, ts):
    """The worker's loop in compiled code: one pread per piece, no Python (and no GIL) per read.
    got[i] = bytes read or -1; ns[i] = the read's duration when timed (clock_gettime)."""
    for i in range(offs.shape[0]):
        if timed:
            _clock(CLOCK_MONOTONIC, ts.ctypes.data)
            t0 = ts[0] * 1_000_000_000 + ts[1]
        got[i] = _pread(fds[i], base + dests[i], sizes[i], offs[i])
        if timed:
            _clock(CLOCK_MONOTONIC, ts.ctypes.data)
            ns[i] = ts[0] * 1_000_000_000 + ts[1] - t0

BLOCK = 4096
PIECE = 1 << 20          # large requests are split into 1 MiB pieces so depth applies to them too


class BatchedReader:
    def __init__(self, depth: int = 8, direct: bool = True):
        if depth < 1:
            raise ValueError(f"reader depth must be >= 1, got {depth}")
        self.depth, self.want_direct = depth, direct
        self.pool = ThreadPoolExecutor(max_workers=depth, thread_name_prefix="dsv41-io")
        self._fds: dict = {}
        self._lock = threading.Lock()
        self.path = "o_direct" if direct else "buffered"
        self.fallback_reason = ""
        self.bytes_read = 0
        self.requests = 0

    def _fd(self, path):
        with self._lock:
            fd = self._fds.get(path)
            if fd is None:
                flags = os.O_RDONLY
                if self.want_direct and hasattr(os, "O_DIRECT"):
                    try:
                        fd = os.open(path, flags | os.O_DIRECT)
                    except OSError as e:       # e.g. tmpfs: EINVAL
                        self.path, self.fallback_reason = "buffered", f"O_DIRECT refused on {os.path.basename(path)}: {e.strerror}"
                if fd is None:
                    fd = os.open(path, flags)
                self._fds[path] = fd
            return fd

    @staticmethod
    def _read_one(fd, start, nbytes, mv):
        """preadv the aligned range [start, start + nbytes) into mv, resuming short reads; -> bytes read
        (short only at the end of the file)."""
        got = 0
        while got < nbytes:
            n = os.preadv(fd, [mv[got:nbytes]], start + got)
            if n == 0:
                break
            got += n
        return got

    def read(self, requests: list[tuple[str, int, int]], latencies: list | None = None) -> list[np.ndarray]:
        """-> one uint8 array per request (views into one page-aligned buffer that the reads fill in
        place: no copies). Pieces are split over `depth` workers, each looping over its own batch.
        `latencies`, if given, receives each piece's read time in seconds (the profiler's p50/p95)."""
        if not requests:
            return []
        fds = {p: self._fd(p) for p in {p for p, _, _ in requests}}
        pieces, views, base = [], [], 0           # piece: (path, aligned file offset, bytes, buffer offset)
        for path, off, length in requests:
            a0 = off - off % BLOCK
            for p in range(0, max(length, 1), PIECE):
                o, n = off + p, min(PIECE, length - p)
                a = o - o % BLOCK
                pieces.append((path, a, -(-(o + n) // BLOCK) * BLOCK - a, base + a - a0))
            views.append((base + off - a0, length))
            base += -(-(off + length) // BLOCK) * BLOCK - a0
        big = _aligned(base)
        mv = memoryview(big)
        addr = np.frombuffer(big, np.uint8).ctypes.data
        per = -(-len(pieces) // self.depth)
        timed = latencies is not None

        def work(batch):
            fd = np.array([fds[p] for p, _, _, _ in batch], np.int64)
            offs = np.array([a for _, a, _, _ in batch], np.int64)
            sizes = np.array([n for _, _, n, _ in batch], np.int64)
            dests = np.array([d for _, _, _, d in batch], np.int64)
            got, ns = np.empty(len(batch), np.int64), np.zeros(len(batch), np.int64)
            _pread_batch(fd, addr, offs, dests, sizes, got, ns, timed, np.zeros(2, np.int64))
            for i in np.nonzero(got != sizes)[0]:          # EOF tails, partial reads, errors: the slow path
                path, a, nbytes, dest = batch[i]
                dst = mv[dest: dest + nbytes]
                try:
                    self._read_one(fds[path], a, nbytes, dst)
                except OSError as e:
                    if e.errno != 22 or self.path != "o_direct":
                        raise
                    with self._lock:                        # EINVAL: no O_DIRECT on this filesystem
                        if fds[path] in self._fds.values():
                            self._fallback(path, e)
                        fds[path] = self._fd(path)
                    self._read_one(fds[path], a, nbytes, dst)
                dst.release()
            if timed:
                latencies.extend((ns * 1e-9).tolist())
        if self.depth == 1 or len(pieces) == 1:
            work(pieces)
        else:
            list(self.pool.map(work, [pieces[k: k + per] for k in range(0, len(pieces), per)]))
        mv.release()
        self.requests += len(requests)
        self.bytes_read += sum(length for _, _, length in requests)
        return [np.frombuffer(big, np.uint8, n, off) for off, n in views]

    def _fallback(self, path, err):
        fd = self._fds.pop(path, None)
        if fd is not None:
            os.close(fd)
        self.want_direct = False
        self.path, self.fallback_reason = "buffered", f"O_DIRECT refused: {err}"

    def close(self):
        self.pool.shutdown(wait=True)
        for fd in self._fds.values():
            os.close(fd)
        self._fds.clear()


def _aligned(n: int):
    """A page-aligned writable buffer of n bytes (anonymous mmap)."""
    return mmap.mmap(-1, max(n, BLOCK))
