"""The cost model: predict(plan, profile, footprint, workload) -> Prediction. Pure and fast (no torch).

predict = validity (plan_problems) + memory (runtime/budget.py, the one accounting) + decode terms +
prefill terms + per-term calibration. Each term is a function in autotune/terms.py matched to a phase of
the runtime's phase table, so validation can measure every term (autotune/validate.py) and fit a factor
per term; the figures each term reads, and their sources, come from autotune/figures.py. Decode terms are
seconds per generated token (a DSpark step's divided by its expected tokens), prefill terms seconds per
prompt. Every source appears in `Prediction.sources`; assumptions are in `notes`, flagged.
  decode context   attention at the mid-generation context P + max_tokens / 2
  concurrency      n = min(workload concurrency, max_num_seqs) streams share each step: union(n) experts
                   of independent tokens per layer, attention per sequence; decode_tok_s is per stream,
                   terms.aggregate_tok_s = n x that, terms.itl_s the step; an ITL budget is a constraint
  DSpark           tokens per step a = 1 + p + ... + p^d, p measured by validation or by the profiler on
                   this checkpoint (else 0.7, assumed); each stream drafts d and verifies d+1 tokens in the
                   step: union(d+1) experts per stream (the routing curve), n streams: _step_experts
  page cache       RAM left after the plan (and the OS headroom) serves the nvme_mmap tiers' reads at DRAM
                   speed in proportion to its share of their bytes
  VRAM / host RAM  runtime.budget.device_bytes + graphs (1 GiB, assumed) / host_bytes + OS headroom (8 GiB,
                   assumed)
"""
from __future__ import annotations

from dataclasses import asdict, dataclass, field

from autotune import terms as T
from autotune.figures import HostFigures, MissingFigure, gather_figures, is_gpu
from runtime.budget import (dense_path_bytes, device_bytes, drafter_dense_bytes, engram_host_bytes, host_bytes,
                            indexer_bound_bytes, kv_states_bytes, kv_state_bytes, staging_bytes)
from runtime.checkpoint.footprint import Footprint
from runtime.plan import IO_ENGINES, Plan
from runtime.workload import Workload

__all__ = ["predict", "objective", "Prediction", "MissingFigure", "OS_HEADROOM", "GRAPHS_BYTES", "TERMS"]

GIB = 1 << 30
GRAPHS_BYTES = 1 * GIB            # assumed CUDA graph pool
OS_HEADROOM = 8 * GIB             # assumed host RAM kept for the OS and the process
VRAM_MARGIN = 0.05                # safety margin on every VRAM budget
DSPARK_P_ACCEPT = 0.7             # assumed per-token acceptance until measured
TERMS = tuple(T.PHASES) + ("other",)

ASSUMED = {   # priors the model uses, each flagged in every prediction's notes (source: assumed)
    "os_headroom": f"host RAM kept for the OS and the process: {OS_HEADROOM / GIB:.0f} GiB (assumed)",
    "graphs": f"CUDA graph pool: {GRAPHS_BYTES / GIB:.0f} GiB (assumed)",
}


@dataclass
class Prediction:
    decode_tok_s: float
    ttft_s: float
    feasible: bool
    why: list = field(default_factory=list)
    memory: dict = field(default_factory=dict)      # bytes per tier
    terms: dict = field(default_factory=dict)       # decode_<term>_s per token, prefill_<term>_s per prompt, inputs
    notes: list = field(default_factory=list)       # extrapolations and assumptions used
    sources: dict = field(default_factory=dict)     # term -> where its figures come from
    raw: dict = field(default_factory=dict)         # decode_tok_s, ttft_s and the terms before calibration

    def to_dict(self) -> dict:
        return asdict(self)


AUTO_ORDER = IO_ENGINES[1:]                    # the reader's auto takes the first of these the kernel opens


