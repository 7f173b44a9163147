"""NVMe probes through the runtime's own BatchedReader (the path serving uses).

  random 4 KiB reads at queue depths 1..64: IOPS, p50/p95 per-read latency (O_DIRECT), each engine of
    the reader this host opens (io_uring, kernel AIO, threads) interleaved: the plan's engine is the
    fastest at its depth (autotune/search.py), predicted at that engine's figure
  the Engram pattern: 48 row reads per token, serial (one read at a time) vs batched at each depth,
    and a prefill batch of thousands of rows deduplicated into blocks
  sequential reads of expert-sized blocks (GB/s), for experts beyond host RAM
  the reader's software ceiling: rows/s from a page-cached file, where the device is not the limit
The probe file is the one the Engram tables live on when it is >= 1 GiB, else a 1 GiB scratch file in
a temporary directory beside the checkpoint (removed after; smaller only where the probe memory budget
is, $DSV41_PROBE_MIB, and then the figures' `path` says so). Where the filesystem refuses O_DIRECT
(tmpfs, some network filesystems) the reader falls back to buffered reads: every figure records it.
"""
from __future__ import annotations

import os
import tempfile
import time
from pathlib import Path

import numpy as np

from hostinfo import o_direct_refusal, probe_budget_bytes
from hostinfo.measure import Measurement
from runtime.io_reader import ASYNC, BLOCK, BatchedReader

MIN_FILE = 1 << 30
CHUNK = 64 << 20                   # the scratch file is written in chunks of random bytes
DEPTHS = (1, 2, 4, 8, 16, 32, 64)


