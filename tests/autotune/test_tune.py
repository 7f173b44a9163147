"""dsv41-tune end to end (quick, on tiny) and the pieces that decide: resume, baseline, pick, recalibration."""
import copy
import json

import pytest

from autotune.costmodel import predict
from runtime.profile import load_profile
from autotune.search import search
from autotune.tune import _fresh
from autotune.validate import calibration, pick
from runtime.checkpoint.footprint import Footprint
from runtime.checkpoint.reader import Checkpoint
from runtime.config import ModelConfig
from runtime.plan import Plan
from runtime.workload import Workload




def test_end_to_end_writes_a_valid_profile_with_evidence(tuned):
    p = load_profile(tuned)
    assert Plan.from_dict(p["plan"]).geometry_hash == Checkpoint(p["checkpoint"]).config.geometry_hash()
    assert p["predicted"]["feasible"] and p["predicted"]["decode_tok_s"] > 0
    v = p["validation"]
    assert v["study"].startswith("dsv41-") and 0 <= v["noise_floor"] < 1
    assert sum(r["baseline"] for r in v["rows"]) == 1                      # the baseline is always validated
    for r in v["rows"]:
        m = r["measured"]
        assert len(m["decode_samples"]) >= 2 and m["cold"]["ttft_s"] > 0 and r["predicted"]["decode_tok_s"] > 0
    best = max(r["measured"]["decode_tok_s"] for r in v["rows"])
    assert v["rows"][v["picked"]]["measured"]["decode_tok_s"] >= best * (1 - v["noise_floor"]) - 1e-9
    cal = p["calibration"]["terms"]
    assert {"decode.moe", "decode.dense", "prefill.moe"} <= set(cal) and all(c["factor"] > 0 for c in cal.values())
    picked = v["rows"][v["picked"]]
    for part in ("decode", "prefill"):                  # every term predicted (raw, calibrated) and measured
        assert set(picked["measured"]["terms"][part]) <= set(picked["predicted"]["raw"][part])
        assert set(picked["predicted"]["calibrated"][part]) == set(picked["predicted"]["raw"][part])


def test_a_fresh_profile_is_reused_and_a_stale_one_is_not(tuned, quick_profile, tiny_dir, tmp_path):
    before, after = load_profile(quick_profile), load_profile(tuned)     # the tune started from quick_profile's
    assert after["measured_at"] == before["measured_at"] and after["measurements"] == before["measurements"]
    assert before["validation"] is None and after["validation"]["rows"]
    ck = Checkpoint(tiny_dir)
    prof, why = _fresh(tuned, ck)
    assert prof is not None and why == "fresh"
    other = tmp_path / "other.json"
    d = json.loads(tuned.read_text())
    d["host"]["hard"]["ram_gib"] += 100
    other.write_text(json.dumps(d))
    assert _fresh(other, ck)[0] is None and "other hardware" in _fresh(other, ck)[1]
    d = json.loads(tuned.read_text())
    d["measured_at"] = "2020-01-01T00:00:00"
    other.write_text(json.dumps(d))
    assert "days old" in _fresh(other, ck)[1]


def test_a_killed_search_resumes_without_losing_trials(tmp_path):
    epyc = load_profile("profiles/5090-epyc.json")
    fp = Footprint.from_config(ModelConfig.preset("deepseek-v4-flash"))
    url = f"sqlite:///{tmp_path / 's.db'}"
    seen = []

    def killer(i, n):
        seen.append(i)
        if i == 25:
            raise KeyboardInterrupt
    with pytest.raises(KeyboardInterrupt):
        search(epyc, fp, Workload(1024, 64), n_trials=60, storage=url, progress=killer)
    import optuna
    kept = optuna.load_study(study_name=_name(epyc, fp), storage=url).trials
    assert len(kept) == 24                     # every trial finished before the kill is kept
    study, res = search(epyc, fp, Workload(1024, 64), n_trials=60, storage=url)
    assert len(study.trials) == 60 and res
    again, _ = search(epyc, fp, Workload(1024, 64), n_trials=80, storage=url)
    assert len(again.trials) == 80             # the 60 kept, 20 added


def _name(profile, fp):
    from autotune.search import study_name
    return study_name(profile, fp, Workload(1024, 64), None, False)


