"""Facts about this host that probes need (cache sizes, cores, memory)."""
from __future__ import annotations

import os
from pathlib import Path

import psutil


def llc_bytes() -> int:
    """Size of the largest CPU cache level (sysfs), 32 MiB if unknown."""
    best = 0
    for idx in Path("/sys/devices/system/cpu/cpu0/cache").glob("index*"):
        try:
            size = (idx / "size").read_text().strip()
        except OSError:
            continue
        mult = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}.get(size[-1], 1)
        best = max(best, int(size.rstrip("KMG")) * mult)
    return best or 32 << 20


def physical_cores() -> int:
    return psutil.cpu_count(logical=False) or os.cpu_count() or 1


def available_bytes() -> int:
    return psutil.virtual_memory().available
