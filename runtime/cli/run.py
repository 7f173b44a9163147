"""`dsv41-run`: one request through the runtime under a plan, cold then warm.

  dsv41-run --checkpoint DIR --plan PLAN.json|PROFILE.json --prompt-tokens N --max-tokens M
            [--prompt-seed S] [--temperature T] [--no-cold] [--json]

The prompt comes from the workload generator (natural text through the checkpoint's tokenizer).
Cold: the checkpoint's files are evicted from the page cache (posix_fadvise DONTNEED, checked with
mincore) before the engine loads; warm: the same request again on the loaded engine. Refusals (a
prompt past the plan's context, a plan over its budgets) happen before anything is loaded.
Memory: the kernels are warmed first (compiled, thread pools started); then what loading and the
requests add is measured (runtime/memwatch.py) beside what the plan counts (runtime/budget.py):
anonymous RSS, file-backed RSS (the mapped checkpoint) and, on a GPU, device memory.
--json prints one object: ttft_s, decode_tok_s, tokens (warm), phases, plan, cold, warm, load_s,
memory {planned: {anon, file, device}, measured: {anon_added, file_added, ..., device_peak},
compiled_after_warm_up: [kernels the warm-up missed: their compiler's memory is in measured]}.
"""
from __future__ import annotations

import argparse
import json
import sys
import time

from runtime.cli.common import console, run_main
from runtime.plan import Plan
from runtime.workload import Workload

WL = {"prompt_tokens": Workload.prompt_tokens, "max_tokens": Workload.max_tokens}


def _measured(watch, engine, root) -> dict | None:
    """Bytes the load and the requests added: anonymous and file-backed RSS (sampled peaks above the
    start), the checkpoint mapping's resident pages and, on a GPU, the device's peak allocation."""
    from runtime.memwatch import mapped_rss
    m = watch.result()
    if m is not None:
        m["checkpoint_mapped"] = mapped_rss(root)
    if m is not None and engine.device.startswith("cuda"):
        import torch
        m["device_peak"] = torch.cuda.max_memory_allocated()
    return m


def _memory_rows(memory) -> list:
    p, m = memory["planned"], memory["measured"]
    if m is None:
        return [("memory", "not measured: no /proc/self/status on this host", "")]
    rows = [("anonymous RSS added MB", p["anon"], m["anon_added"]),
            ("checkpoint mapping resident MB", p["file"], m["checkpoint_mapped"] or 0),
            ("file-backed RSS added MB (libraries too)", None, m["file_added"])]
    if "device_peak" in m:
        rows.append(("device memory MB", p["device"], m["device_peak"]))
    return [(k, "-" if a is None else f"{a / 1e6:.1f}", f"{b / 1e6:.1f}") for k, a, b in rows]


