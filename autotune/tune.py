"""`dsv41-tune` with no subcommand: profile -> search -> validate on the runtime -> pick -> write.

Profile this host (or reuse a fresh profile of it: same hard fingerprint, commit and model geometry,
under a week old; anything else is re-measured, never silently trusted), search with the cost model
(the study persists, so a killed run resumes), then measure the top plans and FreeToken's baseline on
the runtime (autotune/validate.py), recalibrate the model's per-host scales, and write the profile
with `plan`, `predicted` and `validation` (raw samples, noise floor, study name and storage).
"""
from __future__ import annotations

import time
from pathlib import Path

from tokenizers import Tokenizer

from autotune.costmodel import predict
from hostinfo.fingerprint import compare, fingerprint
from runtime.profile import ProfileError, load_profile, save_profile
from autotune.profiler import probe_time_summary, run_profile
from autotune.search import open_storage, search
from autotune.validate import calibration, dspark_acceptance, freetoken_baseline, measure_plans, noise_floor, pick, summarize
from runtime.checkpoint.reader import Checkpoint
from runtime.workload import Workload, make_prompt

FRESH_S = 7 * 24 * 3600


def _fresh(path: Path, ck: Checkpoint) -> tuple[dict | None, str]:
    if not path.exists():
        return None, "no profile yet"
    try:
        prof = load_profile(path)
    except ProfileError as e:
        return None, f"unreadable ({e})"
    here = fingerprint(ck.root, ck.config.geometry_hash())
    hard, soft = compare(prof["host"], here)
    if hard:
        return None, f"made on other hardware ({hard[0]})"
    if prof["host"].get("soft", {}).get("geometry_hash") != here["soft"]["geometry_hash"]:
        return None, "made for another model geometry"
    if any(s.startswith("commit") or s.startswith("versions") for s in soft):
        return None, f"made by other software ({soft[0]})"
    age = time.time() - time.mktime(time.strptime(prof.get("measured_at", "1970-01-01T00:00:00"), "%Y-%m-%dT%H:%M:%S"))
    if age > FRESH_S:
        return None, f"{age / 86400:.0f} days old"
    return prof, "fresh"


def tune(checkpoint, out, wl: Workload, allow_inexact=False, quick=False, storage=None, log=print) -> dict:
    ck = Checkpoint(checkpoint)
    fp = ck.footprint()
    out = Path(out)
    storage_url, storage = storage, open_storage(storage)
    prof, why = _fresh(out, ck)
    if prof is None:
        log(f"profiling this host ({why})")
        prof = run_profile(ck, quick=quick, progress=lambda n: log(f"  probe: {n}"))
        log(probe_time_summary(prof))
    else:
        log(f"reusing the fresh profile {out}")
    kept = (prof.pop("calibration", None) or {}).get("dspark_p_accept")   # the search ranks on the uncalibrated
    if kept is not None:                               # model, with the drafter's acceptance measured here
        prof["calibration"] = {"dspark_p_accept": kept}
    trials = 300 if quick else 2000
    log(f"searching {trials} plans with the cost model")
    study, results = search(prof, fp, wl, n_trials=trials, storage=storage, allow_inexact=allow_inexact)
    if not results:
        raise ValueError("no feasible plan for this host and model")
    top, seen = [], set()
    for plan, _ in results:                            # distinct in the knobs that matter
        key = (plan.moe_strategy, plan.slot_cache_experts, plan.prefill_chunk, plan.prefill_mode, plan.engram_placement,
               plan.dspark and plan.draft_length, plan.cpu_threads)
        if key not in seen:
            seen.add(key)
            top.append(plan)
        if len(top) == (2 if quick else 4):
            break
    base = freetoken_baseline(prof, fp.geometry_hash)
    plans = top + [base]
    prompt = make_prompt(Tokenizer.from_file(str(ck.root / "tokenizer.json")), wl.prompt_tokens, seed=7)
    rounds = 2 if quick else 5
    log(f"validating {len(plans)} plans on the runtime ({rounds} interleaved rounds, plus cold runs)")
    rows = measure_plans(ck, plans, wl, prompt, rounds)
    for r in rows:
        r["predicted"] = predict(r["plan"], prof, fp, wl, allow_inexact).to_dict()
        r["baseline"] = r["plan"] == base
    floor = noise_floor(rows)
    win, runner = pick(rows, wl.ttft_budget_s, floor)
    if runner is not None:                            # the winner against the runner-up, once more
        again = measure_plans(ck, [win["plan"], runner["plan"]], wl, prompt, rounds)
        for r, a in zip((win, runner), again):
            for k in ("decode_samples", "ttft_samples", "term_samples"):
                r[k] += a.get(k, [])
            summarize(r)
        floor = noise_floor(rows)
        win, runner = pick(rows, wl.ttft_budget_s, floor)
    p_accept = dspark_acceptance(rows) or kept
    if p_accept is not None:                          # the drafter's measured acceptance replaces the assumed one
        prof["calibration"] = {"dspark_p_accept": p_accept}
        for r in rows:
            r["predicted"] = predict(r["plan"], prof, fp, wl, allow_inexact).to_dict()
    cal = calibration(rows)
    if p_accept is not None:
        cal["dspark_p_accept"] = p_accept
    prof["calibration"] = cal
    final = predict(win["plan"], prof, fp, wl, allow_inexact)
    prof["plan"] = win["plan"].to_dict()
    prof["predicted"] = final.to_dict()
    prof["validation"] = {
        "workload": {"prompt_tokens": wl.prompt_tokens, "max_tokens": wl.max_tokens, "ttft_budget_s": wl.ttft_budget_s},
        "noise_floor": floor, "study": study.study_name, "storage": storage_url or "journal:$DSV41_CACHE",
        "rows": [_evidence(r, predict(r["plan"], prof, fp, wl, allow_inexact)) for r in rows],
        "picked": rows.index(win),
    }
    prof["checkpoint"] = str(ck.root)
    save_profile(out, prof)
    return prof


