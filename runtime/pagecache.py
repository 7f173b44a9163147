"""Cold runs: evict a checkpoint's files from the page cache and check with mincore how much stays.

evict(paths) calls posix_fadvise(DONTNEED) on each file (clean pages go; pages mapped by a live
process may stay); resident_fraction(path) maps the file and asks mincore which pages are in memory.
"""
from __future__ import annotations

import ctypes
import mmap
import os

import numpy as np

_libc = ctypes.CDLL(None, use_errno=True)
PAGE = mmap.PAGESIZE


def evict(paths) -> None:
    for p in paths:
        fd = os.open(p, os.O_RDONLY)
        try:
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)


def resident_fraction(path) -> float:
    size = os.path.getsize(path)
    if size == 0:
        return 0.0
    n = -(-size // PAGE)
    vec = (ctypes.c_ubyte * n)()
    with open(path, "rb") as f:
        mm = mmap.mmap(f.fileno(), size, prot=mmap.PROT_READ)
        view = np.frombuffer(mm, dtype=np.uint8)
        rc = _libc.mincore(ctypes.c_void_p(view.ctypes.data), ctypes.c_size_t(size), vec)
        del view
        mm.close()
    if rc != 0:
        raise OSError(ctypes.get_errno(), f"mincore failed on {path}")
    return sum(v & 1 for v in vec) / n
