"""The cost model against what was published for the 5090-epyc host, and the seed's memory story."""
import copy
import dataclasses
import json

import pytest

from autotune.cli import main as tune_main
from autotune.costmodel import predict
from runtime.profile import ProfileError, assumed_keys, load_profile, save_profile
from autotune.search import search
from runtime.budget import indexer_bound_bytes, kv_state_bytes
from runtime.checkpoint.footprint import Footprint
from runtime.config import ModelConfig
from runtime.plan import Plan, PlanError
from runtime.workload import Workload

GIB = 1 << 30


@pytest.fixture(scope="module")
def epyc():
    return load_profile("profiles/5090-epyc.json")


@pytest.fixture(scope="module")
def v41():
    return Footprint.from_config(ModelConfig.preset("deepseek-v4.1-flash"))


@pytest.fixture(scope="module")
def v4():
    return Footprint.from_config(ModelConfig.preset("deepseek-v4-flash"))


def test_shipped_profile_has_sources_and_flags_assumptions(epyc):
    assert epyc["measurements"]["dram_stream_read_gbs"]["source"] == "published"
    assert epyc["measurements"]["cpu_moe_gbs"][0]["geometry"] == "4096x2048"
    a = assumed_keys(epyc)
    assert "measurements.contended[0].cpu_moe_gbs" in a and "measurements.nvme_seq_read_gbs" in a
    assert "/" not in json.dumps(epyc["measurements"]["nvme_randread_4k"]).split('"path": "')[1][:1]


def test_v4_flash_decode_reproduces_the_published_serving_figure(epyc, v4):
    # the published bench figures in, serving out: 24.5-26.9 tok/s measured; within 15%
    lo, hi = 24.5 * 0.85, 26.9 * 1.15
    freetoken_like = Plan(moe_strategy="cpu", slot_cache_experts=0, max_context=32768)
    assert lo <= predict(freetoken_like, epyc, v4, Workload(1024, 64)).decode_tok_s <= hi
    _, results = search(epyc, v4, Workload(1024, 64), n_trials=400)
    assert lo <= results[0][1].decode_tok_s <= hi


def test_v41_on_that_host_19_tok_s_if_resident_but_it_does_not_fit(epyc, v41):
    # published: "V4.1 estimate there: ~19 tok/s if experts stay resident" (FreeToken #444, REFERENCE.md
    # host B); the first-order physics agrees: the 72-85 GB/s effective there / 4.51 GB routed per token
    assert 72 / 4.51 <= 19 <= 85 / 4.51 + 0.2 and v41.routed_bytes_per_decode_token == pytest.approx(4.51e9, rel=0.01)
    roomy = copy.deepcopy(epyc)
    roomy["host"]["hard"]["ram_gib"] = 1024
    resident = Plan(moe_strategy="cpu", engram_placement="nvme_direct", max_context=32768)
    r = predict(resident, roomy, v41, Workload(1024, 64))
    assert r.feasible and 19 * 0.85 <= r.decode_tok_s <= 19 * 1.15
    assert any("cpu_moe_gbs extrapolated" in n for n in r.notes)
    on_251 = predict(resident, epyc, v41, Workload(1024, 64))
    assert not on_251.feasible and "host RAM" in on_251.why[0]
    tier = predict(resident.replace(host_expert_budget_gib=200), epyc, v41, Workload(1024, 64))
    assert tier.feasible and tier.decode_tok_s < r.decode_tok_s / 2 and tier.terms["nvme_share"] > 0.2