def probe_file(preferred: Path | None, checkpoint_dir: Path) -> tuple[Path, str]:
    """-> (path, '' or where the scratch file is). The Engram shard when it is >= 1 GiB; else a 1 GiB
    scratch file in a fresh temporary directory beside the checkpoint (its filesystem, never inside
    it: the checkpoint may be read-only or shared), or in the system temporary directory when that
    parent is not writable (said: then it may be another filesystem)."""
    if preferred is not None and preferred.exists() and preferred.stat().st_size >= MIN_FILE:
        return preferred, ""
    try:
        d, where = Path(tempfile.mkdtemp(prefix=".dsv41-probe-", dir=Path(checkpoint_dir).resolve().parent)), "beside the checkpoint"
    except OSError:
        d, where = Path(tempfile.mkdtemp(prefix="dsv41-probe-")), "system temporary directory (checkpoint's parent not writable)"
    path = d / "nvme-probe.bin"
    size = max(CHUNK, min(MIN_FILE, probe_budget_bytes()) // CHUNK * CHUNK)
    if size < MIN_FILE:
        where += f", {size >> 20} MiB: the probe memory budget keeps it under 1 GiB"
    chunk = np.random.default_rng(0).integers(0, 255, CHUNK, dtype=np.uint8).tobytes()
    try:
        with open(path, "wb") as f:
            for _ in range(size // CHUNK):
                f.write(chunk)
            f.flush()
            os.fsync(f.fileno())
    except OSError:
        remove_scratch(path)
        raise
    return path, where


def remove_scratch(path: Path) -> None:
    path.unlink(missing_ok=True)
    try:
        path.parent.rmdir()
    except OSError:
        pass


def engines_here(path: Path, direct: bool = True) -> tuple[list[str], dict]:
    """The reader's engines this host serves O_DIRECT reads of `path` with -> (names in auto's order,
    {engine: why the kernel refused it}). Only the threads where O_DIRECT is refused (buffered reads never
    use the others) or where $DSV41_IO_ENGINE names one engine (a host override: only that one)."""
    if not direct or o_direct_refusal(path):
        return ["threads"], {}
    forced = os.environ.get("DSV41_IO_ENGINE", "auto")
    if forced != "auto":
        return [forced], {}
    names, refused = [], {}
    for name, cls in ASYNC:
        ctx, why = cls.open(1)
        if ctx is None:
            refused[name] = why
        else:
            ctx.close()
            names.append(name)
    return names + ["threads"], refused


def randread_4k(path: Path, depth: int, n_reads: int, seed: int = 0, direct: bool = True, repeats: int = 3,
                engines: list[str] | None = None) -> dict:
    """`repeats` rounds of n_reads / repeats random 4 KiB reads at `depth` through the runtime's reader,
    one batch of its own blocks per engine each round (`engines`, default: the reader's auto; the order
    rotates every round: interleaved, so a drift in the device hits every engine alike; a block another
    engine has just read may sit in a cache below the VM), after one warm-up batch each (opens, the
    engine, the buffer's page faults: out of the timing). Each read lands in a ring of 2 x depth blocks
    (`discard`: as fio reads, and as a decode step's Engram rows land in an arena the cache holds).
    -> per engine: IOPS per batch (raw samples, median, min, max), p50/p95 per-read latency over
    all of them; the top-level figures are the fastest engine's (by median), named in `engine`."""
    size = path.stat().st_size
    per = max(1, n_reads // repeats)
    engines = engines or ["auto"]
    n_e = len(engines)
    blocks = np.random.default_rng(seed + depth).integers(0, size // BLOCK, (per * repeats + per) * n_e)
    readers = {e: BatchedReader(depth=depth, direct=direct, engine=e, arena_bytes=None) for e in engines}   # no arena cap
    lat: dict = {e: [] for e in engines}
    iops: dict = {e: [] for e in engines}
    try:
        for i, r in enumerate(readers.values()):  # warm-up: opens, the engine, the ring
            r.read_blocks(str(path), blocks[(repeats * n_e + i) * per:(repeats * n_e + i + 1) * per], reuse=True, discard=True)
        for k in range(repeats):
            for i in [(k + j) % n_e for j in range(n_e)]:
                e, at = engines[i], (k * n_e + i) * per
                t0 = time.perf_counter()
                readers[e].read_blocks(str(path), blocks[at:at + per], reuse=True, latencies=lat[e], discard=True)
                iops[e].append(per / (time.perf_counter() - t0))
    finally:
        for r in readers.values():
            r.close()
    figs = {}
    for e, r in readers.items():
        us = np.array(lat[e]) * 1e6
        figs[r.engine_used if e == "auto" else e] = {
            "iops": float(np.median(iops[e])), "min": float(min(iops[e])), "max": float(max(iops[e])), "samples": iops[e],
            "p50_us": float(np.percentile(us, 50)), "p95_us": float(np.percentile(us, 95))}
    best = max(figs, key=lambda e: figs[e]["iops"])
    r = next(iter(readers.values()))
    return {"qd": depth, **figs[best], "engine": best, "engines": figs,
            "io_path": r.path, "fallback": r.fallback_reason, "aio_refusal": r.aio_refusal}


def engram_pattern(path: Path, depth: int, tokens: int, rows_per_token: int = 48, row_bytes: int = 264, seed: int = 1) -> dict:
    """Seconds per token for `rows_per_token` random rows: one read at a time vs batched at `depth`."""
    size = path.stat().st_size
    rng = np.random.default_rng(seed)
    rows = rng.integers(0, size // row_bytes - 1, (tokens, rows_per_token)) * row_bytes
    out = {}
    for mode, d in (("serial", 1), ("batched", depth)):
        r = BatchedReader(depth=d)
        try:
            t0 = time.perf_counter()
            for tok in rows:
                if mode == "serial":
                    for o in tok:
                        r.read([(str(path), int(o), row_bytes)], reuse=True)
                else:
                    r.read([(str(path), int(o), row_bytes) for o in tok], reuse=True)
            out[f"{mode}_ms_per_token"] = (time.perf_counter() - t0) / tokens * 1e3
        finally:
            r.close()
    return {"qd": depth, **out}


def prefill_rows(path: Path, depth: int, n_rows: int, row_bytes: int = 264, seed: int = 2) -> dict:
    """A prefill batch: n_rows random rows -> deduplicated, sorted 4 KiB blocks read at `depth`."""
    size = path.stat().st_size
    offs = np.random.default_rng(seed).integers(0, size // row_bytes - 1, n_rows) * row_bytes
    blocks = np.unique(np.concatenate([offs // BLOCK, (offs + row_bytes - 1) // BLOCK]))
    r = BatchedReader(depth=depth)
    try:
        t0 = time.perf_counter()
        r.read([(str(path), int(b) * BLOCK, BLOCK) for b in blocks], reuse=True)
        dt = time.perf_counter() - t0
    finally:
        r.close()
    return {"qd": depth, "rows": n_rows, "blocks": int(len(blocks)), "seconds": dt, "rows_per_s": n_rows / dt}


def seq_read(path: Path, block_bytes: int, n_blocks: int, depth: int = 4) -> Measurement:
    size = path.stat().st_size
    n = max(1, min(n_blocks, size // block_bytes))
    r = BatchedReader(depth=depth)
    samples = []
    try:
        for i in range(n):
            t0 = time.perf_counter()
            r.read([(str(path), (i * block_bytes) % (size - block_bytes), block_bytes)], reuse=True)
            samples.append(block_bytes / (time.perf_counter() - t0) / 1e9)
    finally:
        r.close()
    return Measurement(tuple(samples), "GB/s", note=f"sequential {block_bytes} B blocks through the batched reader, depth {depth}")


def software_ceiling(path: Path, n_reads: int, depth: int) -> dict:
    """Rows/s reading 4 KiB blocks of a page-cached region (buffered): the reader's own limit."""
    region = min(path.stat().st_size, 256 << 20)
    with open(path, "rb") as f:                                   # bring the region into the page cache
        while f.tell() < region and f.read(16 << 20):
            pass
    offs = np.random.default_rng(3).integers(0, region // BLOCK, n_reads) * BLOCK
    r = BatchedReader(depth=depth, direct=False)
    try:
        t0 = time.perf_counter()
        r.read([(str(path), int(o), BLOCK) for o in offs], reuse=True)
        dt = time.perf_counter() - t0
    finally:
        r.close()
    return {"qd": depth, "rows_per_s": n_reads / dt, "io_path": "buffered (page cache)"}
