"""Routing as data: traces from the runtime, the LRU stack-distance curve against an exact replay of the
slot cache, and predicted vs measured hit rates on a prompt the trace never saw."""
import numpy as np
import pytest
from hypothesis import given, settings, strategies as st

from autotune.routing import Routing, curve, simulate, unions
from runtime.engine import Engine
from runtime.plan import Plan
from runtime.routing import RoutingTrace


def random_trace(L, E, K, tokens, seed, skew=0.0, prefill=0):
    rng = np.random.default_rng(seed)
    p = np.exp(skew * rng.standard_normal(E))
    p /= p.sum()
    t = RoutingTrace(L, E, K, "g")
    for phase, n in (("prefill", prefill), ("decode", tokens)):
        t.phase = phase
        for _ in range(n if phase == "decode" else (1 if n else 0)):
            for layer in range(L):
                rows = n if phase == "prefill" else 1
                t.record(layer, np.stack([rng.choice(E, K, replace=False, p=p) for _ in range(rows)]))
    return t


@settings(max_examples=25, deadline=None)
@given(L=st.integers(1, 4), E=st.integers(4, 12), K=st.integers(1, 3), tokens=st.integers(1, 30),
       seed=st.integers(0, 10**6), skew=st.floats(0, 2), prefill=st.integers(0, 8))
def test_one_stack_distance_pass_equals_replaying_the_cache_at_every_slot_count(L, E, K, tokens, seed, skew, prefill):
    """Exact where every call reads one expert; otherwise the order inside a call may differ from the
    runtime's (hits made recent before misses) only for keys at the cache's edge."""
    t = random_trace(L, E, min(K, E), tokens, seed, skew, prefill)
    c = curve(t)
    exact = K == 1 and prefill == 0
    for s, lru, static in zip(c["slots"], c["lru_hit"], c["static_hit"]):
        assert static == pytest.approx(simulate(t, s, "cpu"), abs=1e-12)
        if exact:
            assert lru == pytest.approx(simulate(t, s, "offload"), abs=1e-12)


def test_the_stack_pass_is_within_a_point_of_the_replay_on_a_long_skewed_trace():
    t = random_trace(6, 16, 4, 400, 3, skew=1.0, prefill=32)
    c = curve(t)
    assert max(abs(lru - simulate(t, s, "offload")) for s, lru in zip(c["slots"], c["lru_hit"])) <= 0.01


def test_unions_count_distinct_experts_of_consecutive_tokens():
    t = RoutingTrace(1, 8, 2, "g", phase="decode")
    for ids in ([0, 1], [1, 2], [0, 1], [5, 6]):
        t.record(0, np.array([ids]))
    u = unions(t)
    assert u[1] == 2 and u[2] == pytest.approx(np.mean([3, 3, 4])) and u[4] == 5   # windows 0-1, 1-2, 2-3


def test_without_a_trace_the_uniform_prior_is_used_and_flagged():
    r = Routing(None, 4, 16, 2)
    assert r.source == "assumed" and r.hit(16, "offload") == pytest.approx(0.25)
    assert r.union(3) == pytest.approx(16 * (1 - (1 - 2 / 16) ** 3))
    c = curve(random_trace(4, 16, 2, 20, 0))
    assert Routing(c, 4, 32, 2).source == "assumed"                   # another geometry's curve is not used
    assert Routing(c, 4, 16, 2).source == "measured"


def test_a_trace_saves_and_loads_exactly(tmp_path):
    t = random_trace(3, 8, 2, 5, 1, prefill=4)
    t.save(tmp_path / "r.npz")
    u = RoutingTrace.load(tmp_path / "r.npz")
    assert (u.num_layers, u.n_experts, u.top_k, u.geometry_hash) == (3, 8, 2, "g")
    assert [(a, b, c.tolist()) for a, b, c in u.calls] == [(a, b, c.tolist()) for a, b, c in t.calls]
    (tmp_path / "bad.npz").write_bytes(b"nope")
    with pytest.raises(ValueError, match="bad.npz: not a routing trace"):
        RoutingTrace.load(tmp_path / "bad.npz")


@pytest.fixture(scope="module")
def skewed_tiny(tmp_path_factory):
    from runtime.checkpoint.synth import make_checkpoint
    from runtime.config import ModelConfig
    return make_checkpoint(ModelConfig.preset("tiny"), tmp_path_factory.mktemp("skew"), seed=0, router_skew=0.3)


@pytest.mark.parametrize("which", ["tiny_dir", "skewed_tiny"])
def test_predicted_hit_rate_within_5_points_of_the_runtime_on_another_prompt(which, request):
    ck = request.getfixturevalue(which)
    rng = np.random.default_rng(5)
    traced, fresh = rng.integers(1, 500, 48).tolist(), rng.integers(1, 500, 48).tolist()
    e = Engine(ck, Plan(cpu_threads=1))
    trace = e.record_routing()
    e.generate(traced, 64)
    e.close()
    r = Routing(curve(trace), trace.num_layers, trace.n_experts, trace.top_k)
    assert r.source == "measured" and trace.tokens("decode") == 63 and trace.tokens("prefill") == 48
    worst = 0.0
    for strategy, slots in (("offload", 32), ("offload", 64), ("offload", 96), ("cpu", 32), ("cpu", 96), ("hybrid", 48), ("hybrid", 96)):
        e = Engine(ck, Plan(moe_strategy=strategy, slot_cache_experts=slots, cpu_threads=1, fetch_fraction=0.5))
        measured = e.generate(fresh, 64).hit_rate
        e.close()
        worst = max(worst, abs(r.hit(slots, strategy, 0.5) - measured))
    assert worst <= 0.05, worst
