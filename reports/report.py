"""`dsv41-report`: compare hosts from their profiles (and dsv41-bench results).

  dsv41-report profiles/*.json [results/*.jsonl] --out DIR [--model PRESET] [--trials N]

Writes DIR/report.md, DIR/report.html (self-contained: the plots are embedded), DIR/headline.csv (hosts
as columns: the deciding figures, the plan, predictions raw and calibrated beside the measurement, the
modelled best for one model and its ratio to a baseline host, bench TTFT / TPOT p50 / p99),
DIR/hosts.csv, DIR/validation.csv, DIR/terms.csv, DIR/bench.csv and the PNGs: bandwidths (log scale,
gaps where a host lacks a figure), NVMe IOPS vs depth, predicted vs measured, throughput vs
concurrency from bench rows, and the Pareto front of decode tok/s vs TTFT per host for one model
(default the full V4.1) from the cost model on each host's figures. Bench rows whose workloads differ
get a warning. Tables are keyed by host; columns that are the
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


HEADLINE = {"cpu_model": "CPU", "physical_cores": "cores", "ram_gib": "RAM GiB", "gpu_name": "GPU", "dram_gbs": "DRAM GB/s",
            "gather_gbs": "PCIe gather GB/s", "plan_moe_strategy": "strategy", "predicted_tok_s": "predicted tok/s (raw)",
            "calibrated_tok_s": "predicted tok/s (calibrated)", "measured_tok_s": "measured tok/s",
            "predicted_ttft_s": "predicted TTFT s (raw)", "measured_ttft_s": "measured TTFT s"}


def headline(hosts: pd.DataFrame, bench: pd.DataFrame, model: str, baseline: str | None) -> pd.DataFrame:
    """One table, hosts as columns: the figures that decide, the plan, raw and calibrated predictions
    beside the measurement, the best modelled tok/s for `model` and its ratio to the baseline host,
    and TTFT / TPOT p50 / p99 from the warm bench rows."""
    rows = {label: hosts.set_index("host")[col] for col, label in HEADLINE.items() if col in hosts}
    best = f"{model} best tok/s (model)"
    if best in hosts:
        rows[best] = hosts.set_index("host")[best]
        base = baseline or hosts["host"].iloc[0]
        if base in rows[best].index and rows[best][base]:
            rows[f"vs {base}"] = rows[best] / rows[best][base]
    if len(bench):
        warm = bench[bench["phase"] == "warm"].groupby("host")
        for col in ("ttft_p50_ms", "ttft_p99_ms", "tpot_p50_ms", "tpot_p99_ms"):
            if col in bench:
                rows["bench " + col[:-3].replace("_", " ") + " ms"] = warm[col].median()
    return pd.DataFrame(rows).T.reset_index().rename(columns={"index": "figure"})


def bench_warning(bench: pd.DataFrame) -> str | None:
    """Bench rows compared across hosts must share their workload."""
    if not len(bench):
        return None
    keys = ["prompt_tokens", "output_tokens", "model"]
    differ = [k for k in keys if k in bench and bench[k].nunique() > 1]
    return (f"warning: the bench rows differ in {', '.join(differ)}: their latencies are not comparable across rows"
            if differ else None)


def _fmt(df: pd.DataFrame) -> pd.DataFrame:
    out = df.copy()
    for c in out.columns:
        if pd.api.types.is_float_dtype(out[c]):
            out[c] = out[c].map(lambda v: "-" if pd.isna(v) else (f"{v:,.0f}" if abs(v) >= 1000 else f"{v:.3g}"))
    return out.fillna("-")


def build(paths, out: Path, model: str = "deepseek-v4.1-flash", trials: int = 1000, baseline: str | None = None) -> dict:
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
    tables = {"headline": headline(hosts, bench, model, baseline) if len(hosts) else pd.DataFrame(),
              "hosts": hosts, "validation": val, "terms": terms, "bench": bench, "pareto": front}
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
    if len(bench) and len(bench[(bench["phase"] == "warm") & bench["rate"].isna()]):
        pngs["Throughput vs concurrency"] = plots.throughput_vs_concurrency(bench, out / "throughput_vs_concurrency.png")
    md, body = ["# dsv41 host comparison\n", f"Inputs: {', '.join(Path(p).name for p in paths)}\n"], []
    warn = bench_warning(bench)
    if warn:
        md.append(f"**{warn}**\n")
        body.append(f"<p><b>{html.escape(warn)}</b></p>")
    for name, df in tables.items():
        if not len(df):
            continue
        shown, common = (df, {}) if name == "headline" else fold(df)
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
    r = build(args.inputs, Path(args.out), args.model, args.trials, args.baseline)
    print(f"dsv41-report: wrote {', '.join(r['files'])} to {args.out} "
          f"({', '.join(f'{k} {n} rows' for k, n in r['tables'].items())})")
    return 0


def build_parser():
    p = argparse.ArgumentParser(prog="dsv41-report", description=__doc__.split("\n")[0])
    p.add_argument("inputs", nargs="+", help="profiles (*.json) and dsv41-bench results (*.jsonl)")
    p.add_argument("--out", required=True, help="output directory")
    p.add_argument("--model", default="deepseek-v4.1-flash", help="preset or config.json for the Pareto fronts")
    p.add_argument("--trials", type=int, default=1000, help="cost-model trials per host for the fronts")
    p.add_argument("--baseline", help="the host the headline's ratios are against (default: the first profile)")
    p.set_defaults(fn=cmd_report)
    return p


def main(argv=None) -> int:
    from runtime.cli.common import run_main
    return run_main(build_parser(), argv)


if __name__ == "__main__":
    sys.exit(main())
