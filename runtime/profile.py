"""Host profiles: one versioned schema for every file in profiles/ (docs/profile-schema.md).

A profile is `{schema, host: {name, hard, soft}, measurements, plan?, predicted?, validation?}`.
Every scalar measurement is `{median, min, max, samples, unit, source}` with source `measured`,
`published` (+ `citation`), `formula` (+ `formula`) or `assumed` (flagged in every output); a probe that
could not run is `{skipped: reason}`, never a zero. Reads validate and name the file and key; writes
are atomic (temp file + rename).
"""
from __future__ import annotations

import json
import os
from pathlib import Path

from runtime.config import read_json
from runtime.plan import IO_ENGINES

SCHEMA = "dsv41-profile/1"
SOURCES = ("measured", "published", "formula", "assumed")
HARD_FIELDS = ("cpu_model", "isa", "physical_cores", "numa_nodes", "ram_gib", "gpu_name", "gpu_vram_gib", "pcie_link")
SCALAR_KEYS = ("dram_stream_read_gbs", "pcie_h2d_gbs", "pcie_d2h_gbs", "pcie_gather_gbs", "moe_dispatch_fixed_us",
               "nvme_seq_read_gbs", "matmul_tflops")
OPTIONAL_SCALARS = ("gpu_mem_gbs", "gpu_tflops", "dense_path_gbs", "dense_path_tflops", "step_other_s_per_layer",
                    "shared_call_us", "engram_rows_s", "dspark_p_accept", "dspark_draft_s_per_token")


class ProfileError(ValueError):
    """A profile file breaks the schema; the message names the file and the key."""


def _check_figure(v, where, src):
    if not isinstance(v, dict):
        raise ProfileError(f"{src}: '{where}' must be an object, got {type(v).__name__}")
    if "skipped" in v:
        if not isinstance(v["skipped"], str) or not v["skipped"]:
            raise ProfileError(f"{src}: '{where}.skipped' must give the reason")
        return
    for k in ("median", "unit", "source"):
        if k not in v:
            raise ProfileError(f"{src}: '{where}' lacks '{k}'")
    if not isinstance(v["median"], (int, float)) or isinstance(v["median"], bool):
        raise ProfileError(f"{src}: '{where}.median' must be a number")
    if v["source"] not in SOURCES:
        raise ProfileError(f"{src}: '{where}.source' must be one of {SOURCES}, got {v['source']!r}")
    if v["source"] == "published" and not v.get("citation"):
        raise ProfileError(f"{src}: '{where}' is published but has no 'citation'")
    if v["source"] == "formula" and not v.get("formula"):
        raise ProfileError(f"{src}: '{where}' is a formula but does not state it ('formula')")
    if v["source"] == "measured" and not v.get("samples"):
        raise ProfileError(f"{src}: '{where}' is measured but keeps no raw 'samples'")


