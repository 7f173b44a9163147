"""The GPU slot cache path (Triton slots), run here on CPU tensors under TRITON_INTERPRET=1; on a CUDA
machine the same test runs on the GPU. Compared with the float64 reference experts."""
import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
pytest.importorskip("triton")

from runtime.checkpoint.reader import Checkpoint  # noqa: E402
from runtime.experts import PlacedExperts, ReferenceExperts, TritonSlots  # noqa: E402
from runtime.plan import Plan  # noqa: E402

DEV = "cuda" if torch.cuda.is_available() else "cpu"


@pytest.mark.parametrize("strategy", ["offload", "hybrid"])
def test_triton_slot_cache_matches_reference(tiny_dir, monkeypatch, strategy):
    if DEV == "cpu" and os.environ.get("TRITON_INTERPRET") != "1":
        pytest.skip("no CUDA and triton already imported without TRITON_INTERPRET=1")
    monkeypatch.setenv("DSV41_SLOT_KERNEL", "triton")
    ck = Checkpoint(tiny_dir)
    placed = PlacedExperts(ck, Plan(moe_strategy=strategy, slot_cache_experts=24, fetch_fraction=0.5), device=DEV)
    assert isinstance(placed.cache.mem, TritonSlots)
    ref = ReferenceExperts(ck)
    g = torch.Generator().manual_seed(3)
    for layer in (2, 5):
        m = torch.randn(3, ck.config.hidden_size, generator=g)
        ids = torch.stack([torch.randperm(ck.config.n_routed_experts, generator=g)[:4] for _ in range(3)])
        w = torch.rand(3, 4, generator=g)
        y = placed.routed(layer, m, ids, w)
        r = ref.routed(layer, m.double(), ids, w.double())
        assert ((y.double() - r).norm() / r.norm()) < 1e-5
    assert placed.cache.misses > 0 and placed.seconds["device_moe"] > 0
    placed.close()


@pytest.mark.parametrize("kernel", ["numba", "triton"])
@pytest.mark.parametrize("strategy,slots", [("offload", 1), ("offload", 2), ("hybrid", 2), ("hybrid", 3)])
def test_a_cache_smaller_than_the_call_runs_in_rounds(tiny_dir, monkeypatch, kernel, strategy, slots):
    """5 tokens x top-4 of 16 experts need up to 16 distinct experts: more than the slots. The device
    runs them in rounds (each resident before it computes); the result is the reference's."""
    if kernel == "triton":
        if DEV == "cpu" and os.environ.get("TRITON_INTERPRET") != "1":
            pytest.skip("no CUDA and triton already imported without TRITON_INTERPRET=1")
        monkeypatch.setenv("DSV41_SLOT_KERNEL", "triton")
    ck = Checkpoint(tiny_dir)
    placed = PlacedExperts(ck, Plan(moe_strategy=strategy, slot_cache_experts=slots, fetch_fraction=1.0),
                           device=DEV if kernel == "triton" else "cpu")
    ref = ReferenceExperts(ck)
    g = torch.Generator().manual_seed(slots)
    m = torch.randn(5, ck.config.hidden_size, generator=g)
    ids = torch.stack([torch.randperm(ck.config.n_routed_experts, generator=g)[:4] for _ in range(5)])
    w = torch.rand(5, 4, generator=g)
    assert len(set(ids.reshape(-1).tolist())) > slots
    for _ in range(2):                                   # the second call starts from the first one's cache
        y = placed.routed(3, m, ids, w)
        r = ref.routed(3, m.double(), ids, w.double())
        assert ((y.double() - r).norm() / r.norm()) < 1e-5
    assert len(placed.cache.where) <= slots
    placed.close()


# The device path through the Engine (offload and hybrid, caches smaller than a call, all of it), the
# Triton slots standing in for the GPU on CPU tensors: greedy tokens equal the float64 reference's and
# logits within the runtime's tolerance. Pinned host banks need CUDA (torch pins only with a driver),
# so they run in scripts/gpu_check.sh on a lent GPU machine, not here.
DEVICE_COVER = [Plan(moe_strategy="offload", slot_cache_experts=2, prefill_chunk=512),
                Plan(moe_strategy="hybrid", slot_cache_experts=20, fetch_fraction=0.5, prefill_chunk=512, host_expert_budget_gib=0.0004),
                Plan(moe_strategy="offload", slot_cache_experts=128, prefill_chunk=512, cpu_threads=1)]


@pytest.mark.parametrize("plan", DEVICE_COVER, ids=lambda p: f"{p.moe_strategy}-s{p.slot_cache_experts}")
def test_the_device_path_through_the_engine(tiny_dir, monkeypatch, plan):
    if DEV == "cpu" and os.environ.get("TRITON_INTERPRET") != "1":
        pytest.skip("no CUDA and triton already imported without TRITON_INTERPRET=1")
    from tokenizers import Tokenizer

    from runtime.engine import Engine
    from runtime.workload import make_prompt
    monkeypatch.setenv("DSV41_SLOT_KERNEL", "triton")
    prompt = make_prompt(Tokenizer.from_file(str(tiny_dir / "tokenizer.json")), 24, seed=11)
    ref = Engine(tiny_dir, reference=True).generate(prompt, 4, keep_logits=True)
    e = Engine(tiny_dir, plan, device=DEV)
    try:
        assert isinstance(e.experts.cache.mem, TritonSlots)
        out = e.generate(prompt, 4, keep_logits=True)
    finally:
        e.close()
    assert out.tokens == ref.tokens
    assert max((a.double().cpu() - b).abs().max().item() for a, b in zip(out.logits, ref.logits)) < 1e-3
    assert out.phases.get("device_moe", 0) > 0 or out.prefill_phases.get("device_moe", 0) > 0
