"""Compile (or load from numba's cache) every kernel the runtime calls and start the thread pools, on
toy inputs: one-time process costs, kept out of what a plan's run is measured to add."""
from __future__ import annotations

import numpy as np
import torch

from kernels.cpu_moe import Fp4Bank, expert_ffn
from kernels.fp8_dense import TILE_MIN_TOKENS, Fp8Weight, fp8_linear


def warm_up(threads: int | None = None) -> None:
    rng = np.random.default_rng(0)
    bank = Fp4Bank.random(2, 64, 64)
    for T in (1, TILE_MIN_TOKENS):                          # decode and prefill widths
        x = rng.standard_normal((T, 64)).astype(np.float32)
        expert_ffn(x, np.zeros((T, 1), np.int64), np.ones((T, 1), np.float32), bank, threads=threads)
        w = Fp8Weight(rng.integers(0, 0x7e, (64, 64), dtype=np.uint8), np.full((2, 2), 120, np.uint8), (32, 32))
        fp8_linear(torch.from_numpy(x), w, threads=threads)
    torch.ones(64, 64) @ torch.ones(64, 64)