def cmd_run(args) -> int:
    from tokenizers import Tokenizer

    from kernels.warm import warm_up
    from runtime.budget import check_plan, check_request, planned_bytes
    from runtime.memwatch import RssWatch, added_since, specializations
    from runtime.checkpoint.reader import Checkpoint
    from runtime.engine import Engine
    from runtime.io_reader import warm_up as warm_readers
    from runtime.pagecache import evict, resident_fraction
    from runtime.workload import make_prompt
    ck = Checkpoint(args.checkpoint)
    plan = Plan.load(args.plan) if args.plan else Plan()
    check_request(plan, args.prompt_tokens, args.max_tokens)
    check_plan(plan, ck.footprint())
    prompt = make_prompt(Tokenizer.from_file(str(ck.root / "tokenizer.json")), args.prompt_tokens, seed=args.prompt_seed)
    files = [str(ck.root / s) for s in ck.shards]
    runs, resident = {}, None
    engines = (["auto"] if plan.expert_nvme_path == "nvme_direct" else []) + \
              ([plan.engram_io_engine] if plan.engram_placement == "nvme_direct" else [])
    warm_readers(files[0], engines)                    # the plan's I/O engines' compiled loops (before the eviction)
    if not args.no_cold:
        evict(files)
        resident = sum(resident_fraction(f) for f in files) / len(files)
    warm_up(plan.cpu_threads or None)                  # one-time process costs stay out of the measurement
    warmed = specializations()
    with RssWatch() as watch:
        t0 = time.perf_counter()
        engine = Engine(ck, plan)
        load_s = time.perf_counter() - t0
        try:
            for phase in (("warm",) if args.no_cold else ("cold", "warm")):
                r = engine.generate(prompt, args.max_tokens, temperature=args.temperature, seed=args.prompt_seed)
                runs[phase] = r.to_dict()
            memory = {"planned": planned_bytes(plan, engine.footprint, engine.device == "cpu"),
                      "measured": _measured(watch, engine, ck.root),
                      "compiled_after_warm_up": added_since(warmed)}
        finally:
            engine.close()
    warm = runs["warm"]
    out = {"ttft_s": warm["ttft_s"], "decode_tok_s": warm["decode_tok_s"], "tokens": warm["tokens"],
           "phases": warm["phases"], "plan": plan.to_dict(), "load_s": load_s, "prompt_tokens": len(prompt),
           "cold_resident_fraction_before_load": resident, "memory": memory, **runs}
    if args.json:
        print(json.dumps(out))
        return 0
    from rich.table import Table
    t = Table(title=f"{ck.config.name}: {len(prompt)} prompt tokens, {args.max_tokens} generated, "
                    f"plan {plan.moe_strategy} slots {plan.slot_cache_experts} chunk {plan.prefill_chunk}")
    t.add_column("")
    for name in runs:
        t.add_column(name, justify="right")
    rows = [("TTFT s", "ttft_s", "{:.3f}"), ("decode tok/s", "decode_tok_s", "{:.2f}"), ("prefill tok/s", "prefill_tok_s", "{:.1f}"),
            ("expert hit rate", "hit_rate", "{:.2f}"), ("indexer peak B (measured)", "indexer_peak_bytes", "{:,}"),
            ("indexer peak B (formula)", "indexer_peak_formula_bytes", "{:,}")]
    for label, key, f in rows:
        t.add_row(label, *(f.format(runs[n][key]) for n in runs))
    for part in ("prefill_phases", "phases"):
        for ph in sorted({k for r in runs.values() for k in r[part]}):
            us = ph.endswith("_us")
            t.add_row(f"  {'prefill' if part == 'prefill_phases' else 'decode'} {ph[:-3] if us else ph} {'us' if us else 's'}",
                      *(f"{runs[n][part].get(ph, 0):.{0 if us else 3}f}" for n in runs))
    c = console()
    c.print(t)
    mt = Table(title="memory: planned (runtime/budget.py) vs measured")
    for col in ("", "planned", "measured"):
        mt.add_column(col, justify="right" if col else "left")
    for row in _memory_rows(memory):
        mt.add_row(*row)
    c.print(mt)
    if memory["compiled_after_warm_up"]:
        c.print(f"[yellow]compiled during the run (their compiler's memory is in 'measured'): "
                f"{', '.join(memory['compiled_after_warm_up'])}[/yellow]")
    c.print(f"load {load_s:.2f} s" + (f"; page cache before the cold load: {100 * resident:.1f}% resident" if resident is not None else ""))
    return 0


def build_parser():
    p = argparse.ArgumentParser(prog="dsv41-run", description=__doc__.split("\n")[0])
    p.add_argument("--checkpoint", required=True)
    p.add_argument("--plan", help="plan file or profile file (its plan); default: Plan()")
    p.add_argument("--prompt-tokens", type=int, default=WL["prompt_tokens"])
    p.add_argument("--max-tokens", type=int, default=WL["max_tokens"])
    p.add_argument("--prompt-seed", type=int, default=0)
    p.add_argument("--temperature", type=float, default=0.0)
    p.add_argument("--no-cold", action="store_true", help="skip the cold run")
    p.add_argument("--json", action="store_true")
    p.set_defaults(fn=cmd_run)
    return p


def main(argv=None) -> int:
    return run_main(build_parser(), argv)


if __name__ == "__main__":
    sys.exit(main())
