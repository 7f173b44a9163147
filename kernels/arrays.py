"""Arrays as the numba kernels take them (torch tensors' numpy views, aligned buffers), in one place."""
from __future__ import annotations

import numpy as np
import torch

NUMBA_DTYPES = (torch.float32, torch.float64, torch.int64)


def numba_ok(*ts) -> bool:
    """Whether the numba kernels can take these tensors (CPU, NUMBA_DTYPES)."""
    for t in ts:                                   # a plain loop: called ~60 times a decode token
        if t.dtype not in NUMBA_DTYPES or t.device.type != "cpu":
            return False
    return True


def numpy_views(*ts) -> tuple:
    """numpy views of CPU tensors of NUMBA_DTYPES (the same memory: writes land in the tensors), or the
    tensors themselves where any is elsewhere (a GPU) or of another dtype: callers then take their torch
    form. A conversion costs ~2 us, about as much as a small kernel's work: hold views of long-lived
    tensors rather than converting per call."""
    if numba_ok(*ts):
        return tuple(t.numpy() for t in ts)
    return ts


def aligned_empty(shape, dtype, align: int = 64) -> np.ndarray:
    """np.empty whose data starts on an `align`-byte boundary (a cache line). numpy's allocator gives 16,
    numba's 32: a 64-byte vector load from such a buffer spans two lines. The int8 products' peak
    (kernels/int8_peak.py) read 220-236 GMAC/s from buffers 16 bytes past a line and 337-365 from
    aligned ones on the Zen 4 VM (2 threads, interleaved): the roof moved with malloc's luck."""
    dtype = np.dtype(dtype)
    n = int(np.prod(shape)) * dtype.itemsize
    raw = np.empty(n + align, np.uint8)
    at = -raw.ctypes.data % align
    return raw[at:at + n].view(dtype).reshape(shape)
