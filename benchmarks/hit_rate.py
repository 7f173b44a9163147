"""Predicted vs measured slot-cache hit rate on a checkpoint (mini by default): a routing trace of one
prompt through the runtime gives the curve (autotune/routing.py); the runtime then serves other prompts
with slot caches of several sizes under each strategy (on the CPU stand-in device, which keeps the same
cache) and counts its decode hits. Prints both, the uniform prior beside them, and the worst gap.

  python benchmarks/hit_rate.py [--checkpoint /path/to/mini] [--prompt-tokens 256] [--max-tokens 48] [--json]
"""
from __future__ import annotations

import argparse
import gc
import json
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from tokenizers import Tokenizer  # noqa: E402

from autotune.routing import Routing, curve  # noqa: E402
from runtime.checkpoint.reader import Checkpoint  # noqa: E402
from runtime.engine import Engine  # noqa: E402
from runtime.plan import Plan  # noqa: E402
from runtime.workload import make_prompt  # noqa: E402


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--checkpoint", default="out/mini")
    p.add_argument("--prompt-tokens", type=int, default=256)
    p.add_argument("--max-tokens", type=int, default=48)
    p.add_argument("--json", action="store_true")
    a = p.parse_args(argv)
    ck = Checkpoint(a.checkpoint)
    cfg = ck.config
    tok = Tokenizer.from_file(str(ck.root / "tokenizer.json"))
    ctx = a.prompt_tokens + a.max_tokens + 8
    t0 = time.perf_counter()
    e = Engine(ck, Plan(max_context=ctx, prefill_chunk=128))
    trace = e.record_routing()
    e.generate(make_prompt(tok, a.prompt_tokens, seed=1), a.max_tokens)
    e.close()
    del e
    gc.collect()                                  # one engine's banks in RAM at a time
    r = Routing(curve(trace), cfg.num_hidden_layers, cfg.n_routed_experts, cfg.num_experts_per_tok)
    n = cfg.num_hidden_layers * cfg.n_routed_experts
    rows = []
    for strategy, frac in (("offload", 1.0), ("cpu", 1.0), ("hybrid", 0.5)):
        for share in (0.25, 0.5, 0.75):
            slots = int(share * n)
            e = Engine(ck, Plan(moe_strategy=strategy, slot_cache_experts=slots, fetch_fraction=frac, max_context=ctx,
                                prefill_chunk=128), device="cpu")
            measured = e.generate(make_prompt(tok, a.prompt_tokens, seed=2), a.max_tokens).hit_rate
            e.close()
            del e
            gc.collect()
            rows.append({"strategy": strategy, "slots": slots, "predicted": r.hit(slots, strategy, frac),
                         "measured": measured, "uniform": slots / n})
            if not a.json:
                x = rows[-1]
                print(f"{strategy:8s} {slots:5d} slots  predicted {x['predicted']:.3f}  measured {x['measured']:.3f}  "
                      f"uniform prior {x['uniform']:.3f}", flush=True)
    worst = max(abs(x["predicted"] - x["measured"]) for x in rows)
    out = {"checkpoint": cfg.name, "trace_decode_tokens": trace.tokens("decode"), "rows": rows, "worst_gap": worst,
           "seconds": time.perf_counter() - t0}
    print(json.dumps(out, indent=1) if a.json else f"worst |predicted - measured| {100 * worst:.1f} points "
          f"({out['seconds']:.0f} s)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
