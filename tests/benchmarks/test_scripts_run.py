"""The benchmark scripts run to the end (issue "speed on every ISA": on any host). Only the one that
takes any checkpoint runs here, on tiny and on one core, with a small probe budget: the figures are
not what this checks (benchmarks are scripts, not tests), that every line and JSON key is produced is."""
import json
import math
import os
import subprocess
import sys
from pathlib import Path

import numpy as np

SCRIPTS = Path(__file__).resolve().parents[2] / "benchmarks"


def test_decode_roofline_runs_to_the_end_on_tiny_and_one_core(tiny_dir):
    env = {k: v for k, v in os.environ.items() if not k.startswith("DSV41_")}
    env.update(DSV41_CORES="1", DSV41_PROBE_MIB="128")
    p = subprocess.run([sys.executable, str(SCRIPTS / "decode_roofline.py"), "--checkpoint", str(tiny_dir), "--rounds", "2",
                        "--prompt-tokens", "16", "--max-tokens", "4", "--json"], env=env, capture_output=True, text=True, timeout=300)
    assert p.returncode == 0, p.stderr[-3000:]
    out = json.loads(p.stdout.strip().splitlines()[-1])
    assert out["threads"] == 1 and len(out["rounds"]) == 2
    for k in ("decode_tok_s", "decode_ratio", "decode_kernel_ratio", "moe_engine_vs_replay", "prefill_ratio", "stream_gbs",
              "cpu_moe_kernel_gbs", "dense_gemv_gbs", "matmul_peak_gflops", "int8_peak_gops"):
        assert math.isfinite(out[k]) and out[k] > 0, (k, out[k])
    assert "of their speed replayed alone" in p.stdout
    for k in ("prefill_ratio", "prefill_kernel_ratio", "int8_peak_gops", "matmul_peak_gflops"):   # each round's own roofs
        per = [rd[k] for rd in out["rounds"]]
        assert all(math.isfinite(v) and v > 0 for v in per) and out[k] == float(np.median(per)), (k, per, out[k])
    ref = out["reference"]                     # from DRAM unless the 128 MiB budget keeps it under 4x the LLC, said
    assert "reference from DRAM: MoE steps over" in p.stdout and ref["moe_banks"] >= 1 and ref["dense_copies"] >= 1
    assert ref["dense_rotation_bytes"] == ref["dense_copies"] * out["dense_bytes_runtime"]
    assert (ref["dense_rotation_bytes"] < 4 * ref["llc_bytes"]) == ("the dense reference rotates" in ref["note"]), ref
    assert (ref["moe_rotation_bytes"] < 4 * ref["llc_bytes"]) == ("the MoE reference rotates" in ref["note"]), ref


def test_decode_roofline_refuses_a_run_with_no_decode_step(tiny_dir):
    p = subprocess.run([sys.executable, str(SCRIPTS / "decode_roofline.py"), "--checkpoint", str(tiny_dir), "--max-tokens", "1"],
                       capture_output=True, text=True, timeout=120)
    assert p.returncode == 2 and "--max-tokens 1: at least 2" in p.stderr, p.stderr[-2000:]
    p = subprocess.run([sys.executable, str(SCRIPTS / "decode_roofline.py"), "--checkpoint", str(tiny_dir), "--inputs", "8",
                        "--streams", "4"], capture_output=True, text=True, timeout=120)
    assert p.returncode == 2 and "--inputs 8 needs rows in order" in p.stderr, p.stderr[-2000:]


