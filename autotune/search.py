"""Offline plan search: an Optuna study over Plans scored by the cost model.

NSGA-II (Optuna's own sampler, used directly) over the plan knobs, two objectives (maximize decode
tok/s, minimize TTFT) and the budgets as trial constraints (`Trial.set_constraint`, Optuna 5's successor of
`constraints_func`; a value > 0 is a violation),
so infeasible trials never enter the Pareto front. Thousands of cost-model trials take seconds in
memory (NSGA-II; multi-objective TPE was ~65x slower on a toy objective here). Any Optuna storage URL
persists the study, so a rerun resumes and several hosts can share one storage: one study per
host x profile figures x cost-model code x geometry x workload (`study_name`). The pick: the highest tok/s among feasible plans whose
TTFT meets the budget (or all feasible plans when there is none), ties to the lower TTFT.
"""
from __future__ import annotations

import hashlib
import json
import math

import optuna

from autotune.costmodel import OS_HEADROOM, MissingFigure, Prediction, fastest_engine, predict
from autotune.costmodel import objective as score
from runtime.budget import host_bytes
from runtime.checkpoint.footprint import Footprint
from runtime.plan import Plan
from runtime.workload import Workload

CHUNKS = (256, 512, 1024, 2048, 4096, 8192, 16384)
CONTEXTS = (8192, 16384, 32768, 65536, 131072, 262144, 524288, 1048576)


def open_storage(url: str | None):
    """The Optuna storage for `url` (None: default_storage()), opened now: a URL Optuna cannot open is a
    ValueError naming it before any probe or trial runs, not a traceback after them."""
    if url is None:
        return default_storage()
    import optuna
    try:
        return optuna.storages.get_storage(url)
    except Exception as e:                       # sqlalchemy's OperationalError, an unknown scheme, ...
        raise ValueError(f"--storage {url}: Optuna cannot open it ({str(e).splitlines()[0]})") from None


def default_storage():
    """A journal file under $DSV41_CACHE (default ~/.cache/dsv41): studies persist, a rerun resumes."""
    import os
    from pathlib import Path
    from optuna.storages import JournalStorage
    from optuna.storages.journal import JournalFileBackend
    root = Path(os.environ.get("DSV41_CACHE", Path.home() / ".cache" / "dsv41"))
    root.mkdir(parents=True, exist_ok=True)
    return JournalStorage(JournalFileBackend(str(root / "studies.journal")))


def model_version() -> str:
    """A digest of the cost model's code (its modules' source): a changed model never resumes old trials."""
    from pathlib import Path
    here = Path(__file__).parent
    h = hashlib.sha256()
    for name in ("costmodel.py", "terms.py", "figures.py", "routing.py", "search.py"):
        h.update((here / name).read_bytes())
    return h.hexdigest()[:12]


def study_name(profile: dict, fp: Footprint, wl: Workload, vram_budget_gib, allow_inexact) -> str:
    """One study per host x figures x calibration x model code x geometry x workload x budgets: a new
    profile of the same host, a new calibration or a changed cost model starts a fresh study."""
    key = json.dumps([profile["host"]["hard"], profile["measurements"], profile.get("calibration"), model_version(),
                      fp.geometry_hash, wl.prompt_tokens, wl.max_tokens, wl.ttft_budget_s, vram_budget_gib, allow_inexact]
                     + ([wl.concurrency, wl.itl_budget_s] if wl.concurrency > 1 or wl.itl_budget_s else []),
                     sort_keys=True, default=str)
    return f"dsv41-{profile['host'].get('name', 'host')}-{fp.model}-{hashlib.sha256(key.encode()).hexdigest()[:10]}"


def cpu_moe_streams(profile: dict) -> int:
    """The CPU-MoE row layout the profiler measured faster on this host (the Plan's default when the
    profile predates the probe or skipped it)."""
    return int((profile["measurements"].get("cpu_moe_streams") or {}).get("best", Plan.cpu_moe_streams))


def cpu_moe_inputs(profile: dict) -> int:
    """The most inputs per CPU-MoE row decode the profiler measured faster on this host (the Plan's default
    when the profile predates the probe or skipped it; 4 rows apart always decode for 4)."""
    if cpu_moe_streams(profile) != 1:
        return Plan.cpu_moe_inputs
    return int((profile["measurements"].get("cpu_moe_inputs") or {}).get("best", Plan.cpu_moe_inputs))


def cpu_moe_fetch(profile: dict) -> str:
    """How one input's CPU-MoE calls fetch their weights, as the profiler measured faster on this host (the
    Plan's default when the profile predates the probe, or the host's path fetches one way)."""
    return str((profile["measurements"].get("cpu_moe_fetch") or {}).get("best", Plan.cpu_moe_fetch))


