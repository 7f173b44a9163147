"""The cost model's terms: one function per phase of the runtime's phase table (seconds).

  term                 runtime phases it predicts (runtime/engine.py Result.phases / prefill_phases)
  moe                  moe_layer_total  routed experts per layer call: fixed cost + bytes per strategy
  shared               shared_moe       the shared expert in a call of its own (the CPU kernel); one that
                                        rides in the routed CPU call (`shared_rides`) is in `moe`
  dense                dense            linears, norms, router, LM head
  attention            attention        attention + indexer (grows with context)
  engram_wait          engram_wait      the forward thread waiting for Engram rows
  draft                dspark_draft     the DSpark drafter (its dense part and its MoE on the CPU)
  other                (the rest)       wall time outside every phase: per-layer Python, sampling

Decode MoE per strategy (n distinct experts per layer, h hit rate, miss bytes B = n L (1-h) e):
  cpu      L fixed_cpu + max(B / cpu, P) + S
           P: a step of T > 1 tokens' products (T top_k assignments a layer, 2 x 3 H I FLOP each) at the
           kernel's FLOP/s measured at that width (cpu_moe_gbs entries' GFLOP/s: a verify whose experts
           overlap), the (1-h) share on the CPU: a DSpark verify or a batch that meets few experts many
           times is bound by the kernel's products, not its bytes; 0 at one token (its figure is the bytes')
  offload  L fixed_off + max(B / gather + n L e / dev_mem, S)             (gather, then compute on device)
  hybrid   L fixed_hyb + max(f B / gather_c + f B / dev_mem, max((1-f) B / cpu_c', (1-f) P) + S cpu / cpu_c', B / dram)
           S: the shared expert's CPU seconds where it rides in the routed CPU call (shared_rides), else 0
           (numba's layer not threadsafe, `overlap` False: offload and hybrid add their two sides instead)
           cpu_c' = cpu_c (t-1)/t: one of the plan's t threads drives the device side (formula);
           (cpu_c, gather_c) the contended pair, their sum capped by DRAM read (autotune/figures.py)
  + hits on the device n L h e / dev_mem, + the NVMe tier q B / nvme_seq (the page cache's share of it
    at DRAM speed when read through nvme_mmap).
Prefill MoE per chunk of n tokens: union(n) experts per layer read (the NVMe tier's share first), or
the kernel's FLOP at its measured FLOP/s for that width (cpu_moe_gbs entries' GFLOP/s), the larger.
"""
from __future__ import annotations

from autotune.figures import HostFigures
from runtime.checkpoint.footprint import Footprint
from runtime.plan import Plan

PHASES = {"moe": ("moe_layer_total",), "shared": ("shared_moe",), "dense": ("dense",), "attention": ("attention",),
          "engram_wait": ("engram_wait",), "draft": ("dspark_draft",)}
ENGRAM_ROWS_PER_LAYER = 24


def measured_terms(phases: dict, wall_s: float, per: float) -> dict:
    """A runtime phase table (seconds) -> the terms' measured seconds (each / `per`), `other` the rest."""
    out = {t: sum(phases.get(p, 0.0) for p in ps) / per for t, ps in PHASES.items()}
    out["other"] = max(0.0, wall_s / per - sum(out.values()))
    return out


def products(f: HostFigures, fp: Footprint, tokens: int) -> float:
    """Seconds for a forward of `tokens` tokens' routed products on the CPU kernel, at its FLOP/s measured
    at that width: the compute bound of a wide decode step (0 for one token, whose figure is its bytes')."""
    if tokens <= 1:
        return 0.0
    return 2 * 3 * fp.hidden_size * fp.moe_intermediate_size * fp.top_k * tokens * fp.num_layers / f.moe_flops(tokens)


