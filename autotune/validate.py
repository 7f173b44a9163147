"""Validation: the top plans and the baseline run on the real runtime; only measurement decides.

Plans are measured in interleaved rounds (A, B, C, A, B, C, ...) so drift hits all alike, when their
engines fit in RAM together (else one after the other, recorded as such); each plan's first request
after its load is its cold run, the rest warm. The noise floor is the spread of one
plan's own repeats (half the max-min range over the median of decode tok/s, the largest over plans).
The pick: the best measured plan by the user's rule (TTFT budget, then decode tok/s); the winner is
re-run against the runner-up and a plan that loses beyond the noise floor is not picked. Every run's
phase table gives each cost-model term its measured seconds (autotune/terms.py measured_terms); the
calibration is one factor per term (measured / predicted, median over the plans, with its spread),
kept in the profile, so a wrong term moves only its own share of a prediction.
"""
from __future__ import annotations

import statistics

from autotune.terms import measured_terms, p_from_accepted
from runtime.engine import Engine
from runtime.plan import Plan
from runtime.workload import Workload


def freetoken_baseline(profile: dict, geometry_hash: str) -> Plan:
    """FreeToken's rule: hybrid when CPU-MoE beats 2x the PCIe gather, else offload; CPU-only hosts: cpu.
    Its other knobs are its defaults (prefill chunk 512, Engram in RAM, no speculation)."""
    from runtime.profile import figure
    if not profile["host"]["hard"].get("gpu_name"):
        strategy = "cpu"
    else:
        cpu = max(e["median"] for e in profile["measurements"]["cpu_moe_gbs"] if "median" in e)
        gather = figure(profile, "pcie_gather_gbs") or 0.0
        strategy = "hybrid" if cpu > 2 * gather else "offload"
    return Plan(moe_strategy=strategy, geometry_hash=geometry_hash)


def _objective(row, ttft_budget):
    ok = ttft_budget is None or row["ttft_s"] <= ttft_budget
    return (ok, row["decode_tok_s"], -row["ttft_s"])


def fit_together(ck, plans) -> bool:
    """Can every plan's engine stay loaded at once? Each holds what runtime.budget.host_bytes counts
    (dense as the CPU runtime holds it included) and, with an NVMe tier, transient buffers for one
    layer's experts read twice over; all within half of the available RAM."""
    from hostinfo import ram_available_bytes
    from runtime.budget import host_bytes
    fp = ck.footprint()
    layer = fp.routed_expert_bytes_total // max(fp.num_layers, 1)
    need = sum(host_bytes(p, fp, dense_on_host=True) + (2 * layer if p.host_expert_budget_gib is not None else 0) for p in plans)
    return need < 0.5 * ram_available_bytes()


def measure_plans(ck, plans: list[Plan], wl: Workload, prompt: list[int], rounds: int, progress=None) -> list[dict]:
    """-> one row per plan: cold figures, warm samples (decode tok/s, TTFT), medians, and whether the
    rounds were interleaved (all engines loaded at once) or sequential (they do not fit together)."""
    interleave = fit_together(ck, plans)
    engines, rows = [], []

    def load(p):
        e = Engine(ck, p)
        cold = e.generate(prompt, wl.max_tokens)
        rows.append({"plan": p, "cold": {"ttft_s": cold.ttft_s, "decode_tok_s": cold.decode_tok_s},
                     "decode_samples": [], "ttft_samples": [], "tokens": cold.tokens, "interleaved": interleave})
        return e

    def run(e, row):
        out = e.generate(prompt, wl.max_tokens)
        row["decode_samples"].append(out.decode_tok_s)
        row["ttft_samples"].append(out.ttft_s)
        row.setdefault("term_samples", []).append(run_terms(out))
        if out.dspark:
            row.setdefault("dspark_mean_accepted", []).append(out.dspark["mean_accepted"])
        if progress:
            progress()
    try:
        if interleave:
            engines = [load(p) for p in plans]
            for _ in range(rounds):
                for e, row in zip(engines, rows):
                    run(e, row)
        else:
            for p in plans:
                e = load(p)
                try:
                    for _ in range(rounds):
                        run(e, rows[-1])
                finally:
                    e.close()
    finally:
        for e in engines:
            e.close()
    for row in rows:
        summarize(row)
    return rows