def _nvme_point(profile, depth: int) -> dict | None:
    """The random-read figures at the deepest measured queue depth <= depth (the shallowest if none)."""
    pts = profile["measurements"].get("nvme_randread_4k")
    if not isinstance(pts, list) or not pts:
        return None
    best = [p for p in pts if p["qd"] <= depth] or [min(pts, key=lambda p: p["qd"])]
    return max(best, key=lambda p: p["qd"])


def _iops(profile, depth: int, engine: str = "auto") -> float | None:
    """4 KiB random reads/s at `depth` through the reader's `engine` (auto: the first this host opens);
    None where the profile has no figure for it. A profile from before the engines were measured one by
    one has the auto reader's figure only: that serves every engine."""
    p = _nvme_point(profile, depth)
    if p is None:
        return None
    each = p.get("engines")
    if not each:
        return float(p["iops"])
    name = engine if engine != "auto" else next((e for e in AUTO_ORDER if e in each), None)
    return float(each[name]["iops"]) if name in each else None


def fastest_engine(profile, depth: int) -> str:
    """The reader's engine with the most random reads/s at `depth` on this host ('auto' where the profile
    did not measure them one by one): a measured fact the search copies into the plan."""
    p = _nvme_point(profile, depth)
    return p.get("engine", "auto") if p is not None and p.get("engines") else "auto"


def _engram_iops(plan: Plan, profile) -> float | None:
    """The Engram tier's reads/s: nvme_direct reads through the plan's engine at its depth; nvme_mmap's page
    faults are not the reader's (auto's figure, as measured)."""
    return _iops(profile, plan.engram_io_depth, plan.engram_io_engine if plan.engram_placement == "nvme_direct" else "auto")


def plan_problems(plan: Plan, profile: dict, fp: Footprint, wl: Workload, allow_inexact: bool) -> list[str]:
    """Why this plan cannot run this workload on this host (memory aside)."""
    why = []
    if not is_gpu(profile) and (plan.moe_strategy != "cpu" or plan.slot_cache_experts or plan.prefill_moe_path == "device"):
        why.append("no GPU on this host: moe_strategy must be cpu, no slot cache, prefill on the CPU")
    if plan.prefill_mode == "bounded_replay" and not allow_inexact:
        why.append("prefill_mode bounded_replay changes output: allow inexact prefill to choose it")
    if wl.prompt_tokens + wl.max_tokens > plan.max_context:
        why.append(f"prompt + output ({wl.prompt_tokens + wl.max_tokens}) exceed max_context ({plan.max_context})")
    if plan.dspark and not fp.dspark_num_layers:
        why.append("dspark on but the checkpoint has no drafter")
    if plan.prefill_moe_path == "device" and not staging_bytes(plan, fp):
        why.append(f"prefill_moe_path device needs prefill_buffer_mib >= one expert ({fp.expert_bytes / 2**20:.2f} MiB), "
                   f"got {plan.prefill_buffer_mib}")
    if fp.engram_rows_total and plan.engram_placement != "host" and _engram_iops(plan, profile) is None:
        why.append("Engram on NVMe needs nvme_randread_4k figures this profile lacks" + (
            f" (engram_io_engine {plan.engram_io_engine} was not measured here)" if _nvme_point(profile, plan.engram_io_depth) else ""))
    return why


