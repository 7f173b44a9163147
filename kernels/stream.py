"""DRAM stream read: the figure every CPU-side ratio is held against.

A numba parallel reduction over a float32 buffer of at least 4x the total last-level cache (every
domain) and 1 GiB (a VM may take ~10 s per GiB the first time a process touches fresh memory), within
the probe memory budget (hostinfo), one contiguous share per thread, read with explicit vector loads.
The buffer is touched first (no page faults in the timed runs); numpy asks the kernel for transparent
huge pages on it (madvise) where the OS offers them.

Which access pattern reads fastest differs by CPU: four interleaved streams per thread beat one by
1.6x on an Emerald Rapids VM, one stream per thread beats four by 1.5x on a Zen 4 (EPYC) VM; 64-byte
loads beat 32-byte ones by ~20% on a Xeon, 32-byte ones beat 64 by 5-7% on the Zen 4 VM (all measured,
kernels/lab/README.md). So every variant (`variants`: sub-streams per thread x load width) is
measured, interleaved round by round, and the figure is the best variant's samples (every variant's
are kept in `extra`). GB/s = buffer bytes / time.
"""
from __future__ import annotations

import numpy as np
from llvmlite import ir
from numba import njit, prange, types
from numba.core import cgutils
from numba.extending import intrinsic, overload

from hostinfo import isa, llc_bytes, probe_budget_bytes
from hostinfo.measure import Measurement, measure
from kernels.threads import set_threads

LAYOUTS = (1, 2, 4)          # interleaved sub-streams per thread
LOAD_BYTES = (64, 32)        # vector load widths tried (64 where the CPU has AVX-512; see `variants`)


class BufferTooSmall(ValueError):
    pass


@intrinsic
def _vsum(typingctx, a, base, q, S_t, L_t):
    """Sum a[base : base + S q] as S interleaved streams of L-float vector loads (<L x float>: 64 bytes
    for L = 16, 32 for L = 8), one vector accumulator per stream. q must be a multiple of 16; S and L
    literals."""
    S = S_t.literal_value if isinstance(S_t, types.IntegerLiteral) else None
    L = L_t.literal_value if isinstance(L_t, types.IntegerLiteral) else None
    if S is None or L is None:
        return None
    sig = types.float32(a, base, q, S_t, L_t)

    def codegen(context, builder, signature, args):
        arr, base_v, q_v, _, _ = args
        f32 = ir.FloatType()
        vf = ir.VectorType(f32, L)
        data = context.make_array(signature.args[0])(context, builder, arr).data
        accs = [cgutils.alloca_once_value(builder, ir.Constant(vf, [0.0] * L)) for _ in range(S)]
        with cgutils.for_range(builder, builder.udiv(q_v, ir.Constant(q_v.type, L))) as loop:
            iL = builder.mul(loop.index, ir.Constant(q_v.type, L))
            for k in range(S):
                off = builder.add(builder.add(base_v, builder.mul(q_v, ir.Constant(q_v.type, k))), iL)
                v = builder.load(builder.bitcast(builder.gep(data, [off]), vf.as_pointer()), align=4)
                builder.store(builder.fadd(builder.load(accs[k]), v), accs[k])
        red = cgutils.get_or_insert_function(builder.module, ir.FunctionType(f32, [f32, vf]), f"llvm.vector.reduce.fadd.v{L}f32")
        tot = ir.Constant(f32, 0.0)
        for k in range(S):
            tot = builder.fadd(tot, builder.call(red, [ir.Constant(f32, 0.0), builder.load(accs[k])]))
        return tot
    return sig, codegen


def _share(a, base, q, streams, L):
    """One thread's share as `streams` sub-streams of <L x float> loads (L a literal)."""
    raise NotImplementedError("numba-only")


@overload(_share, prefer_literal=True, inline="always")
def _ov_share(a, base, q, streams, L):
    if not isinstance(L, types.IntegerLiteral):
        return None
    lanes = L.literal_value

    def share(a, base, q, streams, L):
        if streams == 1:
            return _vsum(a, base, q, 1, lanes)
        if streams == 2:
            return _vsum(a, base, q, 2, lanes)
        return _vsum(a, base, q, 4, lanes)
    return share


@njit(parallel=True, nogil=True, cache=True)
def _sum_streams(a, nthreads, streams, load_bytes=64):
    """Each thread sums its contiguous share as `streams` (1, 2 or 4) interleaved sub-streams of
    `load_bytes` (64 or 32) vector loads."""
    n = a.shape[0] // nthreads
    q = n // streams // 16 * 16
    part = np.zeros(nthreads, np.float32)
    for b in prange(nthreads):
        part[b] = _share(a, b * n, q, streams, 16) if load_bytes == 64 else _share(a, b * n, q, streams, 8)
    return part.sum()


def variants() -> list[tuple[int, int]]:
    """(sub-streams per thread, load bytes) the probe measures: 64-byte loads only where the CPU has
    AVX-512 (elsewhere LLVM splits them into the 32-byte ones measured anyway). Which reads DRAM fastest
    is the CPU's: 64-byte loads beat LLVM's 32-byte ones by ~20% on a Xeon, 32-byte ones beat 64 by
    5-7% on a Zen 4 VM (which splits 512-bit ops in two; kernels/lab/README.md)."""
    widths = LOAD_BYTES if isa().startswith("avx512") else (32,)
    return [(S, w) for w in widths for S in LAYOUTS]


