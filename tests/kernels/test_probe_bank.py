"""The probe bank's size and its steps' experts (kernels/probe_bank.py): the rule every CPU-MoE figure's bank
follows (the profiler's probe, benchmarks/cpu_moe.py, the kernel lab)."""
import numpy as np
import pytest

import kernels.probe_bank as pb

H, I, K = 5120, 2304, 6
EB = pb.expert_bytes(H, I)


def test_an_expert_is_its_codes_and_scales():
    assert EB == 3 * H * I // 2 + 3 * H * I // 32
    from kernels.cpu_moe import Fp4Bank
    assert Fp4Bank.random(1, 64, 32).expert_bytes == pb.expert_bytes(64, 32)


@pytest.mark.parametrize("llc_mib,want", [(32, 2 * K + 8), (300, -(-4 * 300 * 2**20 // EB))])
def test_the_bank_spans_4x_the_llc_and_never_fewer_than_a_verify_needs(monkeypatch, llc_mib, want):
    monkeypatch.setattr(pb, "llc_bytes", lambda: llc_mib * 2**20)
    assert pb.bank_size(H, I, K, budget=1 << 40) == (want, "")


def test_a_budget_under_4x_the_llc_says_so_and_one_under_the_floor_refuses(monkeypatch):
    monkeypatch.setattr(pb, "llc_bytes", lambda: 300 * 2**20)
    n, note = pb.bank_size(H, I, K, budget=30 * EB)
    assert n == 30 and "under 4x the total last-level cache" in note
    with pytest.raises(pb.ProbeTooLarge, match="probe bank needs 20 experts"):
        pb.bank_size(H, I, K, budget=19 * EB)


def test_batch_1_meets_fresh_experts_and_a_verify_s_pool_moves_over_the_whole_bank():
    rng, E, pool = np.random.default_rng(0), 2 * K + 8, 10
    b1 = [pb.step_ids(i, 1, K, E, 0, rng) for i in range(10)]
    assert all(p.shape == (1, K) for p in b1)
    assert all(not set(a.flat) & set(b.flat) for a, b in zip(b1, b1[1:]))      # consecutive steps share none
    steps = [pb.step_ids(i, 8, K, E, pool, rng) for i in range(3 * E)]
    for i, p in enumerate(steps):
        assert p.shape == (8, K) and all(len(set(row)) == K for row in p)
        assert set(((p - (pool + 1) * i) % E).flat) <= set(range(pool))
    # at the floor of 2 pools, a stride of one pool would meet 2 pools only; every expert is met here
    assert len({int(e) for p in steps for e in p.flat}) == E
    assert len({frozenset(p.flat) for p in steps}) > 2


def test_a_batch_bank_holds_every_assignment_apart(monkeypatch):
    monkeypatch.setattr(pb, "llc_bytes", lambda: 32 * 2**20)
    assert pb.bank_size(H, I, K, budget=1 << 40, batch=8) == (8 * K + 8, "")
    assert pb.bank_size(H, I, K, budget=1 << 40, batch=1)[0] == 2 * K + 8          # batch 1 and a verify: the old floor
    with pytest.raises(pb.ProbeTooLarge, match="probe bank needs 56 experts"):
        pb.bank_size(H, I, K, budget=55 * EB, batch=8)


@pytest.mark.parametrize("tokens,routed,E", [(8, 384, 56), (2, 384, 20), (8, 16, 56), (4, 384, 24)])
def test_a_batch_meets_the_model_s_overlap_on_fresh_bank_experts(tokens, routed, E):
    rng = np.random.default_rng(1)
    steps = [pb.batch_ids(i, tokens, K, E, routed, rng) for i in range(400)]
    for i, p in enumerate(steps):
        assert p.shape == (tokens, K) and all(len(set(row)) == K for row in p)     # a token's top-k are distinct
        lo = tokens * K * i
        assert set(((p - lo) % E).flat) == set(range(len(np.unique(p))))           # consecutive from the step's base
    # the overlap is the model's: distinct experts per step as uniform routing over `routed` gives
    mean = np.mean([len(np.unique(p)) for p in steps])
    want = routed * (1 - (1 - K / routed) ** tokens)
    assert abs(mean - want) < 0.03 * want, (mean, want)
    assert len({int(e) for p in steps for e in p.flat}) == E                       # the whole bank is met
    with pytest.raises(ValueError, match=f"needs a bank of >= {tokens * K} experts"):
        pb.batch_ids(0, tokens, K, tokens * K - 1, routed, rng)
