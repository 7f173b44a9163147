"""The CPU and GPU kernels. Their compiled code is cached on disk (numba, cache=True) under a directory
named by a hash of every kernel source here: numba keys a cached function only by its own file, so a
change to an intrinsic in another file (kernels/fp4_simd.py, fp8_simd.py, fp4_i8.py) would otherwise
leave callers running the old machine code. A forced SIMD path ($DSV41_CPU_ISA, hostinfo) gets a
directory of its own: numba's key names the CPU, not the path the kernels were compiled for, so one
directory must never hold two paths' code for one CPU. Forcing the CPU's own widest path compiles
exactly the host's code, so it shares the host's directory (`ISA_CACHE`: True when a forced path has a
directory it may cache in, its own or the host's). $NUMBA_CACHE_DIR (the user's) wins; $DSV41_KERNEL_CACHE
moves the root (default ~/.cache/dsv41/numba); an unwritable root keeps numba's default (__pycache__)."""
from __future__ import annotations

import hashlib
import os
from pathlib import Path

# MKL (torch's BLAS on x86) keeps each GEMM's packing buffers for reuse by default, per thread and for the
# life of the process: on the AMX Xeon VM a prompt's attention and FP8 tiles left 16-22 MB of them
# resident that no plan counts (runtime/budget.py: 1.10-1.15 of the plan where the rest read 0.99-1.01).
# MKL reads this once, when torch loads it: set before any module here imports torch (runtime, autotune
# and reports import this package first); a user's own setting wins. Where torch came first,
# kernels.threads.release_blas_buffers hands the buffers back after each forward instead.
os.environ.setdefault("MKL_DISABLE_FAST_MM", "1")


def _salted_cache_dir(forced_isa: str | None) -> Path:
    h = hashlib.sha256()
    for p in sorted(Path(__file__).parent.rglob("*.py")):
        h.update(p.relative_to(Path(__file__).parent).as_posix().encode())
        h.update(p.read_bytes())
    root = Path(os.environ.get("DSV41_KERNEL_CACHE") or Path.home() / ".cache" / "dsv41" / "numba")
    return root / (h.hexdigest()[:16] + (f"-{forced_isa}" if forced_isa else ""))


ISA_CACHE = False
if not os.environ.get("NUMBA_CACHE_DIR"):
    try:
        _forced = os.environ.get("DSV41_CPU_ISA") or None
        if _forced is not None:                  # forcing the CPU's own path compiles the host's code: share it
            from hostinfo.machine import native_isa
            _forced = None if _forced == native_isa() else _forced
        _dir = _salted_cache_dir(_forced)
        _dir.mkdir(parents=True, exist_ok=True)
        if os.access(_dir, os.W_OK):
            from numba.core import config as _numba_config
            _numba_config.CACHE_DIR = str(_dir)
            ISA_CACHE = bool(os.environ.get("DSV41_CPU_ISA"))   # its own directory, or the host's
    except OSError:
        pass
