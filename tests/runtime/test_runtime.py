"""The placed runtime against the float64 reference on the tiny checkpoint.

Tolerance: the runtime computes in float32, the reference in float64. Both quantize every expert input
to int8 per 32-block (kernels/formats.py quantize_act); where the two precisions put an input on opposite
sides of a rounding boundary it moves by one int8 step (1/127 of its block's max). Logits agree to
~3e-6 without such flips and to ~7e-4 with them (measured here over 64 steps); we allow 1.5e-3. Prompts
are chosen so the reference's top-1/top-2 margin stays above 5x that tolerance at every step (two
runs within the tolerance then pick the same token), and so at least 16 distinct tokens come out.
"""
import itertools
import json

import numpy as np
import pytest
import torch
from tokenizers import Tokenizer

from hostinfo import cuda_available
from runtime.budget import DoesNotFit, check_plan, check_request
from runtime.checkpoint.reader import Checkpoint
from runtime.engine import Engine
from runtime.experts import NumbaSlots
from runtime.plan import Plan, PlanError
from runtime.workload import make_prompt

# Logits against the float64 reference. On a CUDA host the dense linears and attention run on the GPU
# (cuBLAS, Triton) and sum in other orders: an expert input then lands on the other side of an int8
# rounding step more often (tests/runtime/test_device_slots.py FLIP_TOL says why and how far it moves).
# The prompts are chosen for a greedy margin of MARGIN on the CPU's tolerance either way.
TOL = 2e-2 if cuda_available() else 1.5e-3
MARGIN = 5 * 1.5e-3
STEPS = 64


@pytest.fixture(scope="module")
def ck(tiny_dir):
    return Checkpoint(tiny_dir)


@pytest.fixture(scope="module")
def ref(ck):
    return Engine(ck, reference=True)


@pytest.fixture(scope="module")
def case(ck, ref):
    """A natural-text prompt whose greedy continuation has safe margins and variety."""
    tok = Tokenizer.from_file(str(ck.root / "tokenizer.json"))
    for seed in range(20):
        prompt = make_prompt(tok, 40, seed=seed)
        r = ref.generate(prompt, STEPS, keep_logits=True)
        margin = min(float(v[0] - v[1]) for v in (torch.topk(l, 2).values for l in r.logits))
        if margin > MARGIN and len(set(r.tokens)) >= 16:
            return prompt, r
    pytest.fail("no prompt with a safe greedy margin among 20 seeds")


# Pairwise cover of the exact knobs: every pair of levels of any two factors meets in some plan. The
# rows are built greedily (each the candidate covering the most uncovered pairs; deterministic).
FACTORS = {
    "slots": (0, 20, 128),                              # none / some / all 8 x 16 experts
    "strategy": ("cpu", "offload", "hybrid"),
    "chunk": (1, 7, 512),                               # one token, odd, the whole prompt
    "tier": ((None, 1), (0.0004, 2), (None, 2)),        # host budget (GiB: 61 of 128 experts; the rest on NVMe), threads
    "fetch_fraction": (0.0, 0.5, 1.0),
    "engram": ("host", "nvme_direct", "nvme_mmap"),
    "dspark": (0, 2, 4),                                # off, draft length 2, 4
    "inputs": (4, 8),                                   # the most inputs a CPU-MoE row decode serves
}


def _pairwise(levels: list[int]) -> list[tuple]:
    k = len(levels)
    pairs = lambda r: {(i, r[i], j, r[j]) for i in range(k) for j in range(i + 1, k)}
    todo = set().union(*(pairs(r) for r in itertools.product(*(range(n) for n in levels))))
    rows = []
    while todo:
        best = max(itertools.product(*(range(n) for n in levels)), key=lambda r: len(pairs(r) & todo))
        rows.append(best)
        todo -= pairs(best)
    return rows


def _plan(row) -> Plan:
    v = {name: levels[i] for (name, levels), i in zip(FACTORS.items(), row)}
    return Plan(slot_cache_experts=v["slots"], moe_strategy=v["strategy"], prefill_chunk=v["chunk"],
                host_expert_budget_gib=v["tier"][0], cpu_threads=v["tier"][1], fetch_fraction=v["fetch_fraction"],
                engram_placement=v["engram"], engram_row_cache_mib=1 if v["engram"] == "nvme_direct" else 0,
                dspark=bool(v["dspark"]), draft_length=v["dspark"] or 1, cpu_moe_inputs=v["inputs"])