def moe(f: HostFigures, plan: Plan, fp: Footprint, n: float, hit: float, q_nvme: float, page_share: float,
        shared_s: float = 0.0, tokens: int = 1) -> float:
    """Seconds for one forward of `tokens` tokens' routed experts when each layer reads n distinct experts;
    `shared_s`: the shared expert's CPU seconds when it rides in the routed CPU call (`shared_rides`), on
    the CPU side of the split (beside the device's share on a GPU host)."""
    L, eb = fp.num_layers, fp.expert_bytes
    miss = n * L * (1 - hit) * eb
    dev = n * L * hit * eb / (f.dev_mem * 1e9) if f.gpu and hit else 0.0
    t_nvme = nvme_read(f, plan, miss, q_nvme, page_share)
    P = products(f, fp, tokens) * (1 - hit)
    if not f.gpu or plan.moe_strategy == "cpu":
        body = max(miss / (f.cpu * 1e9), P) + shared_s
    elif plan.moe_strategy == "offload":
        device = miss / (f.gather * 1e9) + miss / (f.dev_mem * 1e9)
        body = max(device, shared_s) if f.overlap else device + shared_s
    elif not f.overlap:                                     # the CPU share after the device's, uncontended
        fr = plan.fetch_fraction
        body = fr * miss / (f.gather * 1e9) + fr * miss / (f.dev_mem * 1e9) + (1 - fr) * max(miss / (f.cpu * 1e9), P) + shared_s
    else:
        cpu_c, gather_c = f.contended or (f.cpu, f.gather)
        t = plan.cpu_threads or 0
        cpu_c = cpu_c * (t - 1) / t if t > 1 else cpu_c
        fr = plan.fetch_fraction
        body = max(fr * miss / (gather_c * 1e9) + fr * miss / (f.dev_mem * 1e9),
                   (1 - fr) * max(miss / (cpu_c * 1e9), P) + shared_s * f.cpu / cpu_c, miss / (f.dram * 1e9))
    return L * f.fixed + body + dev + t_nvme


def shared_rides(plan: Plan, fp: Footprint, prefill: bool) -> bool:
    """The shared expert computed in the routed experts' CPU call (runtime/experts.py): one shared expert
    (`shared_rides`), except a prefill chunk streamed through the device (its own call there)."""
    return fp.shared_rides and not (prefill and plan.prefill_moe_path == "device")


def shared(f: HostFigures, fp: Footprint, tokens: int, rides: bool = False) -> float:
    """The shared expert over `tokens` on the CPU kernel: its bytes at the CPU-MoE figure where it rides
    in the routed call, else one call per layer (as timed at this geometry at batch 1 by the profiler,
    else its bytes); FLOP-bound when wide (the kernel's measured FLOP/s at that width)."""
    if not fp.bytes_by_class.get("shared_expert"):
        return 0.0
    flop = 2 * 3 * fp.hidden_size * fp.moe_intermediate_size * tokens * fp.num_layers
    own_call = f.shared_call and not rides
    once = fp.num_layers * f.shared_call if own_call else fp.bytes_by_class["shared_expert"] / (f.cpu * 1e9)
    return max(once, flop / f.moe_flops(tokens))


def dense_params(fp: Footprint) -> float:
    """Dense parameters per token (~ their fp8 bytes + the bf16 LM head's)."""
    fp8 = fp.bytes_by_class["dense"]
    return fp8 + (fp.dense_bytes_per_token - fp.bytes_by_class["shared_expert"] - fp8) / 2


def dense(f: HostFigures, fp: Footprint, tokens: int, path_bytes: int) -> tuple[float, str]:
    """The dense path over `tokens` (one forward). GPU: weights read once or FLOP-bound. CPU, timed at
    this geometry: t1 = path bytes at the measured per-token rate, tc = the measured chunk of c tokens;
    linear between them, then proportional (FLOP-bound). Else: bytes at DRAM read or FLOP-bound."""
    flop = 2 * dense_params(fp) * tokens
    if f.gpu:
        nbytes = fp.dense_bytes_per_token - fp.bytes_by_class["shared_expert"]
        return max(nbytes / (f.dev_mem * 1e9), flop / f.dev_flops), "formula: dense bytes / device memory read"
    if f.dense_path:
        t1 = path_bytes / (f.dense_path * 1e9)
        if f.dense_flops and f.dense_chunk > 1:
            c = f.dense_chunk
            tc = 2 * dense_params(fp) * c / f.dense_flops
            t = t1 + (tc - t1) * (tokens - 1) / (c - 1) if tokens <= c else tc * tokens / c
        else:
            t = max(t1, flop / f.cpu_flops)
        return t, "measured: the runtime's dense path at this geometry (per token, and over a prefill chunk)"
    return (max(path_bytes / (f.dram * 1e9), flop / f.cpu_flops),
            "formula: dense_path_bytes / DRAM stream read (dense_path_gbs not measured at this geometry)")


