"""Resident memory of this process while a block runs, anonymous and file-backed apart.

Linux keeps one peak (VmHWM) for both kinds together, so a thread samples RssAnon and RssFile from
/proc/self/status every `interval_s` and keeps their maxima; the figures are bytes above the values
at the start of the block (`*_added`), beside the start values. Anonymous memory is what the runtime
allocated (weights it copied, banks, the sequence state, activations). File-backed RSS also counts
library code paged in, so the checkpoint's own share is read from /proc/self/smaps (`mapped_rss`):
the mapping's pages the runtime touched (page cache; reclaimable). Elsewhere: None.
"""
from __future__ import annotations

import sys
import threading
import time
from pathlib import Path

STATUS = Path("/proc/self/status")
M_TRIM_THRESHOLD, M_MMAP_THRESHOLD, M_ARENA_MAX = -1, -3, -8      # glibc mallopt parameters
MMAP_THRESHOLD = 32 << 20   # the largest glibc's mallopt takes on 64-bit (half its 64 MiB heap size)
ARENA_MAX = 2
INT_MAX = (1 << 31) - 1     # mallopt takes a C int: ctypes would mask a larger value (4 GiB -> 0: trim always)


def keep_freed_memory(transient_bytes: int) -> bool:
    """glibc's allocator set to keep what a forward frees for the next one, up to the forward's
    temporaries the plan counts (`transient_bytes`, runtime/budget.py), and no more:
    - blocks under 32 MiB come from the heap (M_MMAP_THRESHOLD, fixed: glibc's default moves it up as
      big blocks are freed), so a layer's temporaries reuse the pages the last layer's freed; from
      their own mappings (the former setting, 256 KiB) every layer of a prefill page-faulted its
      temporaries afresh: ~860 k faults a warm 512-token prefill on mini (chunk 256) against 18-90 k,
      86-90 against 100-116 tok/s on the Zen 4 VM (kernels/lab/README.md);
    - free memory at the heap's top goes back to the OS past `transient_bytes` (M_TRIM_THRESHOLD,
      128 KiB by default once the threshold above is fixed), so between forwards the process holds at
      most the temporaries the plan already counts (at most 2 GiB - 1: mallopt takes a C int);
    - at most 2 malloc arenas: each new thread (the I/O workers, the Engram prefetch) would otherwise
      get its own, ~0.4 MB resident each.
    -> whether it took (False off glibc)."""
    import ctypes
    import ctypes.util
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        trim = min(max(int(transient_bytes), 128 << 10), INT_MAX)
        took = [libc.mallopt(k, v) for k, v in ((M_MMAP_THRESHOLD, MMAP_THRESHOLD), (M_TRIM_THRESHOLD, trim),
                                               (M_ARENA_MAX, ARENA_MAX))]   # each tried: one refused leaves the others
        return all(took)
    except (OSError, AttributeError):
        return False


def rss_now() -> dict | None:
    """{'anon': B, 'file': B, 'hwm': B} from /proc/self/status, or None where there is none. 'anon'
    counts private and shared anonymous pages (RssAnon + RssShmem: the O_DIRECT read buffers are
    shared anonymous mappings)."""
    try:
        text = STATUS.read_text()
    except OSError:
        return None
    d = {}
    for line in text.splitlines():
        k, _, v = line.partition(":")
        if k in ("RssAnon", "RssShmem", "RssFile", "VmHWM"):
            key = {"RssAnon": "anon", "RssShmem": "anon", "RssFile": "file", "VmHWM": "hwm"}[k]
            d[key] = d.get(key, 0) + int(v.split()[0]) * 1024
    return d if len(d) == 3 else None


def mapped_rss(root) -> int | None:
    """Resident bytes of this process's mappings of files under `root` (/proc/self/smaps), or None."""
    root = str(Path(root).resolve()) + "/"
    try:
        text = Path("/proc/self/smaps").read_text()
    except OSError:
        return None
    total, inside = 0, False
    for line in text.splitlines():
        head = line.split(maxsplit=5)
        if len(head) >= 5 and "-" in head[0] and ":" not in head[0]:        # a mapping's header line
            inside = len(head) == 6 and head[5].startswith(root)
        elif inside and line.startswith("Rss:"):
            total += int(line.split()[1]) * 1024
    return total


class RssWatch:
    def __init__(self, interval_s: float = 0.002):
        self.interval_s, self.start, self.peak, self.samples = interval_s, None, None, 0
        self._stop = threading.Event()

    def __enter__(self) -> "RssWatch":
        self.start = rss_now()
        if self.start is not None:
            self.peak = dict(self.start)
            self._thread = threading.Thread(target=self._run, daemon=True)
            self._thread.start()
        return self

    def _run(self):
        while not self._stop.is_set():
            self._sample()
            time.sleep(self.interval_s)

    def _sample(self):
        now = rss_now()
        if now:
            self.samples += 1
            for k in ("anon", "file"):
                self.peak[k] = max(self.peak[k], now[k])

    def __exit__(self, *exc):
        if self.start is not None:
            self._stop.set()
            self._thread.join()
            self._sample()

    def result(self) -> dict | None:
        if self.start is None:
            return None
        return {"anon_start": self.start["anon"], "anon_added": self.peak["anon"] - self.start["anon"],
                "file_start": self.start["file"], "file_added": self.peak["file"] - self.start["file"],
                "samples": self.samples, "interval_s": self.interval_s}


def specializations() -> dict:
    """{module.function: how many signatures it holds compiled} of every numba dispatcher in the
    project's loaded modules (kernels.*, runtime.*), read, not imported. A run compares it before and
    after: a dispatcher that gained one during the run (compiled, or loaded from numba's cache) is one
    the warm-up (kernels/warm.py) missed, and its compiler's memory lands in what the run measures."""
    from numba.core.dispatcher import Dispatcher
    out = {}
    for name, mod in list(sys.modules.items()):
        if mod is None or not name.startswith(("kernels.", "runtime.")):
            continue
        for attr, f in list(vars(mod).items()):
            if isinstance(f, Dispatcher) and f.__module__ == name:
                out[f"{name}.{attr}"] = len(f.overloads)
    return out


def added_since(before: dict) -> list:
    """The dispatchers (module.function) with more signatures than in `before` (specializations())."""
    return sorted(k for k, n in specializations().items() if n > before.get(k, 0))
