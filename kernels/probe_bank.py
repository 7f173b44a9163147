"""A random ds_fp4 expert bank that measures the CPU-MoE kernel from DRAM, and the experts each step meets:
the profiler's probe (autotune/probes/cpu_moe.py), the benchmarks and the kernel lab size their banks and
plan their steps here, so every figure of the kernel comes from one rule."""
from __future__ import annotations

import math

import numpy as np

from hostinfo import llc_bytes, probe_budget_bytes


class ProbeTooLarge(ValueError):
    """Even the smallest meaningful bank does not fit the probe memory budget."""


def expert_bytes(H: int, I: int) -> int:
    return 3 * H * I * 17 // 32                    # ds_fp4: 1/2 B per weight + 1/32 B of scale


def bank_size(H: int, I: int, top_k: int, budget: int | None = None, batch: int = 0) -> tuple[int, str]:
    """-> (experts, note) for a probe bank at this geometry: 4x the total LLC, at least 2 * top_k + 8
    (a verify's pool and more), or batch * top_k + 8 where a batch of `batch` independent tokens is
    measured (`batch_ids`: every assignment may meet an expert of its own), at most the budget (note says
    when that keeps it under 4x the LLC)."""
    eb, llc = expert_bytes(H, I), llc_bytes()
    budget = probe_budget_bytes() if budget is None else budget
    floor = max(2, batch) * top_k + 8
    n = max(floor, math.ceil(4 * llc / eb))
    cap = budget // eb
    if cap < floor:
        raise ProbeTooLarge(f"a {H}x{I} probe bank needs {floor} experts ({floor * eb / 2**20:.0f} MiB), over the probe "
                            f"memory budget of {budget / 2**20:.0f} MiB")
    if n <= cap:
        return n, ""
    return cap, (f"bank {cap} experts ({cap * eb / 2**20:.0f} MiB): the probe memory budget ({budget / 2**20:.0f} MiB) keeps it "
                 f"under 4x the total last-level cache ({llc / 2**20:.0f} MiB)"
                 + (", inside the cache: a cache figure, not DRAM" if cap * eb <= llc else ", so part of it is cache"))


def step_ids(i: int, tokens: int, top_k: int, n_experts: int, pool: int, rng) -> np.ndarray:
    """Expert ids [tokens, top_k] of step i over a bank of n_experts: one token's top_k consecutive experts,
    the next top_k at every step (fresh while the bank spans 4x the LLC); or, for 2+ tokens, each token's
    top_k drawn from a pool of `pool` consecutive experts (a verify's or a small batch's overlap), the pool
    moving pool + 1 experts a step, ids wrapping around the bank (a stride of pool would keep a bank of
    2 pools on two pools only)."""
    if tokens == 1:
        return ((np.arange(top_k) + top_k * i) % n_experts)[None]
    base = (pool + 1) * i
    return np.stack([(base + rng.choice(pool, top_k, replace=False)) % n_experts for _ in range(tokens)])


def batch_ids(i: int, tokens: int, top_k: int, n_experts: int, routed: int, rng) -> np.ndarray:
    """Expert ids [tokens, top_k] of step i of a continuous batch: each token's top_k drawn uniformly from
    the model's `routed` experts (independent tokens: on V4.1's 384 a batch of 8 meets ~45 experts, ~1.05
    inputs each), the step's distinct ones placed on consecutive bank experts from tokens * top_k * i
    (wrapping), so a bank of >= tokens * top_k experts (`bank_size(batch=tokens)`) holds every step's
    experts apart whatever its size against the model's, and its overlap is the model's, not the bank's."""
    if n_experts < tokens * top_k:
        raise ValueError(f"a batch of {tokens} x top-{top_k} needs a bank of >= {tokens * top_k} experts, this one has {n_experts}")
    drawn = np.stack([rng.choice(routed, top_k, replace=False) for _ in range(tokens)])
    _, rank = np.unique(drawn, return_inverse=True)
    return (tokens * top_k * i + rank.reshape(drawn.shape)) % n_experts