ROWS = _pairwise([len(v) for v in FACTORS.values()])
PLANS = [_plan(r) for r in ROWS]
# slot caches smaller than one call's distinct experts (a wide prefill chunk reads up to 16 per layer)
SMALL = [Plan(slot_cache_experts=2, moe_strategy="offload", prefill_chunk=512, cpu_threads=2),
         Plan(slot_cache_experts=3, moe_strategy="hybrid", fetch_fraction=1.0, prefill_chunk=64, host_expert_budget_gib=0.0004)]


def test_the_cover_is_pairwise():
    k = len(FACTORS)
    for i in range(k):
        for j in range(i + 1, k):
            want = {(a, b) for a in range(len(list(FACTORS.values())[i])) for b in range(len(list(FACTORS.values())[j]))}
            assert want == {(r[i], r[j]) for r in ROWS}, (list(FACTORS)[i], list(FACTORS)[j])
    assert len(ROWS) <= 18                                   # not the 2187 of the full grid


@pytest.mark.parametrize("plan", PLANS + SMALL, ids=lambda p: f"{p.moe_strategy}-s{p.slot_cache_experts}-c{p.prefill_chunk}-"
                         f"{'all' if p.host_expert_budget_gib is None else 'nvme'}-t{p.cpu_threads}-f{p.fetch_fraction}-"
                         f"{p.engram_placement}-d{p.draft_length if p.dspark else 0}-i{p.cpu_moe_inputs}")
def test_no_exact_knob_changes_greedy_output(ck, case, plan):
    prompt, r = case
    e = Engine(ck, plan)
    try:
        out = e.generate(prompt, STEPS, keep_logits=True)
        gathered = e.experts.gathered
    finally:
        e.close()
    assert out.tokens == r.tokens
    for step, (a, b) in enumerate(zip(out.logits, r.logits)):
        assert (a.double().cpu() - b).abs().max() < TOL, step
    all_cached = plan.slot_cache_experts >= 128
    if plan.host_expert_budget_gib is not None and not all_cached:
        assert out.phases.get("nvme_read", 0) > 0              # the NVMe tier really served experts
    gathers = plan.moe_strategy == "offload" or (plan.moe_strategy == "hybrid" and plan.fetch_fraction > 0)
    if plan.slot_cache_experts and gathers and not all_cached:
        assert out.phases.get("gather", 0) > 0 and gathered > 0
    if plan.moe_strategy == "hybrid" and plan.fetch_fraction == 0:
        assert gathered == 0                                    # every miss stays on the CPU
    if all_cached:
        assert out.hit_rate == 1.0
    if plan.dspark:
        assert out.dspark["steps"] > 0 and out.dspark["drafted"] > 0
    if plan.engram_placement == "nvme_direct":
        assert out.engram["reads"] > 0                          # rows came from the O_DIRECT reader


def test_bounded_replay_is_opt_in_and_measured(ck, case):
    prompt, r = case
    full = Engine(ck, Plan(prefill_chunk=16)).generate(prompt, 4, keep_logits=True)
    replay = Engine(ck, Plan(prefill_chunk=16, prefill_mode="bounded_replay")).generate(prompt, 4, keep_logits=True)
    assert not Plan(prefill_mode="bounded_replay").exact and Plan().exact
    divergence = (replay.logits[0] - full.logits[0]).abs().max().item()
    assert 1e-4 < divergence                                   # it changes output: that is why it is opt-in
    assert np.isfinite(replay.logits[0].cpu().numpy()).all()


