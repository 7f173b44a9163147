"""CPU-MoE probe: the project's kernel at a given expert geometry, batch widths and thread counts.

Fresh experts every step from a random bank >= 4x the LLC; GB/s = distinct expert bytes / time;
GFLOP/s = 2 * 3 * H * I * tokens / time. Each figure keeps its raw samples.
"""
from __future__ import annotations

import numpy as np

from autotune.host import llc_bytes
from autotune.measure import Measurement, measure
from kernels.cpu_moe import Fp4Bank, expert_ffn

GEOMETRIES = {"deepseek-v4.1-flash": (5120, 2304), "deepseek-v4-flash": (4096, 2048)}


def random_bank(H: int, I: int, seed: int = 0, min_bytes: int | None = None) -> Fp4Bank:
    expert = 3 * H * I * 17 // 32
    n = max(8, int(np.ceil((min_bytes or 4 * llc_bytes()) / expert)))
    return Fp4Bank.random(n, H, I, seed=seed)


def cpu_moe(bank: Fp4Bank, tokens: int, threads: int, top_k: int = 6, repeats: int = 10) -> Measurement:
    """tokens == 1: decode (top_k fresh experts); 2..8: a verify batch whose experts overlap (drawn
    from 2*top_k); > 8: a prefill width (all tokens on one expert per step)."""
    H, E = bank.hidden, bank.n_experts
    rng = np.random.default_rng(tokens * 7 + threads)
    x = rng.standard_normal((tokens, H)).astype(np.float32)
    state = {"i": 0, "bytes": 0}

    def ids_at(i):
        if tokens == 1:
            return ((np.arange(top_k) + top_k * i) % E)[None]
        if tokens <= 8:
            base = (2 * top_k * i) % (E - 2 * top_k)
            return np.stack([base + rng.choice(2 * top_k, top_k, replace=False) for _ in range(tokens)])
        return np.full((tokens, 1), i % E)
    plans = [ids_at(i) for i in range(max(repeats + 4, 16))]
    sizes = [len(np.unique(p)) * bank.expert_bytes for p in plans]

    def step():
        i = state["i"] % len(plans)
        state["i"] += 1
        ids = plans[i]
        expert_ffn(x, ids, np.ones(ids.shape, np.float32), bank, threads=threads)
    m = measure(step, repeats=repeats, warmup=2)
    nbytes = float(np.mean(sizes))
    k = ids_at(0).shape[1]
    flop = 2 * 3 * H * bank.inter * tokens * k
    g = m.map(lambda s: nbytes / s / 1e9, "GB/s")
    g.extra.update(gflops=flop / m.median / 1e9)
    return g
