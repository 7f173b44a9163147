"""`dsv41-tune`: profile a host, plan for it, and tune end to end.

  dsv41-tune --checkpoint DIR [--prompt-tokens P --ttft-budget S] [--allow-inexact-prefill] [--out FILE] [--quick]

  dsv41-tune profile --checkpoint DIR [--out FILE] [--quick]

  dsv41-tune export --profile P --to sglang|vllm|llama.cpp [--config PRESET|config.json] [--model-path M]

  dsv41-tune plan --profile HOST.json (--checkpoint DIR | --config CONFIG.json|PRESET)
                  [--prompt-tokens P] [--max-tokens M] [--ttft-budget S] [--vram-budget GIB]
                  [--allow-inexact-prefill] [--plan PLAN.json] [--trials N] [--storage URL] [--json]

Searches plans offline with the cost model (or predicts one given plan with --plan) and prints the
pick, the runner-up, the Pareto size and the memory table; figures whose source is `assumed` are
flagged. --json prints one object: {plan, predicted, runner_up, assumed, study}.
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import sys

from runtime.cli.common import console, fmt_bytes, run_main
from runtime.plan import Plan
from runtime.config import EXPERT_FORMATS
from runtime.workload import Workload

WL = {f.name: f.default for f in dataclasses.fields(Workload)}
GIB = 1 << 30


def _footprint(args):
    from runtime.checkpoint.footprint import Footprint
    from runtime.checkpoint.reader import Checkpoint
    from runtime.config import load_config
    if args.checkpoint:
        if getattr(args, "expert_dtype", None):
            raise ValueError("--expert-dtype goes with --config (a checkpoint's format is in its config.json)")
        return Checkpoint(args.checkpoint).footprint()
    cfg = load_config(args.config)
    if getattr(args, "expert_dtype", None):
        cfg = cfg.replace(expert_dtype=args.expert_dtype)
    return Footprint.from_config(cfg)


def _pred_json(pred) -> dict:
    d = pred.to_dict()
    d["memory_gib"] = {k: round(v / GIB, 3) for k, v in d.pop("memory").items()}
    return d


def cmd_plan(args) -> int:
    from autotune.costmodel import predict
    from runtime.profile import assumed_keys, load_profile
    from autotune.search import pareto, runner_up, search, why_none
    profile = load_profile(args.profile)
    fp = _footprint(args)
    wl = Workload(prompt_tokens=args.prompt_tokens, max_tokens=args.max_tokens, ttft_budget_s=args.ttft_budget,
                  concurrency=args.concurrency, itl_budget_s=args.itl_budget)
    assumed = assumed_keys(profile)
    if args.plan:
        plan = Plan.load(args.plan)
        if plan.geometry_hash and plan.geometry_hash != fp.geometry_hash:
            raise ValueError(f"{args.plan}: the plan was made for geometry {plan.geometry_hash}, this model is {fp.geometry_hash}")
        if args.vram_budget is not None:
            plan = plan.replace(vram_budget_gib=args.vram_budget)
        results, study = [(plan, predict(plan, profile, fp, wl, args.allow_inexact_prefill))], None
    else:
        from autotune.search import open_storage
        study, results = search(profile, fp, wl, n_trials=args.trials, storage=open_storage(args.storage),
                                vram_budget_gib=args.vram_budget, allow_inexact=args.allow_inexact_prefill)
        if not results:
            raise ValueError(f"no feasible plan for {fp.model} on {profile['host'].get('name')}: "
                             f"{why_none(study)}")
    pick, pred = results[0]
    runner = runner_up(results)
    if args.json:
        print(json.dumps({"plan": pick.to_dict(), "predicted": _pred_json(pred),
                          "runner_up": None if runner is None else {"plan": runner[0].to_dict(), "predicted": _pred_json(runner[1])},
                          "assumed": assumed, "study": None if study is None else study.study_name}))
        return 0 if pred.feasible else 3
    _print(profile, fp, wl, pick, pred, runner, assumed, study, pareto(results))
    return 0 if pred.feasible else 3


def _print(profile, fp, wl, pick, pred, runner, assumed, study, front):
    from rich.table import Table
    c = console()
    host = profile["host"].get("name", "host")
    c.print(f"[bold]{fp.model}[/] on [bold]{host}[/]: prompt {wl.prompt_tokens} tokens, {wl.max_tokens} out"
            + (f", TTFT budget {wl.ttft_budget_s} s" if wl.ttft_budget_s else "")
            + (f", {wl.concurrency} streams" if wl.concurrency > 1 else "")
            + (f", ITL budget {wl.itl_budget_s} s" if wl.itl_budget_s else ""))
    t = Table(title="plans")
    for col in ("", "decode tok/s", "TTFT s", "feasible", "strategy", "slots", "chunk", "mode", "engram", "dspark", "host experts"):
        t.add_column(col)
    for label, (p, r) in (("pick", (pick, pred)),) + ((("runner-up", runner),) if runner else ()):
        t.add_row(label, f"{r.decode_tok_s:.2f}", f"{r.ttft_s:.1f}", "yes" if r.feasible else "NO",
                  p.moe_strategy + (f" f={p.fetch_fraction:.2f}" if p.moe_strategy == "hybrid" else ""),
                  str(p.slot_cache_experts), str(p.prefill_chunk), p.prefill_mode,
                  f"{p.engram_placement} qd{p.engram_io_depth}", f"d={p.draft_length}" if p.dspark else "off",
                  "all" if p.host_expert_budget_gib is None else f"{p.host_expert_budget_gib:.0f} GiB")
    c.print(t)
    if "aggregate_tok_s" in pred.terms:
        c.print(f"pick: {pred.terms['concurrency']} streams per step (max_num_seqs {pick.max_num_seqs}, "
                f"max_batched_tokens {pick.max_batched_tokens or pick.prefill_chunk}): aggregate "
                f"{pred.terms['aggregate_tok_s']:.2f} tok/s, inter-token latency {pred.terms['itl_s']:.3f} s per stream")
    tt = Table(title="cost model terms (pick): seconds per phase of the runtime")
    for col in ("term", "decode ms/token", "prefill ms", "source"):
        tt.add_column(col)
    from rich.markup import escape

    from autotune.costmodel import TERMS
    for k in TERMS:
        tt.add_row(k, f"{1e3 * pred.terms[f'decode_{k}_s']:.3f}", f"{1e3 * pred.terms[f'prefill_{k}_s']:.1f}",
                   escape(pred.sources.get(k, "-")))
    tt.add_row("routing", "", "", escape(pred.sources.get("routing", "-")))
    c.print(tt)
    m = Table(title="memory (pick)")
    m.add_column("tier"), m.add_column("bytes", justify="right")
    for k, v in pred.memory.items():
        m.add_row(k, fmt_bytes(v) + f" ({v / GIB:.2f} GiB)")
    c.print(m)
    for w in pred.why:
        c.print(f"[red]infeasible:[/] {escape(w)}")
    for n in pred.notes:
        c.print(f"[yellow]note:[/] {escape(n)}")
    if assumed:
        c.print(f"[yellow]assumed figures in this profile:[/] {', '.join(assumed)}")
    if study is not None:
        c.print(f"study {study.study_name}: {len(study.trials)} trials, Pareto front {len(front)} plans")


def cmd_profile(args) -> int:
    import platform

    from rich.progress import Progress, SpinnerColumn, TextColumn, TimeElapsedColumn
    from rich.table import Table

    from runtime.profile import save_profile
    from autotune.profiler import probe_time_summary, run_profile, summary_rows
    out = args.out or f"profiles/local/{platform.node() or 'host'}.json"
    with Progress(SpinnerColumn(), TextColumn("[bold]{task.description}"), TimeElapsedColumn(),
                  console=console(stderr=True), transient=True) as bar:
        task = bar.add_task("profiling", total=None)
        prof = run_profile(args.checkpoint, quick=args.quick, progress=lambda name: bar.update(task, description=name))
    save_profile(out, prof)
    c = console()
    t = Table(title=f"dsv41 profile: {prof['host']['name']} ({'quick' if args.quick else 'full'})")
    t.add_column("path"), t.add_column("measured: median, min-max")
    for name, fig in summary_rows(prof):
        t.add_row(name, fig)
    c.print(t)
    nv = Table(title="NVMe random 4 KiB, O_DIRECT, the runtime's batched reader")
    for col in ("QD", "IOPS", "p50 us", "p95 us", "engine", "IOPS per engine (interleaved)", "I/O path"):
        nv.add_column(col, justify="right")
    for e in prof["measurements"]["nvme_randread_4k"]:
        each = "  ".join(f"{k} {v['iops']:,.0f}" for k, v in e.get("engines", {}).items())
        nv.add_row(str(e["qd"]), f"{e['iops']:,.0f}", f"{e['p50_us']:.0f}", f"{e['p95_us']:.0f}", e.get("engine", "auto"), each,
                   e["io_path"] + (f" ({e['fallback']})" if e.get("fallback") else ""))
    c.print(nv)
    for e in prof["measurements"]["nvme_engram_pattern"]:
        c.print(f"Engram pattern, 48 rows/token: serial {e['serial_ms_per_token']:.2f} ms, batched at QD{e['qd']} {e['batched_ms_per_token']:.2f} ms")
    c.print(probe_time_summary(prof))
    c.print(f"wrote {out}")
    return 0


def cmd_export(args) -> int:
    from autotune.export import export, render
    from runtime.profile import load_profile
    from runtime.checkpoint.footprint import Footprint
    from runtime.config import load_config
    prof = load_profile(args.profile)
    if not prof.get("plan"):
        raise ValueError(f"{args.profile}: holds no plan to export; run dsv41-tune first")
    plan = Plan.from_dict(prof["plan"], f"{args.profile} (plan)")
    cfg = load_config(args.config)
    fp = Footprint.from_config(cfg)
    if plan.geometry_hash and plan.geometry_hash != fp.geometry_hash:
        raise ValueError(f"{args.profile}: the plan was made for model geometry {plan.geometry_hash}, {args.config} is "
                         f"{fp.geometry_hash}; give the config it was made for with --config")
    words, env, notes = export(plan, cfg, args.to, args.model_path, fp.expert_bytes, prof["host"]["hard"].get("gpu_vram_gib"))
    print(render(words, env, notes, f"{args.to} launch line for {cfg.name} from {args.profile}'s plan "
                                    f"(host {prof['host'].get('name')}); re-measure there with dsv41-bench --url"))
    return 0


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="dsv41-tune", description="plan, profile and tune dsv41 for this host")
    sub = p.add_subparsers(dest="cmd", required=True)
    pl = sub.add_parser("plan", help="search plans offline with the cost model")
    pl.add_argument("--profile", required=True, help="host profile JSON")
    src = pl.add_mutually_exclusive_group(required=True)
    src.add_argument("--checkpoint", help="checkpoint directory (footprint from its headers)")
    src.add_argument("--config", help="config.json or preset name (footprint from the layout)")
    pl.add_argument("--expert-dtype", choices=sorted(EXPERT_FORMATS),
                    help="with --config: the experts' format of the download (" +
                         "; ".join(f"{k}: {v}" for k, v in EXPERT_FORMATS.items()) + ")")
    pl.add_argument("--prompt-tokens", type=int, default=WL["prompt_tokens"])
    pl.add_argument("--max-tokens", type=int, default=WL["max_tokens"])
    pl.add_argument("--ttft-budget", type=float, default=WL["ttft_budget_s"], help="seconds")
    pl.add_argument("--concurrency", type=int, default=WL["concurrency"], help="streams at once (continuous batching)")
    pl.add_argument("--itl-budget", type=float, default=WL["itl_budget_s"], help="seconds between a stream's tokens")
    pl.add_argument("--vram-budget", type=float, default=Plan.vram_budget_gib, help="GiB: plan for a smaller card")
    pl.add_argument("--allow-inexact-prefill", action="store_true", help="let the search choose bounded_replay")
    pl.add_argument("--plan", help="predict this plan (plan or profile file) instead of searching")
    pl.add_argument("--trials", type=int, default=2000)
    pl.add_argument("--storage", default=None,
                    help="Optuna storage URL to share studies across hosts (default: a journal file under $DSV41_CACHE)")
    pl.add_argument("--json", action="store_true")
    pl.set_defaults(fn=cmd_plan)
    pr = sub.add_parser("profile", help="measure this host (a trustworthy ft bench bw) into a profile")
    pr.add_argument("--checkpoint", required=True, help="checkpoint directory (its geometry and Engram file are probed)")
    pr.add_argument("--out", help="profile file (default: profiles/local/<host>.json)")
    pr.add_argument("--quick", action="store_true", help="short probes (CI, demos): under a minute")
    pr.set_defaults(fn=cmd_profile)
    ex = sub.add_parser("export", help="print another engine's launch line for a profile's plan")
    ex.add_argument("--profile", required=True, help="a profile holding a plan")
    ex.add_argument("--to", required=True, choices=("sglang", "vllm", "llama.cpp"))
    ex.add_argument("--config", default="deepseek-v4.1-flash", help="the model the plan was made for (preset or config.json)")
    ex.add_argument("--model-path", help="model path/id for that engine (default: the HF id, or the branch's GGUF)")
    ex.set_defaults(fn=cmd_export)
    return p


def cmd_tune(args) -> int:
    import platform

    from rich.table import Table

    from autotune.tune import table, term_table, tune
    out = args.out or f"profiles/local/{platform.node() or 'host'}.json"
    wl = Workload(prompt_tokens=args.prompt_tokens, max_tokens=args.max_tokens, ttft_budget_s=args.ttft_budget,
                  concurrency=args.concurrency, itl_budget_s=args.itl_budget)
    err = console(stderr=True)
    prof = tune(args.checkpoint, out, wl, args.allow_inexact_prefill, args.quick, args.storage, log=err.print)
    rows = table(prof)
    t = Table(title=f"validated plans (noise floor {100 * prof['validation']['noise_floor']:.1f}%): * = picked")
    for col in rows[0]:
        t.add_column(col, justify="right")
    for r in rows:
        t.add_row(*(f"{v:.3g}" if isinstance(v, float) else str(v) for v in r.values()))
    c = console()
    c.print(t)
    terms = term_table(prof)
    if terms:
        t = Table(title="the picked plan, term by term: predicted (raw, calibrated) vs measured; factor = measured / "
                        "predicted over the validated plans")
        for col in terms[0]:
            t.add_column(col, justify="right")
        for r in terms:
            t.add_row(*("-" if v is None else f"{v:.3g}" if isinstance(v, float) else str(v) for v in r.values()))
        c.print(t)
    c.print(f"wrote {out}")
    return 0


def build_tune_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="dsv41-tune", description="profile this host, search plans, validate the best on "
                                "the runtime, write the profile (subcommands: plan, profile)")
    p.add_argument("--checkpoint", required=True)
    p.add_argument("--prompt-tokens", type=int, default=WL["prompt_tokens"])
    p.add_argument("--max-tokens", type=int, default=WL["max_tokens"])
    p.add_argument("--ttft-budget", type=float, default=WL["ttft_budget_s"])
    p.add_argument("--concurrency", type=int, default=WL["concurrency"], help="streams at once (continuous batching)")
    p.add_argument("--itl-budget", type=float, default=WL["itl_budget_s"], help="seconds between a stream's tokens")
    p.add_argument("--allow-inexact-prefill", action="store_true")
    p.add_argument("--out", help="profile file (default: profiles/local/<host>.json)")
    p.add_argument("--storage", default=None, help="Optuna storage URL (default: a journal under $DSV41_CACHE)")
    p.add_argument("--quick", action="store_true", help="short probes, few validation runs")
    p.set_defaults(fn=cmd_tune)
    return p


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv and argv[0] in ("plan", "profile", "export"):
        return run_main(build_parser(), argv)
    return run_main(build_tune_parser(), argv)


if __name__ == "__main__":
    sys.exit(main())
