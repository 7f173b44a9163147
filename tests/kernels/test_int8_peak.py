"""The int8 products' peak (kernels/int8_peak.py) computes what it counts: every chain's products, exactly,
on every instruction path this CPU can run, and its rate is the MACs it did over the time it took."""
import numpy as np
import pytest

from hostinfo import isa, runnable_isas

MODES = {"avx2": 1, "avx512": 2, "avx512vnni": 3, "avx512vbmi": 4, "avx2vnni": 5}


def _runnable(path):
    return path in runnable_isas()


@pytest.mark.parametrize("lanes", [False, True])                                 # the superblock kernel's mix; lanes as rows'
@pytest.mark.parametrize("path", ["avx512vnni", "avx512", "avx2vnni", "avx2"])   # avx512vbmi's products are avx512vnni's
def test_peak_kernel_sums_exactly_what_it_counts(path, lanes):
    if not _runnable(path):
        pytest.skip(f"this CPU cannot run the {path} path")
    from kernels import int8_peak as P
    mode = MODES[path]
    for seed in (1, 2):
        codes, q = P.buffers(mode, 2, seed=seed)
        out = np.zeros((2, P.CHAINS), np.int64)
        iters = 2 * P.SLOTS + 3                      # every slot, some twice; far from int32 wrap
        P.runner(mode, lanes)(iters, codes, q, out, 2)
        for t in range(2):
            assert np.array_equal(out[t], P.reference(mode, iters, codes[t], q[t], lanes)), (path, seed, t)
        assert lanes or not np.array_equal(out[0], P.reference(mode, iters, codes[0], q[0], True))
    assert P.macs_per_iter(mode) == P.CHAINS * 8 * {1: 32, 2: 64, 3: 64, 4: 64, 5: 32}[mode]


def test_peak_rate_is_macs_over_time():
    if isa() == "scalar":
        pytest.skip("no int8 SIMD path on this CPU (the scalar kernel has no products' roof to measure)")
    from kernels import int8_peak as P
    mode = MODES[isa()]
    m = P.measure_peak(mode, 1, seconds=0.02, repeats=3)
    assert m.unit == "MAC/s" and len(m.samples) == 3
    # a CPU core does between 1 and 1000 int8 products per ns: anything outside is a counting bug
    assert 1e9 < m.median < 1e12, m.median


@pytest.mark.parametrize("shape, dtype", [((2, 2048), np.uint8), ((3, 12288), np.int8), ((5, 7), np.float32), ((1,), np.int64)])
def test_peak_buffers_start_on_a_cache_line(shape, dtype):
    """A 64-byte load from a buffer 16 bytes past a line spans two: the peak read 0.65x there on the Zen 4
    VM, so its roof moved with where malloc put the buffers. Every buffer and every thread's row starts
    on a line; the helper keeps the shape, dtype and values written through it."""
    from kernels import int8_peak as P
    from kernels.arrays import aligned_empty
    for _ in range(8):                                   # malloc's offsets vary from call to call
        a = aligned_empty(shape, dtype)
        assert a.shape == shape and a.dtype == dtype and a.flags.c_contiguous and a.ctypes.data % 64 == 0
        want = np.arange(a.size).astype(dtype).reshape(shape)
        a[...] = want
        assert np.array_equal(a, want)
    codes, q = P.buffers(3, 2)
    for b in (codes, q):
        assert all(b[t].ctypes.data % 64 == 0 for t in range(len(b)))