def test_seed_memory_story_as_formulas(epyc, v41):
    assert 263 * v41.expert_bytes / GIB == pytest.approx(4.605, abs=0.001)           # with scales
    assert 263 * 3 * 5120 * 2304 // 2 / GIB == pytest.approx(4.334, abs=0.001)      # the seed's codes-only figure
    plan = Plan(slot_cache_experts=263, max_context=1 << 20, prefill_chunk=256, engram_placement="nvme_direct")
    mem = predict(plan, epyc, v41, Workload(1024, 64)).memory
    assert mem["slots"] == 263 * 18_800_640
    per_context = kv_state_bytes(v41, 1 << 21) - kv_state_bytes(v41, 1 << 20)      # the rings aside
    assert per_context == 890 * 2 ** 20 and 0.89e9 <= per_context <= 0.94e9
    rings = 40 * 127 * (2 * 512 * 4 + 8) + (2 + 2 + 2 + 1) * ((512 + 64) * 4 + 8)     # window rings, row tails
    assert mem["kv"] == kv_state_bytes(v41, 1 << 20) == 890 * 2 ** 20 + rings
    host_nvme = predict(plan, epyc, v41, Workload(1024, 64)).memory["host"]
    host_res = predict(plan.replace(engram_placement="host"), epyc, v41, Workload(1024, 64)).memory["host"]
    reads = 256 * 2 * 24 * 4096                                  # a chunk's Engram rows: one 4 KiB block each
    arenas = 2 * (1 << 20)                                       # the Engram reader's two threads' read arenas
    assert host_res - host_nvme == v41.engram_bytes_total - v41.engram_rows_total * 8 - reads - arenas   # scales stay in RAM
    assert 270 < host_nvme / GIB < 300 and 450 < host_res / GIB < 490                  # seed: ~293 vs ~482 GiB


def test_indexer_peak_binds_the_chunk_ratio_1_layers_included(epyc, v41):
    assert v41.n_blocks_max(1 << 20) == 1 << 20                                     # layers 20-39 keep every position
    wl = Workload(1024, 64)
    big = Plan(max_context=1 << 20, prefill_chunk=16384, engram_placement="nvme_direct", host_expert_budget_gib=200)
    r = predict(big, epyc, v41, wl)
    scores = 4 * 16384 * ((1 << 20) - v41.window_size)                              # fp32 scores: 64 GiB
    assert r.memory["indexer_peak"] == indexer_bound_bytes(big, v41)                # the runtime's accounting
    assert scores < r.memory["indexer_peak"] < 1.02 * scores                        # the tiles are small beside it
    assert not r.feasible and "indexer peak" in r.why[0]
    assert predict(big.replace(prefill_chunk=256), epyc, v41, wl).feasible


def test_search_never_returns_an_infeasible_plan_and_vram_budget_changes_the_pick(epyc, v41):
    wl = Workload(4096, 64)
    _, full = search(epyc, v41, wl, n_trials=400)
    # 20 of the 5090's 32 GiB: the dense weights (10 GiB), embeddings, graphs and a chunk's temporaries
    # (64 heads x 512 latent per token) leave a few GiB for the slot cache
    _, small = search(epyc, v41, wl, n_trials=400, vram_budget_gib=20)
    assert full and small and all(r.feasible for _, r in full + small)
    assert all(r.memory["vram"] <= 20 * GIB * 0.95 for _, r in small)
    assert max(p.slot_cache_experts for p, _ in small) < max(p.slot_cache_experts for p, _ in full)   # it binds


def test_bounded_replay_only_when_allowed(epyc, v41):
    plan = Plan(prefill_mode="bounded_replay", engram_placement="nvme_direct", host_expert_budget_gib=200)
    assert "allow inexact" in predict(plan, epyc, v41, Workload(1024, 64)).why[0]
    _, res = search(epyc, v41, Workload(8192, 64), n_trials=300)
    assert all(p.prefill_mode == "full" for p, _ in res)


def test_cpu_only_host_gets_cpu_plans(epyc, v41):
    cpu_only = copy.deepcopy(epyc)
    cpu_only["host"]["hard"].update(gpu_name="", gpu_vram_gib=0)
    r = predict(Plan(moe_strategy="offload"), cpu_only, v41, Workload(1024, 64))
    assert not r.feasible and "no GPU" in r.why[0]


@pytest.mark.parametrize("field,other", [("cpu_moe_streams", 5 - Plan.cpu_moe_streams),   # 1 <-> 4
                                         ("cpu_moe_inputs", 12 - Plan.cpu_moe_inputs),     # 4 <-> 8
                                         ("cpu_moe_fetch", "near")])