def test_a_plan_that_measures_worse_is_never_picked():
    def row(tok, ttft, samples):
        return {"decode_tok_s": tok, "ttft_s": ttft, "decode_samples": samples}
    good, bad = row(10.0, 1.0, [9.9, 10.0, 10.1]), row(8.0, 0.5, [7.9, 8.0, 8.1])
    assert pick([bad, good], None, 0.02)[0] is good
    assert pick([good, bad], 0.8, 0.02)[0] is bad                         # only bad meets the TTFT budget
    close = row(9.9, 0.6, [9.8, 9.9, 10.0])                              # within the 2% floor of good: a tie
    assert pick([good, close, bad], None, 0.02)[0] is close               # settled by the lower TTFT
    assert pick([good, close, bad], None, 0.0)[0] is good                 # no floor: the measured best


def test_recalibration_is_per_term_and_moves_only_the_wrong_term():
    """A synthetic host whose MoE runs 1.7x slower than modelled and whose dense path is as modelled:
    the calibration fits a factor per term, the calibrated decode lands on the measurement, and the
    dense term is left alone (a per-host scale would have moved both)."""
    epyc = load_profile("profiles/5090-epyc.json")
    fp = Footprint.from_config(ModelConfig.preset("deepseek-v4-flash"))
    wl = Workload(1024, 64)
    plans = [Plan(max_context=8192), Plan(max_context=8192, prefill_chunk=2048)]
    rows = []
    for p in plans:
        pr = predict(p, epyc, fp, wl).to_dict()
        dec = {k: v * (1.7 if k == "moe" else 1.0) for k, v in pr["raw"]["decode"].items()}
        pre = {k: v * (1.3 if k == "moe" else 1.0) for k, v in pr["raw"]["prefill"].items()}
        rows.append({"plan": p, "predicted": pr, "decode_tok_s": 1 / sum(dec.values()), "ttft_s": sum(pre.values()),
                     "terms": {"decode": dec, "prefill": pre}})
    cal = calibration(rows)
    assert cal["terms"]["decode.moe"]["factor"] == pytest.approx(1.7)
    assert cal["terms"]["decode.dense"]["factor"] == pytest.approx(1.0)
    assert cal["terms"]["prefill.moe"]["factor"] == pytest.approx(1.3)
    tuned = copy.deepcopy(epyc)
    tuned["calibration"] = cal
    for r in rows:
        after = predict(r["plan"], tuned, fp, wl)
        assert after.decode_tok_s == pytest.approx(r["decode_tok_s"]) and after.ttft_s == pytest.approx(r["ttft_s"])
        assert after.terms["decode_dense_s"] == pytest.approx(r["terms"]["decode"]["dense"])
        assert after.raw["decode_tok_s"] == pytest.approx(predict(r["plan"], epyc, fp, wl).decode_tok_s)


def test_measured_dspark_acceptance_replaces_the_assumed_one():
    from autotune.validate import dspark_acceptance
    p_true = 0.35
    rows = [{"plan": Plan(dspark=True, draft_length=d), "dspark_mean_accepted": [sum(p_true ** i for i in range(1, d + 1))] * 3}
            for d in (1, 2, 4)] + [{"plan": Plan(), "decode_samples": [1.0]}]
    p = dspark_acceptance(rows)
    assert abs(p - p_true) < 1e-6
    assert dspark_acceptance(rows[-1:]) is None                          # no DSpark plan validated: nothing measured
    epyc = load_profile("profiles/5090-epyc.json")
    fp = Footprint.from_config(ModelConfig.preset("deepseek-v4-flash"))
    plan, wl = Plan(dspark=True, draft_length=3, max_context=8192), Workload(1024, 64)
    assumed = predict(plan, epyc, fp, wl)
    measured = predict(plan, {**epyc, "calibration": {"dspark_p_accept": p}}, fp, wl)
    assert measured.decode_tok_s < assumed.decode_tok_s                 # 0.35 < the assumed 0.7
    assert measured.terms["dspark_accepted"] == pytest.approx(sum(p ** i for i in range(4)))
    assert any("measured on this checkpoint" in n for n in measured.notes) and any("assumed" in n for n in assumed.notes)


def test_a_storage_optuna_cannot_open_is_named_before_any_probe_runs(tiny_dir, tmp_path, capsys):
    from autotune.cli import main as tune_main
    url = f"sqlite:///{tmp_path / 'missing' / 's.db'}"           # its directory does not exist
    rc = tune_main(["--checkpoint", str(tiny_dir), "--quick", "--out", str(tmp_path / "host.json"), "--storage", url])
    err = capsys.readouterr().err
    assert rc == 2 and f"--storage {url}" in err and "probe:" not in err
    assert not (tmp_path / "host.json").exists()
