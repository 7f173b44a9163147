"""The host's int8 dot-product peak at the CPU-MoE kernel's instruction mix: the compute roof of wide calls.

A verify block or a continuous batch of W tokens meets each expert's bytes once but does W inputs' int8
products on them, so past some width the kernel (kernels/fp4_i8.py) is bound by its products, not by
DRAM. This measures that limit on the same instruction path (`MODE` in kernels/cpu_moe.py): per iteration, 8 code vectors
loaded once (the kernel decodes them once per row) and, for each of `CHAINS` inputs, 8 input vectors
loaded and 8 products summed into that input's accumulator (`_Step.dot`: `vpdpbusd` with VNNI,
`vpmaddubsw` + `vpmaddwd` without). Everything sits in L1, so the figure is the products' rate with no
decode, no float epilogue and no DRAM: an upper bound the real kernel does not reach.

    macs per iteration = CHAINS x 8 x (bytes per vector)      (one u8 x s8 product per byte)

`int8_dot_peak(mode, lanes, iters, codes, q, out)`: out[c] = the sum, over iterations and lanes, of input
chain c's products (int32 lanes, wrapping as the hardware does; exact for small `iters`, tested).
`lanes` 1 measures the lanes-as-rows kernel's mix (kernels/fp4_lanes.py, the banks' layout where
kernels/cpu_moe.py GROUP is set): each product's inputs are 4 bytes loaded and broadcast to every lane
(the first 4 of each input vector here), not a whole vector: the same products, fewer bytes loaded.
"""
from __future__ import annotations

import time

import numba
import numpy as np
from llvmlite import ir
from numba import types
from numba.core import cgutils
from numba.extending import intrinsic

from hostinfo.measure import Measurement, measure
from kernels.arrays import aligned_empty
from kernels.fp4_i8 import STEP, SUPER, _Step, mode_error
from kernels.fp4_simd import _data_ptrs, _literal
from kernels.threads import set_threads

CHAINS = 6                          # independent accumulators (inputs): enough to cover the products' latency
SLOTS = 4                           # iteration i reads slot i % SLOTS of each buffer (no loop-invariant loads)
i8, i32, i64 = ir.IntType(8), ir.IntType(32), ir.IntType(64)


def buffer_bytes(mode: int) -> tuple[int, int]:
    """(code bytes, input bytes) the kernel reads: 2 x SUPER vectors per slot, and that per chain."""
    per_slot = 2 * SUPER * STEP[mode]
    return SLOTS * per_slot, SLOTS * CHAINS * per_slot


def macs_per_iter(mode: int) -> int:
    return CHAINS * 2 * SUPER * STEP[mode]


@intrinsic
def int8_dot_peak(typingctx, mode_t, lanes_t, iters, codes, q, out):
    mode, lanes = _literal(mode_t), _literal(lanes_t)
    if mode is None or lanes is None:
        return None
    if mode not in STEP:
        raise TypeError(mode_error(mode))
    sig = types.void(mode_t, lanes_t, iters, codes, q, out)

    def codegen(context, builder, signature, args):
        cbase, qbase, obase = _data_ptrs(context, builder, signature.args[3:], args[3:], (0, 1, 2))
        st = _Step(builder, STEP[mode], mode)
        nb, c64 = st.nb, (lambda v: ir.Constant(i64, v))  # noqa: E731
        slot = 2 * SUPER * nb
        accs = [cgutils.alloca_once_value(builder, ir.Constant(st.vi, [0] * st.n)) for _ in range(CHAINS)]
        def qload(at):
            if not lanes:
                return st.load(qbase, at, st.vb)
            v = builder.insert_element(ir.Constant(st.vi, ir.Undefined), st.load(qbase, at, i32), ir.Constant(i32, 0))
            return builder.bitcast(builder.shuffle_vector(v, ir.Constant(st.vi, ir.Undefined), ir.Constant(st.vi, [0] * st.n)), st.vb)

        with cgutils.for_range(builder, args[2]) as loop:
            s = builder.urem(loop.index, c64(SLOTS))
            cs = builder.mul(s, c64(slot))
            lohi = [(st.load(cbase, builder.add(cs, c64(2 * k * nb)), st.vb),
                     st.load(cbase, builder.add(cs, c64((2 * k + 1) * nb)), st.vb)) for k in range(SUPER)]
            for c in range(CHAINS):
                qs0 = builder.mul(builder.add(builder.mul(s, c64(CHAINS)), c64(c)), c64(slot))
                qs = [(qload(builder.add(qs0, c64(2 * k * nb))), qload(builder.add(qs0, c64((2 * k + 1) * nb))))
                      for k in range(SUPER)]
                builder.store(st.dot(builder.load(accs[c]), lohi, qs), accs[c])
        red = cgutils.get_or_insert_function(builder.module, ir.FunctionType(i32, [st.vi]),
                                             f"llvm.vector.reduce.add.v{st.n}i32")
        for c in range(CHAINS):
            total = builder.sext(builder.call(red, [builder.load(accs[c])]), i64)
            builder.store(total, builder.gep(obase, [c64(c)]))
        return context.get_dummy_value()
    return sig, codegen


