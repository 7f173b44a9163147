"""Continuous batching: aggregate decode tok/s and per-stream inter-token latency at 1, 2, 4, 8 streams
on one engine (runtime/scheduler.py), interleaved in one run, beside the cost model's prediction.

  python benchmarks/concurrency.py [--checkpoint out/mini] [--profile HOST.json] [--streams 1 2 4 8]
                                   [--rounds 3] [--prompt-tokens 64] [--max-tokens 16] [--dspark D] [--json]

Each round runs every stream count once (1, 2, 4, 8, 1, 2, ...): c sequences of natural-text prompts
are added together, prefilled, then decoded together; each decode step gives an aggregate sample (tokens
it decided / its wall time) and an ITL sample (its wall time per token of one stream: c tokens per step
without DSpark, more with `--dspark D`, each stream's drafts verified in the same step). The prediction (with --profile, a profile of
this host for this checkpoint): autotune.costmodel at concurrency c, max_num_seqs = the largest count.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import numpy as np  # noqa: E402
from tokenizers import Tokenizer  # noqa: E402

from runtime.checkpoint.reader import Checkpoint  # noqa: E402
from runtime.engine import Engine  # noqa: E402
from runtime.plan import Plan  # noqa: E402
from runtime.scheduler import Scheduler, Sequence  # noqa: E402
from runtime.workload import Workload, make_prompts  # noqa: E402


def one_round(engine, prompts, max_tokens) -> list[tuple[float, int]]:
    """c streams together -> (wall time, tokens decided) of every step in which all of them decoded
    (with DSpark a step decides each stream's accepted drafts and the target's next token)."""
    sched = Scheduler(engine)
    seqs = [sched.add(Sequence(p, max_tokens)) for p in prompts]
    steps = []
    while sched.busy:
        decoding = all(s.decoding for s in seqs) and all(not s.finished for s in seqs)
        t0 = time.perf_counter()
        out = sched.step()
        if decoding:
            steps.append((time.perf_counter() - t0, len(out)))
    return steps


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--checkpoint", default="out/mini")
    ap.add_argument("--profile", help="this host's profile for the checkpoint: the cost model's prediction beside")
    ap.add_argument("--streams", type=int, nargs="+", default=[1, 2, 4, 8])
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--prompt-tokens", type=int, default=64)
    ap.add_argument("--max-tokens", type=int, default=16)
    ap.add_argument("--dspark", type=int, default=0, metavar="D", help="DSpark with draft length D (each stream's drafts verified in the step)")
    ap.add_argument("--json", action="store_true")
    a = ap.parse_args(argv)
    ck = Checkpoint(a.checkpoint)
    n = max(a.streams)
    plan = Plan(max_num_seqs=n, max_batched_tokens=n * a.prompt_tokens, prefill_chunk=a.prompt_tokens,
                max_context=a.prompt_tokens + a.max_tokens + 8, geometry_hash=ck.config.geometry_hash(),
                dspark=a.dspark > 0, draft_length=max(1, a.dspark))
    tok = Tokenizer.from_file(str(ck.root / "tokenizer.json"))
    e = Engine(ck, plan)
    one_round(e, make_prompts(tok, a.prompt_tokens, 1, seed=99), 3)             # warm the kernels
    samples = {c: {"itl": [], "aggregate": []} for c in a.streams}
    try:
        for r in range(a.rounds):                                               # interleaved: 1, 2, 4, 8, 1, ...
            for c in a.streams:
                steps = one_round(e, make_prompts(tok, a.prompt_tokens, c, seed=1000 * r + c), a.max_tokens)
                samples[c]["itl"] += [dt * c / k for dt, k in steps]             # per stream, per token
                samples[c]["aggregate"] += [k / dt for dt, k in steps]
    finally:
        e.close()
    pred = {}
    if a.profile:
        from autotune.costmodel import predict
        from runtime.profile import load_profile
        prof, fp = load_profile(a.profile), ck.footprint()
        for c in a.streams:
            p = predict(plan, prof, fp, Workload(a.prompt_tokens, a.max_tokens, concurrency=c))
            pred[c] = {"aggregate_tok_s": p.terms.get("aggregate_tok_s", p.decode_tok_s), "itl_s": p.terms["itl_s"]}
    rows = []
    base = statistics.median(samples[a.streams[0]]["aggregate"])
    for c in a.streams:
        s = samples[c]
        agg = statistics.median(s["aggregate"])
        row = {"streams": c, "aggregate_tok_s": agg, "vs_first": agg / base,
               "itl_p50_s": float(np.percentile(s["itl"], 50)), "itl_p99_s": float(np.percentile(s["itl"], 99)),
               "steps": len(s["itl"]), "samples": s}
        if c in pred:
            row["predicted"] = pred[c]
            row["error"] = (pred[c]["aggregate_tok_s"] - agg) / agg
        rows.append(row)
        if not a.json:
            print(f"{c} streams: aggregate {agg:7.2f} tok/s ({row['vs_first']:.2f}x of {a.streams[0]}), ITL p50 "
                  f"{1e3 * row['itl_p50_s']:7.1f} ms p99 {1e3 * row['itl_p99_s']:7.1f} ms"
                  + (f"; predicted {pred[c]['aggregate_tok_s']:7.2f} tok/s ({100 * row['error']:+.0f}%)" if c in pred else ""),
                  flush=True)
    out = {"checkpoint": ck.config.name, "plan": plan.to_dict(), "rows": rows}
    if a.json:
        print(json.dumps(out))
    return out


if __name__ == "__main__":
    main()
