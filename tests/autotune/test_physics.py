"""The cost model's strategy physics on synthetic GPU hosts: what hybrid pays and offload does not, the
DRAM cap on the contended pair, and a crossover that moves with the slot cache (LESSONS.md 1, 3, 4)."""
import pytest

from autotune.costmodel import predict
from runtime.checkpoint.footprint import Footprint
from runtime.config import ModelConfig
from runtime.plan import Plan
from runtime.workload import Workload

WL = Workload(1024, 64)


def fig(v, unit="GB/s"):
    return {"median": v, "min": v, "max": v, "samples": [v], "unit": unit, "source": "assumed"}


def host(*, dram=200.0, cpu=100.0, gather=25.0, fixed=(30.0, 20.0, 60.0), contended=None, cores=32):
    """A GPU host built from the figures a test states (every figure `assumed`: synthetic)."""
    m = {"dram_stream_read_gbs": fig(dram), "pcie_gather_gbs": fig(gather), "pcie_h2d_gbs": fig(gather),
         "pcie_d2h_gbs": fig(gather), "gpu_mem_gbs": fig(1500.0), "gpu_tflops": fig(200.0, "TFLOP/s"),
         "matmul_tflops": fig(3.0, "TFLOP/s"), "nvme_seq_read_gbs": fig(7.0), "moe_dispatch_fixed_us": fig(fixed[0], "us"),
         "moe_fixed_us": {s: fig(v, "us") for s, v in zip(("cpu", "offload", "hybrid"), fixed)},
         "cpu_moe_gbs": [{**fig(cpu), "geometry": "any", "tokens": 1, "threads": cores}], "nvme_randread_4k": []}
    if contended:
        m["contended"] = [{"pair": "cpu_moe+pcie_gather", "cpu_moe_gbs": fig(contended[0]), "pcie_gather_gbs": fig(contended[1])}]
    return {"host": {"name": "synthetic", "hard": {"gpu_name": "a GPU", "gpu_vram_gib": 4000, "ram_gib": 2048,
                                                     "physical_cores": cores}}, "measurements": m}


@pytest.fixture(scope="module")
def v4():
    return Footprint.from_config(ModelConfig.preset("deepseek-v4-flash"))


@pytest.fixture(scope="module")
def small_experts():     # V4-Flash with experts an eighth the size: the fixed costs weigh more
    return Footprint.from_config(ModelConfig.preset("deepseek-v4-flash").replace(moe_intermediate_size=256))


def best(profile, fp, strategy, slots=0):
    """The strategy's best decode tok/s over the fetch fraction (what the search would find)."""
    fracs = [i / 20 for i in range(21)] if strategy == "hybrid" else [0.5]
    return max(predict(Plan(moe_strategy=strategy, slot_cache_experts=slots, fetch_fraction=f, max_context=8192),
                       profile, fp, WL).decode_tok_s for f in fracs)


def test_large_fixed_costs_and_small_experts_rank_offload_above_hybrid(small_experts):
    h = host(cpu=60.0, gather=50.0, fixed=(300.0, 15.0, 400.0))
    assert best(h, small_experts, "offload") > best(h, small_experts, "hybrid")


def test_a_small_gather_and_a_fast_cpu_rank_hybrid_first(v4):
    h = host(cpu=100.0, gather=15.0, dram=200.0, fixed=(30.0, 20.0, 45.0))
    hybrid = best(h, v4, "hybrid")
    assert hybrid > best(h, v4, "cpu") and hybrid > best(h, v4, "offload")


def test_hybrid_pays_fixed_costs_offload_does_not(v4):
    """With equal bandwidth sums, raising only hybrid's per-layer fixed cost lowers only hybrid."""
    a, b = host(fixed=(30.0, 20.0, 40.0)), host(fixed=(30.0, 20.0, 400.0))
    assert best(b, v4, "hybrid") < best(a, v4, "hybrid")
    assert best(b, v4, "offload") == best(a, v4, "offload")
    d = predict(Plan(moe_strategy="hybrid", max_context=8192), b, v4, WL).terms["decode_moe_s"] - \
        predict(Plan(moe_strategy="hybrid", max_context=8192), a, v4, WL).terms["decode_moe_s"]
    assert d == pytest.approx(v4.num_layers * 360e-6)                 # L x the difference, per token


def test_the_crossover_moves_with_the_slot_cache(v4):
    h = host(cpu=60.0, gather=30.0, fixed=(30.0, 20.0, 300.0))
    assert best(h, v4, "hybrid", slots=0) > best(h, v4, "offload", slots=0)          # few hits: CPU bandwidth helps
    assert best(h, v4, "hybrid", slots=10000) < best(h, v4, "offload", slots=10000)  # most hit: fixed costs dominate