def variant_name(v: tuple[int, int]) -> str:
    return f"{v[0]}x{v[1]}B"


def stream_buffer_bytes(min_bytes: int = 1 << 30) -> tuple[int, str]:
    """-> (bytes, note): 4x the total LLC and at least `min_bytes`, within the probe memory budget; the
    note says when the budget kept the buffer under 4x the LLC (then part of it is a cache figure)."""
    llc, cap = llc_bytes(), probe_budget_bytes()
    n = int(min(max(4 * llc, min_bytes), cap)) // 4096 * 4096
    if n >= 4 * llc:
        return n, ""
    return n, (f"buffer {n / 2**20:.0f} MiB: the probe memory budget ({cap / 2**20:.0f} MiB) keeps it under 4x the "
               f"total last-level cache ({llc / 2**20:.0f} MiB), so part of the figure is cache")


def stream_buffer(nbytes: int | None = None) -> tuple[np.ndarray, str]:
    """-> (float32 buffer of ones, note): `stream_buffer_bytes()` unless `nbytes` is given. The stream and
    copy probes can share it: on a VM the first touch of fresh memory can cost seconds per GiB."""
    note = ""
    if nbytes is None:
        nbytes, note = stream_buffer_bytes()
    return np.ones(nbytes // 4, np.float32), note


def _sized(nbytes, buf, note) -> tuple[int, str, bool]:
    """-> (bytes, note, asked): a given buffer's size and note, an asked-for size, or the default."""
    if buf is not None:
        return buf.nbytes, note, not note
    if nbytes is None:
        return (*stream_buffer_bytes(), False)
    return nbytes, "", True


def dram_stream_read(threads: int, nbytes: int | None = None, repeats: int = 7, buf: np.ndarray | None = None,
                     note: str = "") -> Measurement:
    """GB/s read by `threads`: every variant (`variants`), `repeats` rounds (each round runs every variant
    once, so drift hits all alike), the best variant's samples; extra: the variant (`layout`, with its
    sub-streams and load width) and every variant's median and samples. Over `buf` and its `note` (a
    `stream_buffer`) when given, else a fresh buffer.
    An asked-for size under 4x the LLC is refused (it would measure the cache); the default size and a
    stream_buffer's carry a note instead."""
    nbytes, note, asked = _sized(nbytes, buf, note)
    if asked and nbytes < 4 * llc_bytes():
        raise BufferTooSmall(f"a {nbytes / 2**20:.0f} MiB buffer is under 4x the last-level cache "
                             f"({llc_bytes() / 2**20:.0f} MiB): the probe would measure the cache, not DRAM")
    a = np.ones(nbytes // 4, np.float32) if buf is None else buf
    set_threads(threads)
    vs = variants()
    samples = {v: [] for v in vs}
    for v in vs:                                               # compile and warm every variant
        _sum_streams(a, threads, *v)
    for _ in range(repeats):
        for v in vs:
            samples[v] += measure(lambda v=v: _sum_streams(a, threads, *v), repeats=1, warmup=0).samples
    gbs = {v: sorted(nbytes / t / 1e9 for t in ts) for v, ts in samples.items()}
    best = max(vs, key=lambda v: np.median(gbs[v]))
    return Measurement(tuple(nbytes / t / 1e9 for t in samples[best]), "GB/s", note=note,
                       extra={"buffer_bytes": nbytes, "streams_per_thread": best[0], "load_bytes": best[1],
                              "layout": variant_name(best),
                              "layout_median_gbs": {variant_name(v): round(float(np.median(x)), 2) for v, x in gbs.items()},
                              "layout_samples_gbs": {variant_name(v): [round(y, 3) for y in x] for v, x in gbs.items()}})


@njit(parallel=True, nogil=True, cache=True)
def _copy(dst, src, nthreads):
    n = src.shape[0] // nthreads
    for b in prange(nthreads):
        dst[b * n:(b + 1) * n] = src[b * n:(b + 1) * n]


def dram_copy(threads: int, nbytes: int | None = None, repeats: int = 5, buf: np.ndarray | None = None,
              note: str = "") -> Measurement:
    """memcpy-style copy (source + destination = the stream buffer: `buf`'s two halves when given);
    GB/s counts bytes copied (read + write = 2x that). An asked-for size under 2x the LLC per side is
    refused."""
    nbytes, note, asked = _sized(nbytes, buf, note)
    if asked and nbytes // 2 < 2 * llc_bytes():
        raise BufferTooSmall(f"a {nbytes / 2**21:.0f} MiB copy is too small against the {llc_bytes() / 2**20:.0f} MiB last-level cache")
    nbytes //= 2
    if buf is None:
        src, dst = np.ones(nbytes // 4, np.float32), np.zeros(nbytes // 4, np.float32)
    else:
        src, dst = buf[:nbytes // 4], buf[nbytes // 4:2 * (nbytes // 4)]
    set_threads(threads)
    m = measure(lambda: _copy(dst, src, threads), repeats=repeats, warmup=1)
    return Measurement(m.map(lambda s: nbytes / s / 1e9, "GB/s").samples, "GB/s", note=note, extra={"buffer_bytes": 2 * nbytes})
