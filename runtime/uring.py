"""io_uring (the engine of fio's `io_uring`) through raw syscalls: one thread keeps `depth` O_DIRECT
reads in flight, in compiled code (no liburing needed). As fio does by default, each read is submitted
as soon as a slot is free (one io_uring_enter each, SUBMIT_BATCH) and the loop waits only when `depth`
are in flight: on the Zen 2 VM's virtio disk, refilling the queue 32 at a time read 150-162 k IOPS at
QD 32 where one at a time read 187-219 k (kernels/lab/uring_submit.c, a C loop of each form; likely,
not traced: a batch reaches the virtio device as one notification, so its first reads wait for its last).

Kernel AIO (runtime/aio.py) needs an io_submit and an io_getevents per read; here one syscall does
both, and completions are read from shared memory. The rings are set up in Python (io_uring_setup,
three mmaps); the loop runs in numba over numpy views of them. Where the kernel refuses io_uring
(seccomp or containers commonly do; kernels before 5.6 lack IORING_OP_READ) `UringContext.open` says
why and the reader takes kernel AIO or threads.

Layouts (linux/io_uring.h): io_uring_params = 10 u32 (sq_entries, cq_entries, flags, ..., features at
word 5), then sq offsets (head, tail, ring_mask, ring_entries, flags, dropped, array, resv, u64) and
cq offsets (head, tail, ring_mask, ring_entries, overflow, cqes, flags, resv, u64); an SQE is 64 bytes
(opcode u8 @0, fd s32 @4, off u64 @8, addr u64 @16, len u32 @24, user_data u64 @32); a CQE 16 bytes
(user_data u64, res s32, flags u32).
"""
from __future__ import annotations

import ctypes
import mmap
import os

import numpy as np
from numba import njit

from runtime.aio import _clock, _syscall

SYS_SETUP, SYS_ENTER = 425, 426              # the same numbers on x86_64 and aarch64
IORING_OP_READ = 22
IORING_ENTER_GETEVENTS = 1
IORING_FEAT_SINGLE_MMAP = 1
OFF_SQ_RING, OFF_CQ_RING, OFF_SQES = 0, 0x8000000, 0x10000000
SUBMIT_BATCH = 1                             # reads per submission (see above)