_RUNNERS: dict = {}


def runner(mode: int, lanes: bool = False):
    """run(iters, codes, q, out, threads): the peak kernel on `threads` threads, one compiled function per
    instruction path (the path is a constant in it: a literal argument would cost a dispatch of ~10 ms
    per call, and one function holding every path would not compile where the CPU lacks the widest)."""
    key = (mode, int(lanes))
    if key not in _RUNNERS:
        mix = key[1]

        @numba.njit(parallel=True)
        def run(iters, codes, q, out, threads):
            for t in numba.prange(threads):
                int8_dot_peak(mode, mix, iters, codes[t], q[t], out[t])
        _RUNNERS[key] = run
    return _RUNNERS[key]


def buffers(mode: int, threads: int, seed: int = 0):
    """Per thread: code bytes in the kernel's range (2 E2M1 + 12, 0..24) and int8 inputs in [-127, 127], each
    thread's on a cache line boundary (`aligned_empty`; slots are whole vectors, so every load is aligned)."""
    nc, nq = buffer_bytes(mode)
    rng = np.random.default_rng(seed)
    codes, q = aligned_empty((threads, nc), np.uint8), aligned_empty((threads, nq), np.int8)
    codes[...], q[...] = rng.integers(0, 25, codes.shape), rng.integers(-127, 128, q.shape)
    return codes, q


def reference(mode: int, iters: int, codes: np.ndarray, q: np.ndarray, lanes: bool = False) -> np.ndarray:
    """The exact sums in int64 (no int32 wrap: keep iters small): per chain, its products summed."""
    slot, nb = 2 * SUPER * STEP[mode], STEP[mode]
    if lanes:                                                     # each vector's first 4 inputs on every lane
        q = np.repeat(q.reshape(-1, nb)[:, :4].reshape(-1, 1, 4), nb // 4, axis=1).reshape(-1)
    out = np.zeros(CHAINS, np.int64)
    for i in range(iters):
        s = i % SLOTS
        cv = codes[s * slot:(s + 1) * slot].astype(np.int64)
        for c in range(CHAINS):
            qv = q[(s * CHAINS + c) * slot:(s * CHAINS + c + 1) * slot].astype(np.int64)
            out[c] += int(cv @ qv)
    return out


def measure_peak(mode: int, threads: int, seconds: float = 0.2, repeats: int = 5, lanes: bool = False) -> Measurement:
    """int8 products per second on `threads` threads (numba's pool set to that), `repeats` samples of
    ~`seconds` each after a warm-up; `lanes`: the lanes-as-rows kernel's mix (broadcast inputs)."""
    set_threads(threads)
    codes, q = buffers(mode, threads)
    out = np.zeros((threads, CHAINS), np.int64)
    run, iters = runner(mode, lanes), 1 << 16
    run(iters, codes, q, out, threads)                            # compile
    t0 = time.perf_counter()
    run(iters, codes, q, out, threads)
    iters = max(iters, int(iters * seconds / max(time.perf_counter() - t0, 1e-6)))
    m = measure(lambda: run(iters, codes, q, out, threads), repeats=repeats, warmup=1)
    macs = threads * iters * macs_per_iter(mode)
    return m.map(lambda s: macs / s, "MAC/s")