def run_terms(out) -> dict:
    """One request's measured seconds per cost-model term: decode per generated token, prefill per prompt."""
    n = len(out.tokens) - 1
    dec = measured_terms(out.phases, n / out.decode_tok_s if out.decode_tok_s else 0.0, max(n, 1))
    return {"decode": dec, "prefill": measured_terms(out.prefill_phases, out.ttft_s, 1)}


def summarize(row) -> None:
    """Medians of a row's samples: decode tok/s, TTFT and every term."""
    row["decode_tok_s"] = statistics.median(row["decode_samples"])
    row["ttft_s"] = statistics.median(row["ttft_samples"])
    ts = row.get("term_samples") or []
    row["terms"] = {part: {k: statistics.median(s[part][k] for s in ts) for k in ts[0][part]}
                    for part in ("decode", "prefill")} if ts else {}


def noise_floor(rows) -> float:
    """The largest relative half-range of decode tok/s over any plan's own repeats."""
    out = 0.0
    for r in rows:
        s = r["decode_samples"]
        if len(s) > 1 and statistics.median(s) > 0:
            out = max(out, (max(s) - min(s)) / 2 / statistics.median(s))
    return out


def pick(rows, ttft_budget, floor):
    """By the rule (TTFT budget first, then decode tok/s). Plans whose measured decode is within the
    noise floor of the best are a tie, settled by the lower TTFT; a plan that loses beyond the floor
    is never the pick; nor is a plan the model's memory accounting refuses on this host (a baseline
    that keeps every expert in RAM the host does not have). -> (winner row, runner-up row or None)."""
    fits = [r for r in rows if r.get("predicted", {}).get("feasible", True)]
    ranked = sorted(fits or rows, key=lambda r: _objective(r, ttft_budget), reverse=True)
    lead = ranked[0]
    ties = [r for r in ranked if _objective(r, ttft_budget)[0] == _objective(lead, ttft_budget)[0]
            and r["decode_tok_s"] >= lead["decode_tok_s"] * (1 - floor)]
    win = min(ties, key=lambda r: r["ttft_s"])
    rest = [r for r in ranked if r is not win]
    return win, (rest[0] if rest else None)


def dspark_acceptance(rows) -> float | None:
    """The per-token acceptance p the cost model's geometric law needs, from the validated DSpark plans:
    mean accepted drafts per step a = p + p^2 + ... + p^d, solved for p, median over plans. None when
    no DSpark plan was validated."""
    ps = [p_from_accepted(statistics.median(r["dspark_mean_accepted"]), r["plan"].draft_length)
          for r in rows if r.get("dspark_mean_accepted")]
    return statistics.median(ps) if ps else None


def calibration(rows) -> dict:
    """One factor per cost-model term: measured / predicted seconds (median over the validated plans
    whose prediction of that term is not zero), with its spread; terms predicted as zero everywhere get
    no factor (the measured time stays unexplained: see `unexplained_s`)."""
    out, unexplained = {}, {}
    for part in ("decode", "prefill"):
        keys = {k for r in rows for k in r.get("terms", {}).get(part, {})}
        for k in sorted(keys):
            ratios = [r["terms"][part][k] / r["predicted"]["raw"][part][k] for r in rows
                      if r.get("terms") and r["predicted"]["raw"][part].get(k, 0) > 1e-12]
            if ratios:
                out[f"{part}.{k}"] = {"factor": statistics.median(ratios), "min": min(ratios), "max": max(ratios), "plans": len(ratios)}
            else:
                unexplained[f"{part}.{k}"] = statistics.median(r["terms"][part][k] for r in rows if r.get("terms"))
    return {"terms": out, "unexplained_s": unexplained, "plans": len(rows)}