def test_sparse_path_is_exercised(ck, ref, case):
    """A token far before the window changes the last logits only through the compressed latent and
    the indexer (Engram n-grams reach 3 tokens back, the window 8)."""
    prompt, _ = case
    cfg = ck.config
    assert len(prompt) - 3 > cfg.window_size + cfg.engram_max_ngram_size
    a = ref.generate(prompt, 1, keep_logits=True).logits[0]
    other = list(prompt)
    other[3] = (other[3] + 1) % cfg.vocab_size
    b = ref.generate(other, 1, keep_logits=True).logits[0]
    assert (a - b).abs().max() > 1e-6
    st = ref.model.new_state(64)
    with torch.inference_mode():
        ref.model.forward(st, prompt)
    visible_rows = (len(prompt) - cfg.window_size) // min(cfg.compress_ratios[s] for s in cfg.kv_source_layers)
    assert visible_rows > cfg.index_topk and st.indexer_peak_bytes > 0   # the indexer really selects


def test_threads_row_layout_inputs_per_decode_and_fetching_do_not_change_bits(ck, case):
    prompt, _ = case
    for one, other in ((Plan(cpu_threads=1), Plan(cpu_threads=2)),
                       (Plan(cpu_threads=1, cpu_moe_streams=1), Plan(cpu_threads=2, cpu_moe_streams=4)),
                       (Plan(cpu_moe_inputs=4, prefill_chunk=64), Plan(cpu_moe_inputs=8, prefill_chunk=64)),   # wide chunks: > 4 a row
                       (Plan(dspark=True, cpu_moe_streams=1), Plan(dspark=True, cpu_moe_streams=4)),      # the drafter's experts too
                       (Plan(dspark=True, cpu_moe_inputs=4), Plan(dspark=True, cpu_moe_inputs=8)),
                       (Plan(cpu_threads=1), Plan(cpu_threads=1, cpu_moe_fetch="near")),                   # fetching, alone
                       (Plan(dspark=True), Plan(dspark=True, cpu_moe_fetch="near")),                      # and beside others
                       (Plan(moe_strategy="offload", slot_cache_experts=12),                                # the CPU slots too
                        Plan(moe_strategy="offload", slot_cache_experts=12, cpu_moe_streams=4, cpu_moe_fetch="near"))):
        ea, eb = Engine(ck, one), Engine(ck, other)
        for e, p in ((ea, one), (eb, other)):      # every CPU-MoE call of the engine, slots included, runs the plan's choices
            assert not isinstance(e.experts.cache.mem, NumbaSlots) or e.experts.cache.mem.kernel == e.experts.kernel
            assert (e.experts.kernel["streams"], e.experts.kernel["inputs"], e.experts.kernel["fetch"]) == \
                (p.cpu_moe_streams, p.cpu_moe_inputs, p.cpu_moe_fetch)
        a = ea.generate(prompt, 8, keep_logits=True)
        b = eb.generate(prompt, 8, keep_logits=True)
        assert a.tokens == b.tokens and all(torch.equal(x, y) for x, y in zip(a.logits, b.logits)), other


@pytest.mark.parametrize("budget", [None, 0.0], ids=["all resident", "all on NVMe"])
def test_the_shared_expert_rides_in_the_routed_call_with_the_same_sum(ck, budget):
    """One shared expert is the last row of the layer's host bank and runs in the routed experts' call:
    the same bits as the routed experts, then the shared expert in a call of its own, added; with every
    routed expert on the NVMe tier the host bank holds the shared expert alone."""
    from kernels.cpu_moe import expert_ffn
    from runtime.experts import PlacedExperts, ReferenceExperts
    cfg = ck.config
    assert cfg.shared_rides
    pe = PlacedExperts(ck, Plan(cpu_threads=1, host_expert_budget_gib=budget))
    ref = ReferenceExperts(ck)
    g = torch.Generator().manual_seed(5)
    try:
        for layer in (1, cfg.num_hidden_layers - 1):
            bank, row = pe.host[layer], pe.shared_row[layer]
            assert row == pe.resident[layer] == bank.n_experts - 1
            m = torch.randn(3, cfg.hidden_size, generator=g)
            ids = torch.stack([torch.randperm(cfg.n_routed_experts, generator=g)[:cfg.num_experts_per_tok] for _ in range(3)])
            w = torch.rand(3, cfg.num_experts_per_tok, generator=g)
            fused = pe.routed(layer, m, ids, w, shared=True)
            x = m.numpy()
            alone = expert_ffn(x, np.full((3, 1), row), np.ones((3, 1), np.float32), bank, threads=1)
            assert torch.equal(fused, pe.routed(layer, m, ids, w) + torch.from_numpy(alone))
            r = ref.routed(layer, m.double(), ids, w.double(), shared=True)
            assert ((fused.double() - r).norm() / r.norm()) < 1e-5
    finally:
        pe.close()


