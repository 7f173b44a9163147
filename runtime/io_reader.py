"""The runtime's one batched reader: many (file, offset, length) reads, `depth` outstanding at once.

With O_DIRECT (the page cache neither helps nor lies) reads must be 4 KiB aligned in offset, length and
buffer address: each request reads the aligned blocks that contain it into an mmap-allocated (page
aligned) buffer and returns a view of the requested bytes. `depth` worker threads each loop over
their own batch of requests with os.preadv (one task per worker, not per read: a task per read costs
~45 us here). Where O_DIRECT is refused (tmpfs, some filesystems) the reader falls back to buffered
reads and says so in `path`. The expert NVMe tier, the Engram store and the profiler's NVMe probes
all use this reader, so the figure the profiler reports is the one serving sees.
"""
from __future__ import annotations

import mmap
import os
import threading
from concurrent.futures import ThreadPoolExecutor

import numpy as np

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

    def _read_one(self, fd, offset, length, buf, buf_off):
        """Aligned reads covering [offset, offset+length) into buf[buf_off:]."""
        start = offset - offset % BLOCK
        end = -(-(offset + length) // BLOCK) * BLOCK
        mv = memoryview(buf)[buf_off: buf_off + end - start]
        got = 0
        while got < end - start:
            try:
                n = os.preadv(fd, [mv[got:]], start + got)
            except OSError as e:
                if e.errno == 22 and self.path == "o_direct":   # EINVAL: the filesystem does not do O_DIRECT
                    raise _NoDirect(str(e)) from None
                raise
            if n == 0:                    # end of file: the tail block is short
                break
            got += n
        return offset - start

    def read(self, requests: list[tuple[str, int, int]]) -> list[np.ndarray]:
        """-> one uint8 array per request. Pieces are split over `depth` workers, each looping over its
        own batch through one aligned scratch buffer."""
        if not requests:
            return []
        out = [np.empty(length, np.uint8) for _, _, length in requests]
        pieces = [(r, path, off + p, min(PIECE, length - p), p)
                  for r, (path, off, length) in enumerate(requests) for p in range(0, length, PIECE)]
        per = -(-len(pieces) // self.depth)

        def work(batch):
            scratch = _aligned(PIECE + 2 * BLOCK)
            for r, path, off, length, dest in batch:
                try:
                    skip = self._read_one(self._fd(path), off, length, scratch, 0)
                except _NoDirect as e:
                    with self._lock:
                        fd = self._fds.pop(path, None)
                        if fd is not None:
                            os.close(fd)
                        self.want_direct = False
                        self.path, self.fallback_reason = "buffered", f"O_DIRECT refused: {e}"
                    skip = self._read_one(self._fd(path), off, length, scratch, 0)
                out[r][dest: dest + length] = np.frombuffer(scratch, np.uint8, length, skip)
            scratch.close()
        list(self.pool.map(work, [pieces[k: k + per] for k in range(0, len(pieces), per)]))
        self.requests += len(requests)
        self.bytes_read += sum(length for _, _, length in requests)
        return out

    def close(self):
        self.pool.shutdown(wait=True)
        for fd in self._fds.values():
            os.close(fd)
        self._fds.clear()


class _NoDirect(OSError):
    pass


def _aligned(n: int):
    """A page-aligned writable buffer of n bytes (anonymous mmap)."""
    return mmap.mmap(-1, max(n, BLOCK))