def test_the_cpu_moe_kernels_choices_come_from_the_hosts_measurement(epyc, v41, field, other):
    """The row layout, the inputs per row decode and the fetching are measured facts of the host (the
    profiler's interleaved runs), not searched: every plan carries the faster; a profile without the probe keeps
    the kernel's default."""
    one = copy.deepcopy(epyc)
    one["measurements"][field] = {"best": other, "geometry": "5120x2304", "threads": 2, "gbs": {}}
    _, res = search(one, v41, Workload(1024, 64), n_trials=40)
    assert res and all(getattr(p, field) == other for p, _ in res)
    plain = copy.deepcopy(epyc)
    plain["measurements"].pop(field, None)
    _, res = search(plain, v41, Workload(1024, 64), n_trials=20)
    assert res and all(getattr(p, field) == getattr(Plan, field) for p, _ in res)
    if field == "cpu_moe_inputs":                       # 4 rows apart: the inputs figure cannot apply (the Plan refuses 8)
        one["measurements"]["cpu_moe_streams"] = {"best": 4, "geometry": "5120x2304", "threads": 2, "gbs": {}}
        _, res = search(one, v41, Workload(1024, 64), n_trials=20)
        assert res and all((p.cpu_moe_streams, p.cpu_moe_inputs) == (4, Plan.cpu_moe_inputs) for p, _ in res)


def _engine_curve(profile, fast):
    """Random-read figures at every depth, each engine measured, `fast(qd)` twice the others."""
    one = copy.deepcopy(profile)
    one["measurements"]["nvme_randread_4k"] = [
        {"qd": q, "iops": 2e4 * q ** 0.5 * 2, "p50_us": 90.0, "p95_us": 150.0, "path": "x", "engine": fast(q),
         "engines": {e: {"iops": 2e4 * q ** 0.5 * (2 if e == fast(q) else 1)} for e in ("uring", "aio", "threads")}}
        for q in (1, 2, 4, 8, 16, 32, 64)]
    return one


def test_the_engram_reader_engine_comes_from_the_hosts_measurement(epyc, v41):
    """engram_io_engine is a measured fact of the host at the plan's depth (the profiler's interleaved
    engines): every nvme_direct plan carries the fastest there and is predicted at that engine's figure;
    a plan naming an engine the profile did not measure is refused; an older profile (no engines) keeps auto."""
    fast = lambda q: "threads" if q >= 16 else "aio"       # noqa: E731
    one = _engine_curve(epyc, fast)
    small = copy.deepcopy(one)
    small["host"]["hard"].update(gpu_name="", gpu_vram_gib=0, ram_gib=24.0)   # Engram must leave RAM
    _, res = search(small, v41, Workload(1024, 64), n_trials=300)
    direct = [p for p, _ in res if p.engram_placement == "nvme_direct"]
    assert direct and all(p.engram_io_engine == fast(p.engram_io_depth) for p in direct)
    assert {p.engram_io_engine for p in direct} <= {"aio", "threads"}
    assert all(p.engram_io_engine == "auto" for p, _ in res if p.engram_placement != "nvme_direct")
    plan, wl = direct[0], Workload(1024, 64)
    q = plan.engram_io_depth
    slow = plan.replace(engram_io_engine="uring")
    fig = lambda pr: float(pr.sources["engram_wait"].rsplit(": ", 1)[1].split()[0].replace(",", ""))   # noqa: E731
    at_best, at_slow = predict(plan, small, v41, wl), predict(slow, small, v41, wl)
    assert fig(at_best) == pytest.approx(2 * fig(at_slow)) == pytest.approx(2 * 2e4 * q ** 0.5)
    auto = predict(plan.replace(engram_io_engine="auto"), small, v41, wl)     # auto: io_uring, the first the kernel opens
    assert fig(auto) == pytest.approx(fig(at_slow))
    for p in small["measurements"]["nvme_randread_4k"]:
        del p["engines"]["aio"]
    refused = predict(plan.replace(engram_io_engine="aio"), small, v41, wl)
    assert not refused.feasible and any("engram_io_engine aio was not measured here" in w for w in refused.why)
    old = copy.deepcopy(epyc)
    old["host"]["hard"].update(gpu_name="", gpu_vram_gib=0, ram_gib=24.0)
    _, res = search(old, v41, Workload(1024, 64), n_trials=100)
    assert res and all(p.engram_io_engine == "auto" for p, _ in res)