def test_two_shared_experts_run_in_a_call_of_their_own(tmp_path):
    """Shared experts wider than a routed one (two: 2I) cannot ride in the host bank: their own bank and
    call, against the float64 reference."""
    from runtime.checkpoint.synth import make_checkpoint
    from runtime.config import ModelConfig
    from runtime.experts import PlacedExperts, ReferenceExperts
    ck2 = Checkpoint(make_checkpoint(ModelConfig.preset("tiny").replace(name="tiny-2shared", n_shared_experts=2), tmp_path, seed=0))
    cfg = ck2.config
    assert not cfg.shared_rides and not ck2.footprint().shared_rides
    pe = PlacedExperts(ck2, Plan(cpu_threads=1))
    try:
        assert pe.shared_row[2] is None and pe.shared_bank[2].n_experts == 1 and pe.host[2].n_experts == cfg.n_routed_experts
        g = torch.Generator().manual_seed(6)
        m = torch.randn(2, cfg.hidden_size, generator=g)
        ids = torch.stack([torch.randperm(cfg.n_routed_experts, generator=g)[:cfg.num_experts_per_tok] for _ in range(2)])
        w = torch.rand(2, cfg.num_experts_per_tok, generator=g)
        y = pe.routed(2, m, ids, w, shared=True)
        r = ReferenceExperts(ck2).routed(2, m.double(), ids, w.double(), shared=True)
        assert ((y.double() - r).norm() / r.norm()) < 1e-5 and pe.seconds["shared_moe"] > 0
    finally:
        pe.close()


NO_THREADSAFE_LAYER = """
import json, sys, numba
from runtime.engine import Engine
from runtime.plan import Plan
e = Engine(sys.argv[1], Plan.from_dict(json.loads(sys.argv[2])), device="cpu")
r = e.generate(json.loads(sys.argv[3]), 6, keep_logits=True)
print(json.dumps({"layer": numba.threading_layer(), "overlap": e.experts.overlap, "tokens": r.tokens,
                  "logits": [l.tolist() for l in r.logits]}))
"""


@pytest.mark.parametrize("plan", [Plan(moe_strategy="hybrid", slot_cache_experts=8, fetch_fraction=0.5),
                                  Plan(moe_strategy="offload")], ids=["hybrid", "offload"])
def test_without_a_threadsafe_numba_layer_the_cpu_share_runs_in_turn(ck, case, plan):
    """Where neither libgomp nor tbb loads, numba falls back to its workqueue layer, which aborts the
    process when two threads launch parallel kernels at once (the CPU share beside the device's: the
    hybrid split, the shared expert under offload). There the share runs in turn: the same bits."""
    import os
    import subprocess
    import sys
    prompt, _ = case
    env = {**os.environ, "NUMBA_THREADING_LAYER": "workqueue"}
    p = subprocess.run([sys.executable, "-c", NO_THREADSAFE_LAYER, str(ck.root), json.dumps(plan.to_dict()), json.dumps(prompt)],
                       env=env, capture_output=True, text=True, timeout=300)
    assert p.returncode == 0, p.stderr[-2000:]
    got = json.loads(p.stdout.strip().splitlines()[-1])
    assert got["layer"] == "workqueue" and got["overlap"] is False
    e = Engine(ck, plan, device="cpu")                                 # this host's own layer
    try:
        want = e.generate(prompt, 6, keep_logits=True)
    finally:
        e.close()
    assert got["tokens"] == want.tokens and got["logits"] == [l.tolist() for l in want.logits]