def test_the_contended_pair_is_capped_by_dram_read(v4):
    """Both sides read host DRAM: a contended pair summing above DRAM read is scaled to it."""
    capped = host(dram=80.0, cpu=100.0, gather=30.0, contended=(90.0, 30.0))
    roomy = host(dram=500.0, cpu=100.0, gather=30.0, contended=(90.0, 30.0))
    plan = Plan(moe_strategy="hybrid", fetch_fraction=0.25, max_context=8192, cpu_threads=32)
    t_capped = predict(plan, capped, v4, WL).terms["decode_moe_s"]
    t_roomy = predict(plan, roomy, v4, WL).terms["decode_moe_s"]
    miss = v4.num_layers * v4.top_k * v4.expert_bytes
    fixed = v4.num_layers * 60e-6
    assert t_capped - fixed >= miss / 80e9 * (1 - 1e-9)                # never faster than DRAM read allows
    assert t_roomy < t_capped


def test_hybrid_without_a_gather_figure_or_fixed_cost_names_the_key(v4):
    from autotune.costmodel import MissingFigure
    h = host()
    del h["measurements"]["moe_fixed_us"]["hybrid"]
    with pytest.raises(MissingFigure, match="moe_fixed_us.hybrid"):
        predict(Plan(moe_strategy="hybrid", max_context=8192), h, v4, WL)


def test_every_term_names_its_source_and_every_assumption_is_flagged(v4):
    from autotune.costmodel import TERMS
    from runtime.profile import load_profile
    epyc = load_profile("profiles/5090-epyc.json")
    r = predict(Plan(moe_strategy="hybrid", max_context=8192), epyc, v4, WL)
    assert set(TERMS) - {"draft"} <= set(r.sources) and "routing" in r.sources
    words = ("measured", "published", "formula", "assumed")
    assert all(any(w in s for w in words) for s in r.sources.values()), r.sources
    for k, s in r.sources.items():
        if s.startswith("assumed") or "not measured" in s:
            assert any(n.startswith(f"{k}: ") for n in r.notes), k          # flagged in the output
    assert "published" in r.sources["moe"] and "assumed" in r.sources["routing"]


def test_concurrency_shares_each_step_and_an_itl_budget_binds(v4):
    """n streams on one step read the union of n independent tokens' experts: aggregate tok/s grows
    with n but less than n-fold, each stream slows; the search honours an ITL budget."""
    from autotune.search import search
    h = host()
    plan = Plan(max_context=8192, max_num_seqs=8)
    one = predict(plan, h, v4, WL)
    eight = predict(plan, h, v4, Workload(1024, 64, concurrency=8))
    assert "aggregate_tok_s" not in one.terms and eight.terms["concurrency"] == 8
    assert one.decode_tok_s < eight.terms["aggregate_tok_s"] < 8 * one.decode_tok_s
    assert eight.decode_tok_s < one.decode_tok_s                          # per stream
    assert eight.terms["itl_s"] == pytest.approx(1 / eight.decode_tok_s)
    capped = predict(plan.replace(max_num_seqs=2), h, v4, Workload(1024, 64, concurrency=8))
    assert capped.terms["concurrency"] == 2
    tight = Workload(1024, 64, concurrency=8, itl_budget_s=1 / one.decode_tok_s * 1.5)
    assert not predict(plan, h, v4, tight).feasible
    _, results = search(h, v4, tight, n_trials=300)
    assert results and all(r.feasible and r.terms["itl_s"] <= tight.itl_budget_s for _, r in results)


def test_dspark_composes_with_concurrency():
    """n DSpark streams verify n blocks of d + 1 in one step: the step reads more experts than one
    stream's block and fewer than n separate blocks; aggregate tok/s grows with n, each stream slows."""
    v41 = Footprint.from_config(ModelConfig.preset("deepseek-v4.1-flash"))
    h = host()
    plan = Plan(max_context=8192, max_num_seqs=4, dspark=True, draft_length=3)
    one = predict(plan, h, v41, WL)
    four = predict(plan, h, v41, Workload(1024, 64, concurrency=4))
    assert four.terms["concurrency"] == 4 and four.terms["dspark_accepted"] == one.terms["dspark_accepted"] > 1
    u1, u4 = one.terms["dspark_union_experts"], four.terms["dspark_union_experts"]
    assert u1 < u4 < min(4 * u1, v41.n_routed_experts)
    assert one.decode_tok_s < four.terms["aggregate_tok_s"] < 4 * one.decode_tok_s
    assert four.decode_tok_s < one.decode_tok_s
    assert four.terms["decode_draft_s"] == pytest.approx(one.terms["decode_draft_s"], rel=0.05)   # 4x drafts for 4x tokens