def validate(d: dict, src: str = "profile") -> dict:
    if not isinstance(d, dict):
        raise ProfileError(f"{src}: a profile must be a JSON object")
    if d.get("schema") != SCHEMA:
        raise ProfileError(f"{src}: 'schema' is {d.get('schema')!r}, this version reads {SCHEMA!r}")
    host = d.get("host")
    if not isinstance(host, dict) or not isinstance(host.get("hard"), dict):
        raise ProfileError(f"{src}: 'host.hard' (the fingerprint) is missing")
    for k in HARD_FIELDS:
        if k not in host["hard"]:
            raise ProfileError(f"{src}: 'host.hard.{k}' is missing")
    m = d.get("measurements")
    if not isinstance(m, dict):
        raise ProfileError(f"{src}: 'measurements' is missing")
    for k in SCALAR_KEYS:
        if k not in m:
            raise ProfileError(f"{src}: 'measurements.{k}' is missing (use {{\"skipped\": reason}} if it could not run)")
        _check_figure(m[k], f"measurements.{k}", src)
    for k in OPTIONAL_SCALARS:
        if k in m:
            _check_figure(m[k], f"measurements.{k}", src)
    if not isinstance(m.get("cpu_moe_gbs"), list) or not m["cpu_moe_gbs"]:
        raise ProfileError(f"{src}: 'measurements.cpu_moe_gbs' must be a non-empty list")
    for i, e in enumerate(m["cpu_moe_gbs"]):
        _check_figure(e, f"measurements.cpu_moe_gbs[{i}]", src)
        if "geometry" not in e:
            raise ProfileError(f"{src}: 'measurements.cpu_moe_gbs[{i}].geometry' is missing")
    att = m.get("attention_s_per_token")
    if att is not None and "skipped" not in att:
        if not isinstance(att.get("points"), list) or not att["points"]:
            raise ProfileError(f"{src}: 'measurements.attention_s_per_token.points' must list (context, figure) points")
        for i, pt in enumerate(att["points"]):
            if "context" not in pt:
                raise ProfileError(f"{src}: 'measurements.attention_s_per_token.points[{i}].context' is missing")
            _check_figure(pt, f"measurements.attention_s_per_token.points[{i}]", src)
    rt = m.get("routing")
    if rt is not None and "skipped" not in rt:
        for k in ("geometry", "layers", "experts", "top_k", "slots", "lru_hit", "static_hit", "union", "source"):
            if k not in rt:
                raise ProfileError(f"{src}: 'measurements.routing.{k}' is missing")
        if len(rt["slots"]) != len(rt["lru_hit"]) or len(rt["slots"]) != len(rt["static_hit"]):
            raise ProfileError(f"{src}: 'measurements.routing' curves and 'slots' differ in length")
    fixed = m.get("moe_fixed_us", {})
    if not isinstance(fixed, dict):
        raise ProfileError(f"{src}: 'measurements.moe_fixed_us' must map a strategy to its figure")
    for k, v in fixed.items():
        if k not in ("cpu", "offload", "hybrid"):
            raise ProfileError(f"{src}: 'measurements.moe_fixed_us.{k}': strategies are cpu, offload, hybrid")
        _check_figure(v, f"measurements.moe_fixed_us.{k}", src)
    for i, pair in enumerate(m.get("contended", [])):
        if not isinstance(pair, dict) or "pair" not in pair:
            raise ProfileError(f"{src}: 'measurements.contended[{i}]' needs 'pair' and each side's figure")
        for k, v in pair.items():
            if k not in ("pair", "geometry", "note"):
                _check_figure(v, f"measurements.contended[{i}].{k}", src)
    nv = m.get("nvme_randread_4k")
    if not isinstance(nv, (list, dict)):
        raise ProfileError(f"{src}: 'measurements.nvme_randread_4k' must be a list of depth points or {{skipped}}")
    if isinstance(nv, dict):
        _check_figure(nv, "measurements.nvme_randread_4k", src)
    else:
        for i, e in enumerate(nv):
            for k in ("qd", "iops", "p50_us", "p95_us", "path"):
                if k not in e:
                    raise ProfileError(f"{src}: 'measurements.nvme_randread_4k[{i}].{k}' is missing")
            for name, f in (e.get("engines") or {}).items():     # each engine of the reader, at this depth
                if name not in IO_ENGINES[1:] or not isinstance(f, dict) or not isinstance(f.get("iops"), (int, float)):
                    raise ProfileError(f"{src}: 'measurements.nvme_randread_4k[{i}].engines.{name}' must be one of "
                                       f"{IO_ENGINES[1:]} with an 'iops' figure")
            if isinstance(e["path"], str) and e["path"].startswith("/") and host.get("shipped", False):
                raise ProfileError(f"{src}: a shipped profile records an absolute path in nvme_randread_4k[{i}]")
    return d


def load_profile(path) -> dict:
    return validate(read_json(path, ProfileError, "profile"), str(path))


def save_profile(path, d: dict) -> None:
    """Validate, then write atomically: a reader sees the old file or the new one, never half."""
    validate(d, str(path))
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    with open(tmp, "w") as f:
        json.dump(d, f, indent=1)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


# ------------------------------------------------------------------------------------ reading figures
def figure(profile: dict, key: str) -> float | None:
    """The median of a scalar measurement, None when skipped or absent."""
    v = profile["measurements"].get(key)
    if not isinstance(v, dict) or "skipped" in v:
        return None
    return float(v["median"])


