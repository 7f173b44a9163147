"""Measurement: the one place timing statistics are computed (median, spread, noise flag).

Every probe and benchmark times with `measure(fn)`: warm-up calls first (compilation, page faults
and caches stay out of the figure), then `repeats` timed calls with perf_counter; the raw samples are
kept. A figure is `noisy` when IQR / median > 10% (torch.utils.benchmark's rule): it is reported
with that flag, never silently averaged.
"""
from __future__ import annotations

import time
from dataclasses import asdict, dataclass, field

import numpy as np

NOISE_IQR = 0.10


@dataclass(frozen=True)
class Measurement:
    samples: tuple                 # raw values, in the unit below
    unit: str = "s"
    source: str = "measured"
    note: str = ""
    extra: dict = field(default_factory=dict)

    def __post_init__(self):
        if len(self.samples) == 0:
            raise ValueError("a Measurement needs at least one sample")

    @property
    def median(self) -> float:
        return float(np.median(self.samples))

    @property
    def min(self) -> float:
        return float(np.min(self.samples))

    @property
    def max(self) -> float:
        return float(np.max(self.samples))

    @property
    def iqr(self) -> float:
        q1, q3 = np.percentile(self.samples, [25, 75])
        return float(q3 - q1)

    @property
    def noisy(self) -> bool:
        return self.median != 0 and self.iqr / abs(self.median) > NOISE_IQR

    def map(self, f, unit: str) -> "Measurement":
        """The same samples through f (e.g. seconds -> GB/s); min/max follow the samples."""
        return Measurement(tuple(float(f(s)) for s in self.samples), unit, self.source, self.note, dict(self.extra))

    def to_dict(self) -> dict:
        d = asdict(self)
        d.update(samples=list(self.samples), median=self.median, min=self.min, max=self.max, noisy=self.noisy)
        return d


def measure(fn, repeats: int = 10, warmup: int = 2, setup=None) -> Measurement:
    """Time fn() `repeats` times after `warmup` untimed calls; `setup()` (untimed) runs before each."""
    for _ in range(warmup):
        if setup:
            setup()
        fn()
    out = []
    for _ in range(repeats):
        if setup:
            setup()
        t0 = time.perf_counter()
        fn()
        out.append(time.perf_counter() - t0)
    return Measurement(tuple(out), "s")


def paired_ratio(num, den) -> Measurement:
    """Round by round, num[i].median / den[i].median: a figure over a limit measured beside it in the same
    round -> the ratios as one Measurement (unit "ratio"). Its median is the figure to print, not the
    ratio of pooled medians: on a VM whose DRAM bandwidth flips between phases a few seconds long (the Zen
    4 VM: 2-thread stream 35 or 63 GB/s), a pooled median divides a kernel timed in one phase by a stream
    timed in the other (kernels/lab/README.md)."""
    if len(num) != len(den) or not num:
        raise ValueError(f"paired_ratio: {len(num)} figures against {len(den)} limits; one of each per round")
    return Measurement(tuple(n.median / d.median for n, d in zip(num, den)), "ratio")
