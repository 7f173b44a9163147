"""The profiler: a quick profile of this host on the tiny checkpoint, and its failure paths."""
import errno
import json
import os

import pytest

from hostinfo import cuda_available
from hostinfo.fingerprint import compare, fingerprint
from runtime.profile import HARD_FIELDS, load_profile
from runtime.checkpoint.reader import Checkpoint
from runtime.io_reader import BatchedReader


def test_quick_profile_is_complete_and_valid(quick_profile, tiny_dir):
    p = load_profile(quick_profile)                     # validates against the schema
    m = p["measurements"]
    took = p["probe_seconds"]                           # each probe's wall time, for the user's log
    assert {"fingerprint", "DRAM stream read", "NVMe", "contended"} <= set(took) and all(v >= 0 for v in took.values())
    assert took["DRAM stream read"] > 0 and None not in took
    from autotune.profiler import probe_time_summary
    line = probe_time_summary(p)                        # printed by dsv41-tune and dsv41-tune profile
    assert line.startswith(f"profiled in {sum(took.values()):.0f} s") and max(took, key=took.get) in line
    dram = m["dram_stream_read_gbs"]
    assert dram["source"] == "measured" and len(dram["samples"]) >= 3
    by = dram["extra"]["layout_samples_gbs"]            # every variant's raw samples kept; the figure is the best's
    from kernels.stream import variant_name, variants
    assert set(by) == {variant_name(v) for v in variants()} and {"1x32B", "2x32B", "4x32B"} <= set(by)
    assert sorted(dram["samples"]) == pytest.approx(by[dram["extra"]["layout"]], abs=1e-3)
    assert dram["extra"]["layout"] == variant_name((dram["extra"]["streams_per_thread"], dram["extra"]["load_bytes"]))
    geoms = {e["geometry"] for e in m["cpu_moe_gbs"]}
    assert {"64x64", "5120x2304", "4096x2048"} <= geoms  # served geometry + both full-size ones
    assert all(e["median"] > 0 for e in m["cpu_moe_gbs"])
    lay = m["cpu_moe_streams"]                          # the row layout, measured on real-sized experts
    assert lay["geometry"] == "5120x2304" and set(lay["gbs"]) == {"1", "4"}
    assert lay["verify_tokens"] == 8 and set(lay["verify_gbs"]) == {"1", "4"}
    assert lay["best"] == max((1, 4), key=lambda s: lay["gbs"][str(s)]["median"] * lay["verify_gbs"][str(s)]["median"])
    assert all(e["extra"]["streams"] == lay["best"] for e in m["cpu_moe_gbs"] if "extra" in e)
    if lay["best"] == 1:                                # rows in order: inputs per row decode, measured the same way
        blk = m["cpu_moe_inputs"]
        assert blk["geometry"] == "5120x2304" and blk["tokens"] == 8 and set(blk["gbs"]) == {"4", "8"}
        assert blk["best"] == max((4, 8), key=lambda n: blk["gbs"][str(n)]["median"])
        assert all(e["extra"]["inputs"] == blk["best"] for e in m["cpu_moe_gbs"] if "extra" in e)
    else:                                               # four rows apart always decode for 4 inputs
        assert "cpu_moe_inputs" not in m and all(e["extra"]["inputs"] == 4 for e in m["cpu_moe_gbs"] if "extra" in e)
    from kernels.cpu_moe import GROUP
    if GROUP:                                           # the lanes paths: one input's fetching, batch 1, interleaved
        fe = m["cpu_moe_fetch"]
        assert fe["geometry"] == "5120x2304" and fe["tokens"] == 1 and set(fe["gbs"]) == {"far", "near"}
        assert fe["best"] == max(("far", "near"), key=lambda f: fe["gbs"][f]["median"])
        assert all(e["extra"]["fetch"] == fe["best"] for e in m["cpu_moe_gbs"] if "extra" in e)
    else:                                               # rows in order fetch one way
        assert "cpu_moe_fetch" not in m
    for k in ("pcie_h2d_gbs", "pcie_gather_gbs"):
        assert "skipped" in m[k] or m[k]["median"] > 0  # never a zero
    qds = [e["qd"] for e in m["nvme_randread_4k"]]
    assert qds == sorted(qds) and all(e["iops"] > 0 and e["p95_us"] >= e["p50_us"] > 0 for e in m["nvme_randread_4k"])
    assert all(not e["path"].startswith("/") for e in m["nvme_randread_4k"])     # relative to the checkpoint
    assert m["contended"][0]["pair"] == "cpu_moe+nvme_randread" and m["contended"][0]["cpu_moe_gbs"]["median"] > 0
    assert m["moe_dispatch_fixed_us"]["median"] > 0 and m["moe_fixed_us"]["cpu"] == m["moe_dispatch_fixed_us"]
    for s in ("offload", "hybrid"):                     # the device strategies: measured on CUDA, else why not
        assert ("skipped" in m["moe_fixed_us"][s]) != cuda_available()
    d = m["dense_path_gbs"]                              # the runtime's own dense path, CPU host
    assert "skipped" in d or (d["median"] > 0 and len(d["samples"]) >= 3 and d["geometry"])
    att = m["attention_s_per_token"]                     # attention vs context, through the runtime
    assert "skipped" in att or (len(att["points"]) >= 2 and all(p["median"] > 0 for p in att["points"])
                                and att["points"][0]["context"] < att["points"][-1]["context"])
    r = m["routing"]                                     # a routing trace of one request on this checkpoint
    assert r["geometry"] == p["host"]["soft"]["geometry_hash"] and r["decode_tokens"] > 0
    assert r["lru_hit"][0] == 0 and r["lru_hit"][-1] == 1 and r["static_hit"][-1] == 1
    assert r["union"]["1"] == 4 and 4 < r["union"]["2"] <= 8
    acc, dr = m["dspark_p_accept"], m["dspark_draft_s_per_token"]   # the drafter, from the same DSpark generations
    assert 0 <= acc["median"] < 1 and dr["median"] > 0 and dr["geometry"] == acc["geometry"] == r["geometry"]
    assert dr["threads"] >= 1 and dr["draft_length"] == acc["draft_length"]
    assert not list(tiny_dir.parent.glob(".dsv41-probe-*")) and not list(tiny_dir.glob("*probe*"))   # scratch removed
    assert all(len(e["samples"]) >= 3 and e["min"] <= e["iops"] <= e["max"] for e in m["nvme_randread_4k"])
    from autotune.probes.nvme import engines_here                # each engine this host opens, at every depth
    want = engines_here(tiny_dir / "config.json")[0]
    for e in m["nvme_randread_4k"]:
        assert list(e["engines"]) == want and all(len(f["samples"]) >= 3 for f in e["engines"].values())
        assert e["engine"] == max(want, key=lambda k: e["engines"][k]["iops"]) and e["iops"] == e["engines"][e["engine"]]["iops"]
    assert all(k in p["host"]["hard"] for k in HARD_FIELDS)


