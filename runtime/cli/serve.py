"""`dsv41-serve`: serve a profile's plan over an OpenAI-compatible API.

  dsv41-serve --profile profiles/NAME.json [--checkpoint DIR] [--host H] [--port N] [--force]
              [--max-queue N] [--served-model-name NAME] [--chat-template FILE]

The checkpoint: --checkpoint, else $DSV41_CHECKPOINT, else the one the profile recorded when
dsv41-tune made it on this host (shipped profiles record none). Before anything loads, the profile's
hard host fingerprint and its plan's model geometry are checked against this host and checkpoint: a
mismatch is refused with every difference named (--force serves anyway, with a warning); soft
differences (commit, versions, kernel) warn. A plan that does not fit this host is always refused.
"""
from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

from runtime.cli.common import run_main
from runtime.plan import Plan


def resolve_checkpoint(args, profile: dict) -> Path:
    for where, value in (("--checkpoint", args.checkpoint), ("$DSV41_CHECKPOINT", os.environ.get("DSV41_CHECKPOINT")),
                         (f"{args.profile} ('checkpoint')", profile.get("checkpoint"))):
        if value:
            if not Path(value).is_dir():
                raise FileNotFoundError(f"{where}: checkpoint directory {value} does not exist")
            return Path(value)
    raise ValueError(f"no checkpoint: {args.profile} records none (profiles shipped with dsv41 never do); give one "
                     f"with --checkpoint DIR or $DSV41_CHECKPOINT")


def preflight(args, warn=lambda m: print(f"dsv41-serve: warning: {m}", file=sys.stderr)):
    """-> (checkpoint, plan, profile, this host's fingerprint); raises before anything is loaded."""
    from hostinfo.fingerprint import compare, fingerprint
    from runtime.profile import load_profile
    from runtime.budget import check_plan
    from runtime.checkpoint.reader import Checkpoint
    profile = load_profile(args.profile)
    if not profile.get("plan"):
        raise ValueError(f"{args.profile}: holds no plan; run `dsv41-tune --checkpoint DIR --out {args.profile}` first")
    plan = Plan.from_dict(profile["plan"], f"{args.profile} (plan)")
    ck = Checkpoint(resolve_checkpoint(args, profile))
    fp = ck.footprint()
    here = fingerprint(ck.root, fp.geometry_hash)
    hard, soft = compare(profile["host"], here)
    if plan.geometry_hash and plan.geometry_hash != fp.geometry_hash:
        hard.append(f"model geometry: plan made for {plan.geometry_hash}, checkpoint {ck.root.name} is {fp.geometry_hash}")
    if hard and not args.force:
        raise ValueError(f"{args.profile} was made for another host or model: " + "; ".join(hard)
                         + " (re-tune here with dsv41-tune, or --force to serve anyway)")
    for h in hard:
        warn(f"--force: serving despite {h}")
    if hard:
        plan = plan.replace(geometry_hash=fp.geometry_hash)
    if getattr(args, "max_num_seqs", None):                   # admission below counts every sequence's KV
        plan = plan.replace(max_num_seqs=args.max_num_seqs)
    for s in soft:
        warn(f"profile made by other software: {s}")
    check_plan(plan, fp)
    return ck, plan, profile, here


def build_app(args):
    """preflight, load the engine, warm it, and build the ASGI app. -> (app, engine, plan, name)"""
    ck, plan, profile, here = preflight(args)
    from tokenizers import Tokenizer

    from runtime.engine import Engine
    from runtime.profile import io_path
    from runtime.serve.app import create_app
    from runtime.serve.chat import ChatTemplate
    template = ChatTemplate(args.chat_template)
    tokenizer = Tokenizer.from_file(str(ck.root / "tokenizer.json"))
    engine = Engine(ck, plan)
    engine.generate(tokenizer.encode("warm up").ids, 2)            # compile the kernels before the first client
    name = args.served_model_name or ck.config.name
    info = {"profile": profile["host"].get("name"), "host": here, "commit": here["soft"]["commit"],
            "geometry_hash": ck.footprint().geometry_hash, "profile_nvme_io_path": io_path(profile)}
    return create_app(engine, tokenizer, template, name, info, max_queue=args.max_queue), engine, plan, name


def cmd_serve(args) -> int:
    import uvicorn
    app, engine, plan, name = build_app(args)
    print(f"dsv41-serve: {name} at http://{args.host}:{args.port}/v1 (plan: {plan.moe_strategy}, {plan.max_num_seqs} seqs, "
          f"{plan.slot_cache_experts} slots, Engram {plan.engram_placement}, DSpark {'d=%d' % plan.draft_length if plan.dspark else 'off'})",
          file=sys.stderr, flush=True)
    try:
        uvicorn.run(app, host=args.host, port=args.port, log_level=args.log_level)
    finally:
        engine.close()
    return 0


def build_parser():
    p = argparse.ArgumentParser(prog="dsv41-serve", description=__doc__.split("\n")[0])
    p.add_argument("--profile", required=True, help="a profile holding a plan (dsv41-tune writes one)")
    p.add_argument("--checkpoint", help="checkpoint directory (default: $DSV41_CHECKPOINT, then the profile's)")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=8000)
    p.add_argument("--force", action="store_true", help="serve a profile made for another host or model (warns)")
    p.add_argument("--max-queue", type=int, default=16, help="requests waiting beyond the running ones; more get 429")
    p.add_argument("--max-num-seqs", type=int, help="sequences served together (continuous batching; default: the plan's)")
    p.add_argument("--served-model-name", help="the model id clients send (default: the config's name)")
    p.add_argument("--chat-template", help="a Jinja2 chat template file (default: the documented stand-in)")
    p.add_argument("--log-level", default="warning")
    p.set_defaults(fn=cmd_serve)
    return p


def main(argv=None) -> int:
    return run_main(build_parser(), argv)


if __name__ == "__main__":
    sys.exit(main())