def engram_io(plan: Plan, fp: Footprint, iops: float, tokens: int, page_share: float) -> float:
    """Seconds to read one forward's Engram rows for one layer (host placement: 0)."""
    if not fp.engram_rows_total or plan.engram_placement == "host":
        return 0.0
    reads = ENGRAM_ROWS_PER_LAYER * (1 if plan.engram_scales_in_ram else 2) * tokens
    miss = 1 - (page_share if plan.engram_placement == "nvme_mmap" else 0.0)
    return reads * miss / iops


def engram_wait(plan: Plan, fp: Footprint, t_io: float, t_layer: float) -> float:
    """Every read is issued before the forward: layer l's rows hide behind the l layers before it."""
    if not t_io:
        return 0.0
    return sum(max(0.0, t_io - t_layer * l) for l in fp.engram_layer_ids)


def draft(f: HostFigures, fp: Footprint, dense_b: int) -> float:
    """One drafted token: the drafter's routed top-k + shared experts on the CPU kernel (its experts
    live in host RAM: runtime/experts.py drafter_moe), its dense part and the shared LM head where the
    dense weights are (device on a GPU host, else the CPU dense path): `dense_b` bytes, as held."""
    if not fp.dspark_num_layers:
        return 0.0
    moe_b = (fp.top_k + (1 if fp.bytes_by_class.get("shared_expert") else 0)) * fp.drafter_expert_bytes
    bw = f.dev_mem if f.gpu else (f.dense_path or f.dram)
    return fp.dspark_num_layers * 2 * f.fixed_cpu + moe_b / (f.cpu * 1e9) + dense_b / (bw * 1e9)


def p_from_accepted(a: float, d: int) -> float:
    """The per-token acceptance p whose geometric law gives `a` accepted drafts per step of d:
    a = p + p^2 + ... + p^d, solved by bisection."""
    lo, hi = 0.0, 1.0
    for _ in range(50):
        mid = (lo + hi) / 2
        lo, hi = (mid, hi) if sum(mid ** i for i in range(1, d + 1)) < a else (lo, mid)
    return min(lo, 0.99)


def accepted_per_step(p: float, d: int) -> float:
    """Tokens per verify step under the geometric law: 1 + p + ... + p^d."""
    return (1 - p ** (d + 1)) / (1 - p) if p < 1 else d + 1.0


def nvme_read(f: HostFigures, plan: Plan, nbytes: float, q_nvme: float, page_share: float) -> float:
    """Seconds to read the NVMe tier's share q of `nbytes` of experts (the page cache's share of it at
    DRAM speed when read through nvme_mmap)."""
    if not q_nvme or not f.nvme_seq:
        return 0.0
    via_cache = page_share if plan.expert_nvme_path == "nvme_mmap" else 0.0
    return q_nvme * nbytes * ((1 - via_cache) / (f.nvme_seq * 1e9) + via_cache / (f.dram * 1e9))


def prefill_moe(f: HostFigures, plan: Plan, fp: Footprint, tokens: int, layers: int, union, q_nvme: float = 0.0,
                page_share: float = 0.0) -> float:
    """The routed experts over one chunk of `tokens`: union(n) experts per layer (the routing curve),
    bytes or FLOP bound, on the CPU or streamed to the device; the NVMe tier's share read first."""
    if tokens <= 0 or layers <= 0:
        return 0.0
    K, eb, H, I = fp.top_k, fp.expert_bytes, fp.hidden_size, fp.moe_intermediate_size
    nbytes = union(tokens) * eb * layers
    flop = 2 * 3 * H * I * K * tokens * layers
    read = nvme_read(f, plan, nbytes, q_nvme, page_share)
    if plan.prefill_moe_path == "device" and f.gpu:
        return read + max(nbytes / (f.h2d * 1e9), flop / f.dev_flops) + layers * f.fixed
    return read + max(nbytes / (f.cpu * 1e9), flop / f.moe_flops(tokens)) + layers * f.fixed_cpu


def chunks(tokens: int, chunk: int) -> list[tuple[int, int]]:
    """[(start, n)] of a prompt's chunks."""
    return [(c0, min(chunk, tokens - c0)) for c0 in range(0, tokens, chunk)]