def test_gpu_figures_are_measured_on_a_gpu_host_and_skipped_with_the_reason_elsewhere(quick_profile):
    m = load_profile(quick_profile)["measurements"]
    keys = ("gpu_mem_gbs", "gpu_tflops", "pcie_h2d_gbs", "pcie_gather_gbs")
    if not cuda_available():
        assert all(m[k]["skipped"] == "no CUDA device on this host" for k in keys)
        assert [c["pair"] for c in m["contended"]] == ["cpu_moe+nvme_randread"]
        return
    for k in keys:                                       # measured, with warm-up and repeats
        assert m[k]["median"] > 0 and len(m[k]["samples"]) >= 5, k
    pair = next(c for c in m["contended"] if c["pair"] == "cpu_moe+pcie_gather")
    assert pair["cpu_moe_gbs"]["median"] > 0 and ("skipped" in pair["pcie_gather_gbs"] or pair["pcie_gather_gbs"]["median"] > 0)


def test_fingerprint_hard_and_soft(tiny_dir):
    a = fingerprint(tiny_dir, "g1")
    assert a["soft"]["versions"]["torch"] and a["soft"]["storage"]["filesystem"]
    b = json.loads(json.dumps(a))
    b["hard"]["ram_gib"] += 64
    b["soft"]["commit"] = "other"
    hard, soft = compare(b, a)
    assert len(hard) == 1 and hard[0].startswith("ram_gib") and soft[0].startswith("commit")


def test_o_direct_unavailable_is_reported_with_the_fallback(tmp_path, monkeypatch):
    f = tmp_path / "data.bin"
    f.write_bytes(os.urandom(1 << 16))
    real_open = os.open

    def no_direct(path, flags, *a):
        if flags & getattr(os, "O_DIRECT", 0):
            raise OSError(errno.EINVAL, "Invalid argument")
        return real_open(path, flags, *a)
    monkeypatch.setattr(os, "open", no_direct)
    r = BatchedReader(depth=2)
    out = r.read([(str(f), 10, 5000), (str(f), 40000, 300)])
    assert bytes(out[0]) == f.read_bytes()[10:5010] and bytes(out[1]) == f.read_bytes()[40000:40300]
    assert r.path == "buffered" and "O_DIRECT refused" in r.fallback_reason and "data.bin" in r.fallback_reason
    r.close()


def test_a_runtime_probe_the_host_cannot_hold_is_skipped_with_its_reason(tiny_dir, monkeypatch):
    from autotune import profiler
    from runtime.budget import DoesNotFit
    from runtime.checkpoint.reader import Checkpoint

    def too_big(*a, **k):
        raise DoesNotFit("the plan keeps 9.00 GiB in host RAM, 2.00 GiB are available")
    monkeypatch.setattr(profiler.runtime_paths, "forward_terms", too_big)
    monkeypatch.setattr(profiler, "cuda_available", lambda: False)
    out = profiler._forward_terms(Checkpoint(tiny_dir), quick=True)
    assert set(out) == {"dense_path_gbs", "dense_path_tflops", "attention_s_per_token", "engram_rows_s",
                        "shared_call_us", "step_other_s_per_layer"}
    assert all("2.00 GiB are available" in v["skipped"] for v in out.values())


