"""Kernel AIO (the engine of fio's `libaio`) through raw syscalls: one thread keeps `depth` O_DIRECT
reads in flight with io_submit / io_getevents, in compiled code (no GIL, no library to install). As
in runtime/uring.py (and fio), each read is submitted as soon as a slot is free (SUBMIT_BATCH) and the
loop blocks for events only when `depth` are in flight.

Threads looping over pread (runtime/io_reader.py's fallback) need one thread per read in flight; on a
2-core VM they reached 0.73-0.81 of fio's libaio at depth 8-64. Kernel AIO is asynchronous only for
O_DIRECT, so buffered readers keep the threads. Where the kernel refuses it (seccomp, no CONFIG_AIO,
aio-max-nr exhausted) `AioContext.open` says why and the reader keeps the threads.

Layouts (linux/aio_abi.h, little-endian 64-bit): struct iocb = 8 x int64 words
  0 aio_data (our piece index) | 1 key, rw_flags | 2 opcode u16, reqprio s16, fildes u32 | 3 buf
  4 nbytes | 5 offset | 6 reserved | 7 flags, resfd;   struct io_event = data, obj, res, res2.
"""
from __future__ import annotations

import ctypes
import platform

import numpy as np
from numba import njit

_libc = ctypes.CDLL(None, use_errno=True)
_syscall = _libc.syscall
_syscall.argtypes = (ctypes.c_long,) * 7          # the number and up to six arguments
_syscall.restype = ctypes.c_long
_clock = _libc.clock_gettime
_clock.argtypes = (ctypes.c_int, ctypes.c_void_p)
_clock.restype = ctypes.c_int

# io_setup, io_destroy, io_getevents, io_submit
SYSCALLS = {"x86_64": (206, 207, 208, 209), "aarch64": (0, 1, 4, 2)}
NR = SYSCALLS.get(platform.machine())
SYS_SUBMIT, SYS_GETEVENTS = (NR[3], NR[2]) if NR else (-1, -1)
IOCB_CMD_PREAD = 0
SUBMIT_BATCH = 1                  # reads per io_submit (runtime/uring.py says why)


@njit(nogil=True)          # not cached: it holds ctypes function pointers
def _aio_batch(ctx, depth, fds, base, offs, dests, sizes, got, ns, timed, iocbs, ptrs, events, ts):
    """Read every piece with at most `depth` in flight. got[i] = bytes read, -errno, or -1 when the
    submit itself failed (the caller retries those pieces on the slow path). -> 0, or -errno of a
    failed io_getevents."""
    n = offs.shape[0]
    for i in range(n):
        iocbs[i, 0] = i
        iocbs[i, 1] = 0
        iocbs[i, 2] = IOCB_CMD_PREAD | (fds[i] << 32)
        iocbs[i, 3] = base + dests[i]
        iocbs[i, 4] = sizes[i]
        iocbs[i, 5] = offs[i]
        iocbs[i, 6] = 0
        iocbs[i, 7] = 0
        got[i] = -1
    nxt, inflight, done = 0, 0, 0
    pbase = ptrs.ctypes.data
    while done < nxt or nxt < n:
        if inflight < depth and nxt < n:
            k = min(min(depth - inflight, n - nxt), SUBMIT_BATCH)   # (numba: a 3-argument min leaks the arrays' references)
            if timed:
                _clock(1, ts.ctypes.data)
                for j in range(nxt, nxt + k):
                    ns[j] = ts[0] * 1_000_000_000 + ts[1]
            r = _syscall(SYS_SUBMIT, ctx, k, pbase + 8 * nxt, 0, 0, 0)
            if r <= 0:                                   # refused: leave the rest to the slow path
                n = nxt
                continue
            nxt += r
            inflight += r
        wait = 0
        if inflight >= depth or nxt >= n:                        # block only with the queue full or all sent
            wait = 1
        r = _syscall(SYS_GETEVENTS, ctx, wait, depth, events.ctypes.data, 0, 0)
        if r < 0:
            return r
        if timed:
            _clock(1, ts.ctypes.data)
        for e in range(r):
            i = events[e, 0]
            got[i] = events[e, 2]
            if timed:
                ns[i] = ts[0] * 1_000_000_000 + ts[1] - ns[i]
        inflight -= r
        done += r
    return 0


class AioContext:
    """One kernel AIO context of `depth` slots; `read` is not re-entrant (the reader holds a lock)."""

    def __init__(self, ctx: int, depth: int):
        self.ctx, self.depth = ctx, depth
        self.events = np.zeros((depth, 4), np.int64)

    @classmethod
    def open(cls, depth: int) -> tuple["AioContext | None", str]:
        """-> (context, "") or (None, why kernel AIO is unavailable here)."""
        if NR is None:
            return None, f"kernel AIO syscalls unknown on {platform.machine()}"
        ctx = ctypes.c_ulong(0)
        r = _syscall(NR[0], depth, ctypes.addressof(ctx), 0, 0, 0, 0)
        if r != 0:
            err = ctypes.get_errno()
            return None, f"io_setup refused ({err}: {__import__('os').strerror(err)})"
        return cls(ctx.value, depth), ""

    def read(self, fds, base, offs, dests, sizes, got, ns, timed):
        n = len(offs)
        iocbs = np.zeros((max(n, 1), 8), np.int64)
        ptrs = iocbs.ctypes.data + 64 * np.arange(max(n, 1), dtype=np.int64)
        r = _aio_batch(self.ctx, self.depth, fds, base, offs, dests, sizes, got, ns, timed, iocbs, ptrs,
                       self.events, np.zeros(2, np.int64))
        if r < 0:
            raise OSError(-r, f"io_getevents failed ({-r})")

    def close(self):
        if self.ctx:
            _syscall(NR[1], self.ctx, 0, 0, 0, 0, 0)
            self.ctx = 0