def memory(plan: Plan, profile: dict, fp: Footprint, f: HostFigures) -> tuple[dict, list[str], dict]:
    """Bytes per tier from runtime/budget.py, the page cache left, the budgets they break, and the
    shares: of the routed experts on NVMe, of the nvme_mmap tiers' bytes the page cache holds."""
    why, gpu = [], f.gpu
    routed_all = fp.routed_expert_bytes_total
    budget = routed_all if plan.host_expert_budget_gib is None else min(routed_all, plan.host_expert_budget_gib * GIB)
    q_nvme = 1 - budget / routed_all if routed_all else 0.0
    vram = device_bytes(plan, fp) + GRAPHS_BYTES if gpu else 0
    vram_cap = (plan.vram_budget_gib * GIB if plan.vram_budget_gib is not None
                else profile["host"]["hard"]["gpu_vram_gib"] * GIB if gpu else 0)
    peak = indexer_bound_bytes(plan, fp)
    if gpu and vram > vram_cap * (1 - VRAM_MARGIN):
        why.append(f"VRAM {vram / GIB:.2f} GiB exceeds the budget {vram_cap / GIB:.2f} GiB less {VRAM_MARGIN:.0%} margin "
                   f"(indexer peak {peak / GIB:.2f} GiB at chunk {plan.prefill_chunk})")
    engram_host = engram_host_bytes(plan, fp)
    host = host_bytes(plan, fp, dense_on_host=not gpu) + OS_HEADROOM       # the runtime's own accounting
    ram = profile["host"]["hard"]["ram_gib"] * GIB
    if host > ram:
        why.append(f"host RAM {host / GIB:.1f} GiB exceeds {ram / GIB:.1f} GiB (routed experts resident "
                   f"{budget / GIB:.1f} GiB, Engram {engram_host / GIB:.1f} GiB, OS headroom {OS_HEADROOM / GIB:.0f} GiB assumed)")
    if q_nvme > 0 and f.nvme_seq is None:
        why.append("experts beyond the host budget need an NVMe figure (nvme_seq_read_gbs) this profile lacks")
    page_cache = max(0.0, ram - host)
    mapped = (fp.engram_bytes_total if plan.engram_placement == "nvme_mmap" else 0) + \
             (routed_all - budget if plan.expert_nvme_path == "nvme_mmap" else 0)
    shared_pinned = fp.bytes_by_class.get("shared_expert", 0) if fp.shared_rides else 0   # its row of the host banks
    pinned = budget + shared_pinned if gpu and plan.moe_strategy != "cpu" else 0
    return {"vram": vram, "vram_cap": vram_cap, "indexer_peak": peak, "kv": kv_states_bytes(plan, fp),
            "slots": plan.slot_cache_experts * fp.expert_bytes, "host": host, "pinned": pinned, "pageable": host - pinned,
            "page_cache_left": page_cache, "disk": fp.total_bytes}, why, \
        {"page_share": min(1.0, page_cache / mapped) if mapped else 0.0, "nvme_share": q_nvme}


def _head_bytes(fp: Footprint, gpu: bool) -> int:
    """The LM head as the dense path holds it: as stored (BF16) on the CPU, a float32 copy on the device."""
    return fp.vocab_size * fp.hidden_size * (4 if gpu else 2)