def suggest_plan(trial: optuna.Trial, profile: dict, fp: Footprint, wl: Workload, vram_budget_gib, allow_inexact) -> Plan:
    gpu = bool(profile["host"]["hard"].get("gpu_name"))
    cores = int(profile["host"]["hard"]["physical_cores"])
    need = wl.prompt_tokens + wl.max_tokens
    contexts = [c for c in CONTEXTS if c >= need] or [need]
    routed = fp.routed_expert_bytes_total
    kw = dict(
        moe_strategy=trial.suggest_categorical("moe_strategy", ["cpu", "offload", "hybrid"] if gpu else ["cpu"]),
        fetch_fraction=trial.suggest_float("fetch_fraction", 0.0, 1.0, step=0.05),
        slot_cache_experts=trial.suggest_int("slot_cache_experts", 0, 4000 if gpu else 0, step=25 if gpu else 1),
        # 0 = every core; the rest leave cores to the OS / I/O threads or halve the CPU-MoE share
        cpu_threads=trial.suggest_categorical("cpu_threads_choice", sorted({0, max(1, cores - 2), max(1, cores // 2), 1})),
        cpu_moe_streams=cpu_moe_streams(profile),          # a measured fact of the host, not a search dimension
        cpu_moe_inputs=cpu_moe_inputs(profile),            # likewise
        cpu_moe_fetch=cpu_moe_fetch(profile),              # likewise
        # a share of the room this plan leaves in RAM for experts (below); >= 1: all of it
        host_expert_budget_gib=trial.suggest_float("host_expert_share", 0.0, 1.25),
        prefill_chunk=trial.suggest_categorical("prefill_chunk", list(CHUNKS)),
        prefill_mode=trial.suggest_categorical("prefill_mode", ["full", "bounded_replay"] if allow_inexact else ["full"]),
        prefill_moe_path=trial.suggest_categorical("prefill_moe_path", ["cpu", "device"] if gpu else ["cpu"]),
        max_context=trial.suggest_categorical("max_context", contexts),
        vram_budget_gib=vram_budget_gib,
        engram_placement=trial.suggest_categorical("engram_placement", ["host", "nvme_direct", "nvme_mmap"] if fp.engram_rows_total else ["host"]),
        engram_io_depth=trial.suggest_categorical("engram_io_depth", [1, 2, 4, 8, 16, 32, 64]),
        engram_row_cache_mib=trial.suggest_categorical("engram_row_cache_mib", [0, 256, 1024, 4096]),
        engram_scales_in_ram=trial.suggest_categorical("engram_scales_in_ram", [True, False]),
        dspark=trial.suggest_categorical("dspark", [False, True] if fp.dspark_num_layers else [False]),
        draft_length=trial.suggest_int("draft_length", 1, 5),
        geometry_hash=fp.geometry_hash,
    )
    if kw["engram_placement"] == "nvme_direct":   # the reader's engine: a measured fact of the host at this depth
        kw["engram_io_engine"] = fastest_engine(profile, kw["engram_io_depth"])
    if wl.concurrency > 1:                     # continuous batching: streams per step and the step's tokens
        kw["max_num_seqs"] = trial.suggest_categorical("max_num_seqs", [1, 2, 4, 8, 16, 32])
        kw["max_batched_tokens"] = trial.suggest_categorical("max_batched_tokens", [0, 256, 1024, 4096])
    if kw["prefill_moe_path"] == "device":     # its staging buffer, in whole experts (MiB rounded up)
        n = trial.suggest_categorical("prefill_buffer_experts", [1, 4, 16, 64])
        kw["prefill_buffer_mib"] = -(-n * fp.expert_bytes // (1 << 20))
    # experts kept in RAM never exceed what the host's RAM leaves after the OS headroom and everything
    # else this plan holds there (runtime/budget.py): sampling past it only finds infeasible plans (24 GiB
    # host, V4.1: 99% of 0-246 GiB); all resident (None) when the room holds them and the share is >= 1
    share = kw["host_expert_budget_gib"]
    ram = float(profile["host"]["hard"].get("ram_gib") or 0) * 2**30 or float(routed) + OS_HEADROOM
    others = host_bytes(Plan(**{**kw, "host_expert_budget_gib": 0.0}), fp, dense_on_host=not gpu)
    room = max(0.0, min(float(routed), ram - OS_HEADROOM - others))
    kw["host_expert_budget_gib"] = None if share >= 1 and room >= routed else min(share, 1.0) * room / 2**30
    return Plan(**kw)


def _penalties(pred: Prediction) -> list[float]:
    return [0.0] if pred.feasible else [1.0 + len(pred.why)]


def search(profile: dict, fp: Footprint, wl: Workload, n_trials: int = 2000, storage=None, seed: int = 0,
           vram_budget_gib=None, allow_inexact: bool = False, progress=None):
    """-> (study, results): results = [(plan, prediction)] for every feasible trial, best first."""
    optuna.logging.set_verbosity(optuna.logging.WARNING)
    name = study_name(profile, fp, wl, vram_budget_gib, allow_inexact)
    # The search runs in memory (a file-backed study pays a write per trial: ~5x slower here); the
    # persistent study's trials seed it (resume) and new trials are added to it every PERSIST_EVERY.
    kept = None
    if storage is not None:
        kept = optuna.create_study(study_name=name, storage=storage, directions=["maximize", "minimize"], load_if_exists=True)
    study = optuna.create_study(study_name=name, sampler=optuna.samplers.NSGAIISampler(seed=seed),
                                directions=["maximize", "minimize"])
    if kept is not None:
        study.add_trials(kept.get_trials(deepcopy=False, states=(optuna.trial.TrialState.COMPLETE,)))
    done = len(study.trials)

    def objective(trial):
        plan = suggest_plan(trial, profile, fp, wl, vram_budget_gib, allow_inexact)
        trial.set_user_attr("plan", plan.to_dict())
        try:
            pred = predict(plan, profile, fp, wl, allow_inexact=allow_inexact)
        except MissingFigure as e:                 # e.g. a GPU strategy on a profile without gather figures
            trial.set_constraint("budgets", 1.0)
            trial.set_user_attr("constraints", [1.0])
            trial.set_user_attr("why", [str(e)])
            return 0.0, math.inf
        trial.set_constraint("budgets", _penalties(pred)[0])    # > 0: infeasible (budgets, host limits)
        trial.set_user_attr("constraints", _penalties(pred))
        if not pred.feasible:
            trial.set_user_attr("why", [w.split(" (")[0] for w in pred.why])
        if progress:
            progress(trial.number - done + 1, n_trials)
        return score(pred), pred.ttft_s

    saved = done
    try:                      # chunks: a SIGKILL loses at most one chunk; Ctrl-C (KeyboardInterrupt) none
        while len(study.trials) < n_trials:
            study.optimize(objective, n_trials=min(PERSIST_EVERY, n_trials - len(study.trials)))
            saved = _persist(study, kept, saved)
    finally:
        _persist(study, kept, saved)
    return study, ranked(study, profile, fp, wl, allow_inexact)


PERSIST_EVERY = 200


def _persist(study, kept, saved: int) -> int:
    """Copy the in-memory study's finished trials past `saved` into the persistent one. -> new mark."""
    done = [t for t in study.trials[saved:] if t.state == optuna.trial.TrialState.COMPLETE]
    if kept is not None and done:
        kept.add_trials(done)
    return len(study.trials)


def ranked(study, profile, fp, wl, allow_inexact=False):
    """Feasible plans, best first by the user's rule (TTFT budget, then tok/s, then TTFT)."""
    seen, out = set(), []
    for t in study.trials:
        if t.state != optuna.trial.TrialState.COMPLETE or t.user_attrs.get("constraints", [1])[0] > 0:
            continue
        key = json.dumps(t.user_attrs["plan"], sort_keys=True)
        if key in seen:
            continue
        seen.add(key)
        plan = Plan.from_dict(t.user_attrs["plan"])
        out.append((plan, predict(plan, profile, fp, wl, allow_inexact=allow_inexact)))
    budget = wl.ttft_budget_s
    within = [r for r in out if budget is None or r[1].ttft_s <= budget]
    pool = within or out
    pool.sort(key=lambda r: (-score(r[1]), r[1].ttft_s))
    rest = [r for r in out if r not in pool]
    rest.sort(key=lambda r: (-score(r[1]), r[1].ttft_s))
    return pool + rest


def runner_up(results):
    """The best plan that differs from the pick in a knob that matters (not only in unused ones)."""
    def key(p):
        return (p.moe_strategy, p.slot_cache_experts, p.prefill_chunk, p.prefill_mode, p.engram_placement,
                p.dspark and p.draft_length, p.host_expert_budget_gib is None)
    for r in results[1:]:
        if key(r[0]) != key(results[0][0]):
            return r
    return results[1] if len(results) > 1 else None


def pareto(results):
    """The tok/s-vs-TTFT Pareto front of (plan, prediction) pairs."""
    front = []
    for p, r in sorted(results, key=lambda x: (x[1].ttft_s, -x[1].decode_tok_s)):
        if not front or r.decode_tok_s > front[-1][1].decode_tok_s:
            front.append((p, r))
    return front


def why_none(study) -> str:
    """Why a search found no feasible plan: the budgets sampled plans broke most often."""
    from collections import Counter
    reasons = Counter(w for t in study.trials for w in t.user_attrs.get("why", []))
    top = "; ".join(f"{w} ({n} plans)" for w, n in reasons.most_common(2))
    return f"every sampled plan broke a budget: {top}"