def _terms(d: dict) -> dict:
    return {"decode_tok_s": d["decode_tok_s"], "ttft_s": d["ttft_s"], "decode": d["decode"], "prefill": d["prefill"]}


def _evidence(r: dict, calibrated) -> dict:
    """One validated plan as the profile keeps it: predicted raw and calibrated (each term too), measured
    (medians, raw samples, each term's median seconds)."""
    c = calibrated.to_dict()
    return {"plan": r["plan"].to_dict(), "baseline": r["baseline"],
            "predicted": {"decode_tok_s": r["predicted"]["decode_tok_s"], "ttft_s": r["predicted"]["ttft_s"],
                          "feasible": r["predicted"]["feasible"], "raw": _terms(r["predicted"]["raw"]),
                          "calibrated": _terms({**c["raw"], "decode_tok_s": c["decode_tok_s"], "ttft_s": c["ttft_s"],
                                                "decode": {k[7:-2]: v for k, v in c["terms"].items() if k.startswith("decode_") and k.endswith("_s")},
                                                "prefill": {k[8:-2]: v for k, v in c["terms"].items() if k.startswith("prefill_") and k.endswith("_s")}})},
            "measured": {"decode_tok_s": r["decode_tok_s"], "ttft_s": r["ttft_s"], "cold": r["cold"], "interleaved": r["interleaved"],
                         "decode_samples": r["decode_samples"], "ttft_samples": r["ttft_samples"], "terms": r.get("terms", {}),
                         **({"dspark_mean_accepted": r["dspark_mean_accepted"]} if r.get("dspark_mean_accepted") else {})}}


def term_table(prof: dict) -> list[dict]:
    """Predicted (raw, calibrated) vs measured seconds per term, for the picked plan."""
    v = prof["validation"]
    r = v["rows"][v["picked"]]
    out = []
    for part, unit in (("decode", "ms/token"), ("prefill", "ms/prompt")):
        for k, m in r["measured"]["terms"].get(part, {}).items():
            out.append({"term": f"{part} {k}", "unit": unit, "pred raw": 1e3 * r["predicted"]["raw"][part].get(k, 0.0),
                        "pred cal": 1e3 * r["predicted"]["calibrated"][part].get(k, 0.0), "measured": 1e3 * m,
                        "factor": (prof.get("calibration", {}).get("terms", {}).get(f"{part}.{k}") or {}).get("factor")})
    return out


def table(prof: dict) -> list[dict]:
    v = prof["validation"]
    return [{"plan": ("*" if i == v["picked"] else " ") + (" baseline" if r["baseline"] else ""),
             "strategy": r["plan"]["moe_strategy"], "slots": r["plan"]["slot_cache_experts"], "chunk": r["plan"]["prefill_chunk"],
             "engram": r["plan"]["engram_placement"], "threads": r["plan"]["cpu_threads"],
             "pred tok/s": r["predicted"]["decode_tok_s"], "meas tok/s": r["measured"]["decode_tok_s"],
             "pred TTFT": r["predicted"]["ttft_s"], "meas TTFT": r["measured"]["ttft_s"]} for i, r in enumerate(v["rows"])]

