"""The host figures one prediction reads, each with its source, gathered once per (plan, profile, model).

Figures (GB/s = 1e9 B/s, seconds): DRAM stream read; the CPU-MoE kernel at the model's geometry and the
plan's threads; the PCIe gather; the pair CPU-MoE + gather run together (each side, the sum capped by
DRAM read); device memory read; matmul FLOP/s on CPU and device; each strategy's fixed cost per MoE
layer call (`moe_fixed_us`, timed through runtime/experts.py by the profiler); the dense path at the
model's geometry; attention + indexer per decode token against context; the per-layer overhead of a
decode step outside every phase; NVMe figures; the routing curve (autotune/routing.py).
"""
from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from autotune.routing import Routing
from runtime.budget import resident_routed_bytes
from runtime.checkpoint.footprint import Footprint
from runtime.plan import Plan
from runtime.profile import cpu_moe_figure, cpu_moe_flops, figure

STRATEGY_KEYS = {"cpu": "moe_fixed_us.cpu", "offload": "moe_fixed_us.offload", "hybrid": "moe_fixed_us.hybrid"}


class MissingFigure(ValueError):
    """The profile lacks a figure this plan's prediction needs; the message names the key(s)."""


def is_gpu(profile) -> bool:
    return bool(profile["host"]["hard"].get("gpu_name"))


def source_of(profile: dict, key: str) -> str:
    """'measured' / 'published (citation)' / 'formula (...)' / 'assumed' for a measurement key (a.b for nested)."""
    v = profile["measurements"]
    for k in key.split("."):
        v = v.get(k) if isinstance(v, dict) else None
    if isinstance(v, list):
        v = next((e for e in v if isinstance(e, dict) and "source" in e), None)
    if not isinstance(v, dict) or "source" not in v:
        return "absent"
    extra = v.get("citation") or v.get("formula") or v.get("note") or ""
    return v["source"] + (f" ({extra})" if extra and v["source"] != "measured" else "")


def fixed_us(profile: dict, strategy: str) -> float | None:
    """A strategy's fixed cost per MoE layer call (us). The cpu path falls back on the older
    `moe_dispatch_fixed_us` (the same runtime path's dispatch cost)."""
    v = (profile["measurements"].get("moe_fixed_us") or {}).get(strategy)
    if isinstance(v, dict) and "median" in v:
        return float(v["median"])
    return figure(profile, "moe_dispatch_fixed_us") if strategy == "cpu" else None


def _at_geometry(profile: dict, key: str, fp: Footprint, m: dict | None = None) -> dict | None:
    v = (profile["measurements"] if m is None else m).get(key)
    return v if isinstance(v, dict) and "skipped" not in v and v.get("geometry") == fp.geometry_hash else None


def phase_figures(plan: Plan, profile: dict, fp: Footprint) -> tuple[dict, str]:
    """The runtime's phase figures that match the plan's expert placement: `phases_nvme_tier` for a plan
    with an NVMe expert tier where the profile timed the phases both ways. -> (measurements, which)."""
    m = profile["measurements"]
    tier = resident_routed_bytes(plan, fp) < fp.routed_expert_bytes_total
    alt = m.get("phases_nvme_tier")
    if tier and isinstance(alt, dict) and _at_geometry(profile, "dense_path_gbs", fp, alt):
        return alt, "timed beside an NVMe expert tier"
    return m, ""


@dataclass
class HostFigures:
    gpu: bool
    dram: float                       # GB/s
    cpu: float                        # CPU-MoE GB/s at this geometry and thread count
    cpu_flops: float                  # FLOP/s (float32 matmul: the dense path's ceiling without its own figure)
    fixed: float                      # s per MoE layer call, this plan's strategy
    fixed_cpu: float                  # s per MoE layer call on the CPU path (the drafter's, prefill chunks' on the CPU)
    gather: float | None = None       # GB/s
    contended: tuple | None = None    # (cpu, gather) GB/s when both run
    dev_mem: float | None = None      # GB/s
    dev_flops: float | None = None
    h2d: float | None = None
    nvme_seq: float | None = None
    dense_path: float | None = None   # GB/s of runtime.budget.dense_path_bytes, measured at this geometry
    dense_flops: float | None = None  # FLOP/s of the runtime's dense path over a prefill chunk, this geometry
    dense_chunk: int = 0              # that chunk's tokens
    attention: tuple | None = None    # (a0, a1, a2): a forward of T tokens at context c: a0 + a2 (T-1) + a1 T c
    shared_call: float | None = None  # s per layer call of the shared expert at batch 1, this geometry
    overlap: bool = True              # the CPU share of a layer runs beside the device's (numba's layer is threadsafe)
    engram_rows: float = 0.0          # s per Engram layer per forward assembling rows (page cache / RAM), this geometry
    draft_token: float | None = None  # s per DSpark drafted token, timed through the runtime on this CPU host and geometry
    other_per_layer: float | None = None             # s per layer per forward, outside every phase
    moe_flops: object = None          # tokens -> the CPU-MoE kernel's FLOP/s for a call that wide
    routing: Routing | None = None
    sources: dict = field(default_factory=dict)      # term input -> source line
    notes: list = field(default_factory=list)

    def attention_s(self, tokens: int, context: float, fp: Footprint, kv_bytes_at) -> tuple[float, str]:
        """Attention + indexer seconds for one forward of `tokens` at `context`: the fit of the profile's
        points at this geometry, else the formula 'the KV state at this context read once per token'."""
        if self.attention:
            a0, a1, a2 = self.attention
            return a0 + a2 * (tokens - 1) + a1 * tokens * context, "measured (fit over the profile's contexts)"
        bw = (self.dev_mem if self.gpu else self.dram) * 1e9
        return tokens * kv_bytes_at(context) / bw, "formula: KV state bytes at this context read once per token / memory bandwidth"