def test_cpu_host_dense_term_is_the_runtime_path(epyc, v41):
    """On a CPU host the dense term is (fp8 dense + BF16 head, both as stored, norms as float32) bytes at the measured dense-path rate,
    the shared expert its bytes on the CPU-MoE kernel inside `moe` (it rides in the routed call); without the figure it falls back to DRAM, and says so."""
    cpu = copy.deepcopy(epyc)
    cpu["host"]["hard"].update(gpu_name="", gpu_vram_gib=0)
    plan, wl = Plan(host_expert_budget_gib=100.0), Workload(1024, 64)
    fallback = predict(plan, cpu, v41, wl)
    assert any("dense_path_gbs" in n for n in fallback.notes)
    cpu["measurements"]["dense_path_gbs"] = {"median": 10.0, "min": 9.0, "max": 11.0, "unit": "GB/s", "source": "measured",
                                             "samples": [9.0, 10.0, 11.0], "geometry": "another model"}
    assert predict(plan, cpu, v41, wl).decode_tok_s == fallback.decode_tok_s   # timed at another geometry: not used
    cpu["measurements"]["dense_path_gbs"]["geometry"] = v41.geometry_hash
    r = predict(plan, cpu, v41, wl)
    fp8, shared = v41.bytes_by_class["dense"], v41.bytes_by_class["shared_expert"]
    head = v41.dense_bytes_per_token - fp8 - shared
    moe_gbs = r.terms["cpu_moe_gbs"]
    norms = v41.widened_bytes["cpu"]
    assert 0 < norms < 1e6
    assert r.terms["decode_dense_s"] == pytest.approx((fp8 + head + norms) / 10e9)
    assert v41.shared_rides and r.terms["decode_shared_s"] == 0.0        # it rides in the routed CPU call: in `moe`
    own = predict(plan, cpu, dataclasses.replace(v41, shared_rides=False), wl)
    assert own.terms["decode_shared_s"] == pytest.approx(shared / (moe_gbs * 1e9))
    assert r.terms["decode_moe_s"] - own.terms["decode_moe_s"] == pytest.approx(shared / (moe_gbs * 1e9))
    assert "measured" in r.sources["dense"] and "formula" in fallback.sources["dense"]
    assert r.decode_tok_s < fallback.decode_tok_s


def test_plans_with_an_nvme_tier_take_the_phases_timed_beside_one(epyc, v41):
    """Where the profile timed the runtime's phases both ways, a plan with an NVMe expert tier is
    predicted from `phases_nvme_tier` (its reads slow every other phase), one with every expert in RAM
    from the main figures; a profile without them uses the main figures for both."""
    cpu = copy.deepcopy(epyc)
    cpu["host"]["hard"].update(gpu_name="", gpu_vram_gib=0)
    fig = lambda gbs: {"median": gbs, "min": gbs, "max": gbs, "unit": "GB/s", "source": "measured",  # noqa: E731
                       "samples": [gbs], "geometry": v41.geometry_hash}
    cpu["measurements"]["dense_path_gbs"] = {**fig(10.0), "placement": "ram"}
    wl, all_ram = Workload(1024, 64), Plan(host_expert_budget_gib=None)
    tier = Plan(host_expert_budget_gib=0.5 * v41.routed_expert_bytes_total / 2**30)
    before = {p: predict(p, cpu, v41, wl) for p in (all_ram, tier)}
    cpu["measurements"]["phases_nvme_tier"] = {"dense_path_gbs": {**fig(2.5), "placement": "nvme tier"}}
    after = {p: predict(p, cpu, v41, wl) for p in (all_ram, tier)}
    assert after[all_ram].terms["decode_dense_s"] == before[all_ram].terms["decode_dense_s"]
    assert after[tier].terms["decode_dense_s"] == pytest.approx(4 * before[tier].terms["decode_dense_s"])
    assert "phases_nvme_tier" in after[tier].sources["phases"] and "ram" in after[all_ram].sources["phases"]


