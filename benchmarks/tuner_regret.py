"""The tuner against a measured grid on the mini checkpoint: the cost model's error per term on plans it
was not calibrated on, and the regret of the tuner's pick.

  python benchmarks/tuner_regret.py [--checkpoint out/mini] [--plans 10] [--max-minutes 20] [--json]

1. Profile this host on the checkpoint (quick; the profile the tuner then reuses).
2. Grid: plans drawn from the tuner's own search space (autotune.search.suggest_plan under Optuna's
   RandomSampler), those the cost model admits on this host; each measured on the runtime
   (autotune.validate.measure_plans: cold, then repeats; every term's seconds from the phase table).
3. Fidelity: the grid in two halves; the per-term calibration is fitted on one half and the other half's
   median |predicted - measured| / measured reported raw and calibrated, decode and TTFT.
4. Regret: `dsv41-tune --quick` (same workload, this profile) picks; its pick and the grid's best are
   measured interleaved in one run; regret = (best - pick) / best, two-sided (negative: the pick beat
   the grid), beside the noise floor of those repeats.
The grid stops at --max-minutes less the time the tuner needs (what was measured is used), but not
before MIN_GRID plans (a fitted half and a held-out half); with fewer admitted plans than that, the
fidelity is not reported and says why.
`--refit RESULT.json --profile HOST.json` recomputes step 3 from a saved run's grid with the current
cost model (no new measurement): the loop for improving a term against one measured grid.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import optuna  # noqa: E402

from autotune.costmodel import MissingFigure, predict  # noqa: E402
from autotune.profiler import run_profile  # noqa: E402
from autotune.search import suggest_plan  # noqa: E402
from autotune.tune import tune  # noqa: E402
from autotune.validate import calibration, dspark_acceptance, measure_plans, noise_floor  # noqa: E402
from runtime.checkpoint.reader import Checkpoint  # noqa: E402
from runtime.plan import Plan  # noqa: E402
from runtime.profile import load_profile, save_profile  # noqa: E402
from runtime.workload import Workload, make_prompt  # noqa: E402

MIN_GRID = 2                                     # plans the grid measures whatever the time cap


def grid(profile, fp, wl, n: int, seed: int) -> list[Plan]:
    """n distinct plans the cost model admits, sampled uniformly from the tuner's search space."""
    optuna.logging.set_verbosity(optuna.logging.WARNING)
    study = optuna.create_study(sampler=optuna.samplers.RandomSampler(seed=seed))
    out, seen = [], set()
    for _ in range(50 * n):
        trial = study.ask()
        plan = suggest_plan(trial, profile, fp, wl, None, True)
        study.tell(trial, 0.0)
        key = json.dumps(plan.to_dict(), sort_keys=True)
        try:
            ok = predict(plan, profile, fp, wl, allow_inexact=True).feasible
        except MissingFigure:
            ok = False
        if ok and key not in seen:
            seen.add(key)
            out.append(plan)
        if len(out) == n:
            break
    return out


def errors(rows, profile, fp, wl) -> dict:
    """Median |predicted - measured| / measured over rows, decode tok/s and TTFT."""
    dec, ttft = [], []
    for r in rows:
        p = predict(r["plan"], profile, fp, wl, allow_inexact=True)
        dec.append(abs(p.decode_tok_s - r["decode_tok_s"]) / r["decode_tok_s"])
        ttft.append(abs(p.ttft_s - r["ttft_s"]) / r["ttft_s"])
    return {"decode": statistics.median(dec), "ttft": statistics.median(ttft), "plans": len(rows)}


