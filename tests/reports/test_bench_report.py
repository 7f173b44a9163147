"""dsv41-bench against the live server, then dsv41-report over the shipped profile, this host's tuned
profile and the bench rows."""
import json

import pandas as pd
import pytest

from reports.bench import main as bench_main
from reports.report import build, fold
from reports.schema import bench_record


@pytest.fixture(scope="module")
def bench_rows(server, tmp_path_factory):
    out = tmp_path_factory.mktemp("bench") / "results.jsonl"
    args = ["--url", server, "--prompt-tokens", "40", "--output-tokens", "8", "--spread", "0.2", "--seed", "11", "--out", str(out), "--quiet"]
    assert bench_main(args + ["--requests", "4", "--concurrency", "2", "--warmup", "1"]) == 0
    assert bench_main(args + ["--requests", "3", "--rate", "20", "--warmup", "0"]) == 0
    return out


def test_bench_rows_carry_percentiles_samples_and_provenance(bench_rows):
    rows = [json.loads(line) for line in bench_rows.read_text().splitlines()]
    assert [(r["phase"], r["config"]["concurrency"], r["config"]["rate"]) for r in rows] == \
           [("cold", 1, None), ("warm", 2, None), ("warm", 1, 20.0)]
    for r in rows:
        s = r["results"]
        assert s["failed"] == 0 and s["completed"] == r["config"]["requests"] and s["errors"] == []
        assert 0 < s["ttft_s"]["p50"] <= s["ttft_s"]["p99"] and s["decode_tok_s"] > 0 and s["output_tok_s"] > 0
        assert all(32 <= n <= 48 for n in r["samples"]["prompt_tokens"])          # 40 +- 20%, exact token prompts
        assert r["config"]["client_connection_limit"] == (None if r["config"]["rate"] else r["config"]["concurrency"] + 4)
        assert all(0 <= a < b for a, b in zip(r["samples"]["start_s"], r["samples"]["end_s"]))   # per request, raw
        assert all(0 < len(g) <= n - 1 for g, n in zip(r["samples"]["itl_s"], r["samples"]["output_tokens"]))
        assert r["client_dirty"] in (True, False, None) and r["timezone"][0] in "+-"
        assert all(6 <= n <= 10 for n in r["samples"]["output_tokens"])           # ignore_eos: exactly what was asked
        assert r["host"]["hard"]["physical_cores"] >= 1 and r["plan"]["max_context"] == 512 and r["client_commit"]
    rec = bench_record(rows[1])
    assert rec["ttft_p99_ms"] >= rec["ttft_p50_ms"] > 0


def test_bench_names_a_dead_url(capsys):
    assert bench_main(["--url", "http://127.0.0.1:9", "--quiet"]) == 2
    assert "no OpenAI-compatible server" in capsys.readouterr().err


def test_report_renders_two_hosts_with_plots_and_html(shipped, tuned, bench_rows, tmp_path):
    r = build([str(shipped), str(tuned), str(bench_rows)], tmp_path, trials=200)
    for f in ("report.md", "report.html", "hosts.csv", "validation.csv", "bench.csv", "pareto.csv",
              "bandwidths.png", "nvme_iops.png", "predicted_vs_measured.png", "pareto.png"):
        assert (tmp_path / f).stat().st_size > 0, f
    hosts = pd.read_csv(tmp_path / "hosts.csv")
    assert len(hosts) == 2 and "5090-epyc" in set(hosts["host"])
    assert set(hosts["figures"]) == {"published", "measured"}
    assert hosts["dram_gbs"].notna().all() and (hosts.filter(like="kernel_ratio_").notna().sum(axis=1) >= 1).all()
    measured = hosts[hosts["figures"] == "measured"].iloc[0]       # the reader's fastest engine per depth, this host
    assert measured.filter(like="nvme_engine_qd").isin(["uring", "aio", "threads"]).all() and len(measured.filter(like="nvme_engine_qd"))
    val = pd.read_csv(tmp_path / "validation.csv")
    assert len(val) >= 2 and val["measured_tok_s"].gt(0).all() and val["picked"].sum() == 1
    terms = pd.read_csv(tmp_path / "terms.csv")                                  # predicted vs measured per term
    assert {"decode.moe", "decode.dense", "decode.attention", "prefill.moe"} <= set(terms["term"])
    assert terms["measured_ms"].ge(0).all() and terms["predicted_calibrated_ms"].notna().all()
    page = (tmp_path / "report.html").read_text()
    assert page.count("data:image/png;base64,") == 5 and "5090-epyc" in page      # self-contained
    head = pd.read_csv(tmp_path / "headline.csv")                                 # hosts as columns
    assert list(head.columns)[0] == "figure" and set(hosts["host"]) <= set(head.columns)
    assert {"DRAM GB/s", "measured tok/s", "predicted tok/s (raw)"} <= set(head["figure"])
    assert any(f.startswith("vs 5090-epyc") for f in head["figure"]) and "bench ttft p50 ms" in set(head["figure"])
    assert r["tables"]["bench"] == 3


def test_fold_keeps_what_varies_and_names_what_does_not():
    df = pd.DataFrame({"host": ["a", "b"], "same": [1, 1], "differs": [1, 2], "one_missing": [3.0, float("nan")]})
    shown, common = fold(df)
    assert list(shown.columns) == ["host", "differs", "one_missing"] and common == {"same": 1}
    assert fold(df.iloc[:1])[1] == {}                                              # one row: nothing folds


def test_report_names_a_bad_results_line(tmp_path, shipped):
    bad = tmp_path / "r.jsonl"
    bad.write_text('{"schema": "dsv41-bench/1"}\nnot json\n')
    with pytest.raises(ValueError, match="r.jsonl:2"):
        build([str(shipped), str(bad)], tmp_path / "out")
