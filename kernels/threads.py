"""The thread pools (numba's and torch's), set in one place for every kernel."""
from __future__ import annotations

import ctypes
import os
from contextlib import contextmanager
from functools import cache

import numba
import torch

from hostinfo import numba_threading_layer


def set_threads(threads: int | None) -> bool:
    """numba's thread count for the next kernel call (None/0: leave it). More than numba may run is a
    caller's bug (the runtime clamps plans with hostinfo.clamp_threads): said with both numbers."""
    if not threads:
        return False
    if threads > numba.config.NUMBA_NUM_THREADS:
        raise ValueError(f"threads = {threads}, but numba may run {numba.config.NUMBA_NUM_THREADS} in this process "
                         f"(NUMBA_NUM_THREADS); clamp with hostinfo.clamp_threads")
    numba.set_num_threads(threads)
    return True


@contextmanager
def torch_threads(threads: int):
    """torch's intra-op thread count inside the block, the caller's restored after it (a set costs
    ~0.2 us). torch and numba each bring an OpenMP pool (two libgomp copies when torch is imported
    first); after a torch op its idle workers spin for a while on the cores numba's next kernel wants
    (runtime/model/transformer.py ONE_POOL_TOKENS)."""
    before = torch.get_num_threads()
    if threads > 0 and threads != before:
        torch.set_num_threads(threads)
    try:
        yield
    finally:
        if torch.get_num_threads() != before:
            torch.set_num_threads(before)


def concurrent_ok() -> bool:
    """Whether two Python threads may run numba's parallel kernels at once: the tbb and omp threading
    layers are threadsafe; workqueue aborts the process on concurrent launches, so callers then run
    their kernels one after the other (hostinfo.numba_threading_layer)."""
    return numba_threading_layer() != "workqueue"


@cache
def _mkl():
    """torch's MKL (linked into libtorch_cpu on x86 builds) where it exports its memory calls, else None."""
    try:
        lib = ctypes.CDLL(os.path.join(os.path.dirname(torch.__file__), "lib", "libtorch_cpu.so"))
        _ = lib.mkl_serv_get_fast_mm_status, lib.mkl_serv_free_buffers      # both exported, or neither used
        return lib
    except (OSError, AttributeError):
        return None


def blas_keeps_buffers() -> bool:
    """Whether torch's BLAS keeps GEMM buffers between calls in this process: MKL's own allocator on,
    which happens only where torch was loaded before MKL_DISABLE_FAST_MM was set (kernels/__init__.py)."""
    lib = _mkl()
    return lib is not None and lib.mkl_serv_get_fast_mm_status() == 0


def release_blas_buffers() -> bool:
    """Hand the GEMM buffers torch's BLAS kept back to the allocator (every thread's), where it keeps any:
    what a forward's matmuls leave is then freed with the forward's other temporaries. -> whether it did."""
    if not blas_keeps_buffers():
        return False
    _mkl().mkl_serv_free_buffers()
    return True
