"""The profiler: every probe, on this host, into one profile (docs/profile-schema.md).

run_profile(checkpoint, quick) measures: DRAM stream read; the CPU-MoE kernel at the checkpoint's
expert geometry and always at the full V4.1 and V4-Flash geometries (batch 1, verify widths, prefill
widths; swept over threads); float32 matmul throughput (the dtype the runtime's CPU prefill runs);
through the runtime's own paths (autotune/probes/runtime_paths.py): the dense path, attention vs context and the per-layer overhead of a
decode forward, each MoE strategy's fixed cost per layer call, and a routing trace; PCIe copies and expert gather when CUDA is present (skipped with the reason
otherwise, never zero); CPU-MoE contended with NVMe reads (and with PCIe gather on GPU hosts); NVMe
random 4 KiB reads at queue depths 1..64, the Engram row pattern serial vs batched, a prefill row
batch, sequential expert-sized reads and the reader's software ceiling -- all through the runtime's
batched reader. Every figure: warm-up, repeats, raw samples, source `measured`.
"""
from __future__ import annotations

import threading
import time
from pathlib import Path

import torch

from autotune.probes import nvme, runtime_paths
from autotune.probes.cpu_moe import GEOMETRIES, VERIFY_TOKENS, cpu_moe, random_bank, row_fetch, row_inputs, row_streams
from hostinfo import cuda_available, probe_budget_bytes, usable_cores
from hostinfo.fingerprint import fingerprint
from hostinfo.measure import Measurement, measure
from kernels.cpu_moe import DEFAULT_FETCH, DEFAULT_INPUTS
from kernels.probe_bank import ProbeTooLarge, expert_bytes
from kernels.stream import dram_copy, dram_stream_read, stream_buffer
from runtime.profile import SCHEMA, io_path
from runtime.budget import dense_host_bytes
from runtime.checkpoint.reader import Checkpoint
from runtime.plan import Plan


def _fig(m: Measurement, **kw) -> dict:
    d = m.to_dict()
    d.update(kw)
    return d


def _skipped(reason: str) -> dict:
    return {"skipped": reason}


def _matmul_tflops(quick: bool) -> Measurement:
    """The CPU's float32 matmul (the runtime's prefill tiles and attention on the CPU are float32: a bf16
    figure would price what never runs, and without native bf16 it reads ~1 GFLOP/s against ~60 on the
    Zen 2 VM)."""
    n = 1024 if quick else 2048
    a, b = torch.randn(n, n, dtype=torch.float32), torch.randn(n, n, dtype=torch.float32)
    m = measure(lambda: a @ b, repeats=5 if quick else 10, warmup=2)
    return m.map(lambda s: 2 * n ** 3 / s / 1e12, "TFLOP/s")


