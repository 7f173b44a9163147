"""DRAM stream read: the figure every CPU-side ratio is held against.

A numba parallel reduction (4 sub-streams per thread) over a float32 buffer of at least 4x the total
last-level cache (every domain) and 2 GiB, within the probe memory budget (hostinfo), one contiguous
share per thread; the buffer is touched first (no page faults in the timed runs). GB/s = buffer
bytes / time.
"""
from __future__ import annotations

import numpy as np
from llvmlite import ir
from numba import njit, prange, types
from numba.core import cgutils
from numba.extending import intrinsic

from hostinfo import llc_bytes, probe_budget_bytes
from hostinfo.measure import Measurement, measure
from kernels.threads import set_threads


class BufferTooSmall(ValueError):
    pass


@intrinsic
def _vsum4(typingctx, a, base, q):
    """Sum a[base : base + 4q] as four interleaved streams of 64-byte loads (<16 x float>, explicit:
    LLVM's auto-vectorizer picks 256-bit vectors here, which reads ~20% less from DRAM than 512-bit
    loads do on this CPU), one vector accumulator per stream. q must be a multiple of 16."""
    sig = types.float32(a, base, q)

    def codegen(context, builder, signature, args):
        arr, base_v, q_v = args
        f32 = ir.FloatType()
        vf = ir.VectorType(f32, 16)
        data = context.make_array(signature.args[0])(context, builder, arr).data
        accs = [cgutils.alloca_once_value(builder, ir.Constant(vf, [0.0] * 16)) for _ in range(4)]
        with cgutils.for_range(builder, builder.udiv(q_v, ir.Constant(q_v.type, 16))) as loop:
            i16 = builder.mul(loop.index, ir.Constant(q_v.type, 16))
            for k in range(4):
                off = builder.add(builder.add(base_v, builder.mul(q_v, ir.Constant(q_v.type, k))), i16)
                v = builder.load(builder.bitcast(builder.gep(data, [off]), vf.as_pointer()), align=4)
                builder.store(builder.fadd(builder.load(accs[k]), v), accs[k])
        red = cgutils.get_or_insert_function(builder.module, ir.FunctionType(f32, [f32, vf]), "llvm.vector.reduce.fadd.v16f32")
        tot = ir.Constant(f32, 0.0)
        for k in range(4):
            tot = builder.fadd(tot, builder.call(red, [ir.Constant(f32, 0.0), builder.load(accs[k])]))
        return tot
    return sig, codegen


@njit(parallel=True, nogil=True, cache=True)
def _sum_streams(a, nthreads):
    """Each thread sums its contiguous share as 4 interleaved sub-streams: one sequential stream per
    thread leaves DRAM bandwidth unused here (7.4 vs 11.8 GB/s on one thread, measured)."""
    n = a.shape[0] // nthreads
    q = n // 4 // 16 * 16
    part = np.zeros(nthreads, np.float32)
    for b in prange(nthreads):
        part[b] = _vsum4(a, b * n, q)
    return part.sum()


def stream_buffer_bytes(min_bytes: int = 2 << 30) -> tuple[int, str]:
    """-> (bytes, note): 4x the total LLC and at least `min_bytes`, within the probe memory budget; the
    note says when the budget kept the buffer under 4x the LLC (then part of it is a cache figure)."""
    llc, cap = llc_bytes(), probe_budget_bytes()
    n = int(min(max(4 * llc, min_bytes), cap)) // 4096 * 4096
    if n >= 4 * llc:
        return n, ""
    return n, (f"buffer {n / 2**20:.0f} MiB: the probe memory budget ({cap / 2**20:.0f} MiB) keeps it under 4x the "
               f"total last-level cache ({llc / 2**20:.0f} MiB), so part of the figure is cache")


def dram_stream_read(threads: int, nbytes: int | None = None, repeats: int = 7) -> Measurement:
    """GB/s read by `threads`; an explicit `nbytes` under 4x the LLC is refused (it would measure the cache)."""
    note = ""
    if nbytes is None:
        nbytes, note = stream_buffer_bytes()
    elif nbytes < 4 * llc_bytes():
        raise BufferTooSmall(f"a {nbytes / 2**20:.0f} MiB buffer is under 4x the last-level cache "
                             f"({llc_bytes() / 2**20:.0f} MiB): the probe would measure the cache, not DRAM")
    a = np.ones(nbytes // 4, np.float32)
    set_threads(threads)
    m = measure(lambda: _sum_streams(a, threads), repeats=repeats, warmup=1)
    return Measurement(m.map(lambda s: nbytes / s / 1e9, "GB/s").samples, "GB/s", note=note,
                       extra={"buffer_bytes": nbytes})


@njit(parallel=True, nogil=True, cache=True)
def _copy(dst, src, nthreads):
    n = src.shape[0] // nthreads
    for b in prange(nthreads):
        dst[b * n:(b + 1) * n] = src[b * n:(b + 1) * n]


def dram_copy(threads: int, nbytes: int | None = None, repeats: int = 5) -> Measurement:
    """memcpy-style copy (source + destination = the stream buffer); GB/s counts bytes copied (read +
    write = 2x that). An explicit buffer under 2x the LLC per side is refused."""
    note = ""
    if nbytes is None:
        nbytes, note = stream_buffer_bytes()
    elif nbytes // 2 < 2 * llc_bytes():
        raise BufferTooSmall(f"a {nbytes / 2**21:.0f} MiB copy is too small against the {llc_bytes() / 2**20:.0f} MiB last-level cache")
    nbytes //= 2
    src, dst = np.ones(nbytes // 4, np.float32), np.zeros(nbytes // 4, np.float32)
    set_threads(threads)
    m = measure(lambda: _copy(dst, src, threads), repeats=repeats, warmup=1)
    return Measurement(m.map(lambda s: nbytes / s / 1e9, "GB/s").samples, "GB/s", note=note, extra={"buffer_bytes": 2 * nbytes})
