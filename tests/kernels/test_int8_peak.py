"""The int8 products' peak (kernels/int8_peak.py) computes what it counts: every chain's products, exactly,
on every instruction path this CPU can run, and its rate is the MACs it did over the time it took."""
import numpy as np
import pytest

from hostinfo import isa, runnable_isas

MODES = {"avx2": 1, "avx512": 2, "avx512vnni": 3, "avx512vbmi": 4, "avx2vnni": 5}


def _runnable(path):
    return path in runnable_isas()


@pytest.mark.parametrize("path", ["avx512vnni", "avx512", "avx2vnni", "avx2"])   # avx512vbmi's products are avx512vnni's
def test_peak_kernel_sums_exactly_what_it_counts(path):
    if not _runnable(path):
        pytest.skip(f"this CPU cannot run the {path} path")
    from kernels import int8_peak as P
    mode = MODES[path]
    for seed in (1, 2):
        codes, q = P.buffers(mode, 2, seed=seed)
        out = np.zeros((2, P.CHAINS), np.int64)
        iters = 2 * P.SLOTS + 3                      # every slot, some twice; far from int32 wrap
        P.runner(mode)(iters, codes, q, out, 2)
        for t in range(2):
            assert np.array_equal(out[t], P.reference(mode, iters, codes[t], q[t])), (path, seed, t)
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