@njit(nogil=True)          # not cached: it holds ctypes function pointers
def _uring_batch(fd, depth, sq, sqo, sqes, cq, cqo, cqes64, cqes32, fds, base, offs, dests, sizes, got, ns, timed, ts):
    """sq / cq: u32 views of the rings; sqo = (head, tail, mask, array) and cqo = (head, tail, mask, cqes)
    word offsets; sqes: int64 [entries, 8]. got[i] = bytes read or -errno; -1 where never submitted.
    -> 0, or -1 when io_uring_enter failed (the caller retries the rest on the slow path)."""
    n = offs.shape[0]
    for i in range(n):
        got[i] = -1
    sq_tail, sq_mask = np.uint32(sq[sqo[1]]), sq[sqo[2]]
    cq_mask = cq[cqo[2]]
    nxt, inflight, done = 0, 0, 0
    while done < nxt or nxt < n:
        k = min(min(depth - inflight, n - nxt), SUBMIT_BATCH)   # (numba: a 3-argument min leaks the arrays' references)
        wait = 0
        if inflight + k >= depth or nxt + k >= n:                   # block only with the queue full or all sent
            wait = 1
        if timed:
            _clock(1, ts.ctypes.data)
        for j in range(nxt, nxt + k):
            s = sq_tail & sq_mask
            sqes[s, 0] = IORING_OP_READ | (fds[j] << 32)            # opcode, flags 0, ioprio 0, fd
            sqes[s, 1] = offs[j]
            sqes[s, 2] = base + dests[j]
            sqes[s, 3] = sizes[j]                                    # len, rw_flags 0
            sqes[s, 4] = j                                           # user_data
            sqes[s, 5] = 0
            sqes[s, 6] = 0
            sqes[s, 7] = 0
            sq[sqo[3] + s] = s
            if timed:
                ns[j] = ts[0] * 1_000_000_000 + ts[1]
            sq_tail += np.uint32(1)
        sq[sqo[1]] = sq_tail                                         # publish (the syscall orders it)
        r = _syscall(SYS_ENTER, fd, k, wait, IORING_ENTER_GETEVENTS, 0, 0)
        if r < 0:
            return -1
        nxt += k
        inflight += k
        head, tail = np.uint32(cq[cqo[0]]), np.uint32(cq[cqo[1]])
        if timed and head != tail:
            _clock(1, ts.ctypes.data)
        while head != tail:
            c = head & cq_mask
            i = cqes64[c * 2 + cqo[3] // 2]
            got[i] = cqes32[c * 4 + cqo[3] + 2]
            if timed:
                ns[i] = ts[0] * 1_000_000_000 + ts[1] - ns[i]
            head += np.uint32(1)
            inflight -= 1
            done += 1
        cq[cqo[0]] = head
    return 0


class UringContext:
    """One io_uring of `depth` entries; `read` is not re-entrant (the reader holds a lock)."""

    def __init__(self, fd, depth, maps, sq, sqo, sqes, cq, cqo):
        self.fd, self.depth, self.maps = fd, depth, maps
        self.sq, self.sqo, self.sqes, self.cq, self.cqo = sq, sqo, sqes, cq, cqo
        self.cq64, self.cq32 = cq.view(np.int64), cq.view(np.int32)

    @classmethod
    def open(cls, depth: int) -> tuple["UringContext | None", str]:
        """-> (ring, "") or (None, why io_uring is unavailable here)."""
        entries = 1 << max(0, (depth - 1).bit_length())
        params = (ctypes.c_uint32 * 30)()
        fd = _syscall(SYS_SETUP, entries, ctypes.addressof(params), 0, 0, 0, 0)
        if fd < 0:
            err = ctypes.get_errno()
            return None, f"io_uring_setup refused ({err}: {os.strerror(err)})"
        p = list(params)
        sq_entries, cq_entries, features = p[0], p[1], p[5]
        sq_off, cq_off = p[10:18], p[20:28]
        sq_size = sq_off[6] + sq_entries * 4
        cq_size = cq_off[5] + cq_entries * 16
        try:
            rw = dict(flags=mmap.MAP_SHARED | getattr(mmap, "MAP_POPULATE", 0), prot=mmap.PROT_READ | mmap.PROT_WRITE)
            if features & IORING_FEAT_SINGLE_MMAP:
                ring = mmap.mmap(fd, max(sq_size, cq_size), offset=OFF_SQ_RING, **rw)
                sq_map = cq_map = ring
            else:
                sq_map = mmap.mmap(fd, sq_size, offset=OFF_SQ_RING, **rw)
                cq_map = mmap.mmap(fd, cq_size, offset=OFF_CQ_RING, **rw)
            sqe_map = mmap.mmap(fd, sq_entries * 64, offset=OFF_SQES, **rw)
        except OSError as e:
            os.close(fd)
            return None, f"io_uring rings could not be mapped ({e})"
        sq = np.frombuffer(sq_map, np.uint32)
        cq = np.frombuffer(cq_map, np.uint32, (len(cq_map) // 16) * 4)
        sqes = np.frombuffer(sqe_map, np.int64).reshape(sq_entries, 8)
        sqo = np.array([sq_off[0] // 4, sq_off[1] // 4, sq_off[2] // 4, sq_off[6] // 4], np.int64)
        cqo = np.array([cq_off[0] // 4, cq_off[1] // 4, cq_off[2] // 4, cq_off[5] // 4], np.int64)
        return cls(fd, min(depth, sq_entries), {sq_map, cq_map, sqe_map}, sq, sqo, sqes, cq, cqo), ""

    def read(self, fds, base, offs, dests, sizes, got, ns, timed):
        r = _uring_batch(self.fd, self.depth, self.sq, self.sqo, self.sqes, self.cq, self.cqo, self.cq64, self.cq32,
                         fds, base, offs, dests, sizes, got, ns, timed, np.zeros(2, np.int64))
        if r < 0:
            raise OSError(ctypes.get_errno() or 5, "io_uring_enter failed")

    def close(self):
        if self.fd >= 0:
            del self.sq, self.cq, self.sqes, self.cq64, self.cq32
            for m in self.maps:
                m.close()
            os.close(self.fd)
            self.fd = -1