def assumed_keys(profile: dict) -> list[str]:
    """Every figure whose source is `assumed` (to flag in outputs)."""
    out = []
    def walk(v, where):
        if isinstance(v, dict):
            if v.get("source") == "assumed":
                out.append(where)
            for k, x in v.items():
                walk(x, f"{where}.{k}" if where else k)
        elif isinstance(v, list):
            for i, x in enumerate(v):
                walk(x, f"{where}[{i}]")
    walk(profile["measurements"], "measurements")
    return out


def cpu_moe_figure(profile: dict, geometry: str, tokens: int = 1, threads: int | None = None):
    """CPU-MoE GB/s for this expert geometry at batch `tokens`: best over threads, or at `threads`
    (measured there, else the best figure scaled by threads / its thread count, never up: the kernel
    is compute-bound per core until DRAM binds). -> (gbs, note); the note says when the figure was
    measured at another geometry (extrapolation) or scaled to another thread count."""
    rows = [e for e in profile["measurements"]["cpu_moe_gbs"] if "skipped" not in e]
    at = [e for e in rows if e.get("threads") == threads] if threads is not None else []
    pool = at or rows
    same = [e for e in pool if e["geometry"] == geometry and e.get("tokens", 1) == tokens] or \
           [e for e in pool if e["geometry"] == geometry]
    best = max(same or pool, key=lambda e: e["median"])
    gbs = float(best["median"])
    notes = [] if same else [f"cpu_moe_gbs extrapolated from geometry {best['geometry']} to {geometry}"]
    if threads is not None and not at and best.get("threads") and threads < best["threads"]:
        gbs *= threads / best["threads"]
        notes.append(f"cpu_moe_gbs scaled from {best['threads']} measured threads to {threads}")
    return gbs, "; ".join(notes)


def cpu_moe_flops(profile: dict, geometry: str, tokens: int, threads: int | None = None) -> tuple[float | None, str]:
    """The CPU-MoE kernel's FLOP/s for a call of `tokens` tokens at this expert geometry: between two
    measured widths, interpolated on log-log scales (a memory-bound kernel's FLOP/s grows with its width:
    the nearest width alone would give a width of 2 batch 1's rate where only 1 and 6 were measured);
    outside them, the nearest; at `threads` (else scaled down by threads / measured threads).
    -> (FLOP/s or None when no width carries a GFLOP/s figure, note)."""
    import math
    rows = [e for e in profile["measurements"]["cpu_moe_gbs"] if "median" in e and (e.get("extra") or {}).get("gflops")]
    at = [e for e in rows if e.get("threads") == threads] if threads is not None else []
    pool = at or rows
    same = [e for e in pool if e["geometry"] == geometry]
    if not pool:
        return None, "no CPU-MoE GFLOP/s figure in the profile"
    width = lambda e: max(e.get("tokens", 1), 1)                                    # noqa: E731
    cand = same or pool
    top = max(cand, key=lambda e: e["extra"]["gflops"]).get("threads")           # one thread count's widths
    cand = [e for e in cand if e.get("threads") == top]
    by = {}
    for e in cand:                                                                 # the best figure at each width
        if width(e) not in by or e["extra"]["gflops"] > by[width(e)]["extra"]["gflops"]:
            by[width(e)] = e
    t = max(tokens, 1)
    lo, hi = max((w for w in by if w <= t), default=None), min((w for w in by if w >= t), default=None)
    if lo is not None and hi is not None and lo != hi:
        f0, f1 = by[lo]["extra"]["gflops"], by[hi]["extra"]["gflops"]
        best = by[lo]
        flops = math.exp(math.log(f0) + (math.log(f1) - math.log(f0)) * math.log(t / lo) / math.log(hi / lo)) * 1e9
    else:
        best = by[lo if lo is not None else hi]
        flops = best["extra"]["gflops"] * 1e9
    notes = [] if same else [f"CPU-MoE GFLOP/s extrapolated from geometry {best['geometry']} to {geometry}"]
    if threads is not None and not at and best.get("threads") and threads < best["threads"]:
        flops *= threads / best["threads"]
    return flops, "; ".join(notes)


def io_path(profile: dict) -> str:
    """How the NVMe figures were read: 'o_direct', or 'buffered (why O_DIRECT was refused)'."""
    pts = profile["measurements"].get("nvme_randread_4k")
    if not isinstance(pts, list) or not pts:
        return "-"
    e = pts[0]
    return e.get("io_path", "?") + (f" ({e['fallback']})" if e.get("fallback") else "")
