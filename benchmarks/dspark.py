"""DSpark on the mini checkpoint: decode tok/s with DSpark off and at draft lengths 1..5.

  python benchmarks/dspark.py [--checkpoint out/mini] [--prompt-tokens 128] [--max-tokens 48] [--prompts 3]
                              [--repeats 2] [--json]

One engine (plan cpu, DSpark loaded) serves every configuration, so they share the same loaded weights
and warm caches; the configurations run interleaved, each prompt once per repeat, greedy. Per
configuration: decode tok/s (median and spread over prompts x repeats), the speed-up over DSpark off
measured in the same run, acceptance (accepted / drafted), mean accepted drafts per verify step, the
drafter's and the verify pass's cost per step beside one plain decode step, the expert union a verify
batch reads per MoE layer, and routed-expert bytes read per generated token (the drafter's own
experts separately). Greedy output is compared with DSpark off for every prompt: after the timed runs one
untimed run per prompt and draft length keeps its logits: the typical (median) step's largest logit
difference from DSpark off, and where the tokens first part, DSpark off's top-2 margin there. On the
fused CPU path a verify block's rows are one-token decode's to the bit (runtime/model/decode.py), so
both are 0 and nothing parts; where a verify pass runs as a block (tests/runtime/test_dspark.py) the
int8 requantization of each expert input can move a code by one step, and a near-tie parts on float
noise (a wide margin would be a verify bug).
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import kernels  # noqa: E402,F401  (before torch: it sets the process up for it, kernels/__init__.py)
import torch

from tokenizers import Tokenizer  # noqa: E402

from runtime.checkpoint.reader import Checkpoint  # noqa: E402
from runtime.engine import Engine  # noqa: E402
from runtime.plan import Plan  # noqa: E402
from runtime.workload import make_prompt  # noqa: E402

DRAFTS = (0, 1, 2, 3, 4, 5)                     # 0 = DSpark off


def run(engine, plan, prompt, n):
    """-> (Result, routed experts read in decode, drafter experts read)."""
    ex = engine.experts
    engine.plan = plan                          # same loaded weights; the plan's knobs are read per request
    engine.generate(prompt, 1)                  # prefill alone: its expert reads, to subtract
    pre = ex.experts_read
    engine.generate(prompt, 1)
    pre = ex.experts_read - pre
    r0, d0 = ex.experts_read, ex.drafter_experts_read
    r = engine.generate(prompt, n)
    return r, ex.experts_read - r0 - pre, ex.drafter_experts_read - d0


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--checkpoint", default="out/mini")
    ap.add_argument("--prompt-tokens", type=int, default=128)
    ap.add_argument("--max-tokens", type=int, default=48)
    ap.add_argument("--prompts", type=int, default=3)
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args(argv)
    if not os.path.exists(os.path.join(args.checkpoint, "model.safetensors.index.json")):
        sys.exit(f"no checkpoint at {args.checkpoint}: dsv41-checkpoint make --preset mini --out {args.checkpoint}")
    ck = Checkpoint(args.checkpoint)
    cfg, eb = ck.config, ck.config.expert_bytes
    tok = Tokenizer.from_file(os.path.join(args.checkpoint, "tokenizer.json"))
    prompts = [make_prompt(tok, args.prompt_tokens, seed=500 + k) for k in range(args.prompts)]
    base = Plan(dspark=True, draft_length=max(DRAFTS), max_context=args.prompt_tokens + args.max_tokens + 8)
    plans = {d: base.replace(dspark=False) if d == 0 else base.replace(draft_length=d) for d in DRAFTS}
    engine = Engine(ck, base)
    run(engine, plans[1], prompts[0], 4)                           # warm: compile, page in
    rows = {d: {"tok_s": [], "acc": [], "mean_acc": [], "draft_ms": [], "verify_ms": [], "union": [], "bytes_per_tok": [],
                "drafter_bytes_per_tok": [], "steps": 0} for d in DRAFTS}
    reference = {}
    for rep in range(args.repeats):
        order = DRAFTS[rep % len(DRAFTS):] + DRAFTS[:rep % len(DRAFTS)]         # rotate: no config always first
        for d in order:
            for k, p in enumerate(prompts):
                r, routed, drafted = run(engine, plans[d], p, args.max_tokens)
                if d == 0:
                    reference.setdefault(k, r.tokens)
                row = rows[d]
                row["tok_s"].append(r.decode_tok_s)
                gen = len(r.tokens) - 1                                  # decode tokens after the first
                row["bytes_per_tok"].append(routed * eb / gen)
                row["drafter_bytes_per_tok"].append(drafted * eb / gen)
                steps = r.dspark.get("steps", gen)
                row["union"].append(routed / (steps * cfg.num_hidden_layers))
                row.setdefault("tokens", {})[k] = r.tokens
                if d:
                    s = r.dspark
                    row["acc"].append(s["acceptance_rate"])
                    row["mean_acc"].append(s["mean_accepted"])
                    row["draft_ms"].append(1e3 * s["draft_s"] / s["steps"])
                    row["verify_ms"].append(1e3 * s["verify_s"] / s["steps"])
    parted = compare_logits(engine, plans, prompts, args.max_tokens)
    engine.close()
    off = statistics.median(rows[0]["tok_s"])
    out = []
    for d in DRAFTS:
        row = rows[d]
        med = lambda k: statistics.median(row[k]) if row[k] else None
        out.append({"draft_length": d or None, "decode_tok_s": med("tok_s"), "min": min(row["tok_s"]), "max": max(row["tok_s"]),
                    "speedup": med("tok_s") / off, "acceptance": med("acc"), "mean_accepted": med("mean_acc"),
                    "draft_ms_per_step": med("draft_ms"), "verify_ms_per_step": med("verify_ms"),
                    "expert_union_per_layer": med("union"), "routed_mb_per_token": med("bytes_per_tok") / 1e6,
                    "drafter_mb_per_token": med("drafter_bytes_per_tok") / 1e6,
                    "greedy_identical": all(row["tokens"][k] == reference[k] for k in reference), **parted[d],
                    "samples": row["tok_s"]})
    step_ms = 1e3 / off
    if args.json:
        print(json.dumps({"checkpoint": cfg.name, "plain_step_ms": step_ms, "rows": out}))
        return
    print(f"DSpark on {cfg.name}: {args.prompts} prompts x {args.repeats} repeats, {args.prompt_tokens} prompt tokens, "
          f"{args.max_tokens} generated, greedy; plain decode step {step_ms:.1f} ms; top-{cfg.num_experts_per_tok} of "
          f"{cfg.n_routed_experts} experts, {eb / 1e6:.2f} MB each")
    hdr = f"{'draft':>5} {'tok/s':>7} {'[min-max]':>13} {'speedup':>7} {'accept':>6} {'acc/step':>8} {'draft ms':>8} " \
          f"{'verify ms':>9} {'union/layer':>11} {'MB/token':>8} {'drafter MB':>10} {'same':>4}  logits vs off"
    print(hdr)
    for o in out:
        f = lambda v, fmt: format(v, fmt) if v is not None else "-"
        print(f"{o['draft_length'] or 'off':>5} {o['decode_tok_s']:7.2f} {o['min']:6.2f}-{o['max']:<6.2f} {o['speedup']:7.2f} "
              f"{f(o['acceptance'], '6.2f'):>6} {f(o['mean_accepted'], '8.2f'):>8} {f(o['draft_ms_per_step'], '8.1f'):>8} "
              f"{f(o['verify_ms_per_step'], '9.1f'):>9} {o['expert_union_per_layer']:11.1f} {o['routed_mb_per_token']:8.1f} "
              f"{o['drafter_mb_per_token']:10.1f} {'yes' if o['greedy_identical'] else 'NO':>4}  {parted_text(o)}")


def compare_logits(engine, plans, prompts, n):
    """{draft length: median over steps of the largest logit difference from DSpark off, and per prompt where
    the tokens first part and DSpark off's top-2 margin there}, from one untimed run each with its logits."""
    engine.plan = plans[0]
    refs = [engine.generate(p, n, keep_logits=True) for p in prompts]
    out = {}
    for d, plan in plans.items():
        if d == 0:
            continue
        diffs, parts = [], []
        engine.plan = plan
        for p, ref in zip(prompts, refs):
            got = engine.generate(p, n, keep_logits=True)
            first = next((i for i, (a, b) in enumerate(zip(got.tokens, ref.tokens)) if a != b), None)
            diffs += [(a - b).abs().max().item() for a, b in list(zip(got.logits, ref.logits))[:first]]
            if first is not None:
                top = torch.topk(ref.logits[first], 2).values
                parts.append({"step": first, "off_top2_margin": float(top[0] - top[1])})
        out[d] = {"logit_diff_median": statistics.median(diffs) if diffs else None, "parted": parts}
    out[0] = {"logit_diff_median": 0.0, "parted": []}
    return out


def parted_text(o) -> str:
    med = o["logit_diff_median"]
    head = f"median step {med:.1e}" if med is not None else "-"
    if not o["parted"]:
        return head
    return head + "; parted at " + ", ".join(f"step {x['step']} (margin {x['off_top2_margin']:.1e})" for x in o["parted"])


if __name__ == "__main__":
    main()