def test_a_small_host_finds_the_nvme_plans_that_fit(epyc, v41):
    """24 GiB of RAM, no GPU, V4.1's 246 GiB of experts and 203 GB of Engram: only plans with nearly
    every expert on NVMe and the Engram scales off RAM fit; the search must reach them."""
    small = copy.deepcopy(epyc)
    small["host"]["hard"].update(gpu_name="", gpu_vram_gib=0, ram_gib=24.0)
    _, results = search(small, v41, Workload(1024, 64), n_trials=400)
    assert results and all(r.feasible for _, r in results)
    assert all(p.host_expert_budget_gib is not None and p.host_expert_budget_gib <= 24 for p, _ in results)
    assert any(not p.engram_scales_in_ram for p, _ in results)


def test_study_persists_and_a_rerun_resumes(epyc, v4, tmp_path):
    url = f"sqlite:///{tmp_path / 'studies.db'}"
    st1, _ = search(epyc, v4, Workload(1024, 64), n_trials=30, storage=url)
    st2, res = search(epyc, v4, Workload(1024, 64), n_trials=50, storage=url)
    assert st1.study_name == st2.study_name and len(st2.trials) == 50     # 30 kept, 20 added
    assert res and all(r.feasible for _, r in res)


def test_a_new_profile_of_the_same_host_or_a_changed_model_starts_a_fresh_study(epyc, v4, monkeypatch):
    from autotune import search as S
    wl = Workload(1024, 64)
    name = S.study_name(epyc, v4, wl, None, False)
    faster = copy.deepcopy(epyc)
    faster["measurements"]["pcie_gather_gbs"]["median"] *= 2
    assert S.study_name(faster, v4, wl, None, False) != name            # same hardware, new figures
    assert S.study_name({**epyc, "calibration": {"dspark_p_accept": 0.4}}, v4, wl, None, False) != name
    monkeypatch.setattr(S, "model_version", lambda: "another model")
    assert S.study_name(epyc, v4, wl, None, False) != name


def test_plan_cli_json(capsys, tmp_path, monkeypatch):
    monkeypatch.setenv("DSV41_CACHE", str(tmp_path / "cache"))
    assert tune_main(["plan", "--profile", "profiles/5090-epyc.json", "--config", "deepseek-v4.1-flash",
                      "--json", "--trials", "300", "--prompt-tokens", "2048"]) == 0
    d = json.loads(capsys.readouterr().out)
    assert d["predicted"]["feasible"] and d["predicted"]["decode_tok_s"] > 0 and d["predicted"]["ttft_s"] > 0
    assert {"vram", "host", "page_cache_left", "disk"} <= set(d["predicted"]["memory_gib"])
    p = tmp_path / "plan.json"
    p.write_text(json.dumps(d["plan"]))
    assert tune_main(["plan", "--profile", "profiles/5090-epyc.json", "--config", "deepseek-v4.1-flash",
                      "--json", "--plan", str(p), "--prompt-tokens", "2048"]) == 0
    again = json.loads(capsys.readouterr().out)
    assert again["predicted"]["decode_tok_s"] == pytest.approx(d["predicted"]["decode_tok_s"])
    assert tune_main(["plan", "--profile", "profiles/5090-epyc.json", "--config", "deepseek-v4-flash", "--plan", str(p)]) == 2
    assert "geometry" in capsys.readouterr().err


# ---------------------------------------------------------------- schema
def test_profile_roundtrip_and_atomic_write(epyc, tmp_path):
    p = tmp_path / "host.json"
    save_profile(p, epyc)
    assert load_profile(p) == epyc
    bad = copy.deepcopy(epyc)
    del bad["measurements"]["pcie_h2d_gbs"]
    with pytest.raises(ProfileError, match="measurements.pcie_h2d_gbs"):
        save_profile(p, bad)
    assert load_profile(p) == epyc and [x.name for x in tmp_path.iterdir()] == ["host.json"]


@pytest.mark.parametrize("mutate,msg", [
    (lambda d: d["measurements"]["dram_stream_read_gbs"].pop("citation"), "published but has no 'citation'"),
    (lambda d: d["measurements"]["pcie_h2d_gbs"].pop("formula"), "does not state it"),
    (lambda d: d["host"]["hard"].pop("gpu_name"), "host.hard.gpu_name"),
    (lambda d: d.update(schema="dsv41-profile/0"), "schema"),
    (lambda d: d["measurements"]["cpu_moe_gbs"][0].pop("geometry"), "geometry"),
])
def test_profile_schema_errors_named(epyc, tmp_path, mutate, msg):
    d = copy.deepcopy(epyc)
    mutate(d)
    p = tmp_path / "bad.json"
    p.write_text(json.dumps(d))
    with pytest.raises(ProfileError, match=msg):
        load_profile(p)


