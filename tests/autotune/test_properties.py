"""Property tests over the cost model and the search (Hypothesis): for any profile with figures in
physical ranges (GPU or not, NVMe figures or not, a contended pair or not) and any plan the search can
propose, `predict` returns finite positive times or refuses naming the figure it lacks; memory is
never negative; more of any bandwidth never predicts a slower plan; the search never returns an
infeasible plan and, when nothing fits, says which budget broke."""
import copy
import math

import optuna
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from autotune.costmodel import MissingFigure, predict
from autotune.search import CHUNKS, CONTEXTS, search, suggest_plan, why_none
from runtime.checkpoint.footprint import Footprint
from runtime.config import ModelConfig
from runtime.workload import Workload

FOOTPRINTS = {k: Footprint.from_config(ModelConfig.preset(k)) for k in ("tiny", "deepseek-v4.1-flash")}
SETTINGS = settings(max_examples=80, deadline=None, suppress_health_check=[HealthCheck.too_slow])


def fig(x, unit):
    return {"median": x, "min": x, "max": x, "samples": [x], "unit": unit, "source": "measured"}


@st.composite
def profiles(draw, fp: Footprint):
    gpu = draw(st.booleans())
    f = st.floats
    cores = draw(st.integers(1, 128))
    cpu = draw(f(0.5, 200))
    m = {"dram_stream_read_gbs": fig(draw(f(5, 600)), "GB/s"),
         "cpu_moe_gbs": [dict(fig(cpu, "GB/s"), geometry=fp.geometry, tokens=1, threads=cores)],
         "moe_dispatch_fixed_us": fig(draw(f(1, 500)), "us"), "matmul_tflops": fig(draw(f(0.05, 50)), "TFLOP/s"),
         "pcie_h2d_gbs": {"skipped": "no CUDA"}, "pcie_d2h_gbs": {"skipped": "no CUDA"},
         "pcie_gather_gbs": {"skipped": "no CUDA"}, "nvme_seq_read_gbs": {"skipped": "none"},
         "nvme_randread_4k": {"skipped": "none"}}
    if draw(st.booleans()):
        m["nvme_seq_read_gbs"] = fig(draw(f(0.2, 15)), "GB/s")
        m["nvme_randread_4k"] = [{"qd": q, "iops": draw(f(1e3, 3e6)), "p50_us": 50.0, "p95_us": 90.0, "path": "x"}
                                 for q in (1, 8, 32)]
    vram = 0.0
    if gpu:
        vram = draw(f(8, 192))
        m.update(gpu_mem_gbs=fig(draw(f(100, 8000)), "GB/s"), gpu_tflops=fig(draw(f(5, 2000)), "TFLOP/s"),
                 pcie_h2d_gbs=fig(draw(f(1, 64)), "GB/s"), pcie_gather_gbs=fig(draw(f(0.5, 60)), "GB/s"))
        if draw(st.booleans()):
            m["contended"] = [{"pair": "cpu_moe+pcie_gather", "cpu_moe_gbs": fig(cpu * draw(f(0.2, 1)), "GB/s"),
                               "pcie_gather_gbs": fig(m["pcie_gather_gbs"]["median"] * draw(f(0.2, 1)), "GB/s")}]
    hard = {"cpu_model": "x", "isa": [], "physical_cores": cores, "numa_nodes": 1, "ram_gib": draw(f(4, 2048)),
            "gpu_name": "GPU" if gpu else "", "gpu_vram_gib": vram, "pcie_link": ""}
    return {"schema": "dsv41-profile/1", "host": {"name": "h", "hard": hard}, "measurements": m}


