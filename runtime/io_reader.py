"""The runtime's one batched reader: many (file, offset, length) reads, `depth` outstanding at once.

With O_DIRECT (the page cache neither helps nor lies) reads must be 4 KiB aligned in offset, length and
buffer address: each request reads the aligned blocks that contain it into one mmap-allocated (page
aligned) buffer and returns views of the requested bytes. With O_DIRECT one thread keeps `depth` reads
in flight through io_uring (runtime/uring.py) or kernel AIO (runtime/aio.py): fio's two engines, raw
syscalls, compiled loops; otherwise (buffered files, a kernel that refuses both, or
$DSV41_IO_ENGINE=threads) `depth` worker
threads each run their own batch of requests through a numba loop calling libc pread (one task per
worker, not per read: a task per read costs ~45 us here; a Python preadv loop is GIL-bound near 40k
reads/s, the compiled loop is not). Where O_DIRECT is refused (tmpfs, some filesystems) the reader falls back to buffered
reads and says so in `path`. The expert NVMe tier, the Engram store and the profiler's NVMe probes
all use this reader, so the figure the profiler reports is the one serving sees.
"""
from __future__ import annotations

import ctypes
import errno
import mmap
import os
import threading
from concurrent.futures import ThreadPoolExecutor

import numpy as np
from numba import njit

from hostinfo import o_direct_refusal
from runtime.budget import READ_ARENA_BYTES
from runtime.plan import IO_ENGINES
from runtime.aio import AioContext
from runtime.uring import UringContext

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


class ReadError(OSError):
    """A read failed or came back short; the message names the file, the offset and the length."""

    def __str__(self):
        return self.strerror

ENGINES = IO_ENGINES      # auto: io_uring, else kernel AIO (O_DIRECT only), else threads
ASYNC = (("uring", UringContext), ("aio", AioContext))   # auto's order (IO_ENGINES'), threads last
PIECE = 1 << 20          # large requests are split into 1 MiB pieces so depth applies to them too