def _gpu_figures(quick: bool) -> dict:
    """Device memory read bandwidth (a reduction over a buffer far above any GPU cache) and bf16
    matmul throughput: the cost model's dense, attention and device-prefill terms."""
    if not cuda_available():
        reason = "no CUDA device on this host"
        return {"gpu_mem_gbs": _skipped(reason), "gpu_tflops": _skipped(reason)}
    n = (1 if quick else 4) << 30
    a = torch.ones(n // 4, dtype=torch.float32, device="cuda")

    def synced(f):
        def run():
            f()
            torch.cuda.synchronize()
        return run
    mem = measure(synced(lambda: a.sum()), repeats=5 if quick else 15, warmup=2).map(lambda s: n / s / 1e9, "GB/s")
    del a
    k = 4096 if quick else 8192
    x, y = torch.randn(k, k, dtype=torch.bfloat16, device="cuda"), torch.randn(k, k, dtype=torch.bfloat16, device="cuda")
    mm = measure(synced(lambda: x @ y), repeats=5 if quick else 15, warmup=2).map(lambda s: 2 * k ** 3 / s / 1e12, "TFLOP/s")
    return {"gpu_mem_gbs": _fig(mem, buffer_bytes=n), "gpu_tflops": _fig(mm, dtype="bf16", n=k)}


def _gather_probe(ck: Checkpoint, threads: int):
    """A PlacedExperts whose pinned host bank stays inside the probe memory budget (never the whole
    routed bank: 269 GiB for the full V4.1), with a 64-slot device cache. -> (pe, experts per gather)."""
    from runtime.experts import PlacedExperts
    cfg = ck.config
    budget_gib = min(probe_budget_bytes(), cfg.num_hidden_layers * cfg.n_routed_experts * cfg.expert_bytes) / 2**30
    pe = PlacedExperts(ck, Plan(moe_strategy="offload", slot_cache_experts=64, cpu_threads=threads,
                                host_expert_budget_gib=budget_gib), device="cuda")
    return pe, max(1, min(cfg.num_experts_per_tok, pe.resident[1 % cfg.num_hidden_layers], 64))


def _pcie(ck: Checkpoint, quick: bool, threads: int) -> dict:
    if not cuda_available():
        reason = "no CUDA device on this host"
        return {"pcie_h2d_gbs": _skipped(reason), "pcie_d2h_gbs": _skipped(reason), "pcie_gather_gbs": _skipped(reason)}
    n = min((256 if quick else 1024) << 20, probe_budget_bytes() // 2)
    host = torch.empty(n, dtype=torch.uint8).pin_memory()
    dev = torch.empty(n, dtype=torch.uint8, device="cuda")

    def timed(f):
        def run():
            f()
            torch.cuda.synchronize()
        return measure(run, repeats=5 if quick else 15, warmup=2).map(lambda s: n / s / 1e9, "GB/s")
    h2d = timed(lambda: dev.copy_(host, non_blocking=True))
    d2h = timed(lambda: host.copy_(dev, non_blocking=True))
    del host, dev
    cfg = ck.config
    pe, k = _gather_probe(ck, threads)
    try:
        layer = 1 % cfg.num_hidden_layers
        secs = [pe.gather_seconds(layer, k) for _ in range(2 + (5 if quick else 15))][2:]    # 2 warm-up gathers
    finally:
        pe.close()
    gather = Measurement(tuple(k * cfg.expert_bytes / s / 1e9 for s in secs), "GB/s",
                         note=f"{k} experts gathered into the slot cache per sample (runtime path)")
    return {"pcie_h2d_gbs": _fig(h2d), "pcie_d2h_gbs": _fig(d2h),
            "pcie_gather_gbs": _fig(gather, geometry=f"{cfg.hidden_size}x{cfg.moe_intermediate_size}")}


def _contended_gather(ck: Checkpoint, bank, top_k: int, threads: int, quick: bool, streams: int = 4) -> dict:
    """CPU-MoE and the PCIe expert gather at the same time (both read host DRAM): each side's figure."""
    cfg = ck.config
    pe, k = _gather_probe(ck, threads)
    stop, secs = threading.Event(), []

    def gather():
        layer = 1 % cfg.num_hidden_layers
        while not stop.is_set():
            secs.append(pe.gather_seconds(layer, k))
    t = threading.Thread(target=gather)
    try:
        t.start()
        cpu = cpu_moe(bank, 1, threads, top_k=top_k, repeats=6 if quick else 12, streams=streams)
    finally:
        stop.set()
        t.join()
        pe.close()
    if not secs:
        return {"pair": "cpu_moe+pcie_gather", "cpu_moe_gbs": _fig(cpu),
                "pcie_gather_gbs": _skipped("no gather finished while the CPU-MoE probe ran")}
    g = Measurement(tuple(k * cfg.expert_bytes / s / 1e9 for s in secs), "GB/s", note="while the CPU-MoE probe ran")
    return {"pair": "cpu_moe+pcie_gather", "geometry": f"{bank.hidden}x{bank.inter}", "cpu_moe_gbs": _fig(cpu),
            "pcie_gather_gbs": _fig(g)}


def _contended(bank, top_k, threads, path: Path, n_reads: int, repeats: int, streams: int = 4) -> dict:
    """CPU-MoE and NVMe random reads at the same time: each side's figure."""
    res = {}

    def io():
        res["nvme"] = nvme.randread_4k(path, 8, n_reads, seed=9, repeats=repeats)
    t = threading.Thread(target=io)
    t.start()
    res["cpu"] = cpu_moe(bank, 1, threads, top_k=top_k, repeats=8, streams=streams)
    t.join()
    nv = res["nvme"]
    return {"pair": "cpu_moe+nvme_randread", "geometry": f"{bank.hidden}x{bank.inter}",
            "cpu_moe_gbs": _fig(res["cpu"]),
            "nvme_randread_iops": {"median": nv["iops"], "min": nv["min"], "max": nv["max"], "samples": nv["samples"],
                                   "unit": "IOPS", "source": "measured", "note": "QD 8, while the CPU-MoE probe ran"}}


def _cpu_moe_sweep(cfg, cores: int, quick: bool, step) -> tuple[list, tuple | None, dict | None, dict | None, dict | None]:
    """The kernel at the served geometry (its top_k) and at V4.1's and V4-Flash's (theirs), over widths
    and threads, in the row layout this host reads faster, with rows in order the inputs per row decode
    it runs faster, and on the lanes paths the fetching one input's calls run faster with (all chosen
    first, on the first geometry whose experts are >= 1 MiB, interleaved). -> (figures, (bank, top_k,
    layout) for the contended pairs: served, or V4.1's where the served experts are toy-sized, the
    layout choice, the inputs choice, the fetching choice)."""
    geoms = {f"{cfg.hidden_size}x{cfg.moe_intermediate_size}": (cfg.hidden_size, cfg.moe_intermediate_size, cfg.num_experts_per_tok)}
    for h, i, k in GEOMETRIES.values():
        geoms.setdefault(f"{h}x{i}", (h, i, k))
    big = lambda g: expert_bytes(*g[1][:2]) >= 1 << 20
    geoms = dict(sorted(geoms.items(), key=lambda g: not big(g)))     # the layout is chosen on real-sized experts
    streams, layout, inputs, blocking, fetch, fetching = 4, None, DEFAULT_INPUTS, None, DEFAULT_FETCH, None
    threads_sweep = sorted({1, cores}) if quick else sorted({1, max(1, cores // 2), cores})
    widths = (1, 6, 64) if quick else (1, 2, 4, 6, 64, 256)
    out, served = [], None
    for gname, (H, I, K) in geoms.items():
        step(f"CPU-MoE {gname}")
        try:
            bank, note = random_bank(H, I, K)
        except ProbeTooLarge as e:
            out.append({"skipped": str(e), "geometry": gname})
            continue
        here = gname == f"{cfg.hidden_size}x{cfg.moe_intermediate_size}"
        if layout is None and bank.expert_bytes >= 1 << 20:
            step("CPU-MoE row layout")
            streams, by, wide = row_streams(bank, cores, K, rounds=1 if quick else 5, note=note, repeats=2 if quick else 3)
            layout = {"best": streams, "geometry": gname, "threads": cores, "source": "measured",
                      "gbs": {str(k): _fig(v) for k, v in by.items()},
                      "verify_tokens": VERIFY_TOKENS, "verify_gbs": {str(k): _fig(v) for k, v in wide.items()}}
            if streams == 1:              # 4 rows apart always decode for 4 inputs
                step("CPU-MoE inputs per row decode")
                inputs, by = row_inputs(bank, cores, K, rounds=1 if quick else 5, note=note, repeats=2 if quick else 3)
                blocking = {"best": inputs, "geometry": gname, "threads": cores, "tokens": 8, "source": "measured",
                            "gbs": {str(k): _fig(v) for k, v in by.items()}}
            step("CPU-MoE fetching")
            best, by = row_fetch(bank, cores, K, streams, rounds=1 if quick else 5, note=note, repeats=2 if quick else 3)
            if best is not None:
                fetch = best
                fetching = {"best": best, "geometry": gname, "threads": cores, "tokens": 1, "source": "measured",
                            "gbs": {k: _fig(v) for k, v in by.items()}}
        for t in threads_sweep:
            for w in widths:
                if t != cores and (w > 8 if not quick else w not in (1, 64)):
                    continue                  # other thread counts: decode and one prefill width
                if quick and not here and (t != cores or w > 8):
                    continue                  # quick: the reference geometries at decode widths only
                r = cpu_moe(bank, w, t, top_k=K, repeats=6 if quick else 12, note=note, streams=streams, inputs=inputs,
                            fetch=fetch)
                out.append(_fig(r, geometry=gname, tokens=w, threads=t))
        if served is None and (bank.expert_bytes >= 1 << 20 or (H, I) == GEOMETRIES["deepseek-v4.1-flash"][:2]):
            served = (bank, K, streams)
        else:
            del bank
    return out, served, layout, blocking, fetching


def _forward_terms(ck: Checkpoint, quick: bool) -> dict:
    """The dense path, attention vs context and the per-layer overhead (autotune/probes/runtime_paths.py).
    Timed with the experts in RAM where the host holds them, then again beside an NVMe expert tier
    (`phases_nvme_tier`: the same keys, for plans with one: its reads slow every other phase)."""
    held = dense_host_bytes(ck.footprint())
    why = ("the dense path runs on the GPU on this host (not probed on the CPU)" if cuda_available() else
           f"the dense weights as held ({held / 2**30:.1f} GiB) exceed the probe memory budget "
           f"({probe_budget_bytes() / 2**30:.1f} GiB)" if held > probe_budget_bytes() else None)
    if why is None:
        try:                      # a probe engine the host cannot hold (DoesNotFit) or a skeleton: skipped, named
            out = runtime_paths.forward_terms(ck, quick, usable_cores())
        except (OSError, ValueError, RuntimeError) as e:
            why = f"not measured: {e}"
        else:
            if out["dense_path_gbs"].get("placement") == "ram":
                try:              # a failure here keeps the figures above; tier plans then use them
                    out["phases_nvme_tier"] = runtime_paths.forward_terms(ck, quick, usable_cores(), tier=True)
                except (OSError, ValueError, RuntimeError) as e:
                    out["phases_nvme_tier"] = _skipped(f"not measured: {e}")
            return out
    return {k: _skipped(why) for k in ("dense_path_gbs", "dense_path_tflops", "attention_s_per_token", "engram_rows_s",
                                       "shared_call_us", "step_other_s_per_layer")}


def _routing(ck: Checkpoint, quick: bool, cores: int) -> dict:
    try:
        return runtime_paths.routing(ck, quick, cores)
    except (OSError, ValueError, RuntimeError) as e:     # a header-only skeleton, a checkpoint too big to run here
        return _skipped(f"no routing trace recorded: {e}")


def _expert_tier(ck: Checkpoint, cores: int, quick: bool, block: dict) -> dict:
    """The expert NVMe tier's read rate as decode reads it, through the runtime (one layer's top_k
    experts per call: autotune/probes/runtime_paths.py expert_tier_read) where the checkpoint holds real
    experts of >= 1 MiB; else the block figure (toy experts, skeleton checkpoints), said so."""
    cfg = ck.config
    if cfg.expert_bytes >= 1 << 20:
        try:
            return _fig(runtime_paths.expert_tier_read(ck, cores, calls=6 if quick else 12), block_bytes=cfg.expert_bytes)
        except (OSError, ValueError, RuntimeError) as e:
            why = f"the runtime's expert tier could not be read ({e})"
    else:
        why = f"experts of {cfg.expert_bytes} B are toy-sized"
    return {**block, "note": f"{block.get('note', '')}; {why}: the sequential block figure stands in"}


def _nvme(ck: Checkpoint, quick: bool, served, cores: int, step) -> dict:
    """Every NVMe figure through the runtime's reader, on the Engram shard or a scratch file in a
    temporary directory beside the checkpoint (same filesystem, never inside it)."""
    cfg = ck.config
    m: dict = {}
    engram_shard = ck.shard_of(f"layers.{cfg.engram_layer_ids[0]}.engram.embed.weight") if cfg.engram_layer_ids else None
    path, scratch = nvme.probe_file(engram_shard, ck.root)
    rel = path.name if path.parent == ck.root else (f"scratch file ({scratch})" if scratch else str(path))
    repeats = 3 if quick else 7
    try:
        n_reads = 2000 if quick else 20000
        curve = []
        engines, refused = nvme.engines_here(path)        # each measured at every depth, interleaved
        for qd in ((1, 8, 32) if quick else nvme.DEPTHS):
            r = nvme.randread_4k(path, qd, n_reads, repeats=repeats, engines=engines)
            curve.append({"qd": qd, "iops": r["iops"], "min": r["min"], "max": r["max"], "samples": r["samples"],
                          "p50_us": r["p50_us"], "p95_us": r["p95_us"], "engine": r["engine"], "engines": r["engines"],
                          "path": rel, "io_path": r["io_path"], "source": "measured",
                          **({"fallback": r["fallback"]} if r["fallback"] else {}),
                          **({"refused": refused} if refused else {})})
        m["nvme_randread_4k"] = curve
        m["nvme_engram_pattern"] = [nvme.engram_pattern(path, qd, 10 if quick else 40) for qd in ((8,) if quick else (4, 8, 32))]
        m["nvme_prefill_rows"] = [nvme.prefill_rows(path, qd, 4096 if quick else 16384) for qd in ((1, 32) if quick else nvme.DEPTHS)]
        block = cfg.expert_bytes if cfg.expert_bytes >= 1 << 20 else 3 * 5120 * 2304 * 17 // 32
        m["nvme_block_read_gbs"] = _fig(nvme.seq_read(path, block, 4 if quick else 16), block_bytes=block)
        m["nvme_seq_read_gbs"] = _expert_tier(ck, cores, quick, m["nvme_block_read_gbs"])
        m["nvme_software_ceiling"] = nvme.software_ceiling(path, n_reads, 8)
        step("contended")
        m["contended"] = [_contended(*served[:2], cores, path, n_reads, repeats, served[2])] if served else []
        if cuda_available() and served:
            m["contended"].append(_contended_gather(ck, *served[:2], cores, quick, served[2]))
    finally:
        if scratch:
            nvme.remove_scratch(path)
    return m


def run_profile(checkpoint, quick: bool = False, progress=None) -> dict:
    """-> a profile dict (schema dsv41-profile/1). progress(name) is called as each probe starts;
    `probe_seconds` records how long each took (wall clock, in the order run)."""
    took: dict[str, float] = {}
    clock = {"name": None, "t": time.perf_counter()}

    def step(name):
        now = time.perf_counter()
        if clock["name"] is not None:
            took[clock["name"]] = round(took.get(clock["name"], 0.0) + now - clock["t"], 2)
        clock.update(name=name, t=now)
        if progress and name is not None:
            progress(name)
    ck = checkpoint if isinstance(checkpoint, Checkpoint) else Checkpoint(checkpoint)
    cfg = ck.config
    cores = usable_cores()
    step("fingerprint")
    host = fingerprint(ck.root, cfg.geometry_hash())
    m: dict = {"probe_memory_budget_bytes": probe_budget_bytes()}
    step("DRAM stream read")
    buf, note = stream_buffer()                        # one buffer for both: fresh memory is slow to touch on a VM
    m["dram_stream_read_gbs"] = _fig(dram_stream_read(cores, repeats=3 if quick else 7, buf=buf, note=note), threads=cores)
    m["dram_copy_gbs"] = _fig(dram_copy(cores, repeats=3 if quick else 5, buf=buf, note=note), threads=cores,
                              note="bytes copied")
    del buf
    m["cpu_moe_gbs"], served, layout, blocking, fetching = _cpu_moe_sweep(cfg, cores, quick, step)
    for key, fig in (("cpu_moe_streams", layout), ("cpu_moe_inputs", blocking), ("cpu_moe_fetch", fetching)):
        if fig is not None:
            m[key] = fig
    step("matmul")
    m["matmul_tflops"] = _fig(_matmul_tflops(quick), dtype="f32")
    step("dense path, attention vs context (runtime)")
    m.update(_forward_terms(ck, quick))
    step("MoE fixed cost per layer, each strategy (runtime path)")
    m["moe_fixed_us"] = runtime_paths.fixed_costs(ck, cores)
    m["moe_dispatch_fixed_us"] = m["moe_fixed_us"]["cpu"]
    step("routing trace (runtime)")
    m["routing"] = _routing(ck, quick, cores)
    step("DSpark acceptance (runtime)")
    try:
        m.update(runtime_paths.dspark_acceptance(ck, quick, cores))
    except (OSError, ValueError, RuntimeError) as e:
        m["dspark_p_accept"] = m["dspark_draft_s_per_token"] = _skipped(f"not measured: {e}")
    step("GPU")
    m.update(_gpu_figures(quick))
    step("PCIe")
    m.update(_pcie(ck, quick, cores))
    step("NVMe")
    m.update(_nvme(ck, quick, served, cores, step))
    step(None)
    return {"schema": SCHEMA, "host": host, "measurements": m, "plan": None, "predicted": None, "validation": None,
            "checkpoint": str(ck.root), "measured_at": time.strftime("%Y-%m-%dT%H:%M:%S"), "quick": quick,
            "probe_seconds": took}


def probe_time_summary(profile: dict) -> str:
    """'profiled in 43 s (longest: ...)': where a profile's time went, for the log."""
    took = profile.get("probe_seconds") or {}
    slow = sorted(took.items(), key=lambda kv: -kv[1])[:3]
    return f"profiled in {sum(took.values()):.0f} s (longest: " + ", ".join(f"{k} {v:.1f} s" for k, v in slow) + ")"


def _routing_row(r) -> str:
    if not isinstance(r, dict):
        return "-"
    if "skipped" in r:
        return f"skipped: {r['skipped']}"
    half = r["slots"][len(r["slots"]) // 2]
    return (f"{r['decode_tokens']} decode tokens; LRU hit at {half} slots {r['lru_hit'][len(r['slots']) // 2]:.2f} "
            f"(uniform {half / (r['layers'] * r['experts']):.2f}); union of 2 tokens {r['union'].get('2', 0):.1f} experts")


def summary_rows(profile: dict) -> list[tuple[str, str]]:
    """(path, figure) rows in the spirit of `ft bench bw`."""
    m = profile["measurements"]

    def f(v, unit=None):
        if not isinstance(v, dict):
            return "-"
        if "skipped" in v:
            return f"skipped: {v['skipped']}"
        s = f"{v['median']:.2f} {unit or v['unit']} [{v['min']:.2f}-{v['max']:.2f}]"
        return s + (" (noisy)" if v.get("noisy") else "")
    def noted(v):
        return f(v) + (f"  ({v['note']})" if isinstance(v, dict) and "budget" in v.get("note", "") else "")
    rows = [("DRAM stream read", noted(m["dram_stream_read_gbs"])), ("DRAM copy", f(m.get("dram_copy_gbs")))]
    for e in m["cpu_moe_gbs"]:
        if "skipped" in e:
            rows.append((f"CPU-MoE {e['geometry']}", f(e)))
            continue
        rows.append((f"CPU-MoE {e['geometry']} x{e['tokens']} t{e['threads']}",
                     noted(e) + (f"  {e['extra'].get('gflops', 0):.0f} GFLOP/s" if "extra" in e else "")))
    rows += [("matmul f32", f(m["matmul_tflops"])), ("dense path per token (runtime)", f(m.get("dense_path_gbs"))),
             *((f"MoE fixed per layer ({k})", f(v)) for k, v in (m.get("moe_fixed_us") or {"cpu": m["moe_dispatch_fixed_us"]}).items()),
             ("attention per token vs context", ", ".join(f"{p['context']}: {1e3 * p['median']:.2f} ms" for p in
                                                          (m.get("attention_s_per_token") or {}).get("points", [])) or "-"),
             ("outside every phase, per layer", f(m.get("step_other_s_per_layer"))),
             ("routing trace", _routing_row(m.get("routing"))), ("GPU memory read", f(m.get("gpu_mem_gbs"))),
             ("GPU matmul bf16", f(m.get("gpu_tflops"))), ("PCIe H2D", f(m["pcie_h2d_gbs"])), ("PCIe D2H", f(m["pcie_d2h_gbs"])),
             ("PCIe gather", f(m["pcie_gather_gbs"])), ("NVMe expert tier (runtime reads)", f(m["nvme_seq_read_gbs"])),
             ("NVMe I/O path", io_path(profile))]
    for c in m.get("contended", []):
        rows.append((f"contended {c['pair']}", ", ".join(f"{k} {f(v)}" for k, v in c.items() if isinstance(v, dict))))
    return rows