def test_temperature_sampling_is_seeded(ck, case):
    prompt, _ = case
    e = Engine(ck, Plan())
    a = e.generate(prompt, 12, temperature=1.0, seed=5).tokens
    assert a == e.generate(prompt, 12, temperature=1.0, seed=5).tokens
    assert a != e.generate(prompt, 12, temperature=1.0, seed=6).tokens


def test_refusals_name_the_budget_and_shortfall(ck):
    with pytest.raises(DoesNotFit, match=r"= 5000 tokens exceed the plan's max_context 4096 by 904"):
        check_request(Plan(max_context=4096), 4990, 10)
    fp = ck.footprint()
    with pytest.raises(DoesNotFit, match=r"over its vram_budget_gib 0.0001 by"):
        Engine(ck, Plan(vram_budget_gib=0.0001))
    with pytest.raises(DoesNotFit, match=r"GiB are available: short by"):
        check_plan(Plan(), fp, available=1000)
    with pytest.raises(DoesNotFit, match="geometry"):
        check_plan(Plan(geometry_hash="0123456789abcdef"), fp)


def test_engram_vocabulary_mismatch_refused(tiny_dir, tmp_path):
    import shutil
    d = tmp_path / "ck"
    shutil.copytree(tiny_dir, d)
    raw = json.loads((d / "config.json").read_text())
    raw["text_config"]["engram_compressed_vocab_size"] += 1
    (d / "config.json").write_text(json.dumps(raw))
    with pytest.raises(ValueError, match=r"compressed vocabulary has \d+ entries.*engram_compressed_vocab_size is \d+"):
        Engine(d, Plan())


def test_dsv41_run_cli_cold_and_warm(tiny_dir, tmp_path, capsys):
    from runtime.cli.run import main
    plan = tmp_path / "plan.json"
    plan.write_text(json.dumps(Plan(moe_strategy="hybrid", slot_cache_experts=20, prefill_chunk=16).to_dict()))
    assert main(["--checkpoint", str(tiny_dir), "--plan", str(plan), "--prompt-tokens", "60", "--max-tokens", "6",
                 "--prompt-seed", "3", "--json"]) == 0
    d = json.loads(capsys.readouterr().out)
    assert len(d["tokens"]) == 6 and d["ttft_s"] > 0 and d["decode_tok_s"] > 0 and d["plan"]["moe_strategy"] == "hybrid"
    assert d["cold"]["tokens"] == d["warm"]["tokens"] and 0.0 <= d["cold_resident_fraction_before_load"] <= 1.0
    assert {"attention", "dense", "cpu_moe", "gather", "device_moe"} <= set(d["phases"])
    assert main(["--checkpoint", str(tiny_dir), "--prompt-tokens", "40000", "--max-tokens", "6"]) == 2
    assert "exceed the plan's max_context" in capsys.readouterr().err


def test_eviction_is_checked_with_mincore(tmp_path):
    import os
    from runtime.pagecache import evict, resident_fraction
    p = tmp_path / "blob"
    with open(p, "wb") as f:
        f.write(os.urandom(8 << 20))
        f.flush()
        os.fsync(f.fileno())
    p.read_bytes()
    assert resident_fraction(p) > 0.9
    evict([p])
    after = resident_fraction(p)
    if after > 0.9:
        pytest.skip("this filesystem keeps clean pages on POSIX_FADV_DONTNEED (tmpfs?): cold runs cannot be made here")
    assert after < 0.1


def test_dispatch_and_gather_costs_are_exposed(ck):
    from runtime.experts import PlacedExperts
    pe = PlacedExperts(ck, Plan(moe_strategy="offload", slot_cache_experts=40))
    d = pe.dispatch_seconds(3, repeats=5)
    assert len(d) == 5 and all(0 < s < 1 for s in d)
    assert pe.gathered >= 5 * 4                                      # every probe call started from an empty cache
    one, four = pe.gather_seconds(2, 1), pe.gather_seconds(2, 4)
    assert one > 0 and four > 0 and len(pe.cache.where) == 4 and all(k[0] == 2 for k in pe.cache.where)
    assert all(pe.gather_seconds(2, 4) > 0 for _ in range(20))      # repeated samples: each a real gather
    with pytest.raises(ValueError, match="cannot gather"):
        pe.gather_seconds(2, 100)
    pe.close()