def test_plan_roundtrip_and_errors(tmp_path):
    plan = Plan(moe_strategy="hybrid", fetch_fraction=0.25, slot_cache_experts=100, dspark=True, draft_length=3)
    assert Plan.from_dict(json.loads(json.dumps(plan.to_dict()))) == plan
    with pytest.raises(PlanError, match="moe_strategy"):
        Plan(moe_strategy="gpu")
    with pytest.raises(PlanError, match="unknown plan field 'chunk'"):
        Plan.from_dict({"chunk": 4})
    with pytest.raises(PlanError, match="'cpu_moe_inputs' must be 4 or 8"):
        Plan(cpu_moe_inputs=6)
    with pytest.raises(PlanError, match="'cpu_moe_fetch' must be 'far' or 'near'"):
        Plan(cpu_moe_fetch="l2")
    with pytest.raises(PlanError, match="'cpu_moe_inputs' 8 needs cpu_moe_streams = 1"):    # a choice that would not act
        Plan(cpu_moe_inputs=8, cpu_moe_streams=4)
    prof = {"host": {"hard": {}}, "plan": plan.to_dict()}
    (tmp_path / "p.json").write_text(json.dumps(prof))
    assert Plan.load(tmp_path / "p.json") == plan


# ---------------------------------------------------------------- quantized variants of V4.1
@pytest.mark.parametrize("fmt,per_weight", [("fp4", 17 / 32), ("mxfp4", 17 / 32), ("nvfp4", 1 / 2 + 1 / 16),
                                            ("fp8", 1.0), ("bf16", 2.0)])
def test_each_expert_format_has_its_byte_formula_in_the_footprint(fmt, per_weight):
    from runtime.config import expert_format_bytes
    cfg = ModelConfig.preset("deepseek-v4.1-flash").replace(expert_dtype=fmt)
    fp = Footprint.from_config(cfg)                                   # from the layout's tensors
    H, I = cfg.hidden_size, cfg.moe_intermediate_size
    assert fp.expert_bytes == cfg.expert_bytes == expert_format_bytes(fmt, H, I)
    assert fp.expert_bytes == pytest.approx(3 * H * I * per_weight, rel=0.002)   # + per-row / per-block scales
    assert fp.routed_expert_bytes_total == cfg.num_hidden_layers * cfg.n_routed_experts * fp.expert_bytes
    assert fp.expert_dtype == fmt and fp.geometry_hash != Footprint.from_config(cfg.replace(expert_dtype="bf16" if fmt != "bf16" else "fp4")).geometry_hash


def test_plan_another_format_says_it_needs_another_engine(capsys, tmp_path, monkeypatch):
    monkeypatch.setenv("DSV41_CACHE", str(tmp_path / "cache"))
    roomy = load_profile("profiles/5090-epyc.json")
    roomy["host"]["hard"]["ram_gib"] = 2048
    p = tmp_path / "roomy.json"
    save_profile(p, roomy)
    out = {}
    for fmt in ("fp4", "fp8"):
        assert tune_main(["plan", "--profile", str(p), "--config", "deepseek-v4.1-flash", "--expert-dtype", fmt,
                          "--json", "--trials", "150"]) == 0
        out[fmt] = json.loads(capsys.readouterr().out)["predicted"]
    assert any("needs another engine" in n for n in out["fp8"]["notes"])
    assert not any("needs another engine" in n for n in out["fp4"]["notes"])
    assert out["fp8"]["decode_tok_s"] < out["fp4"]["decode_tok_s"]          # twice the expert bytes per token


def test_the_runtime_refuses_another_format_by_name(tmp_path):
    from runtime.checkpoint.synth import make_checkpoint
    from runtime.engine import Engine
    cfg = ModelConfig.preset("tiny").replace(expert_dtype="nvfp4")
    with pytest.raises(ValueError, match="expert_dtype 'nvfp4'.*ds_fp4"):
        make_checkpoint(cfg, tmp_path / "w")                            # no synthetic nvfp4 weights
    d = make_checkpoint(cfg, tmp_path / "s", skeleton=True)
    with pytest.raises(ValueError, match=r"config.json: expert_dtype 'nvfp4'.*another engine"):
        Engine(d)