def fidelity(rows, prof, fp, wl) -> dict | None:
    """Per-term calibration fitted on the even rows, errors on the odd ones, raw and calibrated; None
    with fewer than MIN_GRID rows (no held-out half)."""
    if len(rows) < MIN_GRID:
        return None
    for r in rows:
        r["predicted"] = predict(r["plan"], prof, fp, wl, allow_inexact=True).to_dict()
    fit, held = rows[0::2], rows[1::2]
    p = dspark_acceptance(fit)                     # the drafter's acceptance, as the tuner measures it
    for r in fit if p is not None else []:
        r["predicted"] = predict(r["plan"], {**prof, "calibration": {"dspark_p_accept": p}}, fp, wl, allow_inexact=True).to_dict()
    cal = calibration(fit)
    if p is not None:
        cal["dspark_p_accept"] = p
    return {"raw": errors(held, prof, fp, wl), "calibrated": errors(held, {**prof, "calibration": cal}, fp, wl),
            "fit_raw": errors(fit, prof, fp, wl), "dspark_p_accept": p,
            "factors": {k: round(v["factor"], 3) for k, v in cal["terms"].items()}}


def refit(path, profile, checkpoint) -> dict:
    d = json.loads(Path(path).read_text().strip().splitlines()[-1])
    fp = Checkpoint(checkpoint).footprint()
    wl = Workload(**d.get("workload", {"prompt_tokens": 96, "max_tokens": 8}))
    rows = [{"plan": Plan.from_dict(r["plan"]), "decode_tok_s": r["decode_tok_s"], "ttft_s": r["ttft_s"], "terms": r["terms"],
             **({"dspark_mean_accepted": r["dspark_mean_accepted"]} if r.get("dspark_mean_accepted") else {})} for r in d["grid"]]
    f = fidelity(rows, load_profile(profile), fp, wl)
    if f is None:
        sys.exit(f"{path}: {len(rows)} plan(s) in its grid; a fidelity needs {MIN_GRID}")
    for r in rows:
        p = r["plan"]
        print(f"{p.moe_strategy} chunk {p.prefill_chunk:5d} {p.engram_placement:11s} dspark {p.dspark and p.draft_length} "
              f"-> {r['decode_tok_s']:6.2f} tok/s (pred {r['predicted']['decode_tok_s']:6.2f}), "
              f"TTFT {r['ttft_s']:6.2f} s (pred {r['predicted']['ttft_s']:6.2f})")
    print(json.dumps(f, indent=1))
    return f


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--checkpoint", default="out/mini")
    ap.add_argument("--plans", type=int, default=10)
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--prompt-tokens", type=int, default=128)
    ap.add_argument("--max-tokens", type=int, default=12)
    ap.add_argument("--max-minutes", type=float, default=20)
    ap.add_argument("--tuner-minutes", type=float, default=6, help="reserved for the tuner and the final pair")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--profile", help="reuse this host's quick profile of the checkpoint (else one is made, ~5 min on mini)")
    ap.add_argument("--refit", help="a saved --json run: recompute the fidelity with the current model (needs --profile)")
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args(argv)
    if args.refit:
        return refit(args.refit, args.profile, args.checkpoint)
    t0 = time.time()
    if not (Path(args.checkpoint) / "model.safetensors.index.json").exists():
        subprocess.run([sys.executable, "-m", "runtime.cli.checkpoint", "make", "--preset", "mini", "--out", args.checkpoint], check=True)
    ck = Checkpoint(args.checkpoint)
    fp = ck.footprint()
    wl = Workload(prompt_tokens=args.prompt_tokens, max_tokens=args.max_tokens)
    from tokenizers import Tokenizer
    prompt = make_prompt(Tokenizer.from_file(str(ck.root / "tokenizer.json")), wl.prompt_tokens, seed=7)
    tmp = Path(tempfile.mkdtemp(prefix="dsv41-regret-"))
    prof_path = tmp / "host.json"
    if args.profile:
        prof = load_profile(args.profile)
    else:
        print("profiling this host (quick)", flush=True)
        prof = run_profile(ck, quick=True)
    save_profile(prof_path, prof)
    rows = []
    t_grid_end = t0 + (args.max_minutes - args.tuner_minutes) * 60
    for plan in grid(prof, fp, wl, args.plans, args.seed):
        if time.time() > t_grid_end and len(rows) >= MIN_GRID:
            print(f"time cap: the grid stops after {len(rows)} plans", flush=True)
            break
        r = measure_plans(ck, [plan], wl, prompt, args.repeats)[0]
        r["predicted"] = predict(plan, prof, fp, wl, allow_inexact=True).to_dict()
        rows.append(r)
        p = plan
        print(f"grid {p.moe_strategy} threads {p.cpu_threads} chunk {p.prefill_chunk:5d} {p.prefill_mode:14s} "
              f"engram {p.engram_placement:11s} dspark {'d=' + str(p.draft_length) if p.dspark else 'off':4s} "
              f"experts {'all' if p.host_expert_budget_gib is None else f'{p.host_expert_budget_gib:.1f} GiB'}"
              f" -> {r['decode_tok_s']:6.2f} tok/s (pred {r['predicted']['decode_tok_s']:6.2f}), "
              f"TTFT {r['ttft_s']:6.2f} s (pred {r['predicted']['ttft_s']:6.2f})", flush=True)
    if not rows:
        sys.exit("the cost model admitted no plan of the tuner's space on this host for this workload: nothing to measure")
    fidelity_ = fidelity(rows, prof, fp, wl)
    best = max(rows, key=lambda r: r["decode_tok_s"])
    print("the tuner (dsv41-tune --quick, this profile)", flush=True)
    tuned = tune(ck.root, prof_path, wl, allow_inexact=True, quick=True, storage=f"sqlite:///{tmp}/s.db", log=lambda *a: None)
    pick = Plan.from_dict(tuned["plan"])
    pair = measure_plans(ck, [best["plan"], pick], wl, prompt, max(3, args.repeats))
    best_tok, pick_tok = pair[0]["decode_tok_s"], pair[1]["decode_tok_s"]
    out = {"regret": (best_tok - pick_tok) / best_tok, "noise_floor": noise_floor(pair), "interleaved": pair[0]["interleaved"],
           "grid_best_tok_s": best_tok, "pick_tok_s": pick_tok, "pick": tuned["plan"], "fidelity": fidelity_,
           "workload": {"prompt_tokens": wl.prompt_tokens, "max_tokens": wl.max_tokens},
           "grid": [{"plan": r["plan"].to_dict(), "decode_tok_s": r["decode_tok_s"], "ttft_s": r["ttft_s"],
                     "predicted": {k: r["predicted"][k] for k in ("decode_tok_s", "ttft_s")}, "terms": r["terms"],
                     "decode_samples": r["decode_samples"], "ttft_samples": r["ttft_samples"],
                     **({"dspark_mean_accepted": r["dspark_mean_accepted"]} if r.get("dspark_mean_accepted") else {})}
                    for r in rows],
           "minutes": (time.time() - t0) / 60}
    f = fidelity_
    if f is None:
        print(f"fidelity not reported: {len(rows)} plan(s) measured, it needs {MIN_GRID} (the cost model admitted no more here)")
    else:
        print(f"held-out half ({f['raw']['plans']} plans): median |pred - meas| / meas  decode {100 * f['raw']['decode']:.1f}% raw, "
              f"{100 * f['calibrated']['decode']:.1f}% calibrated; TTFT {100 * f['raw']['ttft']:.1f}% raw, "
              f"{100 * f['calibrated']['ttft']:.1f}% calibrated")
    print(f"grid best {best_tok:.2f} tok/s, tuner's pick {pick_tok:.2f} (measured {'interleaved' if out['interleaved'] else 'in turn'})"
          f" -> regret {100 * out['regret']:+.1f}% (noise floor {100 * out['noise_floor']:.1f}%); {out['minutes']:.1f} min")
    if args.json:
        print(json.dumps(out, default=str))
    return out


if __name__ == "__main__":
    main()
