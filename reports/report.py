"""`dsv41-report`: compare hosts from their profiles (and dsv41-bench results).

  dsv41-report profiles/*.json [results/*.jsonl] --out DIR [--model PRESET] [--trials N]

Writes DIR/report.md, DIR/report.html (self-contained: the plots are embedded), DIR/hosts.csv,
DIR/validation.csv, DIR/bench.csv and the PNGs: bandwidths, NVMe IOPS vs depth, predicted vs
measured, and the Pareto front of decode tok/s vs TTFT per host for one model (default the full
V4.1) from the cost model on each host's figures. Tables are keyed by host; columns that are the
same on every row are folded into one line above the table, as llama-bench does.
"""
from __future__ import annotations

import argparse
import base64
import html
import sys
from pathlib import Path

import pandas as pd

from reports import plots
from reports.schema import bench_record, host_record, read_inputs, term_records, validation_records


def fold(df: pd.DataFrame) -> tuple[pd.DataFrame, dict]:
    """Drop columns with one value on every row (when there is more than one row) -> (table, common)."""
    if len(df) < 2:
        return df, {}
    same = [c for c in df.columns if c != "host" and df[c].astype(str).nunique(dropna=False) == 1]
    return df.drop(columns=same), {c: df[c].iloc[0] for c in same}


def fronts(named, model: str, trials: int) -> tuple[pd.DataFrame, dict]:
    """The cost model's tok/s-vs-TTFT front per host for one model -> (front rows, {host: why none})."""
    from autotune.search import pareto, search, why_none
    from runtime.checkpoint.footprint import Footprint
    from runtime.config import load_config
    from runtime.workload import Workload
    fp = Footprint.from_config(load_config(model))
    rows, none = [], {}
    for name, prof in named:
        study, results = search(prof, fp, Workload(), n_trials=trials, storage=None)
        if not results:
            none[name] = why_none(study)
        rows += [{"host": name, "decode_tok_s": r.decode_tok_s, "ttft_s": r.ttft_s, "moe_strategy": p.moe_strategy,
                  "slots": p.slot_cache_experts, "engram": p.engram_placement, "dspark": p.dspark}
                 for p, r in pareto(results)]
    return pd.DataFrame(rows, columns=["host", "decode_tok_s", "ttft_s", "moe_strategy", "slots", "engram", "dspark"]), none


def _fmt(df: pd.DataFrame) -> pd.DataFrame:
    out = df.copy()
    for c in out.columns:
        if pd.api.types.is_float_dtype(out[c]):
            out[c] = out[c].map(lambda v: "-" if pd.isna(v) else (f"{v:,.0f}" if abs(v) >= 1000 else f"{v:.3g}"))
    return out.fillna("-")


def build(paths, out: Path, model: str = "deepseek-v4.1-flash", trials: int = 1000) -> dict:
    named, bench_rows = read_inputs(paths)
    if not named and not bench_rows:
        raise ValueError("nothing to report: give profiles (*.json) and/or dsv41-bench results (*.jsonl)")
    out.mkdir(parents=True, exist_ok=True)
    hosts = pd.DataFrame([host_record(p, n) for n, p in named])
    val = pd.DataFrame([r for n, p in named for r in validation_records(p, n)])
    terms = pd.DataFrame([r for n, p in named for r in term_records(p, n)])
    bench = pd.DataFrame([bench_record(r) for r in bench_rows])
    front, none = fronts(named, model, trials) if named else (pd.DataFrame(), {})
    if len(front):
        best = front.groupby("host")["decode_tok_s"].max()
        hosts[f"{model} best tok/s (model)"] = hosts["host"].map(best)
    tables = {"hosts": hosts, "validation": val, "terms": terms, "bench": bench, "pareto": front}
    for name, df in tables.items():
        df.to_csv(out / f"{name}.csv", index=False)
    pngs = {}
    if len(hosts):
        pngs["Bandwidths"] = plots.bandwidths(hosts, out / "bandwidths.png")
        pngs["NVMe IOPS vs depth"] = plots.nvme_iops(hosts, out / "nvme_iops.png")
    if len(val):
        pngs["Predicted vs measured"] = plots.predicted_vs_measured(val, out / "predicted_vs_measured.png")
    if len(front):
        pngs[f"Pareto front ({model})"] = plots.pareto(front, out / "pareto.png", model)
    md, body = ["# dsv41 host comparison\n", f"Inputs: {', '.join(Path(p).name for p in paths)}\n"], []
    for name, df in tables.items():
        if not len(df):
            continue
        shown, common = fold(df)
        common_line = "; ".join(f"{k} = {v:.4g}" if isinstance(v, float) else f"{k} = {v}" for k, v in common.items())
        md += [f"## {name}\n", *( [f"Same on every row: {common_line}\n"] if common else []), _fmt(shown).to_markdown(index=False), ""]
        body += [f"<h2>{name}</h2>", *( [f"<p><i>Same on every row:</i> {html.escape(common_line)}</p>"] if common else []),
                 _fmt(shown).to_html(index=False, border=0, classes="t")]
    for host, why in none.items():
        line = f"No feasible plan for {model} on {host}: {why}"
        md.append(f"{line}\n")
        body.append(f"<p>{html.escape(line)}</p>")
    for title, path in pngs.items():
        md.append(f"![{title}]({path.name})\n")
        b64 = base64.b64encode(path.read_bytes()).decode()
        body.append(f"<h2>{html.escape(title)}</h2><img src=\"data:image/png;base64,{b64}\" alt=\"{html.escape(title)}\">")
    (out / "report.md").write_text("\n".join(md))
    style = "body{font-family:sans-serif;margin:2em} table.t{border-collapse:collapse;font-size:12px} " \
            "table.t td,table.t th{padding:2px 8px;border-bottom:1px solid #ddd;text-align:right} img{max-width:100%}"
    (out / "report.html").write_text(f"<!doctype html><html><head><meta charset=\"utf-8\"><title>dsv41 report</title>"
                                     f"<style>{style}</style></head><body><h1>dsv41 host comparison</h1>{''.join(body)}</body></html>")
    return {"tables": {k: len(v) for k, v in tables.items()}, "files": sorted(p.name for p in out.iterdir())}


def cmd_report(args) -> int:
    r = build(args.inputs, Path(args.out), args.model, args.trials)
    print(f"dsv41-report: wrote {', '.join(r['files'])} to {args.out} "
          f"({', '.join(f'{k} {n} rows' for k, n in r['tables'].items())})")
    return 0


def build_parser():
    p = argparse.ArgumentParser(prog="dsv41-report", description=__doc__.split("\n")[0])
    p.add_argument("inputs", nargs="+", help="profiles (*.json) and dsv41-bench results (*.jsonl)")
    p.add_argument("--out", required=True, help="output directory")
    p.add_argument("--model", default="deepseek-v4.1-flash", help="preset or config.json for the Pareto fronts")
    p.add_argument("--trials", type=int, default=1000, help="cost-model trials per host for the fronts")
    p.set_defaults(fn=cmd_report)
    return p


def main(argv=None) -> int:
    from runtime.cli.common import run_main
    return run_main(build_parser(), argv)


if __name__ == "__main__":
    sys.exit(main())