def test_a_shared_expert_riding_in_the_cpu_call_runs_beside_the_devices_share(epyc, v41):
    """On a GPU host the shared expert rides in the CPU call that overlaps the device's share: under
    offload it costs nothing while the gathers take longer; in its own call (two shared experts) it
    is serial, its own term; where numba's threading layer is not threadsafe the CPU share runs after
    the device's (the runtime's `overlap`), and the two sides add."""
    plan, wl = Plan(moe_strategy="offload", slot_cache_experts=64, host_expert_budget_gib=100.0), Workload(1024, 64)
    rides = predict(plan, epyc, v41, wl)
    own = predict(plan, epyc, dataclasses.replace(v41, shared_rides=False), wl)
    assert rides.terms["decode_shared_s"] == 0.0 < own.terms["decode_shared_s"]
    assert rides.terms["decode_moe_s"] == pytest.approx(own.terms["decode_moe_s"])   # hidden beside the gathers
    assert rides.decode_tok_s > own.decode_tok_s
    wq = copy.deepcopy(epyc)                       # numba's workqueue layer: the CPU share runs after the device's
    wq["host"].setdefault("soft", {})["numba_threading_layer"] = "workqueue"
    serial = predict(plan, wq, v41, wl)
    assert serial.terms["decode_moe_s"] == pytest.approx(own.terms["decode_moe_s"] + own.terms["decode_shared_s"])
    assert any("workqueue" in n for n in serial.notes)
    hyb = Plan(moe_strategy="hybrid", slot_cache_experts=64, fetch_fraction=0.5, host_expert_budget_gib=100.0)
    assert predict(hyb, wq, v41, wl).terms["decode_moe_s"] > predict(hyb, epyc, v41, wl).terms["decode_moe_s"]


def test_a_wide_decode_step_is_bound_by_the_kernels_products_at_its_width(epyc, v41):
    """A DSpark verify (or a batch) meets experts several times: on the CPU its time is the larger of its
    bytes at the batch-1 figure and its products at the kernel's GFLOP/s measured at that width (the
    profiler's verify widths), so a host whose kernel slows with inputs per expert is not promised the
    bytes' speed; a one-token step never takes the width figure."""
    cpu = copy.deepcopy(epyc)
    cpu["host"]["hard"].update(gpu_name="", gpu_vram_gib=0)
    cores = int(cpu["host"]["hard"]["physical_cores"])
    H, I, K, L = v41.hidden_size, v41.moe_intermediate_size, v41.top_k, v41.num_layers
    flop1 = 2 * 3 * H * I * K

    def at(g6):                                         # batch 1 at 100 GB/s, a width of 6 at g6 GFLOP/s
        p = copy.deepcopy(cpu)
        one = {"geometry": "5120x2304", "tokens": 1, "threads": cores, "median": 100.0, "unit": "GB/s", "source": "measured",
               "samples": [100.0], "extra": {"gflops": flop1 / (K * v41.expert_bytes / 100e9) / 1e9}}
        six = {**one, "tokens": 6, "median": 50.0, "samples": [50.0], "extra": {"gflops": g6}}
        p["measurements"]["cpu_moe_gbs"] = [one, six]
        return p
    wl, v41 = Workload(1024, 64), dataclasses.replace(v41, shared_rides=False)    # the routed experts alone in `moe`
    spec = Plan(moe_strategy="cpu", dspark=True, draft_length=5, max_context=32768)
    plain = Plan(moe_strategy="cpu", max_context=32768)
    slow, fast = predict(spec, at(50.0), v41, wl), predict(spec, at(1e6), v41, wl)
    a, n = slow.terms["dspark_accepted"], slow.terms["dspark_union_experts"]
    assert (a, n) == (fast.terms["dspark_accepted"], fast.terms["dspark_union_experts"])
    products, nbytes = 6 * flop1 * L / 50e9, n * L * v41.expert_bytes / (slow.terms["cpu_moe_gbs"] * 1e9)
    assert products > 2 * nbytes                                           # the case this test is about
    per_step = lambda r: r.raw["decode"]["moe"] * a                        # noqa: E731  the model divides a step by its tokens
    assert per_step(slow) - per_step(fast) == pytest.approx(products - nbytes, rel=1e-6)
    one = [predict(plain, at(g), v41, wl).raw["decode"]["moe"] for g in (50.0, 1e6)]
    assert one[0] == pytest.approx(one[1])


