"""The report's figures (matplotlib, Agg, PNG): each takes the DataFrames of reports/schema.py."""
from __future__ import annotations

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
import pandas as pd  # noqa: E402

BANDWIDTHS = (("dram_gbs", "DRAM stream read"), ("h2d_gbs", "PCIe H2D"), ("d2h_gbs", "PCIe D2H"),
              ("gather_gbs", "PCIe expert gather"), ("nvme_seq_gbs", "NVMe sequential"))


def _save(fig, path):
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def bandwidths(hosts: pd.DataFrame, path):
    """Bars on a log scale (host DRAM and a PCIe link differ 10-100x); a figure a host lacks is a gap."""
    cols = [(c, label) for c, label in BANDWIDTHS if c in hosts] + \
           [(c, "CPU-MoE " + c[8:-4]) for c in hosts if c.startswith("cpu_moe_")]
    fig, ax = plt.subplots(figsize=(8, 4))
    width = 0.8 / max(len(hosts), 1)
    for i, (_, h) in enumerate(hosts.iterrows()):
        xs = [k + i * width for k, (c, _) in enumerate(cols) if pd.notna(h.get(c)) and h.get(c) > 0]
        vals = [h.get(c) for c, _ in cols if pd.notna(h.get(c)) and h.get(c) > 0]
        ax.bar(xs, vals, width, label=f"{h['host']} ({h['figures']})")
    ax.set_yscale("log")
    ax.set_xticks([k + width * (len(hosts) - 1) / 2 for k in range(len(cols))], [lbl for _, lbl in cols], rotation=25, ha="right")
    ax.set_ylabel("GB/s (log; a gap = not measured / no device)")
    ax.set_title("Bandwidth ceilings per host")
    ax.legend(fontsize=8)
    return _save(fig, path)


def throughput_vs_concurrency(bench: pd.DataFrame, path):
    """Output tok/s against client concurrency, one line per host (warm phases, closed loop)."""
    fig, ax = plt.subplots(figsize=(6, 4))
    warm = bench[(bench["phase"] == "warm") & bench["rate"].isna()]
    for host, g in warm.groupby("host"):
        g = g.sort_values("concurrency")
        ax.plot(g["concurrency"], g["output_tok_s"], marker="o", label=host)
    ax.set_xlabel("concurrent requests")
    ax.set_ylabel("output tok/s")
    ax.set_title("Throughput vs concurrency (dsv41-bench)")
    ax.legend(fontsize=8)
    return _save(fig, path)


def nvme_iops(hosts: pd.DataFrame, path):
    fig, ax = plt.subplots(figsize=(6, 4))
    for _, h in hosts.iterrows():
        pts = sorted((int(c[len("nvme_iops_qd"):]), h[c]) for c in hosts if c.startswith("nvme_iops_qd") and pd.notna(h[c]))
        if pts:
            ax.plot(*zip(*pts), marker="o", label=h["host"])
    ax.set_xscale("log", base=2)
    ax.set_xlabel("queue depth")
    ax.set_ylabel("4 KiB random reads / s")
    ax.set_title("NVMe random-read IOPS vs depth")
    ax.legend(fontsize=8)
    return _save(fig, path)


def predicted_vs_measured(val: pd.DataFrame, path):
    fig, axes = plt.subplots(1, 2, figsize=(9, 4))
    for ax, (key, label) in zip(axes, (("tok_s", "decode tok/s"), ("ttft_s", "TTFT s"))):
        for host, g in val.groupby("host"):
            ax.scatter(g[f"predicted_{key}"], g[f"measured_{key}"], label=host)
        if len(val):
            hi = float(max(val[f"predicted_{key}"].max(), val[f"measured_{key}"].max())) * 1.1
            ax.plot([0, hi], [0, hi], "k--", lw=0.8, label="predicted = measured")
        ax.set_xlabel(f"predicted {label}")
        ax.set_ylabel(f"measured {label}")
        ax.legend(fontsize=8)
    fig.suptitle("Cost model vs the runtime (plans validated by dsv41-tune)")
    return _save(fig, path)


def pareto(fronts: pd.DataFrame, path, model: str):
    fig, ax = plt.subplots(figsize=(6, 4))
    for host, g in fronts.groupby("host"):
        g = g.sort_values("ttft_s")
        ax.step(g["ttft_s"], g["decode_tok_s"], where="post", marker="o", label=host)
    ax.set_xscale("log")
    ax.set_xlabel("predicted TTFT, s")
    ax.set_ylabel("predicted decode tok/s")
    ax.set_title(f"Pareto front per host: {model}")
    ax.legend(fontsize=8)
    return _save(fig, path)