def test_every_strategy_s_fixed_cost_is_timed_through_the_runtime(ck):
    """The profiler's moe_fixed_us: cpu on the host; offload and hybrid on CUDA, here on the CPU stand-in
    device (the same code path, so the probe is exercised; its figures are not a GPU's)."""
    from autotune.probes.runtime_paths import fixed_costs
    out = fixed_costs(ck, threads=1, repeats=3, device="cpu")
    for s in ("cpu", "offload", "hybrid"):
        assert out[s]["median"] > 0 and len(out[s]["samples"]) == 3 and out[s]["geometry"] == ck.config.geometry_hash()
    plain = fixed_costs(ck, threads=1, repeats=3)
    assert cuda_available() or all("no CUDA device" in plain[s]["skipped"] for s in ("offload", "hybrid"))


@pytest.mark.parametrize("placement,depth,cache_mib,scales_in_ram,engine", [
    ("nvme_direct", 1, 0, True, "auto"), ("nvme_direct", 8, 1, True, "auto"), ("nvme_direct", 64, 0, False, "auto"),
    ("nvme_direct", 8, 0, True, "uring"), ("nvme_direct", 32, 0, True, "aio"), ("nvme_direct", 4, 0, False, "threads"),
    ("nvme_mmap", 8, 0, True, "auto")])
def test_engram_placements_give_identical_output(ck, case, placement, depth, cache_mib, scales_in_ram, engine):
    """Every placement, depth and reader engine (engram_io_engine, the plan's: the one serving the reads)
    gives the host placement's bits."""
    prompt, _ = case
    if engine in ("uring", "aio"):
        _skip_unless_engine(engine, ck.root)
    host = Engine(ck, Plan()).generate(prompt, 6, keep_logits=True)
    e = Engine(ck, Plan(engram_placement=placement, engram_io_depth=depth, engram_row_cache_mib=cache_mib,
                        engram_scales_in_ram=scales_in_ram, engram_io_engine=engine))
    out = e.generate(prompt, 6, keep_logits=True)
    used, shown = (e.engram.reader.engine_used, e.io_paths()["engram"]) if e.engram.reader else (None, "")
    e.close()
    assert out.tokens == host.tokens and all(torch.equal(a, b) for a, b in zip(out.logits, host.logits))
    if placement == "nvme_direct":
        c = out.engram
        assert c["rows_requested"] > 0 and c["reads"] > 0 and c["bytes_read"] > 0
        assert c["bytes_read"] == 4096 * c["reads"] and c["reads"] <= (1 if scales_in_ram else 2) * (c["unique_rows"] - c["cache_hits"])
        if cache_mib:
            assert c["cache_hits"] > 0                            # n-gram rows recur in natural text
        if engine != "auto":
            assert used == engine and shown.endswith(f", {engine}")


def _skip_unless_engine(engine, path):
    from hostinfo import o_direct_refusal
    from runtime.io_reader import ASYNC
    if o_direct_refusal(path / "config.json"):
        pytest.skip(f"no O_DIRECT here ({o_direct_refusal(path / 'config.json')}): the threads read every file")
    ctx, why = dict(ASYNC)[engine].open(1)
    if ctx is None:
        pytest.skip(f"the kernel refuses {engine} here: {why}")
    ctx.close()


def test_a_plans_engine_the_kernel_refuses_fails_the_load_naming_the_field(ck, monkeypatch):
    import runtime.io_reader as io_reader
    monkeypatch.setattr(io_reader.AioContext, "open", classmethod(lambda cls, depth: (None, "io_setup refused (1: seccomp)")))
    with pytest.raises(OSError, match=r"plan field 'engram_io_engine': the reader's engine 'aio' is unavailable: aio: io_setup refused"):
        Engine(ck, Plan(engram_placement="nvme_direct", engram_io_engine="aio"))
    with pytest.raises(PlanError, match=r"'engram_io_engine' must be one of"):
        Plan(engram_io_engine="spdk")