def test_the_kernels_flops_at_a_width_between_two_measured_ones_is_interpolated():
    """log-log between the measured widths on each side (a width of 2 where 1 and 6 were measured is not batch
    1's rate), the nearest outside them, one thread count's figures (scaled down to fewer threads)."""
    import math
    from runtime.profile import cpu_moe_flops

    def e(tokens, gflops, threads=2, geometry="g"):
        return {"geometry": geometry, "tokens": tokens, "threads": threads, "median": 1.0, "extra": {"gflops": gflops}}
    prof = {"measurements": {"cpu_moe_gbs": [e(1, 100.0), e(6, 300.0), e(64, 400.0), e(6, 900.0, threads=1), e(2, 5.0, geometry="h")]}}
    at = lambda t, threads=2: cpu_moe_flops(prof, "g", t, threads)[0] / 1e9          # noqa: E731
    assert at(1) == pytest.approx(100.0) and at(6) == pytest.approx(300.0) and at(64) == pytest.approx(400.0)
    assert at(2) == pytest.approx(100.0 * 3.0 ** (math.log(2) / math.log(6)))         # not 100 (the nearest width)
    assert 300.0 < at(16) < 400.0 and at(256) == pytest.approx(400.0)                 # beyond the widths: the nearest
    assert at(6, threads=1) == pytest.approx(900.0)                                     # measured there
    assert at(6, threads=4) == pytest.approx(900.0)   # not measured at 4: the best thread count's own widths, never scaled up
    assert cpu_moe_flops(prof, "h", 2, 2)[0] / 1e9 == pytest.approx(5.0)


def test_the_draft_term_is_the_drafters_measured_cost_on_this_cpu_host_else_its_formula(epyc, v41):
    """The profiler times the drafter per drafted token through the runtime (beside its acceptance); on a
    CPU host at that geometry and thread count a DSpark step's draft term is n x d of it, named as
    measured; at another thread count, another geometry or on a GPU host, the formula."""
    cpu = copy.deepcopy(epyc)
    cpu["host"]["hard"].update(gpu_name="", gpu_vram_gib=0)
    cores = int(cpu["host"]["hard"]["physical_cores"])
    fig = {"median": 0.05, "unit": "s", "source": "measured", "samples": [0.05], "geometry": v41.geometry_hash,
           "draft_length": 3, "threads": cores}
    wl, plan = Workload(1024, 64), Plan(moe_strategy="cpu", dspark=True, draft_length=4, max_context=32768)
    formula = predict(plan, cpu, v41, wl)
    cpu["measurements"]["dspark_draft_s_per_token"] = fig
    measured = predict(plan, cpu, v41, wl)
    a = measured.terms["dspark_accepted"]
    assert measured.raw["decode"]["draft"] * a == pytest.approx(4 * 0.05)
    assert "dspark_draft_s_per_token [measured" in measured.sources["draft"] and "formula" in formula.sources["draft"]
    assert measured.raw["decode"]["draft"] != pytest.approx(formula.raw["decode"]["draft"])
    for other in (dict(fig, threads=cores + 1), dict(fig, geometry="another")):
        cpu["measurements"]["dspark_draft_s_per_token"] = other
        assert predict(plan, cpu, v41, wl).raw["decode"]["draft"] == pytest.approx(formula.raw["decode"]["draft"])
    gpu = copy.deepcopy(epyc)
    gpu["measurements"]["dspark_draft_s_per_token"] = fig
    off = Plan(moe_strategy="offload", slot_cache_experts=64, host_expert_budget_gib=100.0, dspark=True, draft_length=4)
    assert "formula" in predict(off, gpu, v41, wl).sources["draft"]