@st.composite
def plans(draw, profile, fp: Footprint, wl: Workload):
    """A plan exactly as the search proposes it: suggest_plan over an Optuna FixedTrial of drawn values."""
    gpu = bool(profile["host"]["hard"]["gpu_name"])
    cores = profile["host"]["hard"]["physical_cores"]
    need = wl.prompt_tokens + wl.max_tokens
    params = {"moe_strategy": draw(st.sampled_from(["cpu", "offload", "hybrid"] if gpu else ["cpu"])),
              "fetch_fraction": draw(st.integers(0, 20)) * 0.05,
              "slot_cache_experts": draw(st.integers(0, 160)) * 25 if gpu else 0,
              "cpu_threads_choice": draw(st.sampled_from(sorted({0, max(1, cores - 2), max(1, cores // 2), 1}))),
              "host_expert_share": draw(st.floats(0, 1.25)),
              "prefill_chunk": draw(st.sampled_from(CHUNKS)), "prefill_mode": "full",
              "prefill_moe_path": draw(st.sampled_from(["cpu", "device"] if gpu else ["cpu"])),
              "max_context": draw(st.sampled_from([c for c in CONTEXTS if c >= need] or [need])),
              "engram_placement": draw(st.sampled_from(["host", "nvme_direct", "nvme_mmap"] if fp.engram_rows_total else ["host"])),
              "engram_io_depth": draw(st.sampled_from([1, 2, 4, 8, 16, 32, 64])),
              "engram_row_cache_mib": draw(st.sampled_from([0, 256, 1024, 4096])),
              "prefill_buffer_experts": draw(st.sampled_from([1, 4, 16, 64])),
              "engram_scales_in_ram": draw(st.booleans()), "dspark": draw(st.booleans()), "draft_length": draw(st.integers(1, 5))}
    return suggest_plan(optuna.trial.FixedTrial(params), profile, fp, wl, None, False)


@st.composite
def cases(draw):
    fp = FOOTPRINTS[draw(st.sampled_from(sorted(FOOTPRINTS)))]
    wl = Workload(draw(st.sampled_from([16, 1024, 8192])), draw(st.sampled_from([4, 64])))
    prof = draw(profiles(fp))
    return fp, wl, prof, draw(plans(prof, fp, wl))


@SETTINGS
@given(cases())
def test_predict_is_finite_positive_or_names_what_it_lacks(case):
    fp, wl, prof, plan = case
    try:
        r = predict(plan, prof, fp, wl)
    except MissingFigure as e:
        assert "'" in str(e) and "lacks measurements" in str(e)
        return
    assert math.isfinite(r.decode_tok_s) and r.decode_tok_s > 0
    assert math.isfinite(r.ttft_s) and r.ttft_s > 0
    assert all(v >= 0 for v in r.memory.values()), r.memory
    assert all(math.isfinite(v) and v >= 0 for v in r.terms.values() if isinstance(v, float)), r.terms
    assert r.feasible == (not r.why)


BANDWIDTHS = ("dram_stream_read_gbs", "cpu_moe_gbs", "pcie_gather_gbs", "gpu_mem_gbs", "nvme_seq_read_gbs",
              "nvme_randread_4k", "matmul_tflops", "gpu_tflops", "pcie_h2d_gbs", "contended")


def _scaled(prof, key, k):
    p = copy.deepcopy(prof)
    m = p["measurements"]
    if key not in m or (isinstance(m[key], dict) and "skipped" in m[key]):
        return None
    items = m[key] if isinstance(m[key], list) else [m[key]]
    for it in items:
        for v in ([it] if "median" in it or "iops" in it else [x for x in it.values() if isinstance(x, dict)]):
            for f in ("median", "min", "max", "iops"):
                if f in v:
                    v[f] *= k
    return p


@SETTINGS
@given(cases(), st.sampled_from(BANDWIDTHS), st.floats(1.01, 10))
def test_more_of_any_bandwidth_never_predicts_a_slower_plan(case, key, k):
    fp, wl, prof, plan = case
    faster = _scaled(prof, key, k)
    if faster is None:
        return
    try:
        a, b = predict(plan, prof, fp, wl), predict(plan, faster, fp, wl)
    except MissingFigure:
        return
    assert b.decode_tok_s >= a.decode_tok_s * (1 - 1e-9), (key, a.terms, b.terms)
    assert b.ttft_s <= a.ttft_s * (1 + 1e-9), (key, a.terms, b.terms)


@settings(max_examples=12, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(cases())
def test_the_search_returns_only_feasible_plans_or_says_which_budget_broke(case):
    fp, wl, prof, _ = case
    study, results = search(prof, fp, wl, n_trials=60)
    assert all(r.feasible for _, r in results)
    if not results:
        assert "broke a budget" in why_none(study) and "(" in why_none(study)


def test_nothing_fits_is_named():
    """A 4 GiB host without a GPU for the full V4.1: every plan breaks the RAM budget; the search says so."""
    fp = FOOTPRINTS["deepseek-v4.1-flash"]
    m = {"dram_stream_read_gbs": fig(20.0, "GB/s"), "moe_dispatch_fixed_us": fig(50.0, "us"),
         "matmul_tflops": fig(1.0, "TFLOP/s"), "nvme_seq_read_gbs": fig(3.0, "GB/s"),
         "cpu_moe_gbs": [dict(fig(10.0, "GB/s"), geometry=fp.geometry, tokens=1, threads=2)],
         "nvme_randread_4k": [{"qd": 8, "iops": 5e4, "p50_us": 80.0, "p95_us": 120.0, "path": "x"}]}
    prof = {"host": {"name": "small", "hard": {"physical_cores": 2, "ram_gib": 4, "gpu_name": "", "gpu_vram_gib": 0}},
            "measurements": m}
    study, results = search(prof, fp, Workload(1024, 64), n_trials=40)
    assert not results and "host RAM" in why_none(study)
