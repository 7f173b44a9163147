"""One result schema for every output: each input becomes flat records (dicts of scalars), which
pandas turns into the tables, the CSVs, the HTML page and the plots.

  host_record(profile)    one row per profile: fingerprint, bandwidth ceilings, CPU-MoE kernel GB/s
                          and its ratio to DRAM stream read per geometry, NVMe IOPS per depth, the
                          chosen plan, predicted and measured decode tok/s and TTFT
  validation_records(p)   one row per plan the tuner measured on the runtime: predicted vs measured
  term_records(p)         one row per validated plan and cost-model term: predicted raw and calibrated
                          vs measured seconds (decode per token, prefill per prompt)
  bench_record(row)       one row per dsv41-bench phase (a JSONL line)

Every figure keeps its provenance: `source` says measured / published / formula / assumed."""
from __future__ import annotations

import json
from pathlib import Path

from runtime.profile import figure, io_path, load_profile

PLAN_COLS = ("moe_strategy", "slot_cache_experts", "prefill_chunk", "engram_placement", "engram_io_depth", "engram_io_engine", "dspark",
             "draft_length", "cpu_threads")


def host_name(profile: dict) -> str:
    return profile["host"].get("name") or "host"


def host_record(p: dict, name: str | None = None) -> dict:
    h, m = p["host"], p["measurements"]
    r = {"host": name or host_name(p), "figures": "published" if h.get("shipped") else "measured"}
    r.update({k: (",".join(v) if isinstance(v, list) else v) for k, v in h["hard"].items()})
    for key, col in (("dram_stream_read_gbs", "dram_gbs"), ("pcie_h2d_gbs", "h2d_gbs"), ("pcie_d2h_gbs", "d2h_gbs"),
                     ("pcie_gather_gbs", "gather_gbs"), ("nvme_seq_read_gbs", "nvme_seq_gbs"), ("matmul_tflops", "matmul_tflops")):
        r[col] = figure(p, key)
    for e in m["cpu_moe_gbs"]:
        if e.get("tokens", 1) == 1 and "median" in e:
            r[f"cpu_moe_{e['geometry']}_gbs"] = e["median"]
            if r["dram_gbs"]:
                r[f"kernel_ratio_{e['geometry']}"] = e["median"] / r["dram_gbs"]
    for c in m.get("contended", []):
        for k, v in c.items():
            if isinstance(v, dict) and "median" in v:
                r[f"contended_{c['pair']}_{k}"] = v["median"]
    r["nvme_io_path"] = io_path(p)
    nv = m.get("nvme_randread_4k")
    for e in nv if isinstance(nv, list) else []:
        r[f"nvme_iops_qd{e['qd']}"] = e["iops"]
        if e.get("engine"):                                # the fastest of the reader's engines there
            r[f"nvme_engine_qd{e['qd']}"] = e["engine"]
    plan = p.get("plan") or {}
    for k in PLAN_COLS:
        r[f"plan_{k}"] = plan.get(k)
    r["plan_geometry"] = plan.get("geometry_hash")
    pred = p.get("predicted") or {}
    raw = pred.get("raw") or pred                     # the search's (uncalibrated) figure, and validation's
    r["predicted_tok_s"], r["predicted_ttft_s"] = raw.get("decode_tok_s"), raw.get("ttft_s")
    if (p.get("calibration") or {}).get("terms"):
        r["calibrated_tok_s"], r["calibrated_ttft_s"] = pred.get("decode_tok_s"), pred.get("ttft_s")
    v = p.get("validation")
    if v:
        picked = v["rows"][v["picked"]]["measured"]
        r["measured_tok_s"], r["measured_ttft_s"] = picked["decode_tok_s"], picked["ttft_s"]
    return r


def validation_records(p: dict, name: str | None = None) -> list[dict]:
    v = p.get("validation") or {"rows": []}
    return [{"host": name or host_name(p), "picked": i == v.get("picked"), "baseline": row["baseline"],
             "moe_strategy": row["plan"]["moe_strategy"], "slots": row["plan"]["slot_cache_experts"],
             "predicted_tok_s": row["predicted"]["decode_tok_s"], "measured_tok_s": row["measured"]["decode_tok_s"],
             "predicted_ttft_s": row["predicted"]["ttft_s"], "measured_ttft_s": row["measured"]["ttft_s"]}
            for i, row in enumerate(v["rows"])]


def term_records(p: dict, name: str | None = None) -> list[dict]:
    v = p.get("validation") or {"rows": []}
    out = []
    for i, row in enumerate(v["rows"]):
        pred, meas = row["predicted"], row["measured"]
        if "raw" not in pred or "terms" not in meas:
            continue                                   # a profile from before per-term validation
        for part in ("decode", "prefill"):
            for term, m in meas["terms"].get(part, {}).items():
                raw, cal = pred["raw"][part].get(term, 0.0), pred["calibrated"][part].get(term, 0.0)
                out.append({"host": name or host_name(p), "plan": i, "picked": i == v.get("picked"), "term": f"{part}.{term}",
                            "predicted_raw_ms": 1e3 * raw, "predicted_calibrated_ms": 1e3 * cal, "measured_ms": 1e3 * m,
                            "raw_error": (raw - m) / m if m > 0 else None})
    return out


def bench_record(row: dict) -> dict:
    s, c = row["results"], row["config"]
    host = (row.get("host") or {}).get("name") or row.get("profile") or row["url"]
    r = {"host": host, "label": row.get("label", ""), "phase": row["phase"], "time": row["time"], "model": row["model"],
         "requests": c["requests"], "concurrency": c["concurrency"], "rate": c["rate"], "prompt_tokens": c["prompt_tokens"],
         "output_tokens": c["output_tokens"], "completed": s["completed"], "failed": s["failed"],
         "request_per_s": s["request_per_s"], "output_tok_s": s["output_tok_s"], "decode_tok_s": s["decode_tok_s"]}
    for k in ("ttft_s", "tpot_s", "itl_s", "e2e_s"):
        for p in ("p50", "p99"):
            r[f"{k[:-2]}_{p}_ms"] = s[k][p] * 1e3 if s.get(k) else None
    plan = row.get("plan") or {}
    r["plan_moe_strategy"], r["plan_dspark"] = plan.get("moe_strategy"), plan.get("dspark")
    return r


def read_inputs(paths) -> tuple[list[tuple[str, dict]], list[dict]]:
    """-> ([(name, profile)], [bench rows]); *.jsonl are bench results, everything else a profile.
    Two profiles with one host name are told apart by their file name."""
    profiles, bench = [], []
    for path in map(Path, paths):
        if path.suffix == ".jsonl":
            for n, line in enumerate(path.read_text().splitlines(), 1):
                if line.strip():
                    try:
                        row = json.loads(line)
                    except json.JSONDecodeError as e:
                        raise ValueError(f"{path}:{n}: not a JSON line ({e.msg})") from None
                    if row.get("schema") != "dsv41-bench/1":
                        raise ValueError(f"{path}:{n}: not a dsv41-bench row (schema {row.get('schema')!r})")
                    bench.append(row)
        else:
            profiles.append((path, load_profile(path)))
    names = [host_name(p) for _, p in profiles]
    named = [(n if names.count(n) == 1 else f"{n} ({path.stem})", p) for n, (path, p) in zip(names, profiles)]
    return named, bench
