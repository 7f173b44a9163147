"""Probes through the runtime's own code paths, at the checkpoint's geometry: what each cost-model term
costs where the kernels' figures cannot say (autotune/terms.py).

forward_terms  the runtime's decode forwards at several contexts and prefill chunks (a cpu plan, experts
               in RAM up to the probe budget): the `dense` phase (as GB/s of dense_path_bytes, and
               FLOP/s over a chunk), `attention` against context, the shared expert per layer, Engram
               row assembly, and the time outside every phase per layer; each timed where it runs
fixed_costs    each MoE strategy's fixed cost per layer call (runtime/experts.py dispatch_seconds):
               cpu everywhere; offload and hybrid where a CUDA device runs them
routing        a routing trace of one request (prompt + generated tokens) through the runtime, turned
               into hit-rate curves and expert unions (autotune/routing.py)
"""
from __future__ import annotations

import time

import torch

from autotune.routing import curve
from hostinfo import cuda_available, probe_budget_bytes, ram_available_bytes
from hostinfo.measure import Measurement
from runtime.budget import dense_path_bytes
from runtime.checkpoint.reader import Checkpoint
from runtime.plan import Plan


def _fig(m: Measurement, **kw) -> dict:
    d = m.to_dict()
    d.update(kw)
    return d


def _probe_engine(ck: Checkpoint, threads: int, max_context: int, tier: bool = False):
    """The runtime as a cpu plan serves here (Engram rows through the page cache), its routed experts
    all in RAM where half the available RAM holds them (the search's plans there keep them in RAM, and
    an NVMe tier's reads slow every other phase: on mini they made `dense` 1.4x and `attention` 1.8x
    slower on a 480 MiB-L3 Xeon); else half the probe memory budget's worth in RAM and the rest read
    from the NVMe tier, as the plans that fit such a host run (`tier`: an NVMe tier whatever the RAM,
    at most half the experts in RAM, for the NVMe-tier plans' own figures). -> (engine, "ram" | "nvme tier")."""
    from runtime.engine import Engine
    total, budget = ck.footprint().routed_expert_bytes_total, probe_budget_bytes() // 2
    in_ram = total <= ram_available_bytes() // 2
    held = min(budget, total // 2) if tier else None if in_ram or total <= budget else budget
    plan = Plan(cpu_threads=threads, max_context=max_context, prefill_chunk=64,
                host_expert_budget_gib=None if held is None else held / 2**30,
                engram_placement="nvme_mmap" if ck.config.engram_layer_ids else "host")
    return Engine(ck, plan, device="cpu"), "ram" if plan.host_expert_budget_gib is None else "nvme tier"


def forward_terms(ck: Checkpoint, quick: bool, threads: int, contexts=None, chunk: int = 64, tier: bool = False) -> dict:
    """-> {dense_path_gbs, dense_path_tflops, attention_s_per_token, shared_call_us, engram_rows_s,
    step_other_s_per_layer}, each keyed to the geometry: decode forwards of the runtime at several
    contexts, then prefill chunks; each phase timed where it runs (beside the MoE kernel's threads).
    tier: with an NVMe expert tier (`_probe_engine`)."""
    from autotune.terms import dense_params
    cfg, fp = ck.config, ck.footprint()
    contexts = contexts or ((32, 256) if quick else (64, 256, 1024))
    repeats = 5 if quick else 12
    e, placement = _probe_engine(ck, threads, max(contexts) + (repeats + 3) * len(contexts) + 4 * chunk + 8, tier)
    model, experts = e.model, e.experts
    st = model.new_state(e.plan.max_context)
    dense, other, rows, shared, points = [], [], [], [], []
    L, n_engram = cfg.num_hidden_layers, max(len(cfg.engram_layer_ids), 1)
    ids = lambda n: [(st.pos + k) % (cfg.vocab_size - 1) + 1 for k in range(n)]  # noqa: E731

    def timed(tokens):
        model.phases.seconds.clear()
        experts.seconds.clear()
        t0 = time.perf_counter()
        model.forward(st, tokens)
        wall = time.perf_counter() - t0
        ph = {**model.phases.seconds, **experts.seconds}
        inside = sum(ph.get(k, 0.0) for k in ("attention", "dense", "engram_wait", "moe_layer_total", "shared_moe"))
        return max(0.0, wall - inside), ph
    try:
        with torch.inference_mode():
            for ctx in contexts:
                while st.pos < ctx:                                              # extend the sequence to ctx
                    model.forward(st, ids(min(chunk, ctx - st.pos)))
                att = []
                for r in range(repeats + 2):
                    out, ph = timed(ids(1))
                    if r >= 2:                                                    # two warm-up forwards
                        att.append(ph["attention"])
                        dense.append(ph["dense"])
                        shared.append(ph.get("shared_moe", 0.0) / L)
                        rows.append(ph.get("engram_wait", 0.0) / n_engram)
                        other.append(out / L)
                points.append({"context": st.pos, **_fig(Measurement(tuple(att), "s"))})
            timed(ids(chunk))                                                     # warm-up, then prefill chunks
            pre = [timed(ids(chunk))[1] for _ in range(2 if quick else 3)]
    finally:
        e.close()
    geo = cfg.geometry_hash()
    path_bytes = dense_path_bytes(fp)
    flop = 2 * dense_params(fp) * chunk
    out = {"dense_path_gbs": _fig(Measurement(tuple(path_bytes / s / 1e9 for s in dense), "GB/s",
                                              note="the runtime's `dense` phase per decode token"), geometry=geo, placement=placement),
           "dense_path_tflops": _fig(Measurement(tuple(flop / p["dense"] / 1e12 for p in pre), "TFLOP/s",
                                                 note=f"the runtime's `dense` phase over a {chunk}-token prefill chunk"),
                                     geometry=geo, tokens=chunk),
           "attention_s_per_token": {"geometry": geo, "placement": placement, "points": points, "unit": "s", "source": "measured",
                                     "prefill": {"tokens": chunk, "context": st.pos - chunk // 2,
                                                 **_fig(Measurement(tuple(p["attention"] for p in pre), "s"))},
                                     "note": "the runtime's `attention` phase (attention + indexer): per decode token at "
                                             "each context; `prefill`: one chunk's, at its middle context"},
           "step_other_s_per_layer": _fig(Measurement(tuple(other), "s", note="a decode forward's time outside its phases, per layer"),
                                          geometry=geo)}
    out["shared_call_us"] = ({"skipped": "no shared expert"} if not cfg.n_shared_experts else
                             {"skipped": "the shared expert rides in the routed experts' CPU call (timed in cpu_moe_gbs)"}
                             if cfg.shared_rides else
                             _fig(Measurement(tuple(x * 1e6 for x in shared), "us", note="`shared_moe` per layer per decode token"),
                                  geometry=geo))
    out["engram_rows_s"] = (_fig(Measurement(tuple(rows), "s", note="`engram_wait` per Engram layer per decode forward, rows "
                                                                    "in the page cache (the assembly cost, no I/O wait)"), geometry=geo)
                            if cfg.engram_layer_ids else {"skipped": "no Engram layers"})
    return out


def expert_tier_read(ck: Checkpoint, threads: int, calls: int = 6) -> Measurement:
    """GB/s of the expert NVMe tier as a decode step reads it: PlacedExperts._fetch of one layer's top_k
    experts (O_DIRECT batched reads at the runtime's depth, sliced and copied into a bank), fresh
    experts every call, every expert on the tier (host_expert_budget_gib 0)."""
    from runtime.experts import PlacedExperts
    cfg = ck.config
    K, E, L = cfg.num_experts_per_tok, cfg.n_routed_experts, cfg.num_hidden_layers
    pe = PlacedExperts(ck, Plan(moe_strategy="cpu", cpu_threads=threads, host_expert_budget_gib=0.0))
    samples = []
    try:
        for i in range(calls + 1):                        # the first call warms the reader (its ring, buffers)
            experts = sorted({(K * i + k) % E for k in range(K)})
            t0 = time.perf_counter()
            bank, _ = pe._fetch(i % L, experts)
            dt = time.perf_counter() - t0
            del bank
            if i:
                samples.append(len(experts) * cfg.expert_bytes / dt / 1e9)
    finally:
        pe.close()
    return Measurement(tuple(samples), "GB/s", note=f"the expert tier through the runtime: {K} experts of "
                       f"{cfg.expert_bytes / 2**20:.1f} MiB per call (PlacedExperts._fetch, {pe.reader.engine if pe.reader else 'mmap'})")


def fixed_costs(ck: Checkpoint, threads: int, repeats: int = 20, device: str | None = None) -> dict:
    """{strategy: figure (us per MoE layer call) or {skipped}} through PlacedExperts at this geometry.
    The device strategies run on CUDA (`device` overrides it: tests run their code on the CPU stand-in)."""
    from runtime.experts import PlacedExperts
    cfg = ck.config
    K = cfg.num_experts_per_tok
    budget = cfg.num_hidden_layers * max(K, 1) * cfg.expert_bytes / 2**30 * 1.01    # the probed experts resident
    out = {}
    for strategy in ("cpu", "offload", "hybrid"):
        where = "cpu" if strategy == "cpu" else device or "cuda"
        if where == "cuda" and not cuda_available():
            out[strategy] = {"skipped": "no CUDA device on this host: the device strategies cannot run here"}
            continue
        plan = Plan(moe_strategy=strategy, cpu_threads=threads, host_expert_budget_gib=budget,
                    slot_cache_experts=0 if strategy == "cpu" else 2 * K, fetch_fraction=0.5)
        pe = PlacedExperts(ck, plan, device=where)
        try:
            s = pe.dispatch_seconds(min(1, cfg.num_hidden_layers - 1), repeats=repeats)
        finally:
            pe.close()
        out[strategy] = _fig(Measurement(tuple(x * 1e6 for x in s), "us",
                                         note=f"routed() per layer minus its kernels and transfers ({strategy}, runtime path)"),
                             geometry=cfg.geometry_hash())
    return out


def dspark_acceptance(ck: Checkpoint, quick: bool, threads: int, draft_length: int = 3) -> dict:
    """The drafter on this checkpoint, from greedy DSpark generations of natural-text prompts through the
    runtime: {"dspark_p_accept": each one's mean accepted drafts per step solved for p
    (terms.p_from_accepted), "dspark_draft_s_per_token": each one's drafter seconds per drafted token}
    (skipped entries where the checkpoint has no drafter)."""
    from tokenizers import Tokenizer

    from autotune.terms import p_from_accepted
    from runtime.engine import Engine
    from runtime.workload import make_prompts
    cfg, fp = ck.config, ck.footprint()
    if not cfg.dspark_num_layers:
        return {k: {"skipped": "the checkpoint has no DSpark drafter"} for k in ("dspark_p_accept", "dspark_draft_s_per_token")}
    P, D, n = (32, 16, 1) if quick else (96, 32, 3)
    budget = probe_budget_bytes() // 2
    plan = Plan(cpu_threads=threads, max_context=P + D + 16, prefill_chunk=64, dspark=True, draft_length=draft_length,
                host_expert_budget_gib=None if fp.routed_expert_bytes_total <= budget else budget / 2**30,
                engram_placement="nvme_mmap" if cfg.engram_layer_ids else "host")
    e = Engine(ck, plan, device="cpu")
    try:
        tok = Tokenizer.from_file(str(ck.root / "tokenizer.json"))
        prompts = make_prompts(tok, P, n, seed=5)
        e.generate(prompts[0], 4)                                      # warm: compile, page the drafter in (not timed)
        runs = [e.generate(p, D).dspark for p in prompts]
    finally:
        e.close()
    note = f"greedy DSpark, draft length {draft_length}, {n} prompts of {P} tokens, {D} generated each"
    ps = [p_from_accepted(r["mean_accepted"], draft_length) for r in runs]
    per = [r["draft_s"] / r["drafted"] for r in runs if r["drafted"]]
    kw = dict(geometry=cfg.geometry_hash(), draft_length=draft_length)
    return {"dspark_p_accept": _fig(Measurement(tuple(ps), "per token", note=note), **kw),
            "dspark_draft_s_per_token": _fig(Measurement(tuple(per), "s", note=note + f", {threads} threads"), threads=threads, **kw)
            if per else {"skipped": "no token was drafted"}}


def routing(ck: Checkpoint, quick: bool, threads: int) -> dict:
    """A routing trace of one request on this checkpoint -> the profile's `routing` entry."""
    from tokenizers import Tokenizer

    from runtime.engine import Engine
    from runtime.workload import make_prompt
    cfg = ck.config
    P, D = (96, 32) if quick else (384, 96)
    fp = ck.footprint()
    budget = min(fp.routed_expert_bytes_total, probe_budget_bytes() // 2) / 2**30
    plan = Plan(cpu_threads=threads, max_context=P + D + 8, prefill_chunk=128,
                host_expert_budget_gib=None if budget * 2**30 >= fp.routed_expert_bytes_total else budget,
                engram_placement="nvme_mmap" if cfg.engram_layer_ids else "host")
    e = Engine(ck, plan, device="cpu")
    try:
        trace = e.record_routing()
        e.generate(make_prompt(Tokenizer.from_file(str(ck.root / "tokenizer.json")), P, seed=11), D)
    finally:
        e.close()
    return curve(trace)