def attention_fit(entry: dict) -> tuple | None:
    """(a0, a1, a2) from the decode points (least squares a0 + a1 c, both >= 0) and the prefill chunk
    (the per-extra-query cost a2 >= 0)."""
    pts = [(p["context"], p["median"]) for p in entry.get("points", []) if "median" in p]
    if not pts:
        return None
    xs, ys = np.array([p[0] for p in pts], float), np.array([p[1] for p in pts], float)
    a1 = max(0.0, float(np.polyfit(xs, ys, 1)[0])) if len(pts) > 1 and np.ptp(xs) > 0 else 0.0
    a0 = max(0.0, float(np.mean(ys - a1 * xs)))
    pre, a2 = entry.get("prefill"), 0.0
    if pre and "median" in pre and pre["tokens"] > 1:
        n, c = pre["tokens"], pre["context"]
        a2 = max(0.0, (pre["median"] - a0 - a1 * n * c) / (n - 1))
    return a0, a1, a2


def gather_figures(plan: Plan, profile: dict, fp: Footprint) -> HostFigures:
    """Raises MissingFigure naming every key this plan needs that the profile lacks."""
    gpu = is_gpu(profile)
    m = profile["measurements"]
    need = ["dram_stream_read_gbs", "matmul_tflops"]
    if gpu:
        need += ["gpu_mem_gbs", "gpu_tflops"] + (["pcie_gather_gbs"] if plan.moe_strategy != "cpu" else []) \
            + (["pcie_h2d_gbs"] if plan.prefill_moe_path == "device" else [])
    missing = [k for k in need if figure(profile, k) is None]
    if not any("median" in e for e in m.get("cpu_moe_gbs", [])):
        missing.append("cpu_moe_gbs")
    strategy = plan.moe_strategy if gpu else "cpu"
    for s in {strategy, "cpu"}:
        if fixed_us(profile, s) is None:
            missing.append(STRATEGY_KEYS[s] + (" (or moe_dispatch_fixed_us)" if s == "cpu" else ""))
    if missing:
        raise MissingFigure(f"profile of {profile['host'].get('name', 'host')} lacks measurements "
                            + ", ".join(f"'{k}'" for k in missing) + f" that a {plan.moe_strategy} plan on "
                            + ("this GPU host" if gpu else "this host") + " needs (re-profile, or add them with their source)")
    threads = plan.cpu_threads or int(profile["host"]["hard"]["physical_cores"])
    cpu, note = cpu_moe_figure(profile, fp.geometry, threads=threads)
    f = HostFigures(gpu=gpu, dram=figure(profile, "dram_stream_read_gbs"), cpu=cpu,
                    cpu_flops=figure(profile, "matmul_tflops") * 1e12, fixed=fixed_us(profile, strategy) * 1e-6,
                    fixed_cpu=fixed_us(profile, "cpu") * 1e-6, nvme_seq=figure(profile, "nvme_seq_read_gbs"))
    if note:
        f.notes.append(note)
    f.overlap = profile["host"].get("soft", {}).get("numba_threading_layer") != "workqueue"
    if gpu and not f.overlap:
        f.notes.append("numba's threading layer here is workqueue (not threadsafe): a layer's CPU share runs after "
                       "the device's, not beside it (hostinfo.numba_threading_layer)")

    def moe_flops(tokens: int) -> float:
        v, _ = cpu_moe_flops(profile, fp.geometry, tokens, threads)
        return v or f.cpu_flops
    f.moe_flops = moe_flops
    if fp.expert_dtype != "fp4":
        f.notes.append(f"expert_dtype {fp.expert_dtype}: the dsv41 runtime runs ds_fp4 experts only, this plan needs another "
                       "engine (dsv41-tune export); its experts' bytes are this format's, read at the ds_fp4 kernel's and "
                       "the gather's GB/s (assumed: the other engine's kernel is as bandwidth-bound)")
    if gpu:
        f.gather, f.dev_mem = figure(profile, "pcie_gather_gbs"), figure(profile, "gpu_mem_gbs")
        f.dev_flops, f.h2d = figure(profile, "gpu_tflops") * 1e12, figure(profile, "pcie_h2d_gbs")
        f.contended = contended(profile, f.dram)
    ph, which = phase_figures(plan, profile, fp)
    dp = _at_geometry(profile, "dense_path_gbs", fp, ph)
    f.dense_path = float(dp["median"]) if dp else None
    att = _at_geometry(profile, "attention_s_per_token", fp, ph)
    f.attention = attention_fit(att) if att else None
    dfl = _at_geometry(profile, "dense_path_tflops", fp, ph)
    f.dense_flops = float(dfl["median"]) * 1e12 if dfl else None
    f.dense_chunk = int(dfl.get("tokens", 0)) if dfl else 0
    sh = _at_geometry(profile, "shared_call_us", fp, ph)
    f.shared_call = float(sh["median"]) * 1e-6 if sh else None
    er = _at_geometry(profile, "engram_rows_s", fp, ph)
    f.engram_rows = float(er["median"]) if er else 0.0
    dr = _at_geometry(profile, "dspark_draft_s_per_token", fp)         # the drafter on the CPU at the probe's threads
    if dr and not gpu and dr.get("threads") in (None, threads):
        f.draft_token = float(dr["median"])
    oth = _at_geometry(profile, "step_other_s_per_layer", fp, ph)
    if oth is None and isinstance(m.get("step_other_s_per_layer"), dict) and "median" in m["step_other_s_per_layer"]:
        oth = m["step_other_s_per_layer"]       # Python overhead per layer: carried to other geometries
    f.other_per_layer = float(oth["median"]) if oth else None
    f.routing = Routing(m.get("routing") if (m.get("routing") or {}).get("geometry") == fp.geometry_hash else None,
                        fp.num_layers, fp.n_routed_experts, fp.top_k)
    fixed_key = "moe_fixed_us." + strategy if (m.get("moe_fixed_us") or {}).get(strategy, {}).get("source") else "moe_dispatch_fixed_us"
    at = lambda v, key: "measured at this geometry" if v else f"not measured at this geometry ({key})"  # noqa: E731
    f.sources = {
        "moe": f"fixed per layer call: {fixed_key} [{source_of(profile, fixed_key)}]; bytes over cpu_moe_gbs "
               f"[{source_of(profile, 'cpu_moe_gbs')}], a wide step's products at its width's GFLOP/s where slower"
               + (f", pcie_gather_gbs [{source_of(profile, 'pcie_gather_gbs')}]" if gpu else ""),
        "shared": ("formula: rides in the routed experts' CPU call (in `moe`): its bytes over cpu_moe_gbs" if fp.shared_rides else
                   "shared_call_us " + at(f.shared_call, "its bytes over cpu_moe_gbs instead")),
        "engram_wait": "engram_rows_s " + at(f.engram_rows, "row assembly counted as 0") +
                       ("; reads over nvme_randread_4k [" + source_of(profile, "nvme_randread_4k") + "]"),
        "draft": ("dspark_draft_s_per_token [measured at this geometry and thread count]" if f.draft_token is not None else
                  f"formula: drafter experts over cpu_moe_gbs, its dense part and the head over {'gpu_mem_gbs' if gpu else 'the dense path'}"),
        "other": "step_other_s_per_layer [measured] x layers" if f.other_per_layer is not None else "assumed: 0 s (not measured)",
        "phases": ("measured: the runtime's dense, attention, shared, Engram and other phases " +
                   (f"{which} (phases_nvme_tier)" if which else f"with the experts in {dp.get('placement', 'ram')} (dense_path_gbs)"))
                  if dp else "formula: the profile has no runtime phase figures (each term names its own source)",
        "routing": "measured: a routing trace of this checkpoint" if f.routing.source == "measured" else
                   "assumed: uniform, independent routing (no trace at this geometry; none published for V4.1)",
    }
    return f


def contended(profile: dict, dram: float):
    """(cpu_gbs, gather_gbs) when both run at once, from the contended pair if measured; their sum is
    never above DRAM read (both stream from host DRAM): scaled down to it when it is."""
    for pair in profile["measurements"].get("contended", []):
        if pair.get("pair") == "cpu_moe+pcie_gather":
            c, g = pair.get("cpu_moe_gbs", {}), pair.get("pcie_gather_gbs", {})
            if "median" in c and "median" in g:
                c, g = float(c["median"]), float(g["median"])
                s = min(1.0, dram / (c + g)) if c + g > 0 else 1.0
                return c * s, g * s
    return None
