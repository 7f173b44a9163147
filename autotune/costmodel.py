"""The cost model: predict(plan, profile, footprint, workload) -> Prediction. Pure and fast (no torch).

Terms (units: bytes, seconds, GB/s = 1e9 B/s; every one documented where computed):
  hit rate        h = min(1, slots / (L * E))                        prior: uniform routing (stated; a
                                                                     measured popularity curve replaces it)
  misses/token    M = K * L * (1 - h) experts, bytes Bm = M * expert_bytes
  NVMe tier       share q = max(0, 1 - host_budget / all routed bytes) of misses read at nvme_seq GB/s
  decode MoE      cpu:     Bm / cpu_gbs
                  offload: Bm / gather_gbs
                  hybrid:  max(f * Bm / gather_c, (1 - f) * Bm / cpu_c)  (contended figures: both at once)
                  + L * dispatch_fixed                               (LESSONS 3: per-layer submit/sync)
  dense/attn      dense_bytes_per_token / gpu_mem_gbs on a GPU host; on a CPU host the runtime's path:
                  runtime.budget.dense_path_bytes (fp8 as stored + 2 x bf16 head) / dense_path_gbs (the
                  profiler times the runtime's own dense path per token and states it in these bytes;
                  used only at the geometry it was timed at, else DRAM stream read)
                  + shared-expert bytes / CPU-MoE GB/s
  Engram decode   reads of layer l hide behind the layers before it: wait_l = max(0, t_io - t_layer * l)
                  t_io = 24 reads / IOPS(depth) (host placement: 0)
  DSpark          accepted per step a = (1 - p^(d+1)) / (1 - p), p = 0.7 assumed per-token acceptance
                  until validation measured it on this host (calibration.dspark_p_accept);
                  verify reads the union of d+1 tokens' experts: E * (1 - (1 - K/E)^(d+1)) per layer
  prefill chunk   touches u = 1 - (1 - K/E)^chunk of each layer's experts; time per chunk =
                  max(bytes / bandwidth, FLOP / FLOPS), FLOP = 2 * 3 * H * I * K * tokens per layer
                  (full: all layers over the prompt; bounded_replay: encoder over the prompt, decoder
                  over the last window)
  VRAM            runtime.budget.device_bytes (dense + embeddings + the sequence: KV state at
                  max_context, indexer peak, attention scratch + prefill buffer + slots (+ drafter))
                  + graphs (1 GiB, assumed); the indexer peak is the runtime's own: itemsize B x chunk x
                  visible rows + its tiles (runtime.budget.indexer_chunk_bytes; SGLang quotes ~6 B)
  host RAM        runtime.budget.host_bytes (resident routed experts + drafter + Engram (host: all;
                  nvme_*: scales if kept + row cache); on a CPU host also dense as held and the sequence)
                  + OS headroom (8 GiB, assumed); page cache = what is left (nvme_mmap uses it)
  calibration     a profile validated on its host carries decode_scale and ttft_scale (measured /
                  predicted over the validated plans, predicted with the measured DSpark p); predictions
                  are multiplied by them
"""
from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field

from runtime.profile import cpu_moe_figure, figure
from runtime.budget import (dense_path_bytes, device_bytes, engram_host_bytes, host_bytes, indexer_bound_bytes,
                            kv_state_bytes, spare, staging_bytes)
from runtime.checkpoint.footprint import Footprint
from runtime.plan import Plan
from runtime.workload import Workload

GIB = 1 << 30
GRAPHS_BYTES = 1 * GIB            # assumed CUDA graph pool
OS_HEADROOM = 8 * GIB             # assumed host RAM kept for the OS and the process
VRAM_MARGIN = 0.05                # safety margin on every VRAM budget
DSPARK_P_ACCEPT = 0.7             # assumed per-token acceptance until measured
ENGRAM_ROWS_PER_LAYER = 24


@dataclass
class Prediction:
    decode_tok_s: float
    ttft_s: float
    feasible: bool
    why: list = field(default_factory=list)
    memory: dict = field(default_factory=dict)      # bytes per tier
    terms: dict = field(default_factory=dict)       # seconds per term, per token / per prompt
    notes: list = field(default_factory=list)       # extrapolations and assumptions used

    def to_dict(self) -> dict:
        return asdict(self)


def _gpu(profile) -> bool:
    return bool(profile["host"]["hard"].get("gpu_name"))


def _iops(profile, depth: int) -> float | None:
    pts = profile["measurements"].get("nvme_randread_4k")
    if not isinstance(pts, list) or not pts:
        return None
    best = [p for p in pts if p["qd"] <= depth] or [min(pts, key=lambda p: p["qd"])]
    return float(max(best, key=lambda p: p["qd"])["iops"])