def _decode_roofline():
    import importlib.util
    spec = importlib.util.spec_from_file_location("decode_roofline", SCRIPTS / "decode_roofline.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_decode_roofline_times_its_dense_reference_beyond_the_cache(monkeypatch):
    """The kernel-bound rate's dense linears rotate over copies until the rotation spans 4x the total LLC
    (in the engine every layer's MoE read evicts them); where the probe budget cannot hold that many,
    the copies it can hold and a note saying part of the figure is cache."""
    dr = _decode_roofline()
    monkeypatch.setenv("DSV41_LLC_MIB", "8")
    monkeypatch.setenv("DSV41_PROBE_MIB", "64")
    mib = 2**20
    assert dr.rotation(1 * mib) == (32, "")                    # 4 x 8 MiB over 1 MiB copies
    assert dr.rotation(10 * mib) == (4, "")                    # ceil(32 / 10)
    assert dr.rotation(40 * mib) == (1, "")                    # one pass already spans 4x the LLC
    monkeypatch.setenv("DSV41_PROBE_MIB", "16")
    copies, note = dr.rotation(10 * mib)                       # the budget holds one copy, not four
    assert copies == 1 and "the probe memory budget (16 MiB) keeps it under 4x the total last-level cache (8 MiB)" in note, note
    monkeypatch.setenv("DSV41_PROBE_MIB", "1024")
    copies, note = dr.rotation(mib // 8)                       # 256 copies wanted: a call-bound working set
    assert copies == dr.MAX_COPIES and f"at most {dr.MAX_COPIES} copies keeps it under" in note, note


def test_decode_roofline_copies_compute_what_the_held_weights_do():
    """The reference's copies are fresh arrays with the held weights' bytes: the same outputs, bit for bit."""
    import numpy as np
    import torch
    from kernels.bf16_dense import Bf16Weight
    from kernels.fp8_dense import Fp8Weight
    from runtime.model.weights import linear
    dr = _decode_roofline()
    rng = np.random.default_rng(0)
    held = [Fp8Weight(rng.integers(0, 126, (64, 256), dtype=np.uint8), rng.integers(120, 130, (2, 8), dtype=np.uint8), (32, 32)),
            Bf16Weight.from_tensor(torch.randn(48, 256).to(torch.bfloat16)), torch.randn(40, 256)]
    x = torch.randn(1, 256)
    for w in held:
        c = dr.held_copy(w)
        assert type(c) is type(w) and c is not w
        for a, b in ((c.q, w.q), (c.scale, w.scale)) if isinstance(w, Fp8Weight) else \
                ((c.bits, w.bits),) if isinstance(w, Bf16Weight) else ((c, w),):
            assert not np.shares_memory(np.asarray(a), np.asarray(b))
        assert torch.equal(linear(x, c), linear(x, w))


def test_profiler_vs_tools_keeps_likwid_read_kernels_of_one_two_and_four_streams(monkeypatch):
    """likwid-bench's `load` kernels read one stream per thread, `ddot` two (on the Zen 2 VM `ddot_avx`
    read 41 GB/s where `load_avx` read 31), our `read2` and `read4` test files two and four with loads
    only (read4 47 there: the probe's layout), each found by likwid-bench under
    $HOME/.likwid/bench/x86-64 while it runs; a kernel the CPU lacks (exit != 0) is left out."""
    import importlib.util
    spec = importlib.util.spec_from_file_location("profiler_vs_tools", SCRIPTS / "profiler_vs_tools.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    asked, rates = [], {"load_avx": 31285.5, "load": 20000.0, "ddot_avx": 41163.2, "ddot": 30000.0, "read4_avx": 47383.6,
                     "read2_avx512": 45000.0}

    def run(cmd, env=None, **kw):
        kernel = cmd[cmd.index("-t") + 1]
        asked.append((kernel, cmd[cmd.index("-w") + 1]))
        if kernel.startswith("read"):                   # our test file is where likwid-bench looks for it
            n = int(kernel[4])
            ptt = (Path(env["HOME"]) / ".likwid" / "bench" / "x86-64" / f"{kernel}.ptt").read_text().splitlines()
            assert f"STREAMS {n}" in ptt and f"LOADS {n}" in ptt and "STORES 0" in ptt and f"BYTES {8 * n}" in ptt
            loads = [ln for ln in ptt if ln.startswith("vmovaps")]
            width = 64 if kernel.endswith("512") else 32       # LOOP: doubles per stream an iteration reads
            assert len(loads) == 8 and f"LOOP {8 // n * width // 8}" in ptt, kernel
            assert {f"STR{i}" for i in range(n)} == {ln.split("[")[1].split()[0] for ln in loads}
        ok = kernel in rates
        out = f"Cycles:\t\t123\nMByte/s:\t\t{rates[kernel]}\nMFlops/s:\t\t1\n" if ok else ""
        return subprocess.CompletedProcess(cmd, 0 if ok else 1, out, "" if ok else "unknown kernel")
    monkeypatch.setattr(mod.subprocess, "run", run)
    got = mod.likwid(2, 1 << 30)
    assert {k for k, _ in asked} == {"load_avx512", "load_avx", "load", "ddot_avx512", "ddot_avx", "ddot",
                                      "read2_avx512", "read2_avx", "read4_avx512", "read4_avx"}
    assert all(w == "N:1024MB:2" for _, w in asked)
    assert got == {k: v / 1e3 for k, v in rates.items()}


def test_tuner_regret_reports_no_fidelity_from_one_measured_plan():
    """With one plan measured (a tight --max-minutes once crashed on an empty held-out half) the fidelity
    is None, not a crash; MIN_GRID, the plans the grid measures whatever its time cap, gives both halves one."""
    import importlib.util
    spec = importlib.util.spec_from_file_location("tuner_regret", SCRIPTS / "tuner_regret.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    assert mod.MIN_GRID >= 2
    assert mod.fidelity([{"plan": None, "decode_tok_s": 1.0, "ttft_s": 1.0}], {}, None, None) is None


def test_dspark_runs_to_the_end_on_tiny_and_says_where_greedy_output_parts(tiny_dir):
    """Every draft length's row, and beside greedy identity the logits' typical difference from DSpark off
    and, where tokens part, the step and DSpark off's top-2 margin there (a near-tie or a verify bug)."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("DSV41_")}
    env.update(DSV41_CORES="1")
    p = subprocess.run([sys.executable, str(SCRIPTS / "dspark.py"), "--checkpoint", str(tiny_dir), "--prompts", "2", "--repeats", "1",
                        "--prompt-tokens", "24", "--max-tokens", "12", "--json"], env=env, capture_output=True, text=True, timeout=300)
    assert p.returncode == 0, p.stderr[-3000:]
    rows = json.loads(p.stdout.strip().splitlines()[-1])["rows"]
    assert [r["draft_length"] for r in rows] == [None, 1, 2, 3, 4, 5]
    for r in rows[1:]:
        assert r["logit_diff_median"] is not None and 0 <= r["logit_diff_median"] < 1e-3, r
        assert r["greedy_identical"] == (not r["parted"]), r
        assert all(0 <= x["step"] < 12 and x["off_top2_margin"] >= 0 for x in r["parted"]), r


def test_cpu_moe_s_bank_falls_back_to_the_verify_floor_where_a_batch_s_does_not_fit(monkeypatch, capsys):
    """The batch widths need 8 x 6 + 8 experts held apart; under a small probe budget the benchmark measures
    the rest on the verify's floor of 20 (saying so) and skips a geometry whose floor does not fit, so it
    runs to the end on any host."""
    import importlib.util

    import pytest

    from kernels.probe_bank import ProbeTooLarge, expert_bytes
    spec = importlib.util.spec_from_file_location("cpu_moe_bench", SCRIPTS / "cpu_moe.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    H, I = mod.GEOMETRIES["small"]
    monkeypatch.setattr("kernels.probe_bank.llc_bytes", lambda: 1 << 20)
    monkeypatch.setenv("DSV41_PROBE_MIB", str(30 * expert_bytes(H, I) / 2**20))
    bank = mod.bank_for(H, I, batch=8)
    assert bank.n_experts == 20 and "batch widths" in capsys.readouterr().out
    monkeypatch.setenv("DSV41_PROBE_MIB", str(60 * expert_bytes(H, I) / 2**20))
    assert mod.bank_for(H, I, batch=8).n_experts == 56
    monkeypatch.setenv("DSV41_PROBE_MIB", str(10 * expert_bytes(H, I) / 2**20))
    with pytest.raises(ProbeTooLarge):
        mod.bank_for(H, I, batch=8)


def test_decode_roofline_warm_pass_meets_every_expert_of_every_bank():
    """Before its rounds the benchmark reads every expert once (`warm_steps` of its reference's own steps):
    the first reads since the load ran ~0.7x as fast on the AMX Xeon VM, and a reference that never left
    them had the engine beat its kernel-bound rate 1.4-1.6x. Banks of different sizes, top-k not dividing them."""
    from types import SimpleNamespace
    dr = _decode_roofline()
    for sizes, K in (((33,) * 8, 6), ((7, 12, 5), 4), ((1,), 1), ((6, 6), 6)):
        banks = [SimpleNamespace(n_experts=n) for n in sizes]
        met = [set() for _ in banks]
        for i in range(dr.warm_steps(banks, K)):
            bank, ids = dr.moe_ids(i, banks, K)
            assert ids.shape == (1, K) and ids.min() >= 0 and ids.max() < bank.n_experts
            met[next(j for j, b in enumerate(banks) if b is bank)].update(ids.ravel().tolist())
        assert [len(m) for m in met] == list(sizes), (sizes, K)