class BatchedReader:
    def __init__(self, depth: int = 8, direct: bool = True, engine: str | None = None,
                 arena_bytes: int | None = READ_ARENA_BYTES):
        if depth < 1:
            raise ValueError(f"reader depth must be >= 1, got {depth}")
        self.engine = engine or os.environ.get("DSV41_IO_ENGINE", "auto")
        if self.engine not in ENGINES:
            raise ValueError(f"reader engine {self.engine!r} (or $DSV41_IO_ENGINE) must be one of {ENGINES}")
        self._aio, self._aio_name, self._tried, self.aio_refusal, self._aio_lock = None, "", False, "", threading.Lock()
        self._local, self.arena_bytes = threading.local(), arena_bytes      # None: no cap (the probes)
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
                if self.want_direct:
                    why = o_direct_refusal(path)           # e.g. tmpfs: EINVAL; or $DSV41_O_DIRECT=0
                    if why:
                        self.path, self.fallback_reason = "buffered", why
                    else:
                        fd = os.open(path, flags | os.O_DIRECT)
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

    def read(self, requests: list[tuple[str, int, int]], latencies: list | None = None, reuse: bool = False) -> list[np.ndarray]:
        """-> one uint8 array per request (views into one page-aligned buffer that the reads fill in
        place: no copies). `latencies`, if given, receives each piece's read time in seconds (the
        profiler's p50/p95). reuse: a read of up to `arena_bytes` lands in this thread's arena, faulted in
        once and kept (a fresh buffer's first-touch page faults cost O_DIRECT reads ~35% of their IOPS
        here; runtime/budget.py counts the arenas); the views are valid until this thread's next reuse
        read, for callers that copy what they read at once."""
        if not requests:
            return []
        big, view_at, length = self._read(requests, latencies, reuse)
        return [np.frombuffer(big, np.uint8, int(n_), int(v)) for v, n_ in zip(view_at.tolist(), length.tolist())]

    def read_blocks(self, path: str, blocks: np.ndarray, reuse: bool = False, latencies: list | None = None,
                    discard: bool = False) -> np.ndarray | None:
        """The BLOCK-sized blocks `blocks` (block numbers) of one file -> uint8 [len(blocks) * BLOCK], block
        k of the list at k * BLOCK (two consecutive block numbers are adjacent in the result). No Python
        per block (the probes' random 4 KiB reads, Engram prefill rows). reuse, latencies: as in `read`.
        discard (probes): the data is not kept, every read lands in a ring of 2 x depth blocks (as fio's
        buffers, and as a decode step's rows land in an arena the cache holds; 20 000 reads into 80 MB
        of fresh destinations measured 10-15% fewer IOPS at depth 32-64 on a Zen 4 VM) -> None."""
        if not len(blocks):
            return None if discard else np.empty(0, np.uint8)
        n, fd = len(blocks), self._fd(path)
        big, _, _ = self._read_arrays({path: fd}, np.full(n, fd, np.int64), np.asarray(blocks, np.int64) * BLOCK,
                                      np.full(n, BLOCK, np.int64), latencies, reuse, ring=2 * self.depth if discard else 0)
        return None if discard else np.frombuffer(big, np.uint8, n * BLOCK)

    def _arena(self, n: int):
        """This thread's reusable read buffer of at least n bytes: grown to exactly what a read needs
        (the transient peak the plan counts), faulted in when (re)made."""
        a = getattr(self._local, "arena", None)
        if a is None or len(a) < n:
            if a is not None:
                a.close()
            a = self._local.arena = mmap.mmap(-1, -(-max(n, BLOCK) // mmap.PAGESIZE) * mmap.PAGESIZE)
            np.frombuffer(a, np.uint8)[::mmap.PAGESIZE] = 0   # fault it in now, not inside the reads
            # (transparent huge pages on the arena measured 10-20% fewer IOPS here: not asked for)
        return a

    def _read(self, requests, latencies, reuse=False):
        fds = {p: self._fd(p) for p in {p for p, _, _ in requests}}
        fd_of = np.array([fds[p] for p, _, _ in requests], np.int64)
        off = np.array([o for _, o, _ in requests], np.int64)
        length = np.array([n for _, _, n in requests], np.int64)
        return self._read_arrays(fds, fd_of, off, length, latencies, reuse)

    def _read_arrays(self, fds, fd_of, off, length, latencies, reuse, ring=0):
        """Requests as arrays (fd, file offset, bytes) -> (buffer, each request's place in it, length).
        Vectorized plan: piece = (fd, aligned file offset, bytes, offset in the buffer); requests longer
        than PIECE are split so that `depth` applies to them too. ring > 0 (BLOCK-sized requests whose
        data nobody reads): piece i lands at block i % ring of a ring-sized buffer."""
        a0 = off - off % BLOCK
        span = -(-(off + length) // BLOCK) * BLOCK - a0                    # aligned bytes per request
        start = np.concatenate([[0], np.cumsum(span)[:-1]])                # request's place in the buffer
        npieces = np.maximum(1, -(-length // PIECE))
        r = np.repeat(np.arange(len(off)), npieces)                        # piece -> request
        k = np.arange(len(r)) - np.repeat(np.cumsum(npieces) - npieces, npieces)
        o = off[r] + k * PIECE
        n = np.minimum(PIECE, length[r] - k * PIECE)
        a = o - o % BLOCK
        p_fd, p_off, p_len = fd_of[r], a, -(-(o + n) // BLOCK) * BLOCK - a
        p_dst = start[r] + a - a0[r]
        need = int(span.sum())
        if ring:
            if (length != BLOCK).any() or (off % BLOCK).any():
                raise ValueError("a discarding read takes whole aligned blocks only")
            p_dst, need = (np.arange(len(r)) % ring) * BLOCK, min(need, ring * BLOCK)
        arena = reuse and (self.arena_bytes is None or need <= self.arena_bytes)   # a capped arena: counted by the plan
        big = self._arena(need) if arena else _aligned(need)
        mv = memoryview(big)
        addr = np.frombuffer(big, np.uint8).ctypes.data
        timed = latencies is not None
        path_of_fd = {fd: p for p, fd in fds.items()}

        def work(sl, got=None, ns=None):
            if got is None:
                got, ns = np.empty(sl.stop - sl.start, np.int64), np.zeros(sl.stop - sl.start, np.int64)
                _pread_batch(p_fd[sl], addr, p_off[sl], p_dst[sl], p_len[sl], got, ns, timed, np.zeros(2, np.int64))
            for i in np.nonzero(got != p_len[sl])[0] + sl.start:  # EOF tails, partial reads, errors: slow path
                path = path_of_fd[int(p_fd[i])]
                dst = mv[p_dst[i]: p_dst[i] + p_len[i]]
                try:
                    try:
                        done = self._read_one(fds[path], int(p_off[i]), int(p_len[i]), dst)
                    except OSError as e:
                        if e.errno != 22 or self.path != "o_direct":
                            raise
                        with self._lock:                        # EINVAL: no O_DIRECT on this filesystem
                            if fds[path] in self._fds.values():
                                self._fallback(path, e)
                            fds[path] = self._fd(path)
                        done = self._read_one(fds[path], int(p_off[i]), int(p_len[i]), dst)
                except OSError as e:
                    raise ReadError(e.errno, f"{os.path.basename(path)}: reading {int(n[i])} B at offset {int(o[i])}: "
                                             f"{e.strerror or e}") from e
                finally:
                    dst.release()
                if done < o[i] + n[i] - p_off[i]:            # the bytes asked for end past the end of the file
                    raise ReadError(errno.EIO, f"{os.path.basename(path)}: reading {int(n[i])} B at offset {int(o[i])}: "
                                               f"the file ends at {int(p_off[i]) + done} B (truncated?)")
            if timed:
                latencies.extend((ns * 1e-9).tolist())
        aio = self._aio_ready()
        if aio is not None:                              # one thread, `depth` reads in flight (runtime/aio.py)
            got, ns = np.empty(len(r), np.int64), np.zeros(len(r), np.int64)
            with self._aio_lock:
                try:
                    aio.read(p_fd, addr, p_off, p_dst, p_len, got, ns, timed)
                except OSError as e:                     # the engine broke: close it, threads from now on
                    aio.close()
                    self._aio, self.aio_refusal = None, f"{self._aio_name} failed during a read: {e}"
                    got[:] = -1                          # every piece again on the slow path
            work(slice(0, len(r)), got, ns)
        else:
            per = -(-len(r) // self.depth)
            pieces = [slice(i, min(i + per, len(r))) for i in range(0, len(r), per)]
            if len(pieces) == 1:
                work(pieces[0])
            else:
                list(self.pool.map(work, pieces))
        mv.release()
        self.requests += len(off)
        self.bytes_read += int(length.sum())
        return big, start + off - a0, length

    def _aio_ready(self):
        """The asynchronous engine when every file of this reader is open with O_DIRECT and the engine
        setting allows it (None: the threads serve)."""
        if self.engine == "threads" or self.path != "o_direct":
            return None
        return self._open_engine()

    def _open_engine(self):
        """Open the engine once: io_uring, else kernel AIO (each refusal is kept in `aio_refusal` and the
        next engine serves, threads last); a named engine the kernel refuses is an OSError saying why."""
        with self._aio_lock:                         # two threads reading at once open one engine
            if self._aio is None and not self._tried:
                self._tried = True
                why = []
                for name, cls in ASYNC:
                    if self.engine in ("auto", name):
                        ctx, reason = cls.open(self.depth)
                        if ctx is not None:
                            self._aio, self._aio_name = ctx, name
                            break
                        why.append(f"{name}: {reason}")
                self.aio_refusal = "; ".join(why)
                if self._aio is None and self.engine != "auto":
                    self._tried = False                  # asked again, it says so again
                    raise OSError(errno.ENOSYS, f"the reader's engine {self.engine!r} is unavailable: {self.aio_refusal}")
            return self._aio

    def require_engine(self) -> None:
        """A named asynchronous engine (a plan's) opened now, so that a kernel refusing it fails at load,
        not at the first read."""
        if self.engine in dict(ASYNC):
            self._open_engine()

    @property
    def engine_used(self) -> str:
        """What serves this reader's reads now: 'uring', 'aio' (one thread, reads in flight) or 'threads'."""
        return self._aio_name if self._aio is not None and self.path == "o_direct" else "threads"

    @property
    def engine_shown(self) -> str:
        """The engine serving reads, or the one asked for before a first read opened it ('auto', ...)."""
        return self.engine_used if self._tried or self.engine == "threads" or self.path != "o_direct" else self.engine

    def _fallback(self, path, err):
        fd = self._fds.pop(path, None)
        if fd is not None:
            os.close(fd)
        self.want_direct = False
        self.path, self.fallback_reason = "buffered", f"O_DIRECT refused: {err}"

    def close(self):
        self.pool.shutdown(wait=True)
        if self._aio is not None:
            self._aio.close()
        for fd in self._fds.values():
            os.close(fd)
        self._fds.clear()


def _aligned(n: int):
    """A page-aligned writable buffer of n bytes (anonymous mmap)."""
    return mmap.mmap(-1, max(n, BLOCK))


def warm_up(path: str, engines) -> list[str]:
    """Compile the read loops of `engines` (IO_ENGINES names; "auto" as a reader given none resolves it)
    by reading the first block of `path` through each with O_DIRECT: the loops are not cacheable (see
    above), so a run's measurement would otherwise hold their compiler's memory. An engine the kernel
    refuses is skipped; where the filesystem refuses O_DIRECT the read is buffered (call this before
    evicting `path`). -> the engines that served the reads."""
    done = []
    for engine in sorted(set(engines)):
        r = BatchedReader(depth=1, direct=True, engine=None if engine == "auto" else engine, arena_bytes=None)
        try:
            r.read([(path, 0, min(BLOCK, os.path.getsize(path)))])
            done.append(r.engine_used)
        except OSError:
            pass
        finally:
            r.close()
    return done