def test_the_expert_tier_is_read_through_the_runtime(tiny_dir):
    """The NVMe expert tier's figure is PlacedExperts._fetch of one layer's top_k experts, timed per call
    (the profiler uses it for experts of >= 1 MiB; tiny's are toy-sized, the path is the same)."""
    from autotune.probes.runtime_paths import expert_tier_read
    ck = Checkpoint(tiny_dir)
    m = expert_tier_read(ck, 1, calls=3)
    assert len(m.samples) == 3 and min(m.samples) > 0 and m.unit == "GB/s"
    assert f"{ck.config.num_experts_per_tok} experts" in m.note


def test_the_phase_probe_keeps_experts_where_the_plans_keep_them(tiny_dir, monkeypatch):
    """Experts all in RAM where half the available RAM holds them (the plans the search picks there);
    an NVMe tier, the first half of the probe budget's worth in RAM, where it does not."""
    from autotune.probes import runtime_paths
    ck = Checkpoint(tiny_dir)
    total = ck.footprint().routed_expert_bytes_total
    for avail, want in ((2 * total, "ram"), (2 * total - 4096, "nvme tier")):
        monkeypatch.setattr(runtime_paths, "ram_available_bytes", lambda a=avail: a)
        monkeypatch.setattr(runtime_paths, "probe_budget_bytes", lambda a=avail: a // 4)
        e, placement = runtime_paths._probe_engine(ck, 1, 64)
        try:
            assert placement == want
            held = sum(e.experts.resident)
            L, E = ck.config.num_hidden_layers, ck.config.n_routed_experts
            assert (held == L * E) if want == "ram" else (held == int(avail // 8 // ck.config.expert_bytes) < L * E)
        finally:
            e.close()


def test_a_failed_nvme_tier_timing_keeps_the_in_ram_figures(tiny_dir, monkeypatch):
    from autotune import profiler
    main = {"dense_path_gbs": {"median": 5.0, "placement": "ram"}}

    def terms(ck, quick, threads, tier=False):
        if tier:
            raise OSError("no room for the tier's reads")
        return dict(main)
    monkeypatch.setattr(profiler.runtime_paths, "forward_terms", terms)
    monkeypatch.setattr(profiler, "cuda_available", lambda: False)
    out = profiler._forward_terms(Checkpoint(tiny_dir), quick=True)
    assert out["dense_path_gbs"] == main["dense_path_gbs"]
    assert "no room for the tier's reads" in out["phases_nvme_tier"]["skipped"]


def test_the_nvme_probe_measures_the_engines_this_host_opens(tmp_path, monkeypatch):
    """Each engine the kernel opens, interleaved at the depth; a refused one is left out with its reason;
    $DSV41_IO_ENGINE (a host override) names the only one; where O_DIRECT is refused only the threads read."""
    import runtime.io_reader as io_reader
    from autotune.probes import nvme
    f = tmp_path / "data.bin"
    f.write_bytes(os.urandom(4 << 20))
    if (why := nvme.o_direct_refusal(f)):
        pytest.skip(f"no O_DIRECT here: {why}")
    monkeypatch.setattr(io_reader.UringContext, "open", classmethod(lambda cls, depth: (None, "io_uring_setup refused (1: seccomp)")))
    names, refused = nvme.engines_here(f)
    assert names[0] != "uring" and names[-1] == "threads" and "seccomp" in refused["uring"]
    r = nvme.randread_4k(f, 4, 300, engines=names)
    assert list(r["engines"]) == names and all(len(e["samples"]) == 3 and e["iops"] > 0 for e in r["engines"].values())
    assert r["iops"] == max(e["iops"] for e in r["engines"].values()) == r["engines"][r["engine"]]["iops"]
    monkeypatch.setenv("DSV41_IO_ENGINE", "threads")
    assert nvme.engines_here(f) == (["threads"], {})
    monkeypatch.setenv("DSV41_IO_ENGINE", "aio")                  # buffered reads only ever run on the threads
    monkeypatch.setattr(nvme, "o_direct_refusal", lambda p: "EINVAL (tmpfs)")
    assert nvme.engines_here(f) == (["threads"], {})


def test_the_row_layout_is_judged_on_batch_1_and_a_verify_batch():
    """Rows in order let a row decode serve 8 inputs (4 rows apart: 4): the layout is the best geometric
    mean of its batch-1 and verify medians, so a batch-1 edge of a few percent does not cost 20% on
    verify (the AMX Xeon VM's figures), while a clear batch-1 win still counts."""
    from autotune.probes.cpu_moe import pick_layout
    one = {1: [20.0, 21.0, 22.0], 4: [21.0, 22.0, 23.0]}                   # 4 streams 4.8% ahead at batch 1
    assert pick_layout(one, {1: [14.0], 4: [11.5]}) == 1                      # but 18% behind on a verify
    assert pick_layout(one, {1: [14.0], 4: [13.9]}) == 4                      # not behind: batch 1 decides
    assert pick_layout({1: [20.0], 4: [32.0]}, {1: [14.0], 4: [11.0]}) == 4  # a 1.6x batch-1 win stands
