"""`dsv41-checkpoint`: make synthetic checkpoints in the V4.1 layout and inspect any checkpoint's footprint.

  dsv41-checkpoint make --preset tiny|mini --out DIR [--seed N]
  dsv41-checkpoint make --preset deepseek-v4.1-flash --skeleton --out DIR   (headers only, sparse files)
  dsv41-checkpoint inspect DIR [--json]

User errors (bad config, corrupt shard, ...) print one line naming the culprit and exit 2.
"""
from __future__ import annotations

import argparse
import json
import sys

from runtime.cli.common import console, fmt_bytes, run_main
from runtime.config import PRESETS, ModelConfig

SMALL_PRESETS = ("tiny", "mini")


def cmd_make(args) -> int:
    from rich.progress import BarColumn, DownloadColumn, Progress, TextColumn, TimeRemainingColumn

    from runtime.checkpoint.synth import make_checkpoint
    if args.preset not in SMALL_PRESETS and not args.skeleton:
        raise ValueError(f"preset '{args.preset}' is full size: its weights cannot be generated here; "
                         f"add --skeleton for a header-only copy of its layout")
    cfg = ModelConfig.preset(args.preset)
    with Progress(TextColumn("[bold]{task.description}"), BarColumn(), DownloadColumn(), TimeRemainingColumn(),
                  console=console(stderr=True), transient=True) as bar:
        task = bar.add_task(f"writing {args.preset}", total=None)

        def progress(done, total, shard):
            bar.update(task, completed=done, total=total, description=shard)
        out = make_checkpoint(cfg, args.out, seed=args.seed, skeleton=args.skeleton, progress=progress,
                              router_skew=args.router_skew)
    c = console(stderr=True)
    c.print(f"wrote {'skeleton ' if args.skeleton else ''}{args.preset} checkpoint to {out}")
    if (out / "dsv41-distill.json").exists():
        d = json.loads((out / "dsv41-distill.json").read_text())
        c.print(f"drafter distilled on {d['fit_tokens']} tokens: agrees with the target's next token "
                f"{100 * d['held_out_agreement']:.0f}% of the time on held-out text (ridge {d['ridge']}, "
                f"embedding prior {'on' if d['embedding_prior'] else 'off'})")
    return 0


def cmd_inspect(args) -> int:
    from runtime.checkpoint.reader import Checkpoint
    ck = Checkpoint(args.dir)
    fp = ck.footprint()
    tiers = _plan_tiers(args.plan, fp) if args.plan else None
    if args.json:
        print(json.dumps(fp.to_dict() | ({"plan_bytes": tiers} if tiers else {})))
        return 0
    from rich.table import Table
    cfg = ck.config
    t = Table(title=f"{cfg.name}: {fp.n_tensors:,} tensors in {fp.n_shards} shards, {fmt_bytes(fp.total_bytes)}")
    t.add_column("class"), t.add_column("bytes", justify="right"), t.add_column("share", justify="right")
    for cls, nb in fp.bytes_by_class.items():
        if nb:
            t.add_row(cls, fmt_bytes(nb), f"{100 * nb / fp.total_bytes:.1f}%")
    c = console()
    c.print(t)
    per = Table(title="per token / per pass")
    per.add_column("figure"), per.add_column("value", justify="right"), per.add_column("formula")
    K, L, E = cfg.num_experts_per_tok, cfg.num_hidden_layers, cfg.n_routed_experts
    rows = [
        ("one expert (codes + scales)", fp.expert_bytes, "3*H*I*(1/2 + 1/32)"),
        ("routed experts, all", fp.routed_expert_bytes_total, f"{E} x {L} x expert"),
        ("routed bytes per decoded token", fp.routed_bytes_per_decode_token, f"{K} x {L} x expert"),
        ("encoder pass (bounded_replay prefill)", fp.encoder_pass_bytes, f"{E} x {cfg.num_encoder_layers} x expert"),
        ("full pass (full prefill)", fp.full_pass_bytes, f"{E} x {L} x expert"),
        ("dense bytes per token", fp.dense_bytes_per_token, "attention/dense + shared + head"),
        ("Engram tables", fp.engram_bytes_total, f"{fp.engram_rows_total:,} rows x {fp.engram_row_bytes} B"),
        ("Engram bytes per token", fp.engram_bytes_per_token, f"{len(cfg.engram_layer_ids)} layers x {cfg.engram_slots} rows x {fp.engram_row_bytes} B"),
        ("KV bytes per token", fp.kv_bytes_per_token, "latent FP4 + index key, per kv source layer / ratio"),
    ]
    for name, v, f in rows:
        per.add_row(name, f"{v:,.0f} B ({fmt_bytes(v)})", f)
    c.print(per)
    lay = Table(title="per layer")
    for col in ("layer", "kind", "mode", "routed experts", "dense + shared"):
        lay.add_column(col, justify="right")
    for i in range(L):
        kind = "encoder" if i < cfg.num_encoder_layers else "decoder"
        extra = " +engram" if i in cfg.engram_layer_ids else ""
        lay.add_row(str(i), kind + extra, cfg.layer_mode(i), fmt_bytes(fp.routed_bytes_by_layer[i]),
                    fmt_bytes(fp.other_bytes_by_layer[i]))
    c.print(lay)
    if tiers:
        for host, parts in tiers.items():
            pt = Table(title=f"the plan's bytes on a {host.replace('_', ' ')} (runtime/budget.py, as admission counts them)")
            pt.add_column("tier"), pt.add_column("part"), pt.add_column("bytes", justify="right")
            for tier, d in parts.items():
                for part, nb in d.items():
                    pt.add_row(tier, part, fmt_bytes(nb))
                if d:
                    pt.add_row(tier, "[b]total[/b]", f"[b]{fmt_bytes(sum(d.values()))}[/b]")
            c.print(pt)
    return 0


def _plan_tiers(plan_path, fp) -> dict:
    """The plan's bytes by tier and part on a CPU host and on a GPU host (runtime/budget.py breakdown)."""
    from runtime.budget import breakdown
    from runtime.plan import Plan
    plan = Plan.load(plan_path)
    return {"cpu_host": breakdown(plan, fp, on_cpu=True), "gpu_host": breakdown(plan, fp, on_cpu=False)}


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="dsv41-checkpoint", description=__doc__.split("\n")[0])
    sub = p.add_subparsers(dest="cmd", required=True)
    m = sub.add_parser("make", help="write a synthetic checkpoint in the V4.1 layout")
    m.add_argument("--preset", required=True, choices=PRESETS)
    m.add_argument("--out", required=True, help="output directory")
    m.add_argument("--seed", type=int, default=0, help="same seed, same bytes")
    m.add_argument("--skeleton", action="store_true", help="headers only, sparse files (full-size layouts)")
    m.add_argument("--router-skew", type=float, default=0.01,
                   help="std of the router bias: 0.01 ~uniform routing (default), 0.1-0.3 popular experts")
    m.set_defaults(fn=cmd_make)
    i = sub.add_parser("inspect", help="print a checkpoint's footprint from its shard headers")
    i.add_argument("dir")
    i.add_argument("--json", action="store_true", help="one JSON object on stdout")
    i.add_argument("--plan", help="a plan or profile JSON: also print its bytes per tier and part, as admission counts them")
    i.set_defaults(fn=cmd_inspect)
    return p


def main(argv=None) -> int:
    return run_main(build_parser(), argv)


if __name__ == "__main__":
    sys.exit(main())