def _contended(profile):
    """(cpu_gbs, gather_gbs) when both run at once, from the contended pair if measured."""
    for pair in profile["measurements"].get("contended", []):
        if pair.get("pair") == "cpu_moe+pcie_gather":
            c, g = pair.get("cpu_moe_gbs", {}), pair.get("pcie_gather_gbs", {})
            if "median" in c and "median" in g:
                return float(c["median"]), float(g["median"])
    return None


class MissingFigure(ValueError):
    """The profile lacks a figure this plan's prediction needs; the message names the key(s)."""


ASSUMED = {   # priors the model uses, each flagged in every prediction's notes (source: assumed)
    "os_headroom": f"host RAM kept for the OS and the process: {OS_HEADROOM / GIB:.0f} GiB (assumed)",
    "graphs": f"CUDA graph pool: {GRAPHS_BYTES / GIB:.0f} GiB (assumed)",
    "routing": "slot-cache hit rate from uniform, independent routing: slots / (layers x experts) (assumed)",
}


def needed_figures(plan: Plan, profile: dict, fp: Footprint) -> list[str]:
    """The measurement keys this plan's prediction reads on this profile's host."""
    gpu = _gpu(profile)
    keys = ["dram_stream_read_gbs", "moe_dispatch_fixed_us", "matmul_tflops"]
    if gpu:
        keys += ["gpu_mem_gbs", "gpu_tflops"]
        if plan.moe_strategy != "cpu":
            keys.append("pcie_gather_gbs")
        if plan.prefill_moe_path == "device":
            keys.append("pcie_h2d_gbs")
    return keys


def missing_figures(plan: Plan, profile: dict, fp: Footprint) -> list[str]:
    out = [k for k in needed_figures(plan, profile, fp) if figure(profile, k) is None]
    if not any("median" in e for e in profile["measurements"].get("cpu_moe_gbs", [])):
        out.append("cpu_moe_gbs")
    return out


