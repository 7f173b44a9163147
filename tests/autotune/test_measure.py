import numpy as np
import pytest

from hostinfo import llc_bytes
from hostinfo.measure import Measurement, measure
from kernels.stream import BufferTooSmall, dram_stream_read


def test_statistics_on_known_samples():
    m = Measurement((4.0, 1.0, 3.0, 2.0, 5.0), "s")
    assert (m.median, m.min, m.max) == (3.0, 1.0, 5.0)
    assert m.iqr == 2.0 and m.noisy                       # IQR/median = 0.67
    tight = Measurement((10.0, 10.1, 9.9, 10.05, 9.95))
    assert not tight.noisy
    g = m.map(lambda s: 10 / s, "GB/s")
    assert g.unit == "GB/s" and g.max == 10.0 and g.min == 2.0 and g.samples[0] == 2.5
    d = m.to_dict()
    assert d["samples"] == [4.0, 1.0, 3.0, 2.0, 5.0] and d["median"] == 3.0 and d["noisy"] is True
    with pytest.raises(ValueError):
        Measurement(())


def test_measure_runs_warmup_and_keeps_raw_samples():
    calls = []
    m = measure(lambda: calls.append(1), repeats=5, warmup=3, setup=lambda: calls.append(0))
    assert len(m.samples) == 5 and calls.count(1) == 8 and calls.count(0) == 8


def test_measure_times_the_call_and_not_its_setup():
    import time
    m = measure(lambda: time.sleep(0.02), repeats=3, warmup=1, setup=lambda: time.sleep(0.05))
    assert all(0.019 <= s < 0.045 for s in m.samples), m.samples     # the sleep in fn, none of the setup's


def test_dram_probe_refuses_a_buffer_under_4x_llc():
    with pytest.raises(BufferTooSmall, match="4x the last-level cache"):
        dram_stream_read(1, nbytes=llc_bytes())


def test_stream_and_copy_share_one_buffer_and_keep_its_note(monkeypatch):
    """The profiler touches one buffer for both probes; a budget-capped buffer's note travels with it, an
    unexplained small one is refused as an asked-for size is."""
    from kernels.stream import dram_copy, stream_buffer
    monkeypatch.setenv("DSV41_LLC_MIB", "1")
    buf, note = stream_buffer(16 << 20)                  # asked for: 16 MiB, 4x the 4 MiB floor of a 1 MiB LLC
    assert buf.nbytes == 16 << 20 and note == "" and (buf == 1).all()
    r = dram_stream_read(1, repeats=1, buf=buf)
    c = dram_copy(1, repeats=1, buf=buf)
    assert r.extra["buffer_bytes"] == c.extra["buffer_bytes"] == 16 << 20 and r.median > 0 and c.median > 0
    assert (buf[: buf.size // 2] == 1).all()             # the copy read the first half into the second
    small = np.ones((2 << 20) // 4, np.float32)
    with pytest.raises(BufferTooSmall):
        dram_stream_read(1, repeats=1, buf=small)
    with pytest.raises(BufferTooSmall):
        dram_copy(1, repeats=1, buf=small)
    m = dram_stream_read(1, repeats=1, buf=small, note="capped by the probe memory budget")
    assert m.note == "capped by the probe memory budget"


def test_every_stream_variant_reads_every_element_once():
    """The probe's sum over a buffer of ones is its element count, exactly (small enough for float32),
    in every variant it measures and in both load widths, with 1 and 2 threads."""
    from kernels.stream import LAYOUTS, _sum_streams
    n = 2 * 4 * 16 * 64                                   # threads x sub-streams x lanes x steps: no remainder
    a = np.ones(n, np.float32)
    for threads in (1, 2):
        for S in LAYOUTS:
            for width in (64, 32):
                assert _sum_streams(a, threads, S, width) == n, (threads, S, width)
    b = np.zeros(n, np.float32)
    b[::97] = 1.0                                         # not a sum any layout could get by reading one part twice
    assert _sum_streams(b, 2, 4, 32) == b.sum()


def test_a_ratio_is_taken_round_by_round_against_the_limit_timed_beside_it():
    """A VM whose bandwidth flips between two phases (36 and 64 GB/s): the kernel reads 0.8 of the stream
    of its own phase, and in one round of five the phase flipped between the stream read and the kernel.
    The median of the per-round ratios says 0.8; the pooled medians divide a slow-phase kernel by a
    fast-phase stream."""
    from hostinfo.measure import paired_ratio
    streams = [64.0, 36.0, 36.0, 64.0, 64.0]
    kernels = [0.8 * s for s in (64.0, 36.0, 36.0, 64.0, 36.0)]      # the last round's kernel ran in the slow phase
    S = [Measurement((s, s), "GB/s") for s in streams]
    K = [Measurement((k,), "GB/s") for k in kernels]
    r = paired_ratio(K, S)
    assert r.unit == "ratio" and len(r.samples) == 5
    assert abs(r.median - 0.8) < 1e-12 and abs(r.min - 0.45) < 1e-12
    pooled = np.median(kernels) / np.median([x for m in S for x in m.samples])
    assert abs(pooled - 0.45) < 1e-12                               # what a ratio of pooled medians says
    with pytest.raises(ValueError, match="2 figures against 1 limits"):
        paired_ratio(K[:2], S[:1])
    with pytest.raises(ValueError, match="one of each per round"):
        paired_ratio([], [])