def test_gather_rows_reads_each_block_once_and_handles_straddlers(tmp_path):
    from runtime.engram_store import gather_rows
    from runtime.io_reader import BatchedReader
    rng = np.random.default_rng(3)
    base, nbytes, n = 1000, 264, 3000                         # 264 B rows from an unaligned base: many straddle
    data = rng.integers(0, 256, base + n * nbytes + 5000, dtype=np.uint8)
    f = tmp_path / "t.bin"
    f.write_bytes(data.tobytes())
    rows = np.unique(rng.integers(0, n, 700))
    r = BatchedReader(depth=4)
    got, blocks = gather_rows(r, str(f), base, rows, nbytes)
    r.close()
    table = data[base:base + n * nbytes].reshape(n, nbytes)
    assert np.array_equal(got, table[rows])
    off = base + rows * nbytes
    want = len(np.unique(np.concatenate([off // 4096, (off + nbytes - 1) // 4096])))
    assert blocks == want < 2 * len(rows)                     # shared blocks read once
    assert any((o % 4096) + nbytes > 4096 for o in off)      # the case of a row across two blocks ran


def test_engram_table_of_the_wrong_size_refused(tiny_dir, tmp_path):
    import shutil
    d = tmp_path / "ck"
    shutil.copytree(tiny_dir, d)
    raw = json.loads((d / "config.json").read_text())
    raw["text_config"]["engram_num_embeddings"][0] += 7
    (d / "config.json").write_text(json.dumps(raw))
    from runtime.checkpoint.safetensors_io import CheckpointError
    with pytest.raises((CheckpointError, ValueError), match=r"engram.embed.weight.*\[(\d+), 32\].*\[\d+, 32\]"):
        Engine(d, Plan(engram_placement="nvme_direct"))


def test_expert_span_is_one_request_of_exactly_the_expert(ck):
    from runtime.model.weights import expert_span
    path, off, length = expert_span(ck, "layers.2.ffn.experts.5")
    assert length == ck.config.expert_bytes and path.endswith(".safetensors")
    raw = open(path, "rb").read()[off:off + length]
    first = ck.infos["layers.2.ffn.experts.5.w1.weight"]
    assert raw[:64] == bytes(ck.raw(first.name)[:64])


@pytest.mark.parametrize("dspark", [False, True])
def test_stream_yields_the_generated_tokens_and_stops_early(ck, case, dspark):
    prompt, _ = case
    e = Engine(ck, Plan(dspark=dspark, draft_length=3))
    full = e.generate(prompt, 16)
    streamed = list(e.stream(prompt, 16))
    assert streamed == full.tokens
    stop = full.tokens[5]                                # stops at its first occurrence, kept
    cut = full.tokens.index(stop) + 1
    short = e.generate(prompt, 16, stop_ids=[stop])
    assert short.tokens == full.tokens[:cut]
    it = e.stream(prompt, 16)                            # a client that goes away: close mid-stream
    assert [next(it) for _ in range(3)] == full.tokens[:3]
    it.close()
    assert e.generate(prompt, 16).tokens == full.tokens  # the engine is still whole


def test_the_time_outside_every_phase_is_reported(ck, case):
    """The decode and prefill phase tables add the wall time no phase covers (per-layer Python between
    the kernels), in seconds and per layer call: the phases and it account for the request's wall time."""
    import time
    from runtime.engine import TOP_PHASES
    prompt, _ = case
    e = Engine(ck, Plan(prefill_chunk=16))
    try:
        t0 = time.perf_counter()
        r = e.generate(prompt, 8)
        wall = time.perf_counter() - t0
    finally:
        e.close()
    covered = 0.0
    for ph in (r.prefill_phases, r.phases):
        assert ph["outside_phases"] > 0
        covered += sum(ph.get(p, 0.0) for p in TOP_PHASES) + ph["outside_phases"]
    assert 0.9 * wall < covered <= wall
    L = ck.config.num_hidden_layers
    assert r.phases["outside_phases_per_layer_us"] == pytest.approx(r.phases["outside_phases"] / (L * 7) * 1e6)
    assert r.prefill_phases["outside_phases_per_layer_us"] == pytest.approx(
        r.prefill_phases["outside_phases"] / (L * -(-len(prompt) // 16)) * 1e6)
