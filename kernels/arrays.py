"""Torch tensors as the numba kernels take them, in one place."""
from __future__ import annotations

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
