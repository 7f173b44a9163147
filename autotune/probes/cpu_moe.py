"""CPU-MoE probe: the project's kernel at a given expert geometry, batch widths and thread counts.

Fresh experts every step from a random bank of at least 4x the *total* last-level cache (every domain)
and never fewer than 2 * top_k + 8 experts (a verify batch draws from 2 * top_k), within the probe
memory budget (hostinfo); when the budget keeps the bank inside 4x the LLC the figure says so.
GB/s = distinct expert bytes / time; GFLOP/s = 2 * 3 * H * I * tokens * top_k / time. Each figure keeps
its raw samples.
"""
from __future__ import annotations

import numpy as np

from hostinfo.measure import Measurement, measure
from kernels.cpu_moe import DEFAULT_FETCH, DEFAULT_INPUTS, FETCHES, GROUP, ROW_INPUTS, ROW_STREAMS, Fp4Bank, expert_ffn
from kernels.probe_bank import bank_size, step_ids

# name -> (hidden, expert intermediate, top_k): the served geometries every profile carries
GEOMETRIES = {"deepseek-v4.1-flash": (5120, 2304, 6), "deepseek-v4-flash": (4096, 2048, 6)}


def random_bank(H: int, I: int, top_k: int, seed: int = 0, budget: int | None = None) -> tuple[Fp4Bank, str]:
    n, note = bank_size(H, I, top_k, budget)
    return Fp4Bank.random(n, H, I, seed=seed), note


def cpu_moe(bank: Fp4Bank, tokens: int, threads: int, top_k: int, repeats: int = 10, note: str = "",
            streams: int = 4, inputs: int = DEFAULT_INPUTS, fetch: str = DEFAULT_FETCH) -> Measurement:
    """tokens == 1: decode (top_k fresh experts); 2..8: a verify batch whose experts overlap (drawn
    from 2*top_k); > 8: a prefill width (all tokens on one expert per step)."""
    H, E = bank.hidden, bank.n_experts
    if E < 2 * top_k + 8:
        raise ValueError(f"a probe bank needs >= 2 * top_k + 8 = {2 * top_k + 8} experts, this one has {E}")
    rng = np.random.default_rng(tokens * 7 + threads)
    x = rng.standard_normal((tokens, H)).astype(np.float32)
    state = {"i": 0}

    def ids_at(i):
        if tokens <= 8:
            return step_ids(i, tokens, top_k, E, 2 * top_k, rng)
        return np.full((tokens, 1), i % E)
    plans = [ids_at(i) for i in range(max(repeats + 4, 16))]
    sizes = [len(np.unique(p)) * bank.expert_bytes for p in plans]

    def step():
        i = state["i"] % len(plans)
        state["i"] += 1
        ids = plans[i]
        expert_ffn(x, ids, np.ones(ids.shape, np.float32), bank, threads=threads, streams=streams, inputs=inputs, fetch=fetch)
    m = measure(step, repeats=repeats, warmup=2)
    nbytes = float(np.mean(sizes))
    k = plans[0].shape[1]
    flop = 2 * 3 * H * bank.inter * tokens * k
    g = Measurement(m.map(lambda s: nbytes / s / 1e9, "GB/s").samples, "GB/s", note=note,
                    extra={"gflops": flop / m.median / 1e9, "bank_experts": E, "top_k": top_k, "streams": streams,
                           "inputs": inputs, "fetch": fetch})
    return g


VERIFY_TOKENS = 8     # the wide call the row layout is also judged on (a DSpark verify block, a small batch)


def pick_layout(batch1: dict, wide: dict) -> int:
    """{layout: GB/s samples} at batch 1 and at a verify batch of VERIFY_TOKENS -> the layout with the
    best geometric mean of the two medians. Batch 1 alone is not enough: rows in order let one row
    decode serve up to 8 inputs (4 rows apart: always 4), and on the AMX Xeon VM a verify of 8 read
    1.20x faster in order while batch 1 was a tie (1.01; kernels/lab/README.md). A layout that wins
    batch 1 clearly (1.4-1.6x on some hosts) still wins."""
    score = {s: float(np.median(batch1[s])) * float(np.median(wide[s])) for s in batch1}
    return max(score, key=score.get)


def row_streams(bank: Fp4Bank, threads: int, top_k: int, rounds: int = 5, note: str = "", repeats: int = 3) -> tuple[int, dict, dict]:
    """Which row layout (kernels/cpu_moe.py ROW_STREAMS) this host should read its experts in: batch 1 and
    a verify of VERIFY_TOKENS (rows in order with 8 inputs a decode, 4 rows apart with their 4), fresh
    experts, every layout once per round (drift hits all alike), judged by `pick_layout`.
    -> (the layout, {layout: batch-1 samples}, {layout: verify samples})."""
    one, wide = {s: [] for s in ROW_STREAMS}, {s: [] for s in ROW_STREAMS}
    for _ in range(rounds):
        for s in ROW_STREAMS:
            one[s] += cpu_moe(bank, 1, threads, top_k, repeats=repeats, note=note, streams=s).samples
            wide[s] += cpu_moe(bank, VERIFY_TOKENS, threads, top_k, repeats=repeats, note=note, streams=s,
                               inputs=max(ROW_INPUTS) if s == 1 else DEFAULT_INPUTS).samples
    fig = lambda by: {s: Measurement(tuple(v), "GB/s", note=note) for s, v in by.items()}  # noqa: E731
    return pick_layout(one, wide), fig(one), fig(wide)


def row_inputs(bank: Fp4Bank, threads: int, top_k: int, rounds: int = 5, note: str = "", repeats: int = 3,
               tokens: int = 8) -> tuple[int, dict]:
    """How many inputs one row decode should serve (kernels/cpu_moe.py ROW_INPUTS) on this host, rows in
    order: a verify batch of `tokens` (GB/s of distinct expert bytes), every choice once per round.
    -> (the faster one, {inputs: samples})."""
    samples = {n: [] for n in ROW_INPUTS}
    for _ in range(rounds):
        for n in ROW_INPUTS:
            samples[n] += cpu_moe(bank, tokens, threads, top_k, repeats=repeats, note=note, streams=1, inputs=n).samples
    best = max(ROW_INPUTS, key=lambda n: float(np.median(samples[n])))
    return best, {n: Measurement(tuple(v), "GB/s", note=note) for n, v in samples.items()}


def row_fetch(bank: Fp4Bank, threads: int, top_k: int, streams: int, rounds: int = 5, note: str = "",
              repeats: int = 3) -> tuple[str | None, dict]:
    """How a one-input call of the lanes kernel should fetch its weights on this host (kernels/fp4_lanes.py
    FETCHES; a batch-1 step's calls are all one input's, and most of a batch's): batch 1, fresh experts,
    each way once per round. -> (the faster one, {fetch: samples}); (None, {}) on a path with rows in
    order, which fetches one way."""
    if not GROUP:
        return None, {}
    samples = {f: [] for f in FETCHES}
    for _ in range(rounds):
        for f in FETCHES:
            samples[f] += cpu_moe(bank, 1, threads, top_k, repeats=repeats, note=note, streams=streams, fetch=f).samples
    best = max(FETCHES, key=lambda f: float(np.median(samples[f])))
    return best, {f: Measurement(tuple(v), "GB/s", note=note) for f, v in samples.items()}