class _Ctx:
    """What every term of one prediction shares."""

    def __init__(self, plan, profile, fp, wl, f, shares):
        self.plan, self.profile, self.fp, self.wl, self.f, self.mem = plan, profile, fp, wl, f, shares
        self.hit = f.routing.hit(plan.slot_cache_experts, plan.moe_strategy, plan.fetch_fraction) if f.gpu else 0.0
        self.iops = _engram_iops(plan, profile) if fp.engram_rows_total and plan.engram_placement != "host" else None
        self.path_bytes = dense_path_bytes(fp, on_cpu=not f.gpu)
        self.sources = dict(f.sources)
        if self.iops:
            how = (f"through the {plan.engram_io_engine} engine" if plan.engram_placement == "nvme_direct" else
                   "nvme_mmap's page faults at the reader's auto figure")
            self.sources["engram_wait"] += f" at QD {plan.engram_io_depth}, {how}: {self.iops:,.0f} reads/s"
        self.notes = []
        self.extra = {}

    def forward(self, tokens: int, context: float, n_experts: float = 0, moe_s: float | None = None,
                sequences: int = 1, share: float = 1.0) -> dict:
        """One forward over `tokens` at `context` (its routed experts: n_experts per layer, or moe_s
        seconds when given (a prefill chunk, running `share` of its layers x tokens); `sequences` > 1:
        one token each, attention per sequence): seconds per term."""
        f, fp, plan = self.f, self.fp, self.plan
        rides = T.shared_rides(plan, fp, prefill=moe_s is not None)
        shared = T.shared(f, fp, tokens, rides)
        t = {"moe": (moe_s + shared * share if rides else moe_s) if moe_s is not None else
             T.moe(f, plan, fp, n_experts, self.hit, self.mem["nvme_share"], self.mem["page_share"], shared if rides else 0.0,
                   tokens=tokens),
             "shared": 0.0 if rides else shared}
        t["dense"], self.sources["dense"] = T.dense(f, fp, tokens, self.path_bytes)
        att, self.sources["attention"] = f.attention_s(tokens // sequences, context, fp, lambda c: kv_state_bytes(fp, int(c)))
        t["attention"] = sequences * att
        io = T.engram_io(plan, fp, self.iops, tokens, self.mem["page_share"]) if self.iops else 0.0
        t["engram_wait"] = T.engram_wait(plan, fp, io, sum(t.values()) / max(fp.num_layers, 1)) + \
            len(fp.engram_layer_ids) * f.engram_rows            # assembling the rows: per forward, as timed
        t["other"] = (f.other_per_layer or 0.0) * fp.num_layers
        t["draft"] = 0.0
        return t


def decode_terms(c: _Ctx) -> dict:
    """Seconds per generated token, per term: one decode step of n streams (each its next token, or with
    DSpark its verify block of d + 1 and its d drafter steps) divided by the n x a tokens it yields."""
    plan, fp, wl, f = c.plan, c.fp, c.wl, c.f
    ctx = wl.prompt_tokens + wl.max_tokens / 2
    n = min(wl.concurrency, plan.max_num_seqs)              # streams sharing each step (continuous batching)
    d, a = 0, 1.0
    if plan.dspark and fp.dspark_num_layers:
        d, p = plan.draft_length, _p_accept(c)
        a = T.accepted_per_step(p, d)
    experts = _step_experts(f, fp, n, d + 1)
    step = c.forward(n * (d + 1), ctx, n_experts=experts, sequences=n)
    step["draft"] = n * d * (f.draft_token if f.draft_token is not None else
                             T.draft(f, fp, drafter_dense_bytes(fp, on_cpu=not f.gpu) + _head_bytes(fp, f.gpu)))
    c.extra = {"concurrency": n}
    if d:
        c.extra.update(dspark_accepted=a, dspark_union_experts=experts)
    return {k: v / (n * a) for k, v in step.items()}


def _p_accept(c: _Ctx) -> float:
    """DSpark's per-token acceptance: validation's, else the profiler's on this checkpoint, else assumed."""
    measured_p = (c.profile.get("calibration") or {}).get("dspark_p_accept")
    probed = c.profile["measurements"].get("dspark_p_accept") or {}
    if measured_p is None and probed.get("geometry") == c.fp.geometry_hash and "median" in probed:
        measured_p = probed["median"]                    # the profiler's, through the runtime on this checkpoint
    p = DSPARK_P_ACCEPT if measured_p is None else measured_p
    c.notes.append(f"DSpark acceptance p={p:.2f} per token is " + ("assumed until measured" if measured_p is None else
                                                                  "measured on this checkpoint"))
    return p


def _step_experts(f, fp: Footprint, n: int, block: int) -> float:
    """Distinct experts per layer in a step of n streams, each running `block` consecutive tokens: one
    stream's union(block) from the routing curve; n streams: the independent-token curve at the number of
    single tokens that touch as many experts (n x union(block) / top_k), so skew shared across streams counts."""
    one = f.routing.union(block) if block > 1 else float(fp.top_k)
    if n <= 1:
        return one
    return f.routing.union(n * one / fp.top_k, independent=True)


def prefill_terms(c: _Ctx) -> dict:
    """Seconds for the prompt, per term (chunked as the runtime runs it)."""
    plan, fp, wl, f = c.plan, c.fp, c.wl, c.f
    P, L, enc = wl.prompt_tokens, fp.num_layers, fp.num_encoder_layers
    out = {k: 0.0 for k in TERMS}
    replay = plan.prefill_mode == "bounded_replay" and enc
    dec_from = max(0, P - fp.window_size) if replay else 0
    for c0, n in T.chunks(P, plan.prefill_chunk):
        dec_n = max(0, c0 + n - max(c0, dec_from))           # decoder tokens of this chunk
        share = (enc * n + (L - enc) * dec_n) / (L * n)      # the layers x tokens this chunk really runs
        q, ps = c.mem["nvme_share"], c.mem["page_share"]
        moe = T.prefill_moe(f, plan, fp, n, enc, f.routing.union, q, ps) + \
            T.prefill_moe(f, plan, fp, dec_n, L - enc, f.routing.union, q, ps)
        t = c.forward(n, c0 + n / 2, moe_s=moe, share=share)
        for k in TERMS:
            out[k] += t[k] * (share if k in ("shared", "dense") else 1.0)
    out["draft"] = 0.0
    return out


def _calibrated(decode: dict, prefill: dict, profile: dict) -> tuple[dict, dict]:
    """Each term x its factor from validation on this host (profile.calibration.terms), when present."""
    fac = (profile.get("calibration") or {}).get("terms") or {}
    scale = lambda part, d: {k: v * fac.get(f"{part}.{k}", {}).get("factor", 1.0) for k, v in d.items()}  # noqa: E731
    return scale("decode", decode), scale("prefill", prefill)


def predict(plan: Plan, profile: dict, fp: Footprint, wl: Workload, allow_inexact: bool = False) -> Prediction:
    """Raises MissingFigure (naming every key) when the profile lacks a figure this plan needs: no
    figure is ever replaced by a silent stand-in."""
    f = gather_figures(plan, profile, fp)
    why = plan_problems(plan, profile, fp, wl, allow_inexact)
    mem, mem_why, shares = memory(plan, profile, fp, f)
    why += mem_why
    c = _Ctx(plan, profile, fp, wl, f, shares)
    dec, pre = decode_terms(c), prefill_terms(c)
    notes = list(f.notes) + [ASSUMED["os_headroom"]] + c.notes + \
        [f"{k}: {v}" for k, v in c.sources.items() if "not measured" in v or v.startswith("assumed")]
    if f.gpu:
        notes.append(ASSUMED["graphs"])
    n = c.extra.get("concurrency", 1)
    raw = {"decode_tok_s": 1 / (n * sum(dec.values())), "ttft_s": sum(pre.values()), "decode": dec, "prefill": pre}
    dec_c, pre_c = _calibrated(dec, pre, profile)
    tok_s, ttft = 1 / (n * sum(dec_c.values())), sum(pre_c.values())      # per stream; n streams at once
    c.extra["itl_s"] = 1 / tok_s
    if n > 1:
        c.extra["aggregate_tok_s"] = n * tok_s
        notes.append(f"{n} streams share each decode step: aggregate {n * tok_s:.2f} tok/s, each stream {tok_s:.2f} "
                     "tok/s; TTFT is one request's alone")
    if wl.itl_budget_s is not None and 1 / tok_s > wl.itl_budget_s:
        why.append(f"inter-token latency {1 / tok_s:.3f} s per stream at concurrency {n} exceeds the budget {wl.itl_budget_s} s")
    if wl.ttft_budget_s is not None and ttft > wl.ttft_budget_s:
        notes.append(f"TTFT {ttft:.1f} s is over the budget {wl.ttft_budget_s} s")
    terms = {**{f"decode_{k}_s": v for k, v in dec_c.items()}, **{f"prefill_{k}_s": v for k, v in pre_c.items()},
             "hit_rate": c.hit, **shares, "cpu_moe_gbs": f.cpu, **c.extra}
    return Prediction(tok_s, ttft, not why, why, mem, terms, notes, c.sources, raw)


def objective(pred: Prediction) -> float:
    """What the search maximizes: aggregate tok/s over the workload's streams (one stream: its tok/s)."""
    return pred.terms.get("aggregate_tok_s", pred.decode_tok_s)