def predict(plan: Plan, profile: dict, fp: Footprint, wl: Workload, allow_inexact: bool = False) -> Prediction:
    """Raises MissingFigure (naming every key) when the profile lacks a figure this plan needs: no
    figure is ever replaced by a silent stand-in."""
    missing = missing_figures(plan, profile, fp)
    if missing:
        raise MissingFigure(f"profile of {profile['host'].get('name', 'host')} lacks measurements "
                            + ", ".join(f"'{k}'" for k in missing) + f" that a {plan.moe_strategy} plan on "
                            + ("this GPU host" if _gpu(profile) else "this host") + " needs (re-profile, or add them with their source)")
    why, notes, terms = [], [], {}
    gpu = _gpu(profile)
    L, K, E, eb = fp.num_layers, fp.top_k, fp.n_routed_experts, fp.expert_bytes
    cpu_gbs, note = cpu_moe_figure(profile, fp.geometry, threads=plan.cpu_threads or int(profile["host"]["hard"]["physical_cores"]))
    if note:
        notes.append(note)
    notes.append(ASSUMED["os_headroom"])
    if gpu:
        notes += [ASSUMED["graphs"], ASSUMED["routing"]]
    dram = figure(profile, "dram_stream_read_gbs")
    gather = figure(profile, "pcie_gather_gbs") if gpu else None
    disp = figure(profile, "moe_dispatch_fixed_us") * 1e-6
    gpu_mem = figure(profile, "gpu_mem_gbs") if gpu else None
    nvme_seq = figure(profile, "nvme_seq_read_gbs")

    # ---------------------------------------------------------------- validity of the plan on this host
    if not gpu and (plan.moe_strategy != "cpu" or plan.slot_cache_experts or plan.prefill_moe_path == "device"):
        why.append("no GPU on this host: moe_strategy must be cpu, no slot cache, prefill on the CPU")
    if plan.prefill_mode == "bounded_replay" and not allow_inexact:
        why.append("prefill_mode bounded_replay changes output: allow inexact prefill to choose it")
    if wl.prompt_tokens + wl.max_tokens > plan.max_context:
        why.append(f"prompt + output ({wl.prompt_tokens + wl.max_tokens}) exceed max_context ({plan.max_context})")
    if plan.dspark and not fp.dspark_num_layers:
        why.append("dspark on but the checkpoint has no drafter")

    # ---------------------------------------------------------------- memory
    routed_all = fp.routed_expert_bytes_total
    budget = routed_all if plan.host_expert_budget_gib is None else min(routed_all, plan.host_expert_budget_gib * GIB)
    q_nvme = 1 - budget / routed_all if routed_all else 0.0
    slots_bytes = plan.slot_cache_experts * eb
    kv = kv_state_bytes(fp, plan.max_context, spare(plan))
    peak = indexer_bound_bytes(plan, fp)
    staging = staging_bytes(plan, fp)
    if plan.prefill_moe_path == "device" and not staging:
        why.append(f"prefill_moe_path device needs prefill_buffer_mib >= one expert ({eb / 2**20:.2f} MiB), got {plan.prefill_buffer_mib}")
    vram = device_bytes(plan, fp) + GRAPHS_BYTES if gpu else 0
    vram_cap = (plan.vram_budget_gib * GIB if plan.vram_budget_gib is not None
                else profile["host"]["hard"]["gpu_vram_gib"] * GIB if gpu else 0)
    if gpu and vram > vram_cap * (1 - VRAM_MARGIN):
        why.append(f"VRAM {vram / GIB:.2f} GiB exceeds the budget {vram_cap / GIB:.2f} GiB less {VRAM_MARGIN:.0%} margin "
                   f"(indexer peak {peak / GIB:.2f} GiB at chunk {plan.prefill_chunk})")
    rows = fp.engram_rows_total
    engram_host = engram_host_bytes(plan, fp)
    pinned = budget if gpu and plan.moe_strategy != "cpu" else 0
    host = host_bytes(plan, fp, dense_on_host=not gpu) + OS_HEADROOM       # the runtime's own accounting
    ram = profile["host"]["hard"]["ram_gib"] * GIB
    if host > ram:
        why.append(f"host RAM {host / GIB:.1f} GiB exceeds {ram / GIB:.1f} GiB (routed experts resident "
                   f"{budget / GIB:.1f} GiB, Engram {engram_host / GIB:.1f} GiB, OS headroom {OS_HEADROOM / GIB:.0f} GiB assumed)")
    page_cache = max(0.0, ram - host)
    if q_nvme > 0 and nvme_seq is None:
        why.append("experts beyond the host budget need an NVMe figure (nvme_seq_read_gbs) this profile lacks")
    if rows and plan.engram_placement != "host" and _iops(profile, plan.engram_io_depth) is None:
        why.append("Engram on NVMe needs nvme_randread_4k figures this profile lacks")
    memory = {"vram": vram, "vram_cap": vram_cap, "indexer_peak": peak, "kv": kv, "slots": slots_bytes,
              "host": host, "pinned": pinned, "pageable": host - pinned, "page_cache_left": page_cache,
              "disk": fp.total_bytes}

    # ---------------------------------------------------------------- decode
    h = min(1.0, plan.slot_cache_experts / (L * E)) if gpu else 0.0
    def moe_time(n_experts_per_layer):
        """Seconds for one step's routed experts when each layer reads n distinct experts."""
        miss = n_experts_per_layer * L * (1 - h) * eb
        from_nvme = q_nvme * miss / (nvme_seq * 1e9) if q_nvme and nvme_seq else 0.0
        hits = n_experts_per_layer * L * h * eb / (gpu_mem * 1e9) if gpu else 0.0
        if plan.moe_strategy == "cpu" or not gpu:          # (a device strategy without a GPU is refused above)
            t = miss / (cpu_gbs * 1e9)
        elif plan.moe_strategy == "offload":
            t = miss / (gather * 1e9)
        else:
            c = _contended(profile) or (cpu_gbs, gather)
            f = plan.fetch_fraction
            t = max(f * miss / (c[1] * 1e9), (1 - f) * miss / (c[0] * 1e9))
        return t + from_nvme + hits + L * disp
    dense_bw = (gpu_mem if gpu else dram) * 1e9
    if gpu:
        t_dense = fp.dense_bytes_per_token / dense_bw
    else:       # the runtime's CPU path: the fp8 kernel over the weights as stored, the bf16 head as
        #         float32 (runtime.budget.dense_path_bytes), the shared expert on the CPU-MoE kernel
        shared = fp.bytes_by_class["shared_expert"]
        # per-op overheads dominate at toy sizes, so the figure only stands for the geometry it was timed at
        dp = profile["measurements"].get("dense_path_gbs") or {}
        path = figure(profile, "dense_path_gbs") if dp.get("geometry") == fp.geometry_hash else None
        if path is None:
            notes.append("dense_path_gbs not measured at this model's geometry: the dense path is costed at DRAM stream read")
        t_dense = dense_path_bytes(fp) / ((path or dram) * 1e9) + shared / (cpu_gbs * 1e9)
    t_moe = moe_time(K)
    t_layer = (t_moe + t_dense) / max(L, 1)
    t_engram = 0.0
    if rows and plan.engram_placement != "host":
        iops = _iops(profile, plan.engram_io_depth) or math.inf      # missing: infeasible above (why)
        t_io = ENGRAM_ROWS_PER_LAYER * (1 if plan.engram_scales_in_ram else 2) / iops
        t_engram = sum(max(0.0, t_io - t_layer * l) for l in fp.engram_layer_ids)
    t_token = t_moe + t_dense + t_engram
    terms.update(decode_moe_s=t_moe, decode_dense_s=t_dense, decode_engram_wait_s=t_engram, hit_rate=h,
                 nvme_share=q_nvme, cpu_moe_gbs=cpu_gbs)
    tok_s = 1 / t_token
    if plan.dspark:
        measured_p = (profile.get("calibration") or {}).get("dspark_p_accept")
        d, p = plan.draft_length, DSPARK_P_ACCEPT if measured_p is None else measured_p
        accepted = (1 - p ** (d + 1)) / (1 - p)
        union = E * (1 - (1 - K / E) ** (d + 1))
        t_verify = moe_time(union) + t_dense * (1 + 0.1 * d)
        drafter_bytes = fp.dspark_num_layers * (K + 1) * fp.drafter_expert_bytes // max(1, 3 * fp.dspark_num_layers) if fp.dspark_num_layers else 0
        t_draft = d * drafter_bytes / dense_bw
        tok_s = accepted / (t_verify + t_draft)
        terms.update(dspark_accepted=accepted, dspark_union_experts=union, dspark_verify_s=t_verify, dspark_draft_s=t_draft)
        notes.append(f"DSpark acceptance p={p:.2f} per token is " + ("assumed until measured" if measured_p is None else
                                                                      "measured by validation on this host"))

    # ---------------------------------------------------------------- prefill (TTFT)
    P, H, I = wl.prompt_tokens, fp.hidden_size, fp.moe_intermediate_size
    flops_cpu = figure(profile, "matmul_tflops") * 1e12
    flops_dev = figure(profile, "gpu_tflops") * 1e12 if gpu else 0.0

    def pass_time(tokens, layers):
        if tokens <= 0 or layers <= 0:
            return 0.0
        chunks = math.ceil(tokens / plan.prefill_chunk)
        t = 0.0
        for c in range(chunks):
            n = min(plan.prefill_chunk, tokens - c * plan.prefill_chunk)
            u = 1 - (1 - K / E) ** n
            nbytes = u * E * eb * layers
            flop = 2 * 3 * H * I * K * n * layers
            if plan.prefill_moe_path == "device" and gpu:
                h2d = figure(profile, "pcie_h2d_gbs")
                t += max(nbytes / (h2d * 1e9), flop / flops_dev) + layers * disp
            else:
                t += max(nbytes / (cpu_gbs * 1e9), flop / flops_cpu) + layers * disp
        return t

    enc = fp.num_encoder_layers
    if plan.prefill_mode == "bounded_replay" and enc:
        t_prefill = pass_time(P, enc) + pass_time(min(P, fp.window_size), L - enc)
    else:
        t_prefill = pass_time(P, L)
    t_dense_prefill = 2 * fp.dense_bytes_per_token * P / (flops_dev if gpu else flops_cpu)
    t_engram_prefill = 0.0
    if rows and plan.engram_placement != "host":
        iops = _iops(profile, plan.engram_io_depth) or math.inf
        t_engram_prefill = len(fp.engram_layer_ids) * ENGRAM_ROWS_PER_LAYER * P / iops
    compute = t_prefill + t_dense_prefill
    ttft = max(compute, t_engram_prefill)           # every Engram read is issued before the forward pass
    terms.update(prefill_moe_s=t_prefill, prefill_dense_s=t_dense_prefill, prefill_engram_io_s=t_engram_prefill)
    if wl.ttft_budget_s is not None and ttft > wl.ttft_budget_s:
        notes.append(f"TTFT {ttft:.1f} s is over the budget {wl.ttft_budget_s} s")
    cal = profile.get("calibration") or {}
    if "decode_scale" in cal:             # per-host scales from validation (measured / predicted)
        tok_s, ttft = tok_s * cal["decode_scale"], ttft * cal["ttft_scale"]
        terms.update(calibrated_decode_scale=cal["decode_scale"], calibrated_ttft_scale=cal["ttft_scale"])
    return Prediction(tok_s, ttft, not why, why, memory, terms, notes)
